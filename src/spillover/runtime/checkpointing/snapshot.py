"""A task's snapshot of one checkpoint: the synchronous part on the task thread
(operators and keyed state captured, the barrier forwarded), the asynchronous part
(writing state files) on the task's snapshot thread, which acknowledges. An
unaligned checkpoint's channel-state files are finished on a second thread, beside
the operator part (:class:`SnapshotThreads`); whichever half ends last acknowledges.

An aligned barrier follows every record before it; an unaligned one goes to the
head of every output queue, and what it overtook (queued in the channel, then
still in the outbox) becomes output state. Aligned with a timeout: the task waits
for its output to drain, unless the alignment times out meanwhile; then the
barrier overtakes what is still queued.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from spillover.runtime.api import OperatorSnapshot
from spillover.runtime.checkpointing.barriers.alignment import AlignmentStats
from spillover.runtime.checkpointing.inflight import InflightAcks, InFlightCheckpoint
from spillover.runtime.checkpointing.messages import Ack
from spillover.runtime.network.events import BarrierKind, CheckpointBarrier


class _CountedThread:
    """One snapshot thread, started on first use, and the count of the work given to
    it and not finished (a count, not the last future: work queued from another
    thread counts as much)."""

    def __init__(self, name: str) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, name)
        self._outstanding = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        with self._lock:
            self._outstanding += 1
        try:
            f = self._pool.submit(fn, *args)
        except BaseException:
            self._done(None)
            raise
        f.add_done_callback(self._done)
        return f

    def _done(self, _: concurrent.futures.Future[Any] | None) -> None:
        with self._lock:
            self._outstanding -= 1

    def idle(self) -> bool:
        return self._outstanding == 0

    def shutdown(self, wait: bool, cancel_futures: bool) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)


class SnapshotThreads:
    """A task's two snapshot threads, each started on first use: operator parts (state
    files) in checkpoint order on one, unaligned checkpoints' channel-state files
    finished in checkpoint order on the other. The halves of one checkpoint run side
    by side, and acknowledgements still go out in checkpoint order: the one of
    checkpoint n+1 needs both threads past their part of n."""

    def __init__(self, name: str) -> None:
        self._operators = _CountedThread(f"snapshot {name}")
        # Closes of channel state, and the acknowledgements held behind them.
        self._channels = _CountedThread(f"channel state {name}")

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """Runs ``fn`` on the operator parts' thread."""
        return self._operators.submit(fn, *args)

    def operator_part(self, fn: Callable[[], None], light: bool) -> None:
        """Runs operator part ``fn``: on the caller's thread if it is ``light`` (no
        files to write) and no earlier part is outstanding (it cannot overtake an
        earlier checkpoint's), else on the operator parts' thread, behind them.

        Waking the snapshot thread costs a task pinned to one core most of a
        millisecond (the hand-off); a part that writes nothing is done sooner here."""
        if light and self._operators.idle():
            fn()
        else:
            self.submit(fn)

    def submit_channels(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """Runs ``fn`` on the channel-state thread."""
        return self._channels.submit(fn, *args)

    def channels_idle(self) -> bool:
        """Whether the channel-state thread has nothing left to do: work done on the
        caller's thread now cannot overtake an earlier checkpoint's."""
        return self._channels.idle()

    def after_channels(self, fn: Callable[..., Any], *args: Any) -> None:
        """Runs ``fn`` now, or behind the channel-state work still outstanding: an
        acknowledgement without channel state (an aligned checkpoint) must not overtake
        the one of an earlier checkpoint whose channel state is still being closed."""
        if self.channels_idle():
            fn(*args)
        else:
            self.submit_channels(fn, *args)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """Ends both threads (``wait``: after what they were given, acknowledgements
        included)."""
        self._operators.shutdown(wait=wait, cancel_futures=cancel_futures)
        self._channels.shutdown(wait=wait, cancel_futures=cancel_futures)


@dataclass
class Captured:
    """A task's synchronous snapshot: its operators' snapshots, its keyed state's
    (written on the snapshot thread), and whether it was finished."""

    operators: dict[str, OperatorSnapshot]
    keyed_write: Callable[[str], Any] | None
    keyed_uid: str | None
    state_bytes: float
    finished: bool


class SnapshotHost(Protocol):
    """The task, as its snapshot acts on it."""

    vertex_uid: str
    subtask: int
    snapshots: SnapshotThreads
    acks: InflightAcks

    def state_directory(self, cid: int) -> str | None:
        """Where checkpoint ``cid``'s state files go (None: checkpointing is off)."""
        ...

    def check_failure(self, cid: int) -> None:
        """An induced snapshot failure, if one is due."""
        ...

    def capture(self, cid: int) -> Captured: ...
    def flush_writers(self) -> None: ...
    def forward_unaligned(self, barrier: CheckpointBarrier, inf: InFlightCheckpoint) -> None: ...
    def forward_aligned(self, barrier: CheckpointBarrier) -> None:
        """Sends ``barrier`` in line, behind every record before it."""
        ...

    def drain_unless_switched(self, cid: int) -> bool:
        """Drains the output; True when ``cid``'s alignment timed out first."""
        ...

    def open_inflight(
        self, barrier: CheckpointBarrier, pending: set[int]
    ) -> InFlightCheckpoint: ...


def take_snapshot(
    task: SnapshotHost,
    barrier: CheckpointBarrier,
    stats: AlignmentStats | None,
    inflight: InFlightCheckpoint | None = None,
) -> None:
    """Snapshots ``task`` for checkpoint ``barrier`` and forwards the barrier; with
    ``inflight`` (an unaligned checkpoint) the acknowledgement waits for the
    checkpoint's channel state to be complete."""
    cid, trigger_ms = barrier.checkpoint_id, barrier.timestamp_ms
    gateway = task.acks.gateway
    directory = task.state_directory(cid)
    if directory is None:  # no storage: nothing could hold the checkpoint
        gateway.decline(cid, "checkpointing is off")
        return
    now = entered = time.monotonic()
    # The checkpoint's start on this task: an unaligned barrier may have left before.
    t0 = inflight.started if inflight is not None else now
    first = stats.first_barrier_at if stats is not None else t0
    taken_at = time.time() - (now - first)  # wall clock, for the breakdown
    start_delay_ms = max(0.0, taken_at * 1000 - trigger_ms)
    task.check_failure(cid)
    # An unaligned barrier leaves before the operators are snapshot, as Flink's does
    # (usually it left already, before the input state: BarrierHandler.open_checkpoint).
    if inflight is not None and barrier.kind == BarrierKind.UNALIGNED:
        task.forward_unaligned(barrier, inflight)  # flushes the writers first
    else:
        task.flush_writers()
    captured_at = time.monotonic()
    captured = task.capture(cid)
    capture_ms = (time.monotonic() - captured_at) * 1000
    switched = False
    forwarded_at = 0.0
    if (
        inflight is None
        and barrier.kind == BarrierKind.ALIGNED_WITH_TIMEOUT
        and task.drain_unless_switched(cid)
    ):
        # Switched while draining: the inputs are aligned already, only the output
        # state is left to persist.
        inflight = task.open_inflight(barrier, set())
        barrier = barrier.as_unaligned()
        switched = True
    if inflight is None or barrier.kind != BarrierKind.UNALIGNED:
        # An aligned barrier follows every record before it (an iteration head's
        # aligned checkpoint has an ``inflight`` part too: the feedback it logs).
        forwarded_at = time.time()
        task.forward_aligned(barrier)
    else:  # switched to unaligned while draining (a no-op if it left already)
        task.forward_unaligned(barrier, inflight)
    if inflight is not None and inflight.forwarded_at:
        forwarded_at = inflight.forwarded_at
    metrics = {
        # Wall-clock times of taking the barrier and forwarding it (the breakdown's
        # barrier hops, across processes).
        "taken_at": inflight.taken_at if inflight and inflight.taken_at else taken_at,
        "forwarded_at": forwarded_at,
        "start_delay_ms": start_delay_ms,
        "alignment_ms": stats.alignment_seconds * 1000 if stats else 0.0,
        "bytes_during_alignment": float(stats.bytes_during_alignment) if stats else 0.0,
        "sync_ms": (time.monotonic() - t0) * 1000,
        # The sync part's pieces: the unaligned barrier's forward, what ran before the
        # snapshot (the recovered cut, the begun records, what the barrier overtook
        # on its channel), the operators' and keyed state's capture.
        "forward_ms": inflight.forward_ms if inflight is not None else 0.0,
        "before_ms": (entered - t0) * 1000,
        "capture_ms": capture_ms,
        "state_bytes": captured.state_bytes,
        "inflight_bytes": 0.0,
    }
    vertex_uid, subtask = task.vertex_uid, task.subtask
    pending = inflight
    snapshots, acks = task.snapshots, task.acks
    snaps, keyed_write, key_uid = captured.operators, captured.keyed_write, captured.keyed_uid

    def finish_async() -> None:
        t1 = time.monotonic()
        # To the snapshot thread (about 0 when the part runs on the task thread).
        metrics["handoff_ms"] = (t1 - submitted) * 1000
        try:
            handles = {
                uid: s.finalize(directory) for uid, s in snaps.items() if s.finalize is not None
            }
            t2 = time.monotonic()
            keyed = {key_uid: keyed_write(directory)} if keyed_write and key_uid else {}
            metrics["keyed_write_ms"] = (time.monotonic() - t2) * 1000
        except BaseException as e:
            reason = f"snapshot failed: {e!r}"
            if pending is None:
                gateway.decline(cid, reason)
            else:  # declined at once; the channel state's half drops its files
                acks.operator_part_done(pending, None, reason)
            return
        metrics["async_ms"] = (time.monotonic() - t1) * 1000
        ack = Ack(
            cid,
            vertex_uid,
            subtask,
            {uid: s.operator_state for uid, s in snaps.items()},
            handles,
            keyed,
            metrics,
            finished=captured.finished,
        )
        if pending is None:
            snapshots.after_channels(gateway.acknowledge, ack)  # in checkpoint order
        else:
            acks.operator_part_done(pending, ack)  # acked with the channel state

    # Nothing to write (no operator finalizes, no keyed state: sources, sinks): the
    # operator part is only the acknowledgement, done here unless an earlier part is
    # still outstanding (acknowledgements go out in checkpoint order).
    light = keyed_write is None and all(s.finalize is None for s in snaps.values())
    submitted = time.monotonic()
    snapshots.operator_part(finish_async, light)
    if switched:
        assert inflight is not None
        acks.complete(inflight)  # its inputs were aligned: nothing more to wait for
