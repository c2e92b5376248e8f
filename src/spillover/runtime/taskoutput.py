"""A task's output side: its writers, outboxes and partitions, and how barriers,
cancel markers and the end of data leave through them."""

from __future__ import annotations

import time

from spillover.runtime.checkpointing.inflight import InFlightCheckpoint
from spillover.runtime.iteration.feedback import FeedbackPartition
from spillover.runtime.network import events as ev
from spillover.runtime.network.buffers import OutputWaker
from spillover.runtime.network.partition import ResultPartition
from spillover.runtime.network.writers import Outbox, PartitionWriter
from spillover.runtime.outputs import NetworkOutput


class TaskOutput:
    """What one task sends: records through ``writers`` into ``outboxes``, which move
    them into ``partitions`` as credit allows. A loop's feedback edge (when the task
    is its tail) never waits for credit: what has none is spilled."""

    def __init__(
        self,
        partitions: list[ResultPartition | FeedbackPartition],
        outboxes: list[Outbox],
        writers: list[PartitionWriter],
        flush_interval: float,
        waker: OutputWaker,
    ) -> None:
        self.partitions = partitions
        self.outboxes = outboxes
        self.writers = writers
        self.flush_interval = flush_interval  # the buffer timeout
        self.net = NetworkOutput(writers, outboxes)
        self.feedback = [p for p in partitions if isinstance(p, FeedbackPartition)]
        # A backpressured task waits for its output's credit to come back, woken by it.
        self.waker = waker
        for box in outboxes:
            box.pool.waker = self.waker
            target = box.partition
            if isinstance(target, FeedbackPartition):
                target = target.inner
            target.waker = self.waker
        self._last_flush = time.monotonic()
        self._cancelled: set[int] = set()

    def drain(self) -> bool:
        """Moves output on as credit allows; True when every outbox is empty. Left
        armed when it returns False: credit coming back from then on ends the task's
        next wait."""
        waker = self.waker
        waker.arm()  # before the checks: credit returned after them is not missed
        done = True
        for box in self.outboxes:
            done = box.drain() and done
        for p in self.feedback:
            p.pump()
        if done:
            waker.disarm()
        return done

    def drain_blocking(self) -> None:
        for box in self.outboxes:
            box.drain_blocking()

    def flush(self) -> None:
        """Sends the partly filled buffers."""
        for w in self.writers:
            w.flush()
        self._last_flush = time.monotonic()

    def maybe_flush(self) -> None:
        """Flushes once the buffer timeout has passed since the last flush."""
        if time.monotonic() - self._last_flush >= self.flush_interval:
            self.flush()

    def flush_deadline(self) -> float:
        """When (``time.monotonic()``) ``maybe_flush`` flushes next."""
        return self._last_flush + self.flush_interval

    def forward_aligned(self, barrier: ev.CheckpointBarrier) -> None:
        """``barrier`` in line, behind every record before it."""
        self.drain_blocking()
        for p in self.partitions:
            p.broadcast_event(barrier)

    def forward_unaligned(self, barrier: ev.CheckpointBarrier, inf: InFlightCheckpoint) -> None:
        """Sends an unaligned barrier ahead of every output queue, once (again, nothing
        happens); what it overtook (in the channels, then still in the outboxes, records
        the writers still held included) becomes the checkpoint's output state."""
        if inf.forwarded:
            return
        for w in self.writers:
            w.flush()
        writer = inf.writer
        for index, p in enumerate(self.partitions):
            box = self.outboxes[index]
            for sub, overtaken in enumerate(p.broadcast_event(barrier, priority=True)):
                for b in overtaken:
                    writer.add_output(index, sub, b, submit=False)
                    b.release()
                for array in box.queues[sub]:
                    # In-line events (watermarks) are not channel state: derived again.
                    if box.is_data(array):
                        writer.add_output(index, sub, array, submit=False)
        writer.submit()  # one batch, not one hand-off per buffer
        inf.forwarded = True

    def cancel_downstream(self, checkpoint_id: int) -> None:
        """A cancel marker for ``checkpoint_id``, in line, once."""
        if checkpoint_id in self._cancelled:
            return
        self._cancelled.add(checkpoint_id)
        self.drain_blocking()
        for p in self.partitions:
            p.broadcast_event(ev.CancelCheckpointMarker(checkpoint_id))

    def send_event(self, outputs: list[int], event: ev.LoopProbe) -> None:
        """``event`` in line on ``outputs``, behind everything emitted before it."""
        for i in outputs:
            self.writers[i].flush()  # partly filled buffers first: the event follows them
            self.outboxes[i].send_event(event)

    def end_of_data(self, drain: bool) -> None:
        for p in self.partitions:
            p.broadcast_event(ev.EndOfData(drain))

    def finish(self) -> None:
        """The task ends: everything queued goes out, then EndOfPartition; a loop's
        head takes the rest of the feedback."""
        self.drain_blocking()
        for p in self.partitions:
            p.finish()
        for fp in self.feedback:
            fp.pump_blocking()

    def cancel(self) -> None:
        for p in self.partitions:
            p.cancel()

    def close(self) -> None:
        """The feedback's spill files, on the thread that reads them."""
        for fp in self.feedback:
            fp.close()

    def backpressured_seconds(self) -> float:
        """Blocked on credit or on the partitions' buffer budget."""
        return sum(p.backpressured_seconds + p.pool.waited_seconds for p in self.partitions)

    def buffer_bytes(self) -> float:
        """Where output buffers are cut now (below the segment size: debloating's
        initial or announced size)."""
        return float(min((w.buffer_size for w in self.writers), default=0))

    def spilled_bytes(self) -> float:
        return float(sum(p.spilled_bytes for p in self.feedback))
