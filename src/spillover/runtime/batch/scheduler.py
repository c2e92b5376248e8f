"""Runs a batch job region by region, its tasks wherever its launcher puts them
(threads of this process, or Spark workers: ``launch.py``).

A region (in batch mode: one subtask) starts once every producer whose result it
reads has finished. A finished task's results are kept (and reported through
``on_finished``, which the job master logs); a failed task re-runs only its region,
plus the producer of a result it could not read (missing, truncated, corrupt),
whose old files are deleted first. Failures are counted against the restart
strategy like a streaming job's restarts, except the first loss of a result reused
from an earlier master: a restart checks those only at their ends, so a reader
finding one damaged completes that check (its producer runs again) rather than
failing the run.
"""

from __future__ import annotations

import logging
import queue
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from spillover.config import Config, RestartStrategy
from spillover.errors import ConfigError
from spillover.runtime.batch.launch import (
    BatchTaskSpec,
    Launcher,
    LocalLauncher,
    Running,
    TaskOutcome,
)
from spillover.runtime.batch.regions import Region, TaskKey, pipelined_regions
from spillover.runtime.batch.results import InputResult, ResultHandle, edge_key, readable
from spillover.runtime.failures import FailureInjector
from spillover.runtime.graph import JobGraph
from spillover.runtime.restarts import RestartBudget
from spillover.storage.location import Location
from spillover.storage.location import delete_tree as delete_tree  # the job's clean-up too

logger = logging.getLogger("spillover.runtime.jobmaster")


@dataclass
class BatchOutcome:
    """How the stages went: the error that ended the job (None: finished), each
    task's metrics (``runs``: how often it ran here; ``reused``: 1 when its results
    came from an earlier master), and every failure in order."""

    error: BaseException | None = None
    tasks: dict[str, dict[str, float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    errors: list[TaskFailedError] = field(default_factory=list)
    runs: dict[TaskKey, int] = field(default_factory=dict)


class BatchScheduler:
    """Schedules one batch job's tasks (see the module docstring).

    ``finished`` holds tasks whose results are already there (a restarted master
    reuses them); ``splits`` the source split assignment per source uid;
    ``results`` the directory this run's result files go to."""

    def __init__(
        self,
        graph: JobGraph,
        config: Config,
        *,
        results: Location,
        run_id: str,
        failures: FailureInjector,
        flush_interval: float,
        finished: Mapping[TaskKey, tuple[ResultHandle, ...]] | None = None,
        splits: Mapping[str, Mapping[int, tuple[str, ...]]] | None = None,
        on_finished: Callable[[TaskKey, tuple[ResultHandle, ...]], None] | None = None,
        launcher: Launcher | None = None,
    ) -> None:
        self.graph = graph
        self.config = config
        self.results = results
        self.run_id = run_id
        self.failures = failures
        self.flush_interval = flush_interval
        self.regions: list[Region] = pipelined_regions(graph)
        if any(len(r.tasks) != 1 for r in self.regions):
            raise ConfigError("batch mode needs every exchange blocking")
        self.finished: dict[TaskKey, tuple[ResultHandle, ...]] = dict(finished or {})
        self.reused = set(self.finished)
        self.splits = {uid: dict(a) for uid, a in (splits or {}).items()}
        self.on_finished = on_finished
        self._vertex = {v.uid: v for v in graph.vertices}
        self._done: queue.SimpleQueue[TaskOutcome] = queue.SimpleQueue()
        self._running: dict[TaskKey, Running] = {}
        self._specs: dict[TaskKey, BatchTaskSpec] = {}
        self.launcher: Launcher = launcher or LocalLauncher()
        self._failovers = 0
        self._stale: set[tuple[str, int]] = set()  # reused results found damaged

    # -- inputs -----------------------------------------------------------------------

    def _inputs(self, key: TaskKey) -> list[InputResult]:
        """The results ``key`` reads, each on its gate channel (producers finished)."""
        g, v = self.graph, self._vertex[key[0]]
        out: list[InputResult] = []
        first = 0
        for e in sorted(g.inputs_of(v.id), key=lambda e: e.input_index):
            up = g.vertices[e.source]
            ek = edge_key(g, e)
            for u in range(up.parallelism):
                handle = next(h for h in self.finished[(up.uid, u)] if h.edge == ek)
                if not readable(e, handle.channels, v.parallelism):
                    raise AssertionError(f"{handle} cannot be read at {v.parallelism}")
                out.append(InputResult(handle, e, first + u))
            first += up.parallelism
        return out

    def _launch(self, key: TaskKey, outcome: BatchOutcome) -> None:
        uid, i = key
        v = self._vertex[uid]
        runs = outcome.runs[key] = outcome.runs.get(key, 0) + 1
        where = None
        if self.graph.outputs_of(v.id):
            where = self.results.child(f"{uid}-{i:05d}-{uuid.uuid4().hex[:8]}").uri
        spec = BatchTaskSpec(
            self.graph,
            self.config,
            uid,
            i,
            self._failovers,
            self.run_id,
            tuple(self._inputs(key)) if not v.is_source else (),
            where,
            self.splits.get(uid, {}).get(i) if v.is_source else None,
            self.flush_interval,
            self.failures,
        )
        logger.debug("batch: starting %s#%d (run %d)", uid, i, runs)
        self._specs[key] = spec
        self._running[key] = self.launcher.launch(spec, self._done.put)

    def _ready(self) -> list[TaskKey]:
        out = []
        for r in self.regions:
            (key,) = r.tasks
            if key in self.finished or key in self._running:
                continue
            if all(p in self.finished for p in r.consumes):
                out.append(key)
        return out

    # -- the loop ---------------------------------------------------------------------

    def run(self, deadline: float | None) -> BatchOutcome:
        outcome = BatchOutcome()
        for key in self.reused:
            outcome.tasks[f"{key[0]}#{key[1]}"] = {"runs": 0.0, "reused": 1.0}
        total = sum(v.parallelism for v in self.graph.vertices)
        strategy = self.config.restart.strategy or RestartStrategy.FIXED_DELAY
        budget = RestartBudget(strategy, self.config.restart)
        try:
            while len(self.finished) < total:
                for key in self._ready():
                    self._launch(key, outcome)
                if not self._running:
                    raise AssertionError("no task can run: a region waits for itself")
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    done = self._done.get(timeout=timeout)
                except queue.Empty:
                    names = ", ".join(f"{u}#{i}" for u, i in sorted(self._running))
                    raise TimeoutError(
                        f"the job did not finish in time (running: {names})"
                    ) from None
                key = done.key
                self._running.pop(key)
                spec = self._specs.pop(key)
                for index, attempt in done.fired:  # in another process: noted here
                    self.failures.mark_fired(index, attempt)
                metrics = dict(done.metrics)
                metrics["runs"] = float(outcome.runs[key])
                metrics["reused"] = 0.0
                outcome.tasks[f"{key[0]}#{key[1]}"] = metrics
                if done.results is not None:
                    self.finished[key] = done.results
                    if self.on_finished is not None:
                        self.on_finished(key, done.results)
                    continue
                if done.cancelled:
                    continue  # cancelled by us: its region runs again when ready
                error = TaskFailedError(f"{key[0]}#{key[1]}: {done.error}", done)
                outcome.failures.append(str(error))
                outcome.errors.append(error)
                if spec.results_dir is not None:  # what it wrote before it failed
                    delete_tree(Location.parse(spec.results_dir))
                lost = None
                if done.lost is not None:
                    producer = (done.lost.producer, done.lost.subtask)
                    if done.lost in self.finished.get(producer, ()):
                        lost = producer  # not already running again
                # A reused result (checked only at its ends when this master started)
                # found damaged by its reader is the rest of that check, not a failure
                # of this run: its producer runs again without using up a restart.
                if done.fatal:
                    delay = None
                elif (lost is not None and lost in self.reused) or (
                    done.lost is not None and done.lost.gate.key in self._stale
                ):
                    delay = 0.0
                else:
                    delay = budget.after_failure()
                if delay is None:
                    raise error
                self._failovers += 1
                if lost is not None:
                    logger.warning(
                        "batch: the result of %s#%d is lost (%s): it runs again",
                        *lost,
                        done.error,
                    )
                    for h in self.finished.pop(lost):
                        delete_tree(Location.parse(h.gate.uri).parent)
                        if lost in self.reused:  # its other readers may find it gone
                            self._stale.add(h.gate.key)
                    self.reused.discard(lost)
                logger.warning(
                    "batch: %s#%d failed (%s); its region runs again", key[0], key[1], done.error
                )
                time.sleep(delay)
        except BaseException as e:
            outcome.error = e
            for running in self._running.values():
                running.cancel()
            while self._running:  # every run reports its end, cancelled or not
                try:
                    self._running.pop(self._done.get(timeout=60).key, None)
                except queue.Empty:
                    logger.warning("batch: %s did not end when cancelled", sorted(self._running))
                    break
        finally:
            self.launcher.close()
        return outcome


class TaskFailedError(RuntimeError):
    """A batch task failed; ``outcome`` says how (its traceback in ``trace``)."""

    def __init__(self, message: str, outcome: TaskOutcome) -> None:
        super().__init__(message)
        self.outcome = outcome
