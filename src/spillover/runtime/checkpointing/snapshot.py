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
from typing import TYPE_CHECKING, Any

from spillover.runtime.api import OperatorSnapshot
from spillover.runtime.checkpointing.aligned import AlignmentStats
from spillover.runtime.checkpointing.messages import Ack
from spillover.runtime.checkpointing.unaligned import InFlightCheckpoint, forward_unaligned
from spillover.runtime.network.events import BarrierKind, CheckpointBarrier

if TYPE_CHECKING:
    from spillover.runtime.task import Task


class SnapshotThreads:
    """A task's two snapshot threads, each started on first use: operator parts (state
    files) in checkpoint order on one, unaligned checkpoints' channel-state files
    finished in checkpoint order on the other. The halves of one checkpoint run side
    by side, and acknowledgements still go out in checkpoint order: the one of
    checkpoint n+1 needs both threads past their part of n."""

    def __init__(self, name: str) -> None:
        self._operators = concurrent.futures.ThreadPoolExecutor(1, f"snapshot {name}")
        self._channels = concurrent.futures.ThreadPoolExecutor(1, f"channel state {name}")
        # Work given to the channel-state thread and not finished: closes and the
        # acknowledgements held behind them (a count, not the last future: an
        # acknowledgement queued from the operator thread counts as much).
        self._outstanding = 0
        self._count_lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """Runs ``fn`` on the operator parts' thread."""
        return self._operators.submit(fn, *args)

    def submit_channels(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """Runs ``fn`` on the channel-state thread."""
        with self._count_lock:
            self._outstanding += 1
        try:
            f = self._channels.submit(fn, *args)
        except BaseException:
            self._channels_done(None)
            raise
        f.add_done_callback(self._channels_done)
        return f

    def _channels_done(self, _: concurrent.futures.Future[Any] | None) -> None:
        with self._count_lock:
            self._outstanding -= 1

    def channels_idle(self) -> bool:
        """Whether the channel-state thread has nothing left to do: work done on the
        caller's thread now cannot overtake an earlier checkpoint's."""
        return self._outstanding == 0

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


def take_snapshot(
    task: Task,
    cid: int,
    trigger_ms: int,
    stats: AlignmentStats | None,
    barrier: CheckpointBarrier | None = None,
    inflight: InFlightCheckpoint | None = None,
) -> None:
    """Snapshots ``task`` for checkpoint ``cid`` and forwards its barrier; with
    ``inflight`` (an unaligned checkpoint) the acknowledgement waits for the
    checkpoint's channel state to be complete."""
    if task.checkpoint_dir is None:  # no storage: nothing could hold the checkpoint
        task.coordinator.decline(cid, task.vertex.uid, task.subtask, "checkpointing is off")
        return
    now = time.monotonic()
    # The checkpoint's start on this task: an unaligned barrier may have left before.
    t0 = inflight.started if inflight is not None else now
    first = stats.first_barrier_at if stats is not None else t0
    start_delay_ms = max(0.0, (time.time() - (now - first)) * 1000 - trigger_ms)
    task.failures.check("snapshot", task.attempt, task.vertex.uid, task.subtask, checkpoint=cid)
    if barrier is None:
        barrier = CheckpointBarrier(cid, trigger_ms)
    # An unaligned barrier leaves before the operators are snapshot, as Flink's does
    # (usually it left already, before the input state: UnalignedCheckpoints.start).
    if inflight is not None and barrier.kind == BarrierKind.UNALIGNED:
        forward_unaligned(task, barrier, inflight)  # flushes the writers first
    else:
        for w in task.writers:
            w.flush()
    # Restored finished, it is finished whether or not its EndOfData went out yet:
    # nothing of it may run again after a restore of this checkpoint.
    finished = task.life.finished_in_checkpoint
    snaps: dict[str, OperatorSnapshot]
    if task.life.restored_finished:
        # Never opened: the state it was restored with is its state, as it was (its
        # keyed state was restored and is written again below, FLIP-147 keeps it).
        assert task.restore_state is not None
        snaps = {
            uid: OperatorSnapshot(state) for uid, state in task.restore_state.operator_state.items()
        }
    else:
        snaps = {n.uid: op.snapshot(cid) for n, op in zip(task.vertex.nodes, task.ops, strict=True)}
    keyed_write = task.keyed.snapshot() if task.keyed is not None else None
    state_bytes = float(task.keyed.state_bytes()) if task.keyed is not None else 0.0
    unaligned = task.unaligned
    switched = False
    if (
        inflight is None
        and barrier.kind == BarrierKind.ALIGNED_WITH_TIMEOUT
        and unaligned.drain_unless_switched(cid)
    ):
        inflight = unaligned.switched_output_state(barrier)
        barrier = barrier.as_unaligned()
        switched = True
    if inflight is None or barrier.kind != BarrierKind.UNALIGNED:
        # An aligned barrier follows every record before it (an iteration head's
        # aligned checkpoint has an ``inflight`` part too: the feedback it logs).
        task.drain_blocking()
        for p in task.partitions:
            p.broadcast_event(barrier)
        unaligned.done_checkpoints.add(cid)
    else:  # switched to unaligned while draining (a no-op if it left already)
        forward_unaligned(task, barrier, inflight)
    metrics = {
        "start_delay_ms": start_delay_ms,
        "alignment_ms": stats.alignment_seconds * 1000 if stats else 0.0,
        "bytes_during_alignment": float(stats.bytes_during_alignment) if stats else 0.0,
        "sync_ms": (time.monotonic() - t0) * 1000,
        "state_bytes": state_bytes,
        "inflight_bytes": 0.0,
    }
    directory = task.checkpoint_dir(cid, task.vertex.uid, task.subtask)
    vertex_uid, subtask, coordinator = task.vertex.uid, task.subtask, task.coordinator
    key_uid = next((n.uid for n in task.vertex.nodes if n.keyed), None)
    pending = inflight
    snapshots = task.snapshots

    def finish_async() -> None:
        t1 = time.monotonic()
        try:
            handles = {
                uid: s.finalize(directory) for uid, s in snaps.items() if s.finalize is not None
            }
            keyed = {key_uid: keyed_write(directory)} if keyed_write and key_uid else {}
        except BaseException as e:
            reason = f"snapshot failed: {e!r}"
            if pending is None:
                coordinator.decline(cid, vertex_uid, subtask, reason)
            else:  # declined at once; the channel state's half drops its files
                unaligned.operator_part_done(pending, None, reason)
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
            finished=finished,
        )
        if pending is None:
            snapshots.after_channels(coordinator.acknowledge, ack)  # in checkpoint order
        else:
            unaligned.operator_part_done(pending, ack)  # acked with the channel state

    snapshots.submit(finish_async)
    if switched:
        unaligned.complete()  # its inputs were aligned: nothing more to wait for
