"""The job master: runs a job graph, restarting it on failures from the latest
completed checkpoint as the restart strategy allows (possibly at another
parallelism); deployments (``spillover.deploy``) say where its subtasks run."""

from __future__ import annotations

import errno
import logging
import queue
import threading
import time
import traceback
import uuid
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from spillover.config import Config, RestartStrategy
from spillover.errors import ConfigError, StateFileNotFoundError, StorageError
from spillover.runtime.batch import runs_as_batch
from spillover.runtime.batch.job import log_storage, run_batch
from spillover.runtime.batch.launch import Launcher, LocalLauncher
from spillover.runtime.checkpointing.checkpoint_meta import CheckpointMetadata
from spillover.runtime.checkpointing.coordinator import (
    CheckpointCoordinator,
    CheckpointFailuresExceeded,
)
from spillover.runtime.checkpointing.coordinator_state import CoordinatorState
from spillover.runtime.checkpointing.metadata import load_checkpoint
from spillover.runtime.checkpointing.savepoint_request import SavepointRequest
from spillover.runtime.checkpointing.stats import CheckpointStatsTracker
from spillover.runtime.claim import CheckpointClaim
from spillover.runtime.failures import FailureInjector
from spillover.runtime.graph import JobGraph, StreamEnvironment
from spillover.runtime.jobevents import LeaseError
from spillover.runtime.jobrecovery import JobRecovery
from spillover.runtime.jobresult import JobResult
from spillover.runtime.jobstatus import JobStatusTracker
from spillover.runtime.live_rescale import (
    LiveRescale,
    RescaleRequest,
    job_parallelism,
    rescaled_graph,
)
from spillover.runtime.recovery.plan import plan_restore
from spillover.runtime.recovery.restore import TaskRestore
from spillover.runtime.restarts import RestartBudget
from spillover.runtime.savepoints import Savepoints
from spillover.runtime.stopping import Stop
from spillover.runtime.task import Task
from spillover.runtime.wiring import checkpoint_storage
from spillover.storage.location import Publication

__all__ = [
    "Executor",
    "JobCancelledError",
    "JobDiagnosis",
    "JobFailedError",
    "JobResult",  # its home is ``jobresult``; imported from here as ever
    "RescalePolicy",
    "StopWhen",
    "next_event",
    "running_executors",
]

logger = logging.getLogger(__name__)

# Checking a restore point's files (before any task starts) that storage fails, not
# because a file is missing, is tried this many times, waiting 0.1 s, then twice as
# long each time: a fault of the moment must not refuse a checkpoint that is whole.
RESTORE_CHECK_ATTEMPTS = 5
RESTORE_CHECK_BACKOFF_S = 0.1


class JobFailedError(RuntimeError):
    """The job failed and the restart strategy allows no more attempts."""


class JobCancelledError(RuntimeError):
    """The running attempt ends because the job was cancelled (:meth:`Executor.cancel`)."""


StopWhen = Callable[[list[dict[str, Any]]], bool]


def next_event(
    events: queue.SimpleQueue[Any],
    coordinator: CheckpointCoordinator,
    deadline: float | None,
    stop_at: float | None,
    stop_when: StopWhen | None,
) -> tuple[str, Any]:
    """``("event", item)``: the attempt's next event; ``("stop", None)`` once ``stop_at``
    passed or ``stop_when`` holds for the checkpoint summaries (polled every 20 ms);
    ``("timeout", None)`` once ``deadline`` passed, whichever comes first."""
    while True:
        ends = [x for x in (deadline, stop_at) if x is not None]
        timeout = None if not ends else max(0.0, min(ends) - time.monotonic())
        if stop_when is not None:
            timeout = 0.02 if timeout is None else min(timeout, 0.02)
        try:
            return "event", events.get(timeout=timeout)
        except queue.Empty:
            pass
        now = time.monotonic()
        if (stop_at is not None and now >= stop_at) or (
            stop_when is not None and stop_when(list(coordinator.summaries))
        ):
            return "stop", None
        if deadline is not None and now >= deadline:
            return "timeout", None


@dataclass(frozen=True)
class JobDiagnosis:
    """Where a running job is, for one that does not end: its attempt, its stop, its
    coordinator's pending checkpoints and each subtask's lifecycle and barrier state
    (subtasks on threads of this process; a Spark job's are remote: none)."""

    job_name: str
    attempt: int
    stop: str  # the stop asked, or "none"
    coordinator: CoordinatorState | None  # None before the first attempt started
    tasks: tuple[str, ...]  # one line per subtask (Task.describe)

    def describe(self) -> str:
        lines = [f"job {self.job_name}: attempt {self.attempt}, stop {self.stop}"]
        if self.coordinator is not None:
            lines.append(self.coordinator.describe())
        lines += [f"  {t}" for t in self.tasks]
        return "\n".join(lines)


_running: weakref.WeakSet[Executor] = weakref.WeakSet()
_running_lock = threading.Lock()


def running_executors() -> list[Executor]:
    """The executors of this process whose ``run`` has not returned."""
    with _running_lock:
        return list(_running)


RescalePolicy = Callable[["Executor", int, BaseException], "JobGraph | StreamEnvironment | None"]
"""``(executor, failed attempt, its error)`` → the job to run the next attempt with
(another parallelism: the restore rescales state and in-flight data), or None to
keep it. Called before each restart."""


class Executor:
    """Runs a job graph, restarting it on failures; subclasses say where subtasks run.

    A subclass gives ``_attempt(attempt, restore, restored_id)``: an object with
    ``run(deadline, stop_at, stop_when)`` (the error that ended it, or None),
    ``coordinator``, ``stopped``, ``task_metrics()``, ``stop_sources(drain)``
    (stop-with-savepoint: posts :class:`StopSource` to its source subtasks), and the
    ``time.monotonic()``
    instants ``running_at`` (its subtasks started) and ``failed_at`` (it detected its
    failure), each None until then; ``JobResult.restart_s`` is timed from them.
    """

    def __init__(
        self,
        job: JobGraph | StreamEnvironment,
        config: Config | None = None,
        *,
        failures: FailureInjector | None = None,
        metrics_path: str | None = None,
        restore_checkpoint: int | str | None = None,
        flush_interval: float | None = None,
        allow_non_restored_state: bool | None = None,
        ignore_inflight: bool | None = None,
        force_forward_rescale: bool | None = None,
        rescale: RescalePolicy | None = None,
    ) -> None:
        self.graph = job.build() if isinstance(job, StreamEnvironment) else job
        self.rescale = rescale
        self.config = config or Config()
        self.failures = failures or FailureInjector()
        self.metrics_path = metrics_path
        # Seconds a partly filled buffer waits (None: execution.buffer-timeout.interval).
        self.flush_interval = (
            self.config.network.buffer_timeout.total_seconds()
            if flush_interval is None
            else flush_interval
        )
        rec = self.config.recovery
        self.restore_checkpoint = restore_checkpoint if restore_checkpoint is not None else rec.path
        self.allow_non_restored_state = (
            rec.ignore_unclaimed_state
            if allow_non_restored_state is None
            else allow_non_restored_state
        )
        # True: drop in-flight data of whatever checkpoint is restored (the records are lost).
        self.ignore_inflight = bool(ignore_inflight)
        self.force_forward_rescale = (
            rec.force_forward_rescale if force_forward_rescale is None else force_forward_rescale
        )
        self.settings = {
            **self.config.restore_critical(),
            "max-parallelism": self.graph.max_parallelism,
        }
        # Batch mode (execution.runtime-mode): stages of blocking exchanges, no
        # checkpoints; its storage is where the event log goes (docs/recovery.md).
        self.batch = runs_as_batch(self.graph, self.config)
        if self.batch and self.config.checkpointing.enabled:
            logger.info(
                "job %s runs in batch mode: execution.checkpointing.interval is ignored",
                self.graph.name,
            )
        self.storage = (
            log_storage(self.config, self.graph.name)
            if self.batch
            else checkpoint_storage(self.config, self.graph.name)
        )
        self.next_checkpoint_id = 1
        self.run_id: str | None = None  # set by ``run``
        # The run's retained and subsumed checkpoints, carried from attempt to attempt
        # so that retention counts them all (state.checkpoints.num-retained).
        self.retained_ids: list[int] = []
        self.subsumed_ids: list[int] = []
        self.job_id = uuid.uuid4().hex
        self._current: Any = None  # the running attempt
        self._attempt_no = 0  # ... its number
        self._stop = Stop()  # stop-with-savepoint
        self.recovery: JobRecovery | None = None  # the lease and event log, while running
        # What operators read while it runs (the REST API): checkpoint statistics over
        # every attempt, the job's state, its exceptions and restarts.
        storage = self.storage
        self.stats = CheckpointStatsTracker(
            None if storage is None else lambda cid: str(storage.checkpoint_dir(cid))
        )
        self.status = JobStatusTracker()
        self._cancelled = False
        # Savepoints without a stop, and every savepoint's export.
        self._savepoints = Savepoints(
            storage, self.stats, self.job_id, self.config.state.savepoints_dir
        )
        self._claim = CheckpointClaim(storage, self.config)  # the restored checkpoint's
        self._rescales = LiveRescale(storage)  # ``rescale_live``

    @property
    def last_rescale(self) -> RescaleRequest | None:
        """The latest live rescale asked for (None before any)."""
        return self._rescales.last

    @property
    def _rescaling(self) -> RescaleRequest | None:
        """The live rescale under way, if any."""
        return self._rescales.under_way

    def _attempt(
        self,
        attempt: int,
        restore: dict[tuple[str, int], TaskRestore] | None,
        restored_id: int | None,
    ) -> Any:
        raise NotImplementedError

    def diagnosis(self) -> JobDiagnosis:
        """Where the running job is (safe from any thread; for a job that hangs)."""
        run = self._current
        asked = self._stop.asked
        coordinator = None if run is None else run.coordinator
        tasks: tuple[str, ...] = ()
        if coordinator is not None:
            tasks = tuple(
                t.describe() for _, t in sorted(coordinator.tasks.items()) if isinstance(t, Task)
            )
        return JobDiagnosis(
            self.graph.name,
            self._attempt_no,
            "none" if asked is None else asked.describe(),
            None if coordinator is None else coordinator.state(),
            tasks,
        )

    def completed_ids(self) -> list[int]:
        """The checkpoints the running attempt completed so far."""
        run = self._current
        return [] if run is None else list(run.coordinator.completed_ids)

    def stop_with_savepoint(
        self, drain: bool = False, savepoint_dir: str | None = None, unaligned: bool = False
    ) -> SavepointRequest:
        """Stops the running job with a savepoint, from any thread (FLIP-147, as Flink's
        stop-with-savepoint); the answer gives its path once ``run`` returned (with
        ``JobResult.savepoint``), or why the stop failed. The savepoint is a
        self-contained copy of the stop's checkpoint, ``savepoint-<job>-<id>`` under
        ``savepoint_dir`` (default ``state.savepoints.dir``, else ``savepoints`` in the
        job's checkpoint directory); restore it with ``restore_checkpoint=``.

        Without ``drain``, every task is told the next checkpoint (aligned, or
        ``unaligned``) is the savepoint, holds what reaches it once it took it, and
        ends when it completed (job ``stopped``). An aborted attempt leaves the job
        running exactly as before and is tried again, up to
        ``tolerable-failed-checkpoints`` times; then the stop fails and the job goes
        on. With ``drain`` the sources end, every ``finish()`` runs and the final
        checkpoint is the savepoint (job ``finished``, for good: docs/runtime.md)."""
        if self.batch:
            raise ConfigError(
                "a batch job takes no savepoints",
                hint="let it finish; a batch job started again reuses what finished",
            )
        if self.storage is None:
            raise ConfigError(
                "stop-with-savepoint needs checkpoint storage",
                hint="set state.checkpoints.dir and execution.checkpointing.interval",
            )
        if drain and unaligned:
            raise ConfigError(
                "a drained stop cannot take an unaligned savepoint",
                detail="drain processes everything in flight before the savepoint",
                hint="stop without drain, or with an aligned savepoint",
            )
        if self._rescaling is not None:
            raise ConfigError("the job is rescaling", hint="stop it once the rescale ended")
        where = savepoint_dir or self._savepoints.default_dir()
        request = self._stop.accept(drain, unaligned, where)
        run = self._current
        if run is not None:
            self._ask_stop(run)
        return request

    def _stop_failed(self, reason: str) -> None:  # from the coordinator: the job goes on
        self._stop.give_up(reason, self.recovery)

    def _log_command(self, command: str, detail: str) -> None:
        recovery = self.recovery
        if recovery is not None:
            recovery.command_received(command, detail)

    def trigger_savepoint(
        self, savepoint_dir: str | None = None, unaligned: bool = False
    ) -> SavepointRequest:
        """Takes a savepoint without stopping the job, from any thread: a checkpoint
        triggered now (aligned, or ``unaligned``) and exported as
        :meth:`stop_with_savepoint` exports its own; ``wait()`` on the answer gives
        its path. Asked while the job restarts, the next attempt takes it; the
        request fails if the run ends first. Refused (ConfigError) without
        checkpoint storage or before the job started."""
        storage = self.storage
        if self.batch or storage is None:
            raise ConfigError(
                "a savepoint needs checkpoint storage",
                hint="set state.checkpoints.dir and execution.checkpointing.interval",
            )
        if self._current is None:
            raise ConfigError("the job is not running", hint="wait for it to start")
        request = self._savepoints.trigger(savepoint_dir, unaligned)
        self._log_command("savepoint", f"dir={savepoint_dir} unaligned={unaligned}")
        return request

    def rescale_live(self, wanted: Mapping[str, int] | int) -> RescaleRequest:
        """Rescales the running job, from any thread: ``wanted`` is a parallelism per
        vertex uid (the others keep theirs) or one for every vertex.

        The job takes the stop's unaligned savepoint (nothing drains; what is in
        flight goes into it), its tasks end once it completed, and the job restarts
        from it at the new parallelism in this process, its in-flight data
        redistributed by key group: the same job id, statistics and event log
        (which records the rescale). The answer completes with the time from the
        request to the first record at the new parallelism. A savepoint attempt the
        coordinator aborts is tried again, within
        ``execution.checkpointing.tolerable-failed-checkpoints``; beyond them the
        rescale fails and the job restarts from its latest checkpoint at the
        parallelism it had (not charged to the restart strategy). Refused
        (ConfigError) before anything is touched: no checkpoint storage, a job not
        running, a stop or another rescale under way, and a parallelism below 1,
        above the max parallelism or the one the job has."""
        if self.batch or self.storage is None:
            raise ConfigError(
                "a live rescale needs checkpoint storage",
                hint="set state.checkpoints.dir and execution.checkpointing.interval",
            )
        graph = self.graph
        if isinstance(wanted, int):
            wanted = {v.uid: wanted for v in graph.vertices}
        new = rescaled_graph(graph, wanted)
        run = self._current
        if run is None:
            raise ConfigError("the job is not running", hint="wait for it to start")
        # Refused before the savepoint when no checkpoint of the job restores at ``new``.
        self._rescales.check_restorable(
            lambda meta: self._plan(meta, new, ignore_inflight=self.ignore_inflight)
        )
        if self._stop.asked is not None:
            raise ConfigError("the job is stopping", hint="let the stop end")
        request = self._rescales.start(graph, new, self._current.coordinator)
        self._log_command("rescale", " ".join(f"{u}={p}" for u, p in sorted(wanted.items())))
        return request

    def _ask_stop(self, run: Any) -> None:
        """Asks the stop under way of ``run``'s attempt (recorded in the log once)."""
        self._stop.record(self.recovery)
        asked = self._stop.asked
        if asked is None:
            return
        if not asked.drain:  # a savepoint the tasks suspend at: aborted, they go on
            run.coordinator.request_stop(int(asked.kind), on_failed=self._stop_failed)
        else:  # drained: the sources end, the final checkpoint is the savepoint
            run.stop_sources(True)

    def cancel(self) -> None:
        """Cancels the job from any thread, as Flink's cancel: no savepoint; ``run``
        returns with status ``cancelled`` and the event log records the job cancelled
        (a later start resumes it from its latest checkpoint)."""
        self._cancelled = True
        self._log_command("cancel", "")
        self.status.cancel_requested()
        run = self._current
        if run is not None:
            run.coordinator.on_failure(JobCancelledError("the job was cancelled"))

    def checkpoint_completed(self, checkpoint_id: int, metadata: Publication) -> None:
        """A checkpoint completed: its metadata file published, and then the checkpoint
        recorded in the job's event log, before any task hears of it (a restarted
        master restores it)."""
        if self.recovery is not None:
            self.recovery.checkpoint_completed(checkpoint_id, metadata)
        else:
            metadata.publish()
        self._claim.checkpoint_completed(checkpoint_id)

    def _begin_recovery(self) -> JobRecovery | None:
        """With checkpoint storage: the job's lease and event log, and the decision
        whether this start resumes an earlier run (``JobResult.recovery`` says it)."""
        if self.storage is None:
            return None
        rec = JobRecovery(
            self.storage,
            enabled=self.config.execution.batch_job_recovery
            if self.batch
            else self.config.recovery.job_recovery,
            explicit_restore=None
            if self.restore_checkpoint is None
            else str(self.restore_checkpoint),
            lease_ttl_s=self.config.recovery.lease_timeout_s,
        )
        rec.on_lost = self._lease_lost
        rec.begin(
            job_name=self.graph.name,
            fingerprint=self.graph.fingerprint(),
            parallelism=self._parallelism(),
            configuration=self.config.to_dict(),
        )
        self.recovery = rec
        return rec

    def _parallelism(self) -> int:
        """The job's parallelism as the event log records it: its largest vertex's."""
        return job_parallelism(self.graph)

    def _lease_lost(self, error: LeaseError) -> None:
        """Another master took the job: this one fails its attempt and stops."""
        run = self._current
        if run is not None:
            run.coordinator.on_failure(error)

    def prepare(self) -> None:
        """Gets the cluster ready (a no-op here), so that timing ``run`` measures the job."""

    def running_since(self) -> float | None:
        """When the running attempt's subtasks started (``time.monotonic()``): a
        measurement window that starts there leaves the cluster's start-up out. None
        before."""
        run = self._current
        return None if run is None else run.running_at

    def live_metric(self, uid: str, metric: str = "records_in") -> float:
        """The sum of ``metric`` over the subtasks of operator ``uid`` in the running
        attempt (0 before it starts); safe to call from any thread."""
        run = self._current
        if run is None:
            return 0.0
        prefix = f"{uid}#"
        return float(
            sum(m.get(metric, 0.0) for k, m in run.task_metrics().items() if k.startswith(prefix))
        )

    def task_metrics(self) -> dict[str, dict[str, float]]:
        """Each subtask's live metrics (``uid#i``) in the running attempt ({} before it
        starts); safe to call from any thread (on Spark, as the workers last reported)."""
        run = self._current
        return {} if run is None else dict(run.task_metrics())

    def _retain_own(self, own: list[int]) -> None:
        """A resumed run's retention, as its dead master left it: the newest
        ``state.checkpoints.num-retained`` of the run's complete checkpoints (``own``,
        oldest first, the resumed one last) retained, the older ones subsumed, deleted
        at the next completion unless a retained one references them (Flink's
        completed checkpoint store, recovered on failover, subsumes them the same way)."""
        keep = self.config.state.num_retained
        self.retained_ids, self.subsumed_ids = own[-keep:], own[:-keep]

    def _restore_point(self) -> CheckpointMetadata | None:
        """The metadata of the checkpoint to restore: the one asked for (an id in this
        job's checkpoint directory, or a checkpoint directory's path), else the latest."""
        rc = self.restore_checkpoint
        if isinstance(rc, str):
            return load_checkpoint(rc)
        if self.storage is None:
            return None
        if isinstance(rc, int):
            return self.storage.read(rc)
        latest = self.storage.latest()
        if latest is None:
            return None
        return latest.metadata

    def _use_graph(self, job: JobGraph | StreamEnvironment) -> None:
        """The job at other parallelisms, for the next attempt (a rescale policy's
        answer): the same job name and max parallelism, or it is refused."""
        graph = job.build() if isinstance(job, StreamEnvironment) else job
        if graph.name != self.graph.name or graph.max_parallelism != self.graph.max_parallelism:
            raise ConfigError(
                "a rescale policy must keep the job's name and max parallelism",
                detail=f"{self.graph.name!r}/{self.graph.max_parallelism} became "
                f"{graph.name!r}/{graph.max_parallelism}",
                hint="build the job with the same name and pipeline.max-parallelism",
            )
        self.graph = graph

    def _plan(
        self,
        meta: CheckpointMetadata | None,
        graph: JobGraph | None = None,
        *,
        ignore_inflight: bool | None = None,
    ) -> dict[tuple[str, int], TaskRestore] | None:
        """What each subtask of ``graph`` (default: the job's) restores of ``meta``;
        raises when it does not fit. In-flight data is dropped as ``ignore_inflight``
        says (default: as asked, and for the checkpoint
        ``execution.checkpointing.recover-without-channel-state.checkpoint-id``)."""
        if meta is None:
            return None
        if ignore_inflight is None:
            ignore_inflight = (
                self.ignore_inflight
                or meta.checkpoint_id == self.config.recovery.without_channel_state_checkpoint
            )
        for attempt in range(RESTORE_CHECK_ATTEMPTS):
            try:
                return plan_restore(
                    meta,
                    self.graph if graph is None else graph,
                    allow_non_restored_state=self.allow_non_restored_state,
                    ignore_inflight=ignore_inflight,
                    force_forward=self.force_forward_rescale,
                )
            except StorageError as e:
                missing = isinstance(e, StateFileNotFoundError) or e.errno == errno.ENOENT
                if missing or attempt + 1 == RESTORE_CHECK_ATTEMPTS:
                    raise
                logger.warning(
                    "checking checkpoint %d failed, trying again: %s", meta.checkpoint_id, e
                )
                time.sleep(RESTORE_CHECK_BACKOFF_S * 2**attempt)
        raise AssertionError("unreachable")

    def run(
        self,
        timeout: float | None = None,
        *,
        stop_after: float | None = None,
        stop_when: StopWhen | None = None,
    ) -> JobResult:
        """Runs the job to its end, restarting it on failures as the strategy allows.

        ``timeout``: give up (status ``failed``) after that many seconds.
        ``stop_after``: stop an unbounded job after that many seconds (status
        ``stopped``; the checkpoints taken until then are kept). ``stop_when``: stop
        as soon as it returns True for the current attempt's checkpoint summaries.
        """
        started = time.monotonic()
        result = JobResult(
            self.graph.name,
            "failed",
            0,
            0.0,
            checkpoint_dir=self.storage.uri if self.storage else None,
        )
        if self.batch and self.restore_checkpoint is not None:
            raise ConfigError(
                "a batch job restores no checkpoint",
                detail=f"asked to restore {self.restore_checkpoint}",
                hint="unset execution.state-recovery.path, or run it in streaming mode",
            )
        if self.batch and not self.supports_batch:
            raise ConfigError(
                f"{type(self).__name__} cannot run batch jobs yet",
                hint="run it on the local executor, or set execution.runtime-mode: streaming",
            )
        recovery = self._begin_recovery()  # the lease first: a refused master starts nothing
        self._savepoints.open(recovery)
        # The run every subtask and attempt belongs to: the log's when it resumes one.
        resume = recovery.resume if recovery is not None else None
        self.run_id = resume.run_id if resume is not None else uuid.uuid4().hex
        with _running_lock:
            _running.add(self)
        try:
            if self.batch:
                self.start_cluster()  # meanwhile: the log's replay, the reuse check
                self.status.attempt_started(0)
                self._run_batch(result, recovery, started, timeout)
            else:
                self._run(result, recovery, started, timeout, stop_after, stop_when)
        finally:
            with _running_lock:
                _running.discard(self)
            try:
                self._release()
            except Exception:  # the lease and the status below are released all the same
                logger.warning("could not free what the last attempt left", exc_info=True)
            self._savepoints.close()
            # The run ended, or raised, with a rescale under way: it failed.
            self._rescales.fail(f"the job ended ({result.status}) before the rescale did")
            self._stop.ended(result.status)  # answered already if it had a savepoint
            self.status.ended(result.status)
            self.recovery = None
            if recovery is not None:
                recovery.close()
            if self.batch:  # a run that ended before its tasks: nothing left starting
                try:
                    self.cluster_started()
                except Exception as e:
                    logger.debug("the cluster did not start: %s", e)
        result.duration_s = time.monotonic() - started
        return result

    supports_batch = False  # whether ``_run_batch`` can run tasks where this executor does

    def _release(self) -> None:
        """Frees what a failed attempt left for the next one to reuse (a restart in
        place's stage) once the run ended; a no-op here."""

    def start_cluster(self) -> None:
        """Starts getting the cluster ready in the background (a no-op here); the
        batch launcher waits for it (``cluster_started``). A batch master that holds
        its lease replays its log and checks the results it reuses meanwhile."""

    def cluster_started(self) -> None:
        """Waits for what ``start_cluster`` began; raises what it failed with."""

    def _batch_launcher(self) -> Launcher:
        """Where a batch job's tasks run: threads of this process, unless overridden."""
        return LocalLauncher()

    def _run_batch(
        self,
        result: JobResult,
        recovery: JobRecovery | None,
        started: float,
        timeout: float | None,
    ) -> None:
        """A batch job: region by region, reusing what an earlier master finished."""
        run = run_batch(
            self.graph,
            self.config,
            recovery=recovery,
            failures=self.failures,
            flush_interval=self.flush_interval,
            deadline=None if timeout is None else started + timeout,
            launcher=self._batch_launcher,
            run_id=self.run_id,
        )
        result.run_id, result.recovery = run.run_id, run.recovery
        result.reused_tasks = [f"{uid}#{i}" for uid, i in run.reused]
        if run.outcome is None:
            result.status, result.already_finished = "finished", True
            return
        out = run.outcome
        result.attempts = 1 + len(out.failures)
        result.tasks = out.tasks
        result.failures = [f"attempt {k}: {f}" for k, f in enumerate(out.failures)]
        result.tracebacks = [e.outcome.trace for e in out.errors]
        result.status = "finished" if out.error is None else "failed"
        if out.error is not None and not out.errors:
            result.failures.append(f"{type(out.error).__name__}: {out.error}")

    def _run(
        self,
        result: JobResult,
        recovery: JobRecovery | None,
        started: float,
        timeout: float | None,
        stop_after: float | None,
        stop_when: StopWhen | None,
    ) -> None:
        deadline = None if timeout is None else started + timeout
        stop_at = None if stop_after is None else started + stop_after
        strategy = self.config.restart_strategy
        budget = RestartBudget(strategy, self.config.restart)
        attempt = 0
        failed_at: float | None = None
        generation, cause = 0, "submitted"
        meta = self._restore_point() if self.restore_checkpoint is not None else None
        first_meta = meta  # what a restart restores while this run completed no checkpoint
        if recovery is not None and recovery.resume is not None:
            resume = recovery.resume
            result.run_id, result.recovery = resume.run_id, resume.reason
            (logger.info if resume.fresh else logger.warning)(
                "job %s: %s", self.graph.name, resume.reason
            )
            if resume.finished:
                result.status, result.already_finished = "finished", True
                return
            generation = resume.generation
            self.next_checkpoint_id = max(self.next_checkpoint_id, resume.first_checkpoint_id)
            if resume.stop is not None:
                self._stop.resume(resume.stop)
            if not resume.fresh:
                cause = "resumed after its previous master ended"
                if resume.checkpoint is not None:
                    assert self.storage is not None
                    cp = resume.checkpoint
                    meta = first_meta = self.storage.read(cp.checkpoint_id)
                    self._retain_own(recovery.own_checkpoints(cp.checkpoint_id))
        restore = self._plan(meta)  # refuses a checkpoint that does not fit, before starting
        if meta is not None and meta is first_meta and self.restore_checkpoint is not None:
            owned = self._claim.claim(meta, self.restore_checkpoint)
            if owned is not None:  # claimed in the job's folder: retention counts it
                self.retained_ids = [owned]
        rescaled = False  # the attempt to start is a live rescale's, not a restart
        while True:
            restored_id = meta.checkpoint_id if meta is not None else None
            if restored_id is not None:
                result.restored_from.append(restored_id)
                self.stats.restored(
                    restored_id,
                    _restore_path(self.restore_checkpoint, restored_id, self.storage),
                    isinstance(self.restore_checkpoint, str),
                )
            if recovery is not None:
                assert self.storage is not None
                first = max(
                    self.next_checkpoint_id,
                    (restored_id or 0) + 1,
                    self.storage.highest_id() + 1,
                )
                self.next_checkpoint_id = first
                recovery.generation_started(
                    generation + attempt,
                    self._parallelism(),
                    cause,
                    _restore_path(self.restore_checkpoint, restored_id, self.storage),
                    first,
                )
            run = self._attempt(attempt, restore, restored_id)
            self._current, self._attempt_no = run, attempt
            self._savepoints.attempt_started(run.coordinator)
            if self._stop.asked is not None:  # asked before this attempt started
                self._ask_stop(run)
            rescale = self._rescaling
            watch: threading.Event | None = None
            if rescale is not None and rescale.status().savepoint_id is None:
                self._rescales.ask_stop(run.coordinator)  # asked before this attempt started
            elif rescale is not None:  # this attempt is the rescaled job
                watch = self._rescales.watch_first_record(run, rescale)
            self.status.attempt_started(attempt, restart=not rescaled)
            if self._cancelled:  # asked before this attempt started
                run.coordinator.on_failure(JobCancelledError("the job was cancelled"))
            try:
                error = run.run(deadline, stop_at, stop_when)
            finally:
                if watch is not None:
                    watch.set()
            if failed_at is not None and run.running_at is not None:
                result.restart_s.append(round(run.running_at - failed_at, 4))
            failed_at = run.failed_at or time.monotonic()
            result.attempts = attempt + 1
            result.add_checkpoints(run.coordinator.summaries, run.coordinator.ended)
            for name, m in run.task_metrics().items():
                result.tasks[name] = m
                result.replayed_bytes += int(m.get("replayed_bytes", 0))
            self.next_checkpoint_id = run.coordinator.next_id
            self.retained_ids = run.coordinator.retained_ids
            self.subsumed_ids = run.coordinator.subsumed_ids
            rescaled = free_restart = False
            rescale = self._rescaling  # asked for before or while the attempt ran
            if rescale is not None and not rescale.done:
                stop_id = run.coordinator.stop_id
                took_savepoint = stop_id is not None and stop_id in run.coordinator.completed_ids
                if rescale.status().savepoint_id is not None:
                    self._rescales.fail(
                        "the job ended at the new parallelism before its first record"
                        if error is None
                        else f"the job failed at the new parallelism: {error}",
                        rescale,
                    )
                elif error is None and took_savepoint and not self._cancelled and not run.stopped:
                    assert stop_id is not None
                    rescaled = True
                else:
                    self._rescales.fail(
                        "the job ended before its savepoint"
                        if error is None
                        else f"the savepoint failed: {type(error).__name__}: {error}",
                        rescale,
                    )
                    # Savepoint attempts failed beyond the tolerated: the job goes on
                    # at its parallelism, from its latest checkpoint, at no cost to
                    # the restart strategy.
                    free_restart = isinstance(error, CheckpointFailuresExceeded)
            if rescaled:
                assert rescale is not None and stop_id is not None
                if recovery is not None:
                    recovery.generation_ended(
                        generation + attempt, f"rescaled from savepoint {stop_id}"
                    )
                attempt += 1
                self.restore_checkpoint = None  # from now on: this run's own checkpoints
                step = self._rescales.restart_from(
                    rescale, stop_id, self.graph, self._plan, recovery
                )
                self._use_graph(step.graph)
                meta, restore = step.meta, step.restore
                cause = f"live rescale to {self._parallelism()}"
                failed_at = None
                continue
            if self._cancelled and error is not None:
                result.status = "cancelled"
                if recovery is not None:
                    recovery.generation_ended(generation + attempt, "cancelled")
                    recovery.terminated("cancelled", "cancelled on request")
                break
            if error is None:
                result.status = "stopped" if run.stopped else "finished"
                asked = self._stop.asked
                if asked is not None and run.coordinator.completed_ids:
                    assert self.storage is not None
                    # The stop's savepoint; if the data ended first, the final checkpoint.
                    cid = run.coordinator.stop_savepoint_id or run.coordinator.completed_ids[-1]
                    result.savepoint, copy_failed = self._savepoints.export_stop(
                        cid, asked.savepoint_dir
                    )
                    result.failures += [copy_failed] if copy_failed else []
                    result.status = "finished" if asked.drain else "stopped"
                    asked.request.succeeded(result.savepoint)
                if recovery is not None:
                    recovery.generation_ended(generation + attempt, result.status)
                    recovery.terminated(
                        result.status,
                        f"stopped with savepoint {result.savepoint}"
                        if result.savepoint and result.status == "stopped"
                        else result.status,
                    )
                break
            failure = f"{type(error).__name__}: {error}"
            result.failures.append(f"attempt {attempt}: {failure}")
            result.tracebacks.append("".join(traceback.format_exception(error)))
            self.status.attempt_failed(attempt, error, result.tracebacks[-1])
            if recovery is not None:
                recovery.generation_ended(generation + attempt, f"failed: {failure}"[:500])
            if not free_restart and (
                strategy is RestartStrategy.NONE
                or isinstance(error, TimeoutError | ConfigError | LeaseError)
            ):
                # A configuration error does not heal on a restart; a master that lost
                # its lease must leave the job to the one that took it.
                if recovery is not None:
                    recovery.terminated("failed", failure[:500])
                break
            delay = 0.0 if free_restart else budget.after_failure()
            if delay is None:
                if recovery is not None:
                    recovery.terminated("failed", f"restart strategy exhausted: {failure}"[:500])
                break
            time.sleep(delay)
            if self.rescale is not None:
                old = self._parallelism()
                changed = self.rescale(self, attempt, error)
                if changed is not None:
                    self._use_graph(changed)
                    new = self._parallelism()
                    if recovery is not None and new != old:
                        recovery.rescale_decided(old, new, "rescale policy")
            attempt += 1
            cause = f"restart after {failure}"[:500]
            self.restore_checkpoint = None  # failover: the latest completed checkpoint
            if recovery is not None:  # ... the log names (this run's), else where it began
                meta = recovery.latest_metadata() or first_meta
            else:
                meta = self._restore_point()
            restore = self._plan(meta)


def _restore_path(asked: int | str | None, restored_id: int | None, storage: Any) -> str | None:
    """Where an attempt's state comes from, for the event log."""
    if isinstance(asked, str):
        return asked
    return None if restored_id is None else str(storage.checkpoint_dir(restored_id))
