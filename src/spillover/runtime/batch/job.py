"""A batch job's run under its job master: where its results go, what an earlier
master's log lets it reuse, and what the log records (docs/recovery.md, "Batch
jobs").

With durable storage (``state.checkpoints.dir`` or ``execution.batch.shuffle-dir``)
the master logs each source's split assignment before the sources run and each
finished task with its results. A master that resumes the run (its predecessor
died, or the run failed) reuses every finished task whose vertex kept its
parallelism and whose result files are there as the log names them (size, header
and trailer, file id and the trailer's sums: only each file's two ends are read)
and readable at the consumers' parallelism; every other task runs, sources with
the splits the log assigned them. A reused file's frames are checked by its
consumers as they read them: a damaged one fails only that consumer, and its
producer runs again (region failover, ``scheduler.py``), so a restart never reads
the reused results twice. A run the log says finished is not
run again. The run's result files are deleted once it finished.
"""

from __future__ import annotations

import logging
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from spillover.config import Config
from spillover.errors import FormatError, SpilloverError
from spillover.runtime.batch.launch import Launcher
from spillover.runtime.batch.regions import TaskKey
from spillover.runtime.batch.results import ResultHandle, edge_key, readable
from spillover.runtime.batch.scheduler import BatchOutcome, BatchScheduler, delete_tree
from spillover.runtime.checkpointing.metadata import CheckpointStorage
from spillover.runtime.failures import FailureInjector
from spillover.runtime.graph import JobGraph
from spillover.runtime.jobevents import JobLogState
from spillover.runtime.jobrecovery import JobRecovery
from spillover.storage import check_ends
from spillover.storage.location import Location

logger = logging.getLogger("spillover.runtime.jobmaster")


def durable_dir(config: Config) -> str | None:
    """The batch job's durable storage: the checkpoint directory, else the shuffle
    directory; None when neither is set (nothing survives the driver)."""
    return config.state.checkpoints_dir or config.execution.shuffle_dir


def log_storage(config: Config, job_name: str) -> CheckpointStorage | None:
    """Where a batch job keeps its event log and lease (``<dir>/<job>/_events``)."""
    base = durable_dir(config)
    if base is None:
        return None
    return CheckpointStorage(base, job_name, fsync=config.state.fsync_metadata)


def results_dir(config: Config, job_name: str, run_id: str) -> Location:
    """``<shuffle dir or checkpoint dir or io.tmp.dirs>/<job>/<run>/results``."""
    base = (
        config.execution.shuffle_dir
        or config.state.checkpoints_dir
        or Location.parse(config.network.tmp_dir or tempfile.gettempdir())
        .child("spillover-batch")
        .uri
    )
    job = CheckpointStorage(base, job_name).location
    return job.child(run_id[:12], "results")


def check_result(handle: ResultHandle) -> str | None:
    """None when the result's file is there as its handle says (size, header, trailer,
    file id, the trailer's sums; its frames are not read), else what is wrong."""
    try:
        check_ends(handle.gate)
    except (SpilloverError, OSError) as e:
        return str(e)
    return None


def _stages_to_rerun(graph: JobGraph, state: JobLogState) -> tuple[set[str], list[str]]:
    """The vertices whose finished tasks cannot be reused however sound their results,
    and why: a source stage left part way whose source cannot say which splits its
    subtasks read (no split assignment in the log: the role of Flink's
    ``SupportsBatchSnapshot``), and everything downstream of it.

    Its unfinished subtasks would read whatever the source gives them now, which
    need not be what the finished ones left over: the whole stage runs again, and
    so does every task that read its old results. A source whose assignment the log
    holds hands the unfinished subtasks exactly their splits, and a source stage
    that finished whole is complete either way: both are reused."""
    finished = set(state.finished_tasks)
    stale: set[int] = set()
    notes: list[str] = []
    for v in graph.vertices:
        if not v.is_source:
            continue
        logged = state.splits.get(v.uid)
        if logged is not None and sorted(logged.assignment) == list(range(v.parallelism)):
            continue
        done = sum((v.uid, i) in finished for i in range(v.parallelism))
        if 0 < done < v.parallelism:
            stale.add(v.id)
            notes.append(
                f"source {v.uid!r} runs again whole: {done} of its {v.parallelism} "
                "subtasks finished and it cannot say which splits they read"
            )
    todo = list(stale)
    while todo:
        for e in graph.outputs_of(todo.pop()):
            if e.target not in stale:
                stale.add(e.target)
                todo.append(e.target)
    uids = {graph.vertices[i].uid for i in stale}
    after = sorted(uids - {graph.vertices[i].uid for i in stale if graph.vertices[i].is_source})
    if after:
        notes.append(f"so does what read it: {', '.join(repr(u) for u in after)}")
    return uids, notes


def reusable(
    graph: JobGraph, state: JobLogState
) -> tuple[dict[TaskKey, tuple[ResultHandle, ...]], list[str]]:
    """The finished tasks of ``state`` whose results this run can use, and why the
    others run again."""
    vertices = {v.uid: v for v in graph.vertices}
    out: dict[TaskKey, tuple[ResultHandle, ...]] = {}
    rerun, notes = _stages_to_rerun(graph, state)
    for (uid, i), ev in sorted(state.finished_tasks.items()):
        v = vertices.get(uid)
        name = f"{uid}#{i}"
        if uid in rerun:
            continue
        if v is None or i >= v.parallelism or ev.parallelism != v.parallelism:
            notes.append(f"{name} runs again: its operator's parallelism changed")
            continue
        try:
            handles = tuple(ResultHandle.from_dict(r) for r in ev.results)
        except (FormatError, ValueError, KeyError, TypeError) as e:
            notes.append(f"{name} runs again: its logged results do not read ({e})")
            continue
        outputs = {edge_key(graph, e): e for e in graph.outputs_of(v.id)}
        if sorted(h.edge for h in handles) != sorted(outputs):
            notes.append(f"{name} runs again: the job's edges changed")
            continue
        problem = next(
            (
                f"its result for {h.consumer} cannot be read at parallelism "
                f"{graph.vertices[outputs[h.edge].target].parallelism}"
                for h in handles
                if not readable(
                    outputs[h.edge], h.channels, graph.vertices[outputs[h.edge].target].parallelism
                )
            ),
            None,
        )
        for h in handles:
            if problem is None:
                bad = check_result(h)
                problem = None if bad is None else f"its result file is unusable: {bad}"
        if problem is not None:
            notes.append(f"{name} runs again: {problem}")
            continue
        out[(uid, i)] = handles
    return out, notes


@dataclass
class BatchRun:
    """What a batch run did: ``outcome`` (None when the log said the job had
    finished), the run id and the recovery decision in words."""

    run_id: str
    outcome: BatchOutcome | None = None
    recovery: str | None = None
    reused: list[TaskKey] = field(default_factory=list)


def _splits(
    graph: JobGraph, state: JobLogState, recovery: JobRecovery | None
) -> dict[str, dict[int, tuple[str, ...]]]:
    """Each source's split assignment: the logged one when it fits the source's
    parallelism, else the enumerator's, logged before the source runs."""
    out: dict[str, dict[int, tuple[str, ...]]] = {}
    for v in graph.vertices:
        if not v.is_source:
            continue
        logged = state.splits.get(v.uid)
        if logged is not None and sorted(logged.assignment) == list(range(v.parallelism)):
            out[v.uid] = {int(k): tuple(s) for k, s in logged.assignment.items()}
            continue
        op = v.head.prototype
        assignment = {i: op.splits_of(i, v.parallelism) for i in range(v.parallelism)}
        if any(s is None for s in assignment.values()):
            continue
        out[v.uid] = {i: s for i, s in assignment.items() if s is not None}
        if recovery is not None:
            recovery.splits_assigned(v.uid, out[v.uid])
    return out


def run_batch(
    graph: JobGraph,
    config: Config,
    *,
    recovery: JobRecovery | None,
    failures: FailureInjector,
    flush_interval: float,
    deadline: float | None,
    launcher: Callable[[], Launcher] | None = None,
    run_id: str | None = None,
) -> BatchRun:
    """Runs ``graph`` in batch mode under ``recovery``'s lease and log (None: no
    durable storage), resuming the run the log describes when it may.

    ``launcher`` gives where the tasks run (default: threads of this process); it is
    called once the log is replayed and the reused results checked, so a cluster
    that starts meanwhile (the executor's ``start_cluster``) overlaps that work.
    ``run_id``: the run a fresh start is (its master's; default a new one)."""
    resume = recovery.resume if recovery is not None else None
    run = BatchRun(resume.run_id if resume is not None else run_id or uuid.uuid4().hex)
    state = JobLogState()
    generation = 0
    if resume is not None:
        run.recovery = resume.reason
        if resume.finished:
            return run
        generation = resume.generation
        if not resume.fresh:
            assert recovery is not None
            state = recovery.state()
    finished, notes = reusable(graph, state)
    total = sum(v.parallelism for v in graph.vertices)
    if resume is not None and not resume.fresh:
        died = resume.reason.split(": ", 1)[-1]
        run.recovery = (
            f"resuming batch run {run.run_id[:12]} ({died}): {len(finished)} of {total} "
            f"task(s) finished and are reused, {total - len(finished)} run"
        ) + ("; " + "; ".join(notes) if notes else "")
    run.reused = sorted(finished)
    if run.recovery is not None:
        (logger.info if resume is None or resume.fresh else logger.warning)(
            "job %s: %s", graph.name, run.recovery
        )
    splits = _splits(graph, state, recovery)
    parallelism = max(v.parallelism for v in graph.vertices)
    where = launcher() if launcher is not None else None  # waits for the cluster
    cause = "submitted" if resume is None or resume.fresh else "resumed after its master ended"
    if recovery is not None:
        recovery.generation_started(generation, parallelism, cause, None, 0)

    def on_finished(key: TaskKey, results: tuple[ResultHandle, ...]) -> None:
        if recovery is not None:
            p = next(v.parallelism for v in graph.vertices if v.uid == key[0])
            recovery.task_finished(
                key[0], key[1], generation, tuple(r.to_dict() for r in results), p
            )

    results = results_dir(config, graph.name, run.run_id)
    scheduler = BatchScheduler(
        graph,
        config,
        results=results,
        run_id=run.run_id,
        failures=failures,
        flush_interval=flush_interval,
        finished=finished,
        splits=splits,
        on_finished=on_finished,
        launcher=where,
    )
    outcome = run.outcome = scheduler.run(deadline)
    status = "finished" if outcome.error is None else "failed"
    if recovery is not None:
        err = outcome.error
        recovery.generation_ended(
            generation, status if err is None else f"failed: {type(err).__name__}: {err}"[:500]
        )
        recovery.terminated(status, status if err is None else str(err)[:500])
    if outcome.error is None:
        delete_tree(results.parent)  # the run's results: nobody reads them any more
    return run
