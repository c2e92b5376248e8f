"""The job master: runs a job graph, restarting it on failures from the latest
completed checkpoint as the restart strategy allows (possibly at another
parallelism); deployments (``spillover.deploy``) say where its subtasks run."""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from spillover.config import ClaimMode, Config, RestartStrategy
from spillover.errors import ConfigError, SpilloverError, StorageError
from spillover.runtime.batch import runs_as_batch
from spillover.runtime.batch.job import log_storage, run_batch
from spillover.runtime.batch.launch import Launcher, LocalLauncher
from spillover.runtime.checkpointing.checkpoint_meta import CheckpointMetadata
from spillover.runtime.checkpointing.coordinator import (
    CheckpointCoordinator,
    CheckpointFailuresExceeded,
)
from spillover.runtime.checkpointing.metadata import read_checkpoint
from spillover.runtime.checkpointing.savepoint_request import SavepointRequest
from spillover.runtime.checkpointing.stats import CheckpointStatsTracker
from spillover.runtime.failures import FailureInjector
from spillover.runtime.graph import JobGraph, StreamEnvironment
from spillover.runtime.jobevents import LeaseError
from spillover.runtime.jobrecovery import JobRecovery
from spillover.runtime.jobstatus import JobStatusTracker
from spillover.runtime.live_rescale import RescaleRequest, job_parallelism, rescaled_graph
from spillover.runtime.network.events import BarrierKind
from spillover.runtime.recovery.plan import plan_restore
from spillover.runtime.recovery.restore import TaskRestore
from spillover.runtime.restarts import RestartBudget
from spillover.runtime.wiring import checkpoint_storage
from spillover.storage.location import Location, delete_tree

logger = logging.getLogger(__name__)

# A savepoint's copy that storage fails is tried this many times, waiting 0.1 s,
# then twice as long each time (about 3 s in all).
EXPORT_ATTEMPTS = 5
EXPORT_BACKOFF_S = 0.1


def _transient(e: BaseException) -> bool:
    """Whether a failed copy may succeed when tried again: storage errors, not a
    refused target (another filesystem, a folder that exists)."""
    return not isinstance(e, ConfigError) and "exists already" not in str(e)


class JobFailedError(RuntimeError):
    """The job failed and the restart strategy allows no more attempts."""


class JobCancelledError(RuntimeError):
    """The running attempt ends because the job was cancelled (:meth:`Executor.cancel`)."""


@dataclass
class JobResult:
    """How a run went: status, attempts, per-checkpoint and per-task metrics."""

    job_name: str
    status: str  # finished | stopped | failed | cancelled
    attempts: int
    duration_s: float
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    tasks: dict[str, dict[str, float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    tracebacks: list[str] = field(default_factory=list, repr=False)
    restored_from: list[int] = field(default_factory=list)
    replayed_bytes: int = 0  # in-flight bytes replayed by restores, over every attempt
    checkpoint_dir: str | None = None
    # Per restart: seconds from the failure's detection to the next attempt's subtasks
    # running (restore included; the restart strategy's delay too).
    restart_s: list[float] = field(default_factory=list)
    # Stop-with-savepoint: the savepoint's directory (restore it with
    # ``restore_checkpoint=``); ``status`` is ``stopped`` without drain.
    savepoint: str | None = None
    # With checkpoint storage, the run this is (kept when a later start resumes
    # it), and what the master decided from the job's event log, said for people.
    run_id: str | None = None
    recovery: str | None = None
    # The event log said the job had finished already: nothing ran.
    already_finished: bool = False
    # A batch job: the tasks whose results an earlier master left and this run reused.
    reused_tasks: list[str] = field(default_factory=list)

    def completed_checkpoints(self) -> list[dict[str, Any]]:
        return [c for c in self.checkpoints if c["status"] == "completed"]

    @property
    def persisted_inflight_bytes(self) -> int:
        """In-flight bytes persisted by completed checkpoints, over every attempt."""
        return sum(int(c["inflight_bytes"]) for c in self.completed_checkpoints())

    def to_json(self) -> str:
        return json.dumps(self.__dict__, default=str, indent=1)


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
            stop_when is not None and stop_when([c.summary() for c in coordinator.history])
        ):
            return "stop", None
        if deadline is not None and now >= deadline:
            return "timeout", None


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
        self._stop: bool | None = None  # stop-with-savepoint asked for: its drain
        self._stop_unaligned = False  # ... with an unaligned savepoint
        self._stop_request: SavepointRequest | None = None  # ... answered with its path
        self._savepoint_dir = ""  # ... under this directory
        self.recovery: JobRecovery | None = None  # the lease and event log, while running
        # What operators read while it runs (the REST API): checkpoint statistics over
        # every attempt, the job's state, its exceptions and restarts.
        storage = self.storage
        self.stats = CheckpointStatsTracker(
            None if storage is None else lambda cid: str(storage.checkpoint_dir(cid))
        )
        self.status = JobStatusTracker()
        self._cancelled = False
        # Savepoints asked for without a stop: those between attempts wait for the
        # next one; every one not yet done is kept so that a later attempt keeps the
        # checkpoint an export still reads.
        self._savepoint_lock = threading.Lock()
        self._savepoints_waiting: list[SavepointRequest] = []
        self._savepoints: list[SavepointRequest] = []
        self._savepoints_closed = False  # the run ended: requests fail at once
        # A claimed checkpoint outside the job's folder, deleted once unreferenced, and
        # how many completed checkpoints in a row have not referenced it.
        self._claimed: Location | None = None
        self._claimed_unreferenced = 0
        # A live rescale under way (``rescale_live``), and the latest one asked for.
        self._rescaling: RescaleRequest | None = None
        self.last_rescale: RescaleRequest | None = None

    def _attempt(
        self,
        attempt: int,
        restore: dict[tuple[str, int], TaskRestore] | None,
        restored_id: int | None,
    ) -> Any:
        raise NotImplementedError

    def completed_ids(self) -> list[int]:
        """The checkpoints the running attempt completed so far."""
        run = self._current
        return [] if run is None else list(run.coordinator.completed_ids)

    def stop_with_savepoint(
        self, drain: bool = False, savepoint_dir: str | None = None, unaligned: bool = False
    ) -> SavepointRequest:
        """Stops the running job with a savepoint, from any thread; ``run`` then returns
        with ``JobResult.savepoint`` set (FLIP-147, as Flink's stop-with-savepoint).

        The savepoint is a self-contained copy of the stop's checkpoint in a new
        directory ``savepoint-<job>-<id>`` under ``savepoint_dir`` (default
        ``state.savepoints.dir``, else ``savepoints`` in the job's checkpoint
        directory): no retention deletes it; restore it with ``restore_checkpoint=``.

        Without ``drain`` no operator finishes: every task is told the next
        checkpoint (aligned, or ``unaligned``) is the savepoint and, once it took it,
        holds what reaches it; once it completed, the tasks end. An aborted attempt
        leaves the job running exactly as before and the next checkpoint tries again,
        up to ``execution.checkpointing.tolerable-failed-checkpoints`` times; then the
        stop fails (the answer says why) and the job goes on as it was. Either way
        two-phase-commit sinks commit up to it and the job ends ``stopped``;
        restoring it resumes exactly where it stopped. With ``drain`` the sources
        end, every operator's ``end_input`` and ``finish()`` run and the job
        ``finished`` for good (its last checkpoint records every operator finished,
        as Flink's drained savepoint): a drained stop cannot be taken back.

        The answer (``wait()``) gives the savepoint's path once the job ended, or
        the reason the stop failed."""
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
        kind = BarrierKind.UNALIGNED if unaligned else BarrierKind.ALIGNED
        request = SavepointRequest(kind)
        with self._savepoint_lock:
            if self._stop is not None:
                raise ConfigError("the job is stopping already", hint="wait for that stop")
            self._savepoint_dir = savepoint_dir or self._default_savepoint_dir()
            self._stop = drain
            self._stop_unaligned = unaligned
            self._stop_request = request
        run = self._current
        if run is not None:
            self._ask_stop(run)
        return request

    def _stop_failed(self, reason: str) -> None:
        """From the coordinator: the stop gave up; the job goes on as it was."""
        with self._savepoint_lock:
            request, self._stop_request, self._stop = self._stop_request, None, None
        if request is not None:
            request.failed(reason)

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
        where = savepoint_dir or self._default_savepoint_dir()
        kind = BarrierKind.UNALIGNED if unaligned else BarrierKind.ALIGNED
        request = SavepointRequest(kind, lambda cid: self._export_savepoint(cid, where))
        with self._savepoint_lock:
            if self._savepoints_closed:
                request.failed("the job has ended")
                return request
            self._savepoints = [r for r in self._savepoints if not r.done] + [request]
            if not self._current.coordinator.trigger_savepoint(request):
                self._savepoints_waiting.append(request)  # between attempts
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
        self._check_restorable(new)
        with self._savepoint_lock:
            if self._stop is not None:
                raise ConfigError("the job is stopping", hint="let the stop end")
            if self._rescaling is not None:
                raise ConfigError(
                    "the job is rescaling already", hint="wait for that rescale to end"
                )
            request = RescaleRequest(uuid.uuid4().hex, graph, new)
            self._rescaling = self.last_rescale = request
            self._current.coordinator.request_stop(on_failed=self._rescale_failed)
        return request

    def _rescale_failed(self, reason: str) -> None:
        """From the coordinator: the rescale's savepoint failed beyond the tolerated
        attempts; the job goes on as it was, at its parallelism, without a restart."""
        with self._savepoint_lock:
            request, self._rescaling = self._rescaling, None
        if request is not None:
            request.failed(reason)

    def _check_restorable(self, graph: JobGraph) -> None:
        """Refuses (ConfigError, RescaleError) a rescale that no checkpoint of the job
        could restore, before its savepoint: the latest completed checkpoint planned
        at ``graph`` (a forward edge that does not rescale, say)."""
        assert self.storage is not None
        latest = self.storage.latest()
        if latest is None:
            return
        meta = CheckpointMetadata.from_json(latest.metadata, latest.path)
        plan_restore(
            meta,
            graph,
            allow_non_restored_state=self.allow_non_restored_state,
            ignore_inflight=self.ignore_inflight,
            force_forward=self.force_forward_rescale,
        )

    def _rescale_from(
        self, savepoint_id: int, request: RescaleRequest, recovery: JobRecovery | None
    ) -> tuple[CheckpointMetadata, dict[tuple[str, int], TaskRestore] | None]:
        """The next attempt of a live rescale: the job at the new parallelism,
        restoring the savepoint the last one ended with. A plan the savepoint does
        not allow fails the rescale and keeps the parallelism the job had."""
        assert self.storage is not None
        meta = CheckpointMetadata.from_json(
            self.storage.read_metadata(savepoint_id), f"chk-{savepoint_id}"
        )
        self.restore_checkpoint = None  # from now on: this run's own checkpoints
        old_graph, old = self.graph, self._parallelism()
        try:
            self._use_graph(request.graph)
            restore = self._plan(meta)
        except SpilloverError as e:
            self._rescaling = None
            request.failed(f"the savepoint does not restore at the new parallelism: {e}")
            self.graph = old_graph
            return meta, self._plan(meta)
        new = self._parallelism()
        if recovery is not None:
            recovery.rescale_decided(old, new, "live rescale")
        logger.info("job %s: rescaled from %d to %d", self.graph.name, old, new)
        request.restarted(savepoint_id)
        return meta, restore

    def _watch_first_record(self, run: Any, request: RescaleRequest) -> threading.Event:
        """Completes ``request`` once the attempt ``run`` (the job at the new
        parallelism) processed its first record, by its subtasks' live counters,
        polled every few milliseconds; set the answer when the attempt ended."""
        ended = threading.Event()

        def watch() -> None:
            while not ended.is_set() and not request.done:
                metrics = run.task_metrics() if run.running_at is not None else {}
                if any(
                    m.get("records_in", 0) + m.get("records_out", 0) > 0 for m in metrics.values()
                ):
                    with self._savepoint_lock:
                        if self._rescaling is request:
                            self._rescaling = None
                    request.first_record(time.monotonic())
                    return
                ended.wait(0.002)

        threading.Thread(target=watch, name="rescale-first-record", daemon=True).start()
        return ended

    def _default_savepoint_dir(self) -> str:
        assert self.storage is not None
        return (
            self.config.state.savepoints_dir
            or Location.parse(self.storage.uri).child("savepoints").uri
        )

    def _export_savepoint(self, cid: int, savepoint_dir: str) -> str:
        """Copies completed checkpoint ``cid`` as a savepoint ``savepoint-<job>-<cid>``
        under ``savepoint_dir``; recorded in the statistics and the event log."""
        assert self.storage is not None
        name = f"savepoint-{self.job_id[:6]}-{cid}"
        for attempt in range(EXPORT_ATTEMPTS):
            target = Location.parse(savepoint_dir).child(name)
            try:
                path = self.storage.export(cid, target.uri)
                break
            except (OSError, StorageError) as e:
                # The checkpoint is complete and kept: a storage fault costs the copy,
                # which is tried again (into a new folder if the old one stays).
                if attempt + 1 == EXPORT_ATTEMPTS or not _transient(e):
                    raise
                logger.warning("exporting savepoint %s failed, trying again: %s", name, e)
                delete_tree(target, "partial savepoint")
                time.sleep(EXPORT_BACKOFF_S * 2**attempt)
                if target.exists():
                    name = f"savepoint-{self.job_id[:6]}-{cid}-{attempt + 1}"
        self.stats.exported(cid, path)
        recovery = self.recovery
        if recovery is not None:
            recovery.savepoint_completed(cid, path)
        return path

    def _attempt_takes_savepoints(self, run: Any) -> None:
        """``run`` is the running attempt now: it keeps the checkpoints of exports an
        earlier one started, and takes the requests asked for between attempts."""
        with self._savepoint_lock:
            previous, self._current = self._current, run
            waiting, self._savepoints_waiting = self._savepoints_waiting, []
            run.coordinator.keep_exporting([r for r in self._savepoints if r.exporting is not None])
            for request in waiting:
                if not run.coordinator.trigger_savepoint(request):
                    request.failed("the job attempt ended")
        if previous is not None and previous is not run:
            previous.coordinator.close_savepoints()

    def _close_savepoints(self) -> None:
        """The run ended: requests not yet triggered fail, later ones at once, and
        exports under way finish before the run returns (and its event log closes)."""
        with self._savepoint_lock:
            self._savepoints_closed = True
            waiting, self._savepoints_waiting = self._savepoints_waiting, []
            exporting, self._savepoints = self._savepoints, []
            run = self._current
        for request in waiting:
            request.failed("the job ended before its savepoint was triggered")
        if run is not None:
            run.coordinator.close_savepoints("the job ended")
        for request in exporting:
            if request.exporting is not None:
                request.wait_done()

    def _ask_stop(self, run: Any) -> None:
        if not self._stop:
            # A savepoint the tasks suspend at: aborted, the job goes on as it was.
            kind = BarrierKind.UNALIGNED if self._stop_unaligned else BarrierKind.ALIGNED
            run.coordinator.request_stop(int(kind), on_failed=self._stop_failed)
        else:  # drained: the sources end, the final checkpoint is the savepoint
            run.stop_sources(True)

    def cancel(self) -> None:
        """Cancels the job from any thread, as Flink's cancel: no savepoint; ``run``
        returns with status ``cancelled`` and the event log records the job cancelled
        (a later start resumes it from its latest checkpoint)."""
        self._cancelled = True
        self.status.cancel_requested()
        run = self._current
        if run is not None:
            run.coordinator.on_failure(JobCancelledError("the job was cancelled"))

    def checkpoint_completed(self, checkpoint_id: int) -> None:
        """The coordinator wrote a checkpoint's metadata: recorded in the job's event
        log before any task hears of it (a restarted master restores it)."""
        if self.recovery is not None:
            self.recovery.checkpoint_completed(checkpoint_id)
        if self._claimed is not None:
            self._release_claimed(checkpoint_id)

    def _claim(self, meta: CheckpointMetadata) -> None:
        """What the job owns of the checkpoint it restores
        (``execution.state-recovery.claim-mode``). NO_CLAIM: nothing; a checkpoint
        outside the job's checkpoint folder (a savepoint) is never deleted, and
        every checkpoint copies the files it references there, so none depends on
        it; one in the job's folder is never deleted either, and checkpoints
        reference its files as after a failover. CLAIM: retention deletes it, as
        one of the job's own checkpoints (in the job's folder), or, elsewhere, once
        as many newer checkpoints as are retained completed without referencing it."""
        storage = self.storage
        if storage is None:
            return
        rc = self.restore_checkpoint
        chk = (
            Location.parse(rc)
            if isinstance(rc, str)
            else Location.parse(storage.checkpoint_dir(meta.checkpoint_id))
        )
        own = chk.parent.prefix == storage.location.prefix
        # A savepoint's folder holds the chk-<id> of its references beside its own.
        folder = chk.parent if not own and chk.parent.name.startswith("savepoint-") else chk
        if self.config.recovery.claim_mode is ClaimMode.NO_CLAIM:
            if not own:
                storage.copy_referenced_from = (folder,)
        elif own:
            self.retained_ids = [meta.checkpoint_id]
        else:
            self._claimed, self._claimed_unreferenced = folder, 0

    def _release_claimed(self, checkpoint_id: int) -> None:
        """Deletes a claimed checkpoint outside the job's folder once the retained
        checkpoints no longer reference it; a failure is logged, never raised (the
        checkpoint that just completed must not fail for it)."""
        claimed, storage = self._claimed, self.storage
        assert claimed is not None and storage is not None
        try:
            meta = storage.read_metadata(checkpoint_id)
            prefix = claimed.prefix + "/"
            if prefix in json.dumps(meta.get("tasks")):
                self._claimed_unreferenced = 0
                return
            self._claimed_unreferenced += 1
            if self._claimed_unreferenced >= self.config.state.num_retained:
                self._claimed = None
                delete_tree(claimed, "claimed checkpoint")
                logger.info("deleted the claimed checkpoint %s", claimed.uri)
        except (OSError, SpilloverError) as e:
            logger.warning("cannot release the claimed checkpoint %s: %s", claimed.uri, e)

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

    def _restore_point(self) -> CheckpointMetadata | None:
        """The metadata of the checkpoint to restore: the one asked for (an id in this
        job's checkpoint directory, or a checkpoint directory's path), else the latest."""
        rc = self.restore_checkpoint
        if isinstance(rc, str):
            return CheckpointMetadata.from_json(read_checkpoint(rc), rc)
        if self.storage is None:
            return None
        if isinstance(rc, int):
            return CheckpointMetadata.from_json(self.storage.read_metadata(rc), f"chk-{rc}")
        latest = self.storage.latest()
        if latest is None:
            return None
        return CheckpointMetadata.from_json(latest.metadata, latest.path)

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

    def _plan(self, meta: CheckpointMetadata | None) -> dict[tuple[str, int], TaskRestore] | None:
        if meta is None:
            return None
        cid = meta.checkpoint_id
        return plan_restore(
            meta,
            self.graph,
            allow_non_restored_state=self.allow_non_restored_state,
            ignore_inflight=self.ignore_inflight
            or cid == self.config.recovery.without_channel_state_checkpoint,
            force_forward=self.force_forward_rescale,
        )

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
        with self._savepoint_lock:
            self._savepoints_closed = False
        # The run every subtask and attempt belongs to: the log's when it resumes one.
        resume = recovery.resume if recovery is not None else None
        self.run_id = resume.run_id if resume is not None else uuid.uuid4().hex
        try:
            if self.batch:
                self.start_cluster()  # meanwhile: the log's replay, the reuse check
                self.status.attempt_started(0)
                self._run_batch(result, recovery, started, timeout)
            else:
                self._run(result, recovery, started, timeout, stop_after, stop_when)
        finally:
            self._close_savepoints()
            rescale, self._rescaling = self._rescaling, None
            if rescale is not None:  # the run ended, or raised, with one under way
                rescale.failed(f"the job ended ({result.status}) before the rescale did")
            stop = self._stop_request
            if stop is not None:  # answered already if it had a savepoint
                stop.failed(f"the job ended {result.status} without a savepoint")
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
            if not resume.fresh:
                cause = "resumed after its previous master ended"
                if resume.checkpoint is not None:
                    assert self.storage is not None
                    cp = resume.checkpoint
                    meta = first_meta = CheckpointMetadata.from_json(
                        self.storage.read_metadata(cp.checkpoint_id), cp.metadata_path
                    )
                    self.retained_ids = [resume.checkpoint.checkpoint_id]  # the run's own
        restore = self._plan(meta)  # refuses a checkpoint that does not fit, before starting
        if meta is not None and meta is first_meta and self.restore_checkpoint is not None:
            self._claim(meta)
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
            self._attempt_takes_savepoints(run)
            if self._stop is not None:  # asked before this attempt started
                self._ask_stop(run)
            rescale = self._rescaling
            watch: threading.Event | None = None
            if rescale is not None and rescale.status().savepoint_id is None:
                # asked before this attempt started
                run.coordinator.request_stop(on_failed=self._rescale_failed)
            elif rescale is not None:  # this attempt is the rescaled job
                watch = self._watch_first_record(run, rescale)
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
            result.checkpoints += [c.summary() for c in run.coordinator.history]
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
                    self._rescaling = None
                    rescale.failed(
                        "the job ended at the new parallelism before its first record"
                        if error is None
                        else f"the job failed at the new parallelism: {error}"
                    )
                elif error is None and took_savepoint and not self._cancelled and not run.stopped:
                    assert stop_id is not None
                    rescaled = True
                else:
                    self._rescaling = None
                    rescale.failed(
                        "the job ended before its savepoint"
                        if error is None
                        else f"the savepoint failed: {type(error).__name__}: {error}"
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
                meta, restore = self._rescale_from(stop_id, rescale, recovery)
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
                if self._stop is not None and run.coordinator.completed_ids:
                    assert self.storage is not None
                    # The stop's savepoint; if the data ended first, the final checkpoint.
                    cid = run.coordinator.stop_savepoint_id or run.coordinator.completed_ids[-1]
                    result.savepoint = self._export_savepoint(cid, self._savepoint_dir)
                    result.status = "finished" if self._stop else "stopped"
                    if self._stop_request is not None:
                        self._stop_request.succeeded(result.savepoint)
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
