"""The checkpoint coordinator: triggers checkpoints, collects acknowledgements,
writes metadata, keeps the last N, cleans up, and notifies completion.

It runs on its own thread (the driver's, on Spark). Tasks call
``acknowledge``, ``decline``, ``end_of_data`` and ``task_exited`` from their
threads; those calls only queue events, so the coordinator's state has one owner,
and which tasks run is worked out on that thread, atomically with triggering.

Checkpoints after tasks finish (FLIP-147): a checkpoint is triggered at its
*roots*, the running subtasks none of whose operator's predecessors has a running
subtask (every edge connects every upstream subtask to every downstream one), and
waits for every running subtask. A subtask that exited keeps, in every later
checkpoint, the state of the last checkpoint it acknowledged (whose files are
kept); per subtask the metadata says whether its operators ``finished``, per
operator ``fully``, ``partially`` or ``running``.
"""

from __future__ import annotations

import collections
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from spillover.errors import SpilloverError
from spillover.runtime.checkpointing.checkpoint_meta import (
    ChannelStateMeta,
    OperatorMeta,
    SubtaskMeta,
    VertexInfo,
    graph_from_json,
)
from spillover.runtime.checkpointing.coordinator_state import CoordinatorState, PendingCheckpoint
from spillover.runtime.checkpointing.messages import (
    Ack,
    CoordinatorEvent,
    Declined,
    LoopDone,
    LoopQuiet,
    NotifyAborted,
    NotifyComplete,
    StopCoordinator,
    Suspend,
    TaskEndedData,
    TaskExited,
    TaskGateway,
    TriggerCheckpoint,
    TriggerNow,
    TriggerStop,
)
from spillover.runtime.checkpointing.metadata import CheckpointStorage, new_metadata
from spillover.runtime.checkpointing.savepoint_request import SavepointRequest
from spillover.runtime.checkpointing.stats import HISTORY_SIZE, CheckpointStatsListener
from spillover.runtime.iteration.termination import LoopTermination
from spillover.runtime.jobevents.lease import LeaseError
from spillover.runtime.jobresult import MAX_CHECKPOINTS
from spillover.storage.location import Publication

logger = logging.getLogger(__name__)

UNALIGNED = 1  # events.BarrierKind.UNALIGNED
ALIGNED_WITH_TIMEOUT = 2  # events.BarrierKind.ALIGNED_WITH_TIMEOUT


class CheckpointFailuresExceeded(RuntimeError):
    """Too many checkpoints failed in a row."""


@dataclass
class CheckpointStats:
    """What one checkpoint cost; ``subtasks`` holds each subtask's metrics."""

    checkpoint_id: int
    trigger_ms: int
    status: str = "pending"  # completed | aborted
    final: bool = False
    savepoint: bool = False  # the unaligned savepoint of a stop (``request_stop``)
    duration_ms: float = 0.0
    # Of the duration, after the last acknowledgement: the metadata written and the
    # completion recorded in the job's event log (building the metadata before that,
    # a fraction of a millisecond, counts in neither this nor ``acked_ms``).
    finalize_ms: float = 0.0
    # Of that part, building the metadata file (the rest: publishing it and then the
    # job event log's record of it, in one ordered group).
    metadata_ms: float = 0.0
    reason: str = ""
    subtasks: dict[str, dict[str, float]] = field(default_factory=dict)

    def total(self, metric: str) -> float:
        return sum(m.get(metric, 0.0) for m in self.subtasks.values())

    def peak(self, metric: str) -> float:
        return max((m.get(metric, 0.0) for m in self.subtasks.values()), default=0.0)

    def summary(self) -> dict[str, Any]:
        return {
            "checkpoint_id": self.checkpoint_id,
            "trigger_ms": self.trigger_ms,
            "status": self.status,
            "final": self.final,
            "savepoint": self.savepoint,
            "duration_ms": round(self.duration_ms, 3),
            # Trigger to the last acknowledgement: Flink's end_to_end_duration, which
            # leaves the metadata and the completion's record (finalize_ms) out.
            "acked_ms": round(self.peak("acked_ms"), 3),
            "finalize_ms": round(self.finalize_ms, 3),
            "start_delay_ms": round(self.peak("start_delay_ms"), 3),
            "alignment_ms": round(self.peak("alignment_ms"), 3),
            "bytes_during_alignment": int(self.total("bytes_during_alignment")),
            "state_bytes": int(self.total("state_bytes")),
            "inflight_bytes": int(self.total("inflight_bytes")),
            "referenced_bytes": int(self.total("referenced_bytes")),
            "reason": self.reason,
        }


@dataclass
class _Pending:
    stats: CheckpointStats
    started: float
    expected: set[tuple[str, int]]
    # Each acknowledgement's metadata entry, made as it arrives: not at completion.
    acks: dict[tuple[str, int], SubtaskMeta] = field(default_factory=dict)
    switched: bool = False
    trigger: TriggerCheckpoint | None = None  # what its roots were sent
    triggered: set[tuple[str, int]] = field(default_factory=set)  # its roots so far


class CheckpointCoordinator:
    """Periodic and final checkpoints of one execution attempt of a job."""

    def __init__(
        self,
        *,
        job_name: str,
        fingerprint: str,
        settings: dict[str, Any],
        storage: CheckpointStorage | None,
        tasks: Mapping[tuple[str, int], TaskGateway],
        sources: list[tuple[str, int]],
        interval_s: float | None,
        timeout_s: float = 600.0,
        min_pause_s: float = 0.0,
        max_concurrent: int = 1,
        num_retained: int = 1,
        tolerable_failures: int = 0,
        first_id: int = 1,
        on_final: Callable[[], None],
        on_failure: Callable[[BaseException], None],
        metrics_path: str | None = None,
        barrier_kind: int = 0,
        alignment_timeout_s: float = 0.0,
        graph: dict[str, Any] | None = None,
        on_complete: Callable[[int, Publication], None] | None = None,
        retained: Sequence[int] = (),
        subsumed: Sequence[int] = (),
        stats_listener: CheckpointStatsListener | None = None,
    ) -> None:
        self.job_name = job_name
        # Told of every checkpoint triggered and ended (the job's statistics tracker).
        self.stats_listener = stats_listener
        # Savepoints without a stop: asked from any thread, triggered on this one.
        self._savepoint_requests: queue.SimpleQueue[SavepointRequest] = queue.SimpleQueue()
        self._savepoints: dict[int, SavepointRequest] = {}  # by their checkpoint's id
        # Completed savepoints whose export runs: kept, with what they reference.
        self._exporting: list[SavepointRequest] = []
        self._requests_lock = threading.Lock()
        self._requests_closed = False  # the loop ended: requests are refused
        # Given a completed checkpoint's metadata file, before anything is subsumed or
        # any task told: the job master publishes it and then records the checkpoint
        # durably (its event log), both in one ordered group (publish_in_order).
        # Without it, the metadata file is published alone.
        self.on_complete = on_complete
        self.fingerprint = fingerprint
        self.settings = settings
        self.storage = storage
        self.tasks = tasks
        self.sources = set(sources)
        self.interval_s = interval_s if storage is not None else None
        self.timeout_s = timeout_s
        self.min_pause_s = min_pause_s
        self.max_concurrent = max_concurrent
        self.num_retained = num_retained
        self.tolerable_failures = tolerable_failures
        # Ids are never reused, also across runs over the same directory.
        self.next_id = max(first_id, storage.highest_id() + 1 if storage is not None else 1)
        self.on_final = on_final
        self.on_failure = on_failure
        self.metrics_path = metrics_path
        self.barrier_kind = barrier_kind  # events.BarrierKind
        self.graph = graph or {}
        self.alignment_timeout_s = alignment_timeout_s
        # What it keeps of its ended checkpoints, oldest first, so that its memory stays
        # bounded however long a job runs: every subtask's metrics of the newest
        # HISTORY_SIZE (about 1.2 kB a subtask: 1.2 MB a checkpoint at 1,000
        # subtasks), the summaries (JobResult.checkpoints, about 1 kB each) of the
        # newest MAX_CHECKPOINTS (almost three hours at one a second); ``ended``
        # counts them all. Only the coordinator's thread appends: another thread
        # copies them (``list(...)``, one step) before it iterates, as a deque
        # appended meanwhile refuses that.
        self.history: collections.deque[CheckpointStats] = collections.deque(maxlen=HISTORY_SIZE)
        self.summaries: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=MAX_CHECKPOINTS
        )
        self.ended = 0
        self.completed_ids: list[int] = []  # this attempt's, still retained
        # The run's retained checkpoints, oldest first, earlier attempts' included
        # (``retained``): state.checkpoints.num-retained counts them all.
        self._retained: list[int] = list(retained)
        self._subsumed: list[int] = list(subsumed)  # out of retention, kept while referenced
        self._aborted = False  # a checkpoint was aborted since the last sweep
        self._references: dict[int, set[int]] = {}
        self._events: queue.SimpleQueue[CoordinatorEvent] = queue.SimpleQueue()
        self._pending: dict[int, _Pending] = {}
        self._finished_tasks: set[tuple[str, int]] = set()  # ended their data
        self._exited: set[tuple[str, int]] = set()
        # Each subtask's entry in the last checkpoint it completed, and made from it
        # once it is carried (an exited subtask's entry in later checkpoints).
        self._last: dict[tuple[str, int], SubtaskMeta] = {}
        self._carried: dict[tuple[str, int], SubtaskMeta] = {}
        vertices = self.graph.get("vertices", {})
        # The graph as every checkpoint's metadata records it (none: kept as given).
        self._vertices: dict[str, VertexInfo] = graph_from_json(self.graph) or {}
        # Per operator, its inputs: (upstream operator, whether subtask i reads only
        # upstream subtask i, a forward edge) ; every other edge reads every subtask.
        # A loop's feedback edge does not count: the head is where its loop's
        # barriers start, the feedback carries them back (runtime/iteration).
        self._predecessors = {
            uid: [
                (i["source"], i.get("kind") == "forward")
                for i in v.get("inputs", [])
                if not i.get("feedback")
            ]
            for uid, v in vertices.items()
        }
        self.loops = LoopTermination(
            {uid: v["parallelism"] for uid, v in vertices.items() if v.get("iteration_head")}
        )
        self._prepared: int | None = None  # the next checkpoint's folders, made ahead
        self._final_id: int | None = None
        self._final_done = False
        self._stopping = False  # a stop's savepoint was asked for
        self.stop_id: int | None = None  # ... its checkpoint
        self._stop = TriggerStop()  # ... its kind, and whom to tell if it gives up
        self._stop_failures = 0  # ... its attempts that failed
        self._savepoint_id: int | None = None  # ... once it completed
        self._consecutive_failures = 0
        self._last_completed_at = 0.0
        self._thread = threading.Thread(
            target=self._run, name="checkpoint-coordinator", daemon=True
        )
        self._stopped = False

    # -- called from task threads ------------------------------------------------------

    def acknowledge(self, ack: Ack) -> None:
        self._events.put(ack)

    def decline(self, checkpoint_id: int, vertex_uid: str, subtask: int, reason: str) -> None:
        self._events.put(Declined(checkpoint_id, vertex_uid, subtask, reason))

    def end_of_data(self, vertex_uid: str, subtask: int) -> None:
        """A task finished: it processed all its input and emitted all its output."""
        self._events.put(TaskEndedData(vertex_uid, subtask))

    def task_exited(self, vertex_uid: str, subtask: int) -> None:
        """A task ended cleanly, after the checkpoint that covers its finish."""
        self._events.put(TaskExited(vertex_uid, subtask))

    def loop_quiet(self, vertex_uid: str, subtask: int, round: int) -> None:
        """An iteration head's round ``round`` brought no record back (runtime/iteration)."""
        self._events.put(LoopQuiet(vertex_uid, subtask, round))

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stops triggering and aborts pending checkpoints (the attempt ends)."""
        self._events.put(StopCoordinator())
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    def trigger_now(self) -> None:
        self._events.put(TriggerNow())

    def trigger_savepoint(self, request: SavepointRequest) -> bool:
        """A savepoint without stopping: the next checkpoint a free slot allows, with
        the request's barrier kind; once it completes the request exports it (not on
        this thread) and nothing deletes it until that ended. The request fails if
        it is aborted, the job stops or finishes first, or the attempt ends. False,
        the request untouched, once this attempt's loop ended: the caller gives it
        to the next attempt or fails it."""
        with self._requests_lock:
            if self._requests_closed:
                return False
            self._savepoint_requests.put(request)
        self._events.put(TriggerNow())  # wakes the loop
        return True

    def keep_exporting(self, requests: Sequence[SavepointRequest]) -> None:
        """Savepoints an earlier attempt completed whose export still runs: their
        checkpoints are not deleted until it ended (called before :meth:`start`)."""
        with self._requests_lock:
            self._exporting.extend(requests)

    def close_savepoints(self, reason: str = "the job attempt ended") -> None:
        """Refuses further savepoint requests and fails those queued (the loop ended,
        or never started); idempotent."""
        with self._requests_lock:
            self._requests_closed = True
        while True:
            try:
                request = self._savepoint_requests.get_nowait()
            except queue.Empty:
                return
            request.failed(reason)

    def request_stop(
        self, kind: int = UNALIGNED, on_failed: Callable[[str], None] | None = None
    ) -> None:
        """Stop-with-savepoint: the next checkpoint (at once if none is pending) is a
        savepoint of barrier ``kind``; every task is told beforehand
        (:class:`Suspend`) to process no more input once it took it and to end when
        it completes. Aborted, the tasks go on exactly as before (nothing they took
        in meanwhile is lost) and the next checkpoint tries again, up to
        ``tolerable_failures`` times (as Flink, a savepoint's failure never fails the
        job); then the stop gives up (``on_failed``) and the job goes on as it was,
        periodic checkpoints included. Periodic checkpoints pause meanwhile."""
        self._events.put(TriggerStop(kind, on_failed))

    # -- the coordinator thread -----------------------------------------------------------

    def _run(self) -> None:
        next_trigger = time.monotonic() + (self.interval_s or 0)
        try:
            while True:
                now = time.monotonic()
                wait = 0.05
                if self.interval_s is not None and self._final_id is None and not self._stopping:
                    if now >= next_trigger and self._can_trigger(now):
                        self._trigger(final=False)
                        next_trigger = now + self.interval_s
                    wait = min(wait, max(0.001, next_trigger - now))
                try:
                    event = self._events.get(timeout=wait)
                except queue.Empty:
                    event = None
                if event is not None and not self._handle(event):
                    break
                self._check_timeouts()
                self._maybe_stop()
                self._maybe_final()
                self._maybe_savepoint()
        except BaseException as e:  # a coordinator failure fails the attempt
            self.on_failure(e)
        finally:
            for cid in list(self._pending):
                self._abort(cid, "job attempt ended")
            if self._prepared is not None and self._prepared >= self.next_id:
                assert self.storage is not None
                self.storage.delete(self._prepared)  # made ahead, never triggered
            self.close_savepoints()

    def _can_trigger(self, now: float) -> bool:
        return (
            len(self._pending) < self.max_concurrent
            and now - self._last_completed_at >= self.min_pause_s
        )

    def _handle(self, event: CoordinatorEvent) -> bool:
        match event:
            case StopCoordinator():
                return False
            case TriggerStop():
                self._stopping, self._stop, self._stop_failures = True, event, 0
            case TriggerNow():
                if not self._stopping and self._can_trigger(time.monotonic()):
                    self._trigger(final=False)
            case Ack():
                self._on_ack(event)
            case Declined(checkpoint_id=cid, vertex_uid=uid, subtask=subtask, reason=reason):
                if cid in self._pending:
                    why = f"declined by {uid}#{subtask}: {reason}"
                    self._abort(cid, why)
                    self._count_failure(cid, why)
            case TaskEndedData(vertex_uid=uid, subtask=subtask):
                self._finished_tasks.add((uid, subtask))
            case TaskExited(vertex_uid=uid, subtask=subtask):
                self._on_exit((uid, subtask))
            case LoopQuiet(vertex_uid=uid, subtask=subtask, round=r):
                if self.loops.quiet(uid, subtask, r):
                    # No record is left anywhere in the loop: its heads end it.
                    for key in sorted(self.running()):
                        if key[0] == uid:
                            self.tasks[key].post(LoopDone(r))
        return True

    def _on_exit(self, key: tuple[str, int]) -> None:
        """A pending checkpoint the subtask did not acknowledge goes on without it:
        it exited after a checkpoint it took once its data had ended, and nothing of
        it changed since, so that checkpoint's state is its part (its channels ended,
        so the tasks behind it align without its barrier). With no such state (it
        never completed a checkpoint) the checkpoint is aborted, not counted as a
        failure (the task-finished race FLIP-147 describes)."""
        self._finished_tasks.add(key)
        self._exited.add(key)
        for cid, p in list(self._pending.items()):
            if key not in p.expected or key in p.acks:
                continue
            if key not in self._last:
                self._abort(cid, f"{key[0]}#{key[1]} finished before acknowledging")
                continue
            p.expected.discard(key)
            if set(p.acks) >= p.expected:
                self._complete(cid)
                continue
            # It may have been a root that exited before taking its trigger: its
            # barrier never left, so the subtasks behind it, roots now, take theirs
            # from here (one that had the barrier from upstream ignores this).
            if p.trigger is not None:
                for root in self.roots(self.running()):
                    if root in p.expected and root not in p.triggered and root not in p.acks:
                        p.triggered.add(root)
                        self.tasks[root].post(p.trigger)

    def running(self) -> set[tuple[str, int]]:
        """The subtasks that have not exited."""
        return set(self.tasks) - self._exited

    def roots(self, running: set[tuple[str, int]]) -> list[tuple[str, int]]:
        """Where a checkpoint starts: the running subtasks none of whose upstream
        subtasks runs (sources, and those behind finished ones). A forward edge
        connects upstream subtask i to subtask i only, every other edge connects
        every upstream subtask, so a barrier reaches every running subtask."""
        live = {uid for uid, _ in running}
        out = []
        for key in sorted(running):
            preds = self._predecessors.get(key[0])
            if preds is None:  # no graph given: the sources
                if key in self.sources:
                    out.append(key)
            elif not any(
                (src, key[1]) in running if forward else src in live for src, forward in preds
            ):
                out.append(key)
        return out

    def _maybe_stop(self) -> None:
        """Triggers the stop's savepoint once asked and a slot is free (again after an
        abort), unless the data ended first: then the final checkpoint ends the job."""
        if not self._stopping or self._final_id is not None or self._final_done:
            return
        if any(p.stats.savepoint for p in self._pending.values()):
            return
        if self.stop_id is not None and self.stop_id in self.completed_ids:
            return
        # A pending aligned checkpoint may wait long for its barriers under
        # backpressure: an unaligned savepoint supersedes it (not counted as a
        # failure); an aligned one waits its turn.
        if self._stop.kind == UNALIGNED:
            for cid, p in list(self._pending.items()):
                if p.trigger is not None and p.trigger.kind == 0 and not p.stats.final:
                    self._abort(cid, "superseded by the stop's savepoint")
        if len(self._pending) < self.max_concurrent:
            self.stop_id = self._trigger(final=False, savepoint=True, kind=self._stop.kind)

    def _maybe_savepoint(self) -> None:
        """Triggers the oldest savepoint request once a checkpoint slot is free."""
        while not self._savepoint_requests.empty():
            if self._stopping or self._final_id is not None or self._final_done:
                self._savepoint_requests.get().failed("the job is stopping or finishing")
                continue
            if self.storage is None or len(self._pending) >= self.max_concurrent:
                return
            request = self._savepoint_requests.get()
            cid = self._trigger(final=False, kind=request.kind)
            if cid is None:
                request.failed("no task runs any more")
                continue
            self._savepoints[cid] = request
            if self.stats_listener is not None:
                self.stats_listener.savepoint_triggered(cid)

    def _maybe_final(self) -> None:
        """FLIP-147's final checkpoint: once every task processed all its input, one
        aligned checkpoint (no data is in flight any more) commits the last output."""
        if self._final_done or self._finished_tasks < set(self.tasks):
            return
        # Not while a stop's savepoint is pending: a task that takes a barrier newer
        # than the savepoint it holds lets go of it (it cannot complete any more, as
        # far as that task knows), a source does not, and if the savepoint completed
        # after all, the sources would end suspended while the tasks behind them waited
        # for their end forever. Completed, the savepoint ends the job (final if every
        # operator finished); aborted, it is retried, or the stop gives up.
        if any(p.stats.savepoint for p in self._pending.values()):
            return
        if self.storage is None:
            self._final_done = True
            self.on_final()
            return
        if self._final_id is None or self._final_id not in self._pending:
            if self._final_id is not None and self._final_id in self.completed_ids:
                return
            if len(self._pending) < self.max_concurrent:
                self._final_id = self._trigger(final=True)
                if self._final_id is None:  # every task exited: nothing left to commit
                    self._final_done = True
                    self.on_final()

    def _trigger(self, final: bool, savepoint: bool = False, kind: int | None = None) -> int | None:
        """Triggers a checkpoint at its roots; None when no task runs any more. A
        savepoint (unaligned) first tells every running task it is one."""
        running = self.running()
        roots = self.roots(running)
        if not roots:
            return None
        cid = self.next_id
        self.next_id += 1
        trigger_ms = int(time.time() * 1000)
        stats = CheckpointStats(cid, trigger_ms, final=final, savepoint=savepoint)
        p = self._pending[cid] = _Pending(stats, time.monotonic(), running)
        kind = 0 if final else self.barrier_kind if kind is None else kind  # final: aligned
        if savepoint:
            for key in sorted(running):  # before any barrier can reach them
                self.tasks[key].post(Suspend(cid))
        p.switched = final or savepoint  # aligned, or unaligned from the start
        timeout_ms = int(self.alignment_timeout_s * 1000) if kind == ALIGNED_WITH_TIMEOUT else 0
        p.trigger = TriggerCheckpoint(cid, trigger_ms, kind, timeout_ms)
        p.triggered = set(roots)
        for key in roots:
            self.tasks[key].post(p.trigger)
        if self.stats_listener is not None:
            self.stats_listener.checkpoint_triggered(stats, kind, len(running))
        return cid

    def _on_ack(self, ack: Ack) -> None:
        p = self._pending.get(ack.checkpoint_id)
        if p is None:
            return  # late ack of an aborted checkpoint
        key = (ack.vertex_uid, ack.subtask)
        cs = ack.channel_state
        # Parsed before the map takes the ack: a bad one leaves it as it was.
        entry = SubtaskMeta(
            ack.operator_state,
            ack.keyed,
            ack.handles,
            # The gates' maps stay encoded as the task sent them (GateStateHandle.entry).
            ChannelStateMeta.from_json(cs) if cs else None,
            ack.metrics,
            ack.finished,
        )
        p.acks[key] = entry
        metrics = dict(ack.metrics)
        # When the acknowledgement reached the coordinator, from the trigger: which
        # subtask a checkpoint waited for last.
        metrics["acked_ms"] = (time.monotonic() - p.started) * 1000
        p.stats.subtasks[f"{ack.vertex_uid}#{ack.subtask}"] = metrics
        # Counted first: comparing the sets at every acknowledgement made a checkpoint
        # of T subtasks cost T^2 / 2 set insertions.
        if len(p.acks) >= len(p.expected) and p.acks.keys() >= p.expected:
            self._complete(ack.checkpoint_id)

    def _complete(self, cid: int) -> None:
        p = self._pending.pop(cid)
        assert self.storage is not None
        subtasks: dict[str, dict[int, SubtaskMeta]] = {}
        for (uid, subtask), entry in sorted(p.acks.items()):
            subtasks.setdefault(uid, {})[subtask] = entry
        # Exited subtasks keep the state of the last checkpoint they acknowledged (its
        # files stay, as references); everything they emitted is in the state of the
        # tasks behind them by now, so no channel state.
        for key in sorted(self._last):
            if key not in p.acks:
                subtasks.setdefault(key[0], {})[key[1]] = self._carried_entry(key)
        tasks: dict[str, OperatorMeta] = {}
        for uid, subs in subtasks.items():
            vertex = self._vertices.get(uid)
            parallelism = vertex.parallelism if vertex is not None else len(subs)
            done = sum(1 for e in subs.values() if e.finished)
            finished = "fully" if done == parallelism else "partially" if done else "running"
            tasks[uid] = OperatorMeta(subs, parallelism, finished)
        if tasks and all(e.finished == "fully" for e in tasks.values()):
            p.stats.final = True  # every operator finished: the job's last checkpoint
        meta = new_metadata(
            job_name=self.job_name,
            checkpoint_id=cid,
            trigger_ms=p.stats.trigger_ms,
            fingerprint=self.fingerprint,
            settings=self.settings,
            tasks=tasks,
            final=p.stats.final,
            graph=self._vertices if self._vertices else None,
            extra=None if self._vertices else {"graph": self.graph},
        )
        # Checkpoints whose files this one references must outlive it (recovery.py).
        self._references[cid] = set(meta.references)
        finalizing = time.monotonic()
        try:
            file = self.storage.metadata_file(cid, meta)
            p.stats.metadata_ms = (time.monotonic() - finalizing) * 1000
            if self.on_complete is not None:
                self.on_complete(cid, file)
            else:
                file.publish()
        except (OSError, SpilloverError) as e:
            if isinstance(e, LeaseError):  # the master must stop, not go on
                raise
            # Storage failed the checkpoint's last step: it never completed (no task
            # heard of it, its directory goes); the job goes on, as tolerated.
            self._pending[cid] = p
            why = f"completing it failed: {type(e).__name__}: {e}"
            self._abort(cid, why)
            self._count_failure(cid, why)
            return
        request = self._savepoints.pop(cid, None)
        if request is not None:  # its export starts; retention below keeps it meanwhile
            with self._requests_lock:
                self._exporting.append(request)
            request.completed(cid)
        p.stats.status = "completed"
        p.stats.duration_ms = (time.monotonic() - p.started) * 1000
        p.stats.finalize_ms = (time.monotonic() - finalizing) * 1000
        self._last_completed_at = time.monotonic()
        self._consecutive_failures = 0
        self.completed_ids.append(cid)
        for key in p.acks:  # what a subtask that exits after this leaves
            self._last[key] = meta.tasks[key[0]].subtasks[key[1]]
            self._carried.pop(key, None)
        # Counted and reported before the deletes and folders below: those may wait
        # on slow storage (seconds while S3 is unreachable).
        self._record(p.stats)
        self._retained.append(cid)
        while len(self._retained) > self.num_retained:
            old = self._retained.pop(0)
            self._subsumed.append(old)
            if old in self.completed_ids:
                self.completed_ids.remove(old)
        # A subsumed checkpoint whose files a retained one references stays until
        # no retained checkpoint does. The stop's savepoint and what it references
        # stay whatever completes after it: they are exported once the attempt ended.
        if p.stats.savepoint:
            self._savepoint_id = cid
        keep = set(self._retained)
        if self._savepoint_id is not None:
            keep.add(self._savepoint_id)
        keep.update(self._exported_ids())
        needed = set().union(*(self._references_of(c) for c in keep))
        needed.update(keep)
        unneeded = [old for old in self._subsumed if old not in needed]
        for old in unneeded:
            self._subsumed.remove(old)
            self._references.pop(old, None)
        # The tasks hear of it first (their sinks commit): what it subsumed is deleted
        # after, as Flink discards subsumed checkpoints apart from the notification.
        for task in self.tasks.values():
            task.post(NotifyComplete(cid))
        for old in unneeded:
            self.storage.delete(old)
        if self._aborted:
            self._sweep(cid)
        # The next checkpoint's folders, while no task waits (CheckpointStorage.prepare).
        periodic = self.interval_s is not None and not p.stats.final
        if periodic and self.storage.prepare(self.next_id, meta):
            self._prepared = self.next_id
        if p.stats.final:
            self._final_done = True
            self.on_final()

    def _carried_entry(self, key: tuple[str, int]) -> SubtaskMeta:
        """An exited subtask's entry: the state of the last checkpoint it completed
        (whose files stay, as references); everything it emitted is in the state of
        the tasks behind it by now, so no channel state, and no metrics."""
        carried = self._carried.get(key)
        if carried is None:
            last = self._last[key]
            carried = SubtaskMeta(last.operators, last.keyed, last.handles, finished=last.finished)
            self._carried[key] = carried
        return carried

    def _exported_ids(self) -> set[int]:
        """The checkpoints of savepoints whose export runs (finished ones dropped)."""
        with self._requests_lock:
            self._exporting = [r for r in self._exporting if r.exporting is not None]
            return {cid for r in self._exporting if (cid := r.exporting) is not None}

    def _sweep(self, completed: int) -> None:
        """Deletes what aborted checkpoints below ``completed`` left (a write that
        came after the abort deleted their directory): incomplete directories of no
        pending checkpoint. Complete ones are never touched here."""
        assert self.storage is not None
        try:
            ids, complete = self.storage.listing()
            done = set(complete)
        except (OSError, SpilloverError) as e:
            # Housekeeping, after the checkpoint completed: a listing that fails costs
            # neither it nor the attempt; the next completion sweeps again.
            logger.warning("cannot list checkpoints to sweep (tried again later): %s", e)
            return
        self._aborted = False
        for old in ids:
            if old < completed and old not in done and old not in self._pending:
                self.storage.delete(old)

    @property
    def stop_savepoint_id(self) -> int | None:
        """The stop's savepoint, once it completed (``stop_id`` is the latest attempt
        at it, which may have been aborted while the data ended)."""
        return self._savepoint_id

    @property
    def retained_ids(self) -> list[int]:
        """The run's retained checkpoints, oldest first: the next attempt's ``retained``."""
        return list(self._retained)

    @property
    def subsumed_ids(self) -> list[int]:
        """Checkpoints out of retention still kept for a retained one's references."""
        return list(self._subsumed)

    def _references_of(self, cid: int) -> set[int]:
        refs = self._references.get(cid)
        if refs is None and self.storage is not None:
            try:
                refs = set(self.storage.read(cid).references)
            except (OSError, ValueError, SpilloverError):
                refs = set()
            self._references[cid] = refs
        return refs or set()

    def _abort(self, cid: int, reason: str) -> None:
        p = self._pending.pop(cid, None)
        if p is None:
            return
        p.stats.status = "aborted"
        p.stats.reason = reason
        request = self._savepoints.pop(cid, None)
        if request is not None:
            request.failed(f"checkpoint {cid} was aborted: {reason}")
        self._aborted = True  # the next completion sweeps what late writes left
        p.stats.duration_ms = (time.monotonic() - p.started) * 1000
        self._record(p.stats)  # at once: the delete may wait on unreachable storage
        if self.storage is not None:
            self.storage.delete(cid)
        for task in self.tasks.values():
            task.post(NotifyAborted(cid))

    def _count_failure(self, cid: int, reason: str) -> None:
        """Flink's rule: more than tolerable-failed-checkpoints failures in a row fail
        the job. A stop's savepoint never does: beyond as many attempts the stop
        gives up and the job goes on."""
        if self._stopping and cid == self.stop_id:
            self._stop_failures += 1
            if self._stop_failures > self.tolerable_failures:
                on_failed = self._stop.on_failed
                self._stopping, self.stop_id = False, None
                logger.warning("stop-with-savepoint gave up, the job goes on: %s", reason)
                if on_failed is not None:
                    on_failed(f"the savepoint failed: {reason}")
            return
        self._consecutive_failures += 1
        if self._consecutive_failures > self.tolerable_failures:
            self.on_failure(
                CheckpointFailuresExceeded(
                    f"{self._consecutive_failures} checkpoints in a row failed (last: {cid}); "
                    f"execution.checkpointing.tolerable-failed-checkpoints is "
                    f"{self.tolerable_failures}"
                )
            )

    def _check_timeouts(self) -> None:
        now = time.monotonic()
        for cid, p in list(self._pending.items()):
            if (
                self.barrier_kind == ALIGNED_WITH_TIMEOUT
                and not p.switched
                and now - p.started >= self.alignment_timeout_s
            ):
                # Measured from the trigger: every task still aligning switches to
                # unaligned, wherever the barrier waits (in an input or behind data).
                p.switched = True
                for key, task in self.tasks.items():
                    if key not in p.acks:
                        task.request_unaligned(cid)
            if now - p.started > self.timeout_s:
                why = f"timed out after {self.timeout_s:g} s"
                self._abort(cid, why)
                self._count_failure(cid, why)

    def _record(self, stats: CheckpointStats) -> None:
        """An ended checkpoint: kept (bounded), summarised once, told to the listener."""
        self.history.append(stats)
        summary = stats.summary()
        self.summaries.append(summary)
        self.ended += 1
        if self.stats_listener is not None:
            self.stats_listener.checkpoint_ended(stats)
        if self.metrics_path:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps({"type": "checkpoint", **summary}) + "\n")

    def stats_dicts(self) -> list[dict[str, Any]]:
        return [asdict(s) for s in list(self.history)]  # (one copy: appended meanwhile)

    def state(self) -> CoordinatorState:
        """What it waits for, read from any thread (for a job that does not end): a
        snapshot of fields its own thread owns, so a field may be a moment older
        than the next."""
        now = time.monotonic()
        running = self.running()
        roots = set(self.roots(running))
        pending = tuple(
            PendingCheckpoint(
                cid,
                p.trigger.kind if p.trigger is not None else -1,
                p.stats.savepoint,
                p.stats.final,
                now - p.started,
                tuple(sorted(set(p.expected) - set(p.acks))),
                tuple(sorted(roots - set(p.triggered) - set(p.acks))),
            )
            for cid, p in sorted(list(self._pending.items()))
        )
        return CoordinatorState(
            alive=self._thread.is_alive(),
            next_id=self.next_id,
            completed=tuple(self.completed_ids),
            last_ended=tuple(f"{s.checkpoint_id} {s.status}" for s in list(self.history)[-6:]),
            pending=pending,
            stopping=self._stopping,
            stop_id=self.stop_id,
            stop_failures=self._stop_failures,
            stop_savepoint_id=self._savepoint_id,
            final_id=self._final_id,
            final_done=self._final_done,
            data_ended=tuple(sorted(set(self._finished_tasks))),
            exited=tuple(sorted(set(self._exited))),
            running=tuple(sorted(running)),
        )
