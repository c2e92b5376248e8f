"""Running a spec: the failure-free reference and the run with induced
failures (and rescaled restores), then the comparison."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from spillover.config import Config
from spillover.deploy import create_executor
from spillover.errors import ConfigError
from spillover.runtime.batch import runs_as_batch
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.failures import FailureInjector
from spillover.runtime.jobmaster import JobResult
from spillover.verify.compare import (
    Report,
    compare,
)
from spillover.verify.driver import run_killing_the_driver
from spillover.verify.inflight import AfterInflight, InflightWait
from spillover.verify.output import (
    DrainedSources,
    RunOutput,
    _read,
    _state_of,
    drained_sources,
    output_of,
)
from spillover.verify.spec import (
    VerifySpec,
    _checkpoints,
    config_for,
)
from spillover.verify.topologies import (
    KEYED_CHECKS,
    SHORT_OFFSET,
    SOURCE_PARTITION_OFFSETS,
    SUMMARY_PARTITION,
    TOPOLOGIES,
    _ship_by_value,
)


def _executor(
    spec: VerifySpec, graph: Any, cfg: Config, executor: str | None = None, **options: Any
) -> Any:
    """``executor`` (default ``spec.executor``) for ``graph``."""
    kind = executor or spec.executor
    if kind == "local":
        return create_executor("local", graph, cfg, **options)
    if callable(spec.job):
        _ship_by_value(sys.modules.get(getattr(spec.job, "__module__", "")))
    return create_executor(kind, graph, cfg, master=spec.master, **options)


def run_once(
    spec: VerifySpec,
    workdir: str,
    name: str,
    failures: FailureInjector,
    executor: str | None = None,
    on_ended: Callable[[], None] | None = None,
) -> RunOutput:
    """One run to the end; ``executor`` overrides ``spec.executor``; ``on_ended`` is
    called once the job ended, before its output and final state are read."""
    out_dir = os.path.join(workdir, name, "output")
    ckpt = _checkpoints(spec, workdir, name)
    os.makedirs(out_dir, exist_ok=True)
    graph = spec.factory()(out_dir, name, spec.parallelism).build()
    cfg = config_for(spec, ckpt)
    if isinstance(failures, AfterInflight):
        failures.hold_sinks(graph)
    ex = _executor(spec, graph, cfg, executor, failures=failures)
    if isinstance(failures, AfterInflight):
        failures.follow(ex)
    result = ex.run(timeout=600)
    if on_ended is not None:
        on_ended()
    if result.status == "failed" and result.completed_checkpoints():
        return finish_failed(spec, cfg, out_dir, name, result, failures)
    return output_of(spec, result, out_dir, graph.max_parallelism, failures)


def finish_failed(
    spec: VerifySpec,
    cfg: Config,
    out_dir: str,
    name: str,
    failed: JobResult,
    failures: FailureInjector,
) -> RunOutput:
    """A run that failed for good (its restart strategy exhausted), restored from its
    latest completed checkpoint and run to the end with no failures (and, in
    ``spillover chaos``, no storage faults: they are disarmed by then). What it
    committed before failing must stay, once, so the comparison of the whole output
    with the failure-free run's still names every record lost or duplicated; the
    result keeps ``status`` ``failed`` (the run did not survive its faults) and
    ``finished_from`` says where it was restored from."""
    cid = int(failed.completed_checkpoints()[-1]["checkpoint_id"])
    graph = spec.factory()(out_dir, name, spec.parallelism).build()
    result = _executor(spec, graph, cfg, restore_checkpoint=cid).run(timeout=600)
    result.continues(failed)
    finished = result.status
    result.status = failed.status
    out = output_of(spec, result, out_dir, graph.max_parallelism, failures)
    out.finished_from = cid
    out.finished_status = finished
    return out


HOLD_SLACK_S = 10.0
"""How long past a stop's bound the first run's sources hold their end. The bound is
when the stop is due, but it also waits for a checkpoint and, for a drain, for an
attempt that runs and sent records: a job restarted by an induced failure near the
bound would otherwise end before it (chaos 832849741-3: bound 0.09 s)."""


DRAIN_GRACE_S = 1.0
"""How long past its bound a drain waits for a running attempt to send records."""


class _TwoRuns:
    """A run stopped part way and the run that resumes it, in one work directory."""

    def __init__(
        self,
        spec: VerifySpec,
        workdir: str,
        name: str,
        failures: FailureInjector,
        hold_end_s: float = 0.0,
    ):
        self.spec, self.failures = spec, failures
        self.out_dir = os.path.join(workdir, name, "output")
        os.makedirs(self.out_dir, exist_ok=True)
        self.cfg = config_for(spec, _checkpoints(spec, workdir, name))
        self.make_job = spec.factory()
        self.name = name
        first = self.graph(spec.parallelism)
        # The first run is stopped part way: its sources hold their end, so however
        # fast the machine, the run cannot finish before the stop comes (bounded).
        for v in first.vertices:
            for node in v.nodes:
                if isinstance(node.prototype, GeneratorSource):
                    node.prototype.hold_end(hold_end_s + HOLD_SLACK_S)
        self.first = _executor(spec, first, self.cfg, failures=failures)

    def graph(self, parallelism: int) -> Any:
        return self.make_job(self.out_dir, self.name, parallelism).build()

    def resume(
        self,
        r1: JobResult,
        restore: int | str,
        parallelism: int,
        on_ended: Callable[[], None] | None = None,
        **options: Any,
    ) -> RunOutput:
        """Runs the job at ``parallelism`` from ``restore`` to the end; its result
        carries the first run's attempts, checkpoints, failures and replayed bytes.
        ``on_ended`` is called before its output and final state are read."""
        graph = self.graph(parallelism)
        r2 = _executor(self.spec, graph, self.cfg, restore_checkpoint=restore, **options).run(
            timeout=600
        )
        if on_ended is not None:
            on_ended()
        r2.continues(r1)
        return RunOutput(
            r2,
            _read(self.spec, self.out_dir),
            _state_of(self.spec, r2, graph.max_parallelism),
            [s.describe() for s in self.failures.fired],
            out_dir=self.out_dir,
            max_parallelism=graph.max_parallelism,
        )


def run_rescaled(
    spec: VerifySpec,
    workdir: str,
    name: str,
    failures: FailureInjector,
    stop_after: float,
    on_ended: Callable[[], None] | None = None,
) -> RunOutput:
    """Runs at ``spec.parallelism`` until every induced failure happened and the latest
    completed checkpoint holds in-flight data (or, after ``stop_after`` seconds, once
    any attempt completed a checkpoint), stops it as a crash would, restores the latest
    completed checkpoint at ``spec.rescale_to`` and runs to the end."""
    deadline = time.monotonic() + stop_after
    seen = [False]  # a checkpoint completed in some attempt (``history`` is one attempt's)

    def ready(history: list[dict[str, Any]]) -> bool:
        done = [c for c in history if c["status"] == "completed" and not c["final"]]
        seen[0] = seen[0] or bool(done)
        inflight = spec.policy == "aligned" or (bool(done) and done[-1]["inflight_bytes"] > 0)
        if failures.pending == 0 and bool(done) and inflight:
            return True
        # Past the bound, stop once there is a checkpoint to restore; before one
        # completed, the run goes on (a loaded machine may take longer than the
        # baseline suggests).
        return seen[0] and time.monotonic() >= deadline

    assert spec.rescale_to is not None
    runs = _TwoRuns(spec, workdir, name, failures, hold_end_s=stop_after)
    r1 = runs.first.run(timeout=600, stop_when=ready)
    completed = r1.completed_checkpoints()
    if r1.status == "finished":
        raise ConfigError(
            "the run ended before it was stopped: give it more records (or a slower sink), "
            "so that every induced failure happens and then a checkpoint completes"
            + (" with in-flight data" if spec.policy != "aligned" else "")
            + " while it runs"
        )
    if not completed:
        raise ConfigError("no checkpoint completed before the stop: lengthen the run")
    # Only the latest completed checkpoint keeps exactly-once: sinks published up to it.
    restored = completed[-1]
    out = runs.resume(r1, restored["checkpoint_id"], spec.rescale_to, on_ended)
    if r1.status not in ("stopped", "finished"):
        out.result.status = r1.status
    out.restored_inflight = int(restored["inflight_bytes"])
    return out


STOPS = ("savepoint", "unaligned-savepoint", "drain")
# Whose sink commits every record, which a drained stop is checked by.
DRAIN_TOPOLOGIES = tuple(t for t in TOPOLOGIES if t not in KEYED_CHECKS and t != "broadcast")


def run_stopped(
    spec: VerifySpec,
    workdir: str,
    name: str,
    failures: FailureInjector,
    stop_after: float,
    on_stop: Callable[[], None] | None = None,
    on_ended: Callable[[], None] | None = None,
) -> RunOutput:
    """Runs at ``spec.parallelism`` until a checkpoint completed and every induced
    failure happened (or ``stop_after`` seconds passed), stops it with a savepoint
    (``spec.stop``), then restores the savepoint (at ``spec.rescale_to`` if given)
    and runs that to the end. After a drain the restored job has nothing left to
    run: every operator finished. ``on_stop`` is called just before the stop is
    asked (``spillover chaos`` arms its faults there)."""
    assert spec.stop in STOPS
    runs = _TwoRuns(spec, workdir, name, failures, hold_end_s=stop_after)
    first = runs.first
    stopping = threading.Event()

    def stop() -> None:
        deadline = time.monotonic() + stop_after
        attempt = (first.running_since(), len(failures.fired))  # (its start, failures then)
        checkpointed = False  # a checkpoint completed in some attempt
        while not stopping.wait(0.01):
            checkpointed = checkpointed or bool(first.completed_ids())
            due = time.monotonic() >= deadline or failures.pending == 0
            if spec.stop == "drain":
                # While an induced failure restarts the job, the next attempt, restored
                # from a checkpoint that may precede every record, would take the
                # drain at once and end its sources before they emit one, leaving
                # nothing to commit (chaos 29-60; tests/it/test_drained_stop.py asks
                # one so, on purpose). A drain waits for an attempt that runs and
                # sent records; past its bound, not for records: an attempt restored
                # after its sources emitted their last record sends none (chaos
                # 832849741-3), and one restored before the first is ``vacuous``.
                if first.running_since() != attempt[0]:  # another attempt began
                    attempt = (first.running_since(), len(failures.fired))
                running = attempt[0] is not None and len(failures.fired) == attempt[1]
                sent = sum(m.get("records_out", 0.0) for m in first.task_metrics().values())
                late = time.monotonic() >= deadline + DRAIN_GRACE_S
                ready = checkpointed and running and (sent > 0 or late)
            else:
                # Not before a checkpoint completed: a job slow to start (storage far
                # away) would be stopped before its sources emitted anything.
                ready = bool(first.completed_ids())
            if ready and due:
                if on_stop is not None:
                    on_stop()
                first.stop_with_savepoint(
                    drain=spec.stop == "drain", unaligned=spec.stop == "unaligned-savepoint"
                )
                return

    stopper = threading.Thread(target=stop, name="verify-stop", daemon=True)
    stopper.start()
    try:
        r1 = first.run(timeout=600)
    finally:
        stopping.set()
        stopper.join()
    if r1.savepoint is None and r1.status == "failed" and r1.completed_checkpoints():
        # Failed for good before the stop: finished from its latest checkpoint, the
        # whole output is compared (no drain ended the sources).
        return finish_failed(spec, runs.cfg, runs.out_dir, name, r1, failures)
    if r1.savepoint is None:
        raise ConfigError(
            "the run ended before it was stopped with a savepoint: give it more records "
            "(or a slower sink)" + (f" ({r1.failures[-1]})" if r1.failures else "")
        )
    # Failures not fired before the stop may fire after the restore.
    p = spec.rescale_to or spec.parallelism
    out = runs.resume(r1, r1.savepoint, p, on_ended, failures=failures)
    out.result.savepoint = r1.savepoint
    if r1.status != ("finished" if spec.stop == "drain" else "stopped"):
        out.result.status = r1.status
    return out


def drained_part(expected: RunOutput, sources: DrainedSources) -> RunOutput:
    """What a failure-free run committed of the records a drained run's sources had
    emitted when the drain ended them (``sources``, read from its savepoint): per
    source partition, the records below the source's position. Not the drained
    run's own output, which would hide a lost tail (or everything, when it
    committed nothing). ``finish()`` summaries are left out (:func:`drained_summaries_wrong`
    checks them). A data partition of the failure-free run that the savepoint
    holds no position of raises :class:`ConfigError`."""
    e = expected.rows
    e = e[e["partition"] < SUMMARY_PARTITION]
    unknown = sorted(set(np.unique(e["partition"]).tolist()) - set(sources.next_seq))
    if unknown:
        raise ConfigError(
            "the drained run's savepoint holds no position of some source partitions",
            detail=f"{sources.savepoint}: partitions {unknown[:20]}",
        )
    return RunOutput(expected.result, e[sources.emitted(e)], {}, out_dir=expected.out_dir)


def drained_summaries_wrong(rows: np.ndarray[Any, Any]) -> list[tuple[int, int, int]]:
    """``finishing`` after a drain: (partition, summarised, committed) of each short
    source partition whose ``finish()`` summary does not count exactly the records
    of it that were committed (the drain stopped the branch part way, so its
    summaries count what it had emitted, not what a full run does)."""
    wrong = []
    summaries = rows[rows["partition"] >= SUMMARY_PARTITION]
    for part, seen in zip(summaries["partition"].tolist(), summaries["seq"].tolist(), strict=True):
        p = int(part) - SUMMARY_PARTITION
        committed = int(np.count_nonzero(rows["partition"] == SHORT_OFFSET + p))
        if committed != seen:
            wrong.append((p, int(seen), committed))
    return wrong


def compare_drained(spec: VerifySpec, expected: RunOutput, actual: RunOutput) -> Report:
    """The verdict on a drained stop: every record the sources emitted before the
    drain ended them (their positions in the savepoint, ``actual.result.savepoint``)
    committed once, in order, and nothing else; ``finish()`` summaries count the
    records committed. The keyed state is not compared (a drain ends it part way)."""
    if actual.result.savepoint is None:
        raise ConfigError("the drained run has no savepoint to read its sources' positions from")
    sources = drained_sources(actual.result.savepoint, SOURCE_PARTITION_OFFSETS)
    rows = actual.rows
    data = dataclasses.replace(actual, rows=rows[rows["partition"] < SUMMARY_PARTITION], state={})
    report = compare(spec, drained_part(expected, sources), data)
    report.drain_emitted = sources.records
    report.summaries_wrong = drained_summaries_wrong(rows)
    report.exact = report.exact and not report.summaries_wrong
    if spec.topology == "finishing":
        report.checks.append("finish() summaries count the committed records")
    report.checks.append(
        f"a drain commits every record its sources emitted ({sources.records:,}, up to "
        "each partition's position in the savepoint) once"
    )
    return report


def check_runs_as_batch(spec: VerifySpec) -> None:
    """Builds ``spec``'s job once in a scratch folder and asks the runtime whether it
    runs in batch mode: a job with an unbounded source or a loop is refused now (a
    :class:`ConfigError` naming it), before any run, not when the first run starts."""
    with tempfile.TemporaryDirectory(prefix="spillover-verify-probe-") as d:
        graph = spec.factory()(os.path.join(d, "output"), "probe", spec.parallelism).build()
        try:
            runs_as_batch(graph, config_for(spec, os.path.join(d, "checkpoints")))
        except ConfigError as e:
            raise ConfigError(
                f"{spec.describe()} cannot run in batch mode: {e.message}",
                detail=e.detail,
                hint="give --runtime-mode streaming, or a job whose sources are bounded "
                "and that holds no loop",
            ) from None


def verify(
    spec: VerifySpec,
    workdir: str | None = None,
    on_stop: Callable[[], None] | None = None,
    on_ended: Callable[[], None] | None = None,
) -> Report:
    """Runs the job without and with ``spec.failures`` induced failures; ``on_stop``
    is called just before a stop with a savepoint (``spec.stop``) is asked, and
    ``on_ended`` once the run with failures ended, before its output and final state
    are read (``spillover chaos`` disarms its storage faults there)."""
    ended = on_ended or (lambda: None)
    spec.check()
    if spec.order not in ("per-key", None):
        raise ConfigError(f"order must be 'per-key' or None, got {spec.order!r}")
    if spec.master is not None and spec.executor != "spark":
        raise ConfigError(
            "a Spark master (--master) needs the spark executor",
            detail=f"master {spec.master!r} with executor {spec.executor!r}",
            hint="add --executor spark (VerifySpec.executor='spark')",
        )
    if spec.stop is not None and spec.stop not in STOPS:
        raise ConfigError(f"stop must be one of {STOPS}, got {spec.stop!r}")
    if spec.stop == "drain" and (spec.job is not None or spec.topology not in DRAIN_TOPOLOGIES):
        raise ConfigError(
            f"a drained stop is checked record by record, which {spec.describe()} is not",
            hint="use a built-in topology whose sink gets every record: "
            + ", ".join(DRAIN_TOPOLOGIES),
        )
    if spec.kill_driver < 0:
        raise ConfigError("--kill-driver must be at least 0", detail=str(spec.kill_driver))
    if spec.kill_driver and (spec.failures or spec.stop or spec.rescale_to):
        raise ConfigError(
            "--kill-driver kills the driver instead of inducing failures, stops or rescales",
            hint="give it with --failures 0 and without --rescale-to or a stop",
        )
    if spec.batch:
        check_runs_as_batch(spec)
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="spillover-verify-")
    try:
        baseline = run_once(spec, workdir, "baseline", FailureInjector(), executor="local")
        if spec.job is not None and baseline.result.status == "finished" and not len(baseline.rows):
            raise ConfigError(
                f"{spec.describe()} committed nothing without failures",
                hint="end it in ParquetSink(out_dir), with out_dir the factory's first argument",
            )
        graph = spec.factory()(os.path.join(workdir, "probe"), "probe", spec.parallelism).build()
        vertices = [(v.uid, v.parallelism) for v in graph.vertices]
        injector = FailureInjector.random(
            spec.failures,
            vertices,
            seed=spec.seed,
            records_per_subtask=max(1, spec.records // spec.parallelism),
            kinds=("operator",) if spec.batch else ("operator", "commit", "restore", "snapshot"),
        )
        if spec.failures_after_inflight:
            injector = AfterInflight(injector.specs, InflightWait())
        started = time.monotonic()
        # A bound; stop_when decides. Spark adds a stage start per attempt.
        stop_after = 0.8 * baseline.result.duration_s + 5.0
        if spec.executor != "local":
            stop_after += 30.0
        if spec.stop is not None:
            # Half way through (at the latest), so the stop comes while the job runs.
            half = 0.5 * baseline.result.duration_s + (30.0 if spec.executor != "local" else 0)
            actual = run_stopped(spec, workdir, "with-stop", injector, half, on_stop, ended)
            if spec.stop == "drain" and actual.finished_from is None:
                report = compare_drained(spec, baseline, actual)
            else:
                report = compare(spec, baseline, actual)
            report.duration_s = time.monotonic() - started
            return report
        if spec.kill_driver:
            actual, starts = run_killing_the_driver(
                spec, workdir, "killed-driver", spec.kill_driver, seed=spec.seed
            )
            ended()
            report = compare(spec, baseline, actual)
            report.driver_starts = [k.describe() for k in starts]
            report.checks.append(
                f"the driver was SIGKILLed {sum(k.killed for k in starts)} times and started "
                "again; "
                + (
                    "each start re-ran only the tasks its event log did not name finished"
                    if spec.batch
                    else "each start resumed the run from the checkpoint its event log names"
                )
            )
            report.duration_s = time.monotonic() - started
            return report
        if spec.rescale_to is None:
            actual = run_once(spec, workdir, "with-failures", injector, on_ended=ended)
        else:
            actual = run_rescaled(spec, workdir, "with-failures", injector, stop_after, ended)
        report = compare(spec, baseline, actual)
        report.duration_s = time.monotonic() - started
        return report
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)


def write_json(report: Report, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report.to_dict(), f, indent=1, default=str)
