"""The states of one task's barrier handling, the shape of Flink's
``BarrierHandlerState``: each takes an event and returns the next state.

- :class:`WaitingForFirstBarrier`: no checkpoint in progress.
- :class:`CollectingAligned`: an aligned checkpoint. Each channel that delivered
  its barrier is blocked, so the records behind it wait; once every live channel
  has, the task snapshots, forwards the barrier and unblocks everything.
- :class:`CollectingAlignedWithTimeout`: the same, for an aligned-with-timeout
  barrier (Flink's alternating states). When the coordinator says the alignment
  timed out, or a channel brings the checkpoint's barrier as unaligned (an upstream
  switched), it becomes unaligned: the channels whose barrier came are done, the
  others' data is persisted until theirs comes.
- :class:`CollectingUnaligned`: an unaligned checkpoint. The barrier went ahead of
  the output and the operators were snapshot at the first barrier; every buffer
  processed from a channel whose barrier has not come yet is input state.

A newer checkpoint's barrier, a cancel marker or an abort ends the one in
progress (declined). States act on the task only through the handler's
``Controller`` and ``Channels``; what every state shares (the newest checkpoint
seen, the ended channels) is the handler's, and only the handler writes it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from spillover.runtime.checkpointing.barriers.alignment import AlignmentStats
from spillover.runtime.checkpointing.inflight import InFlightCheckpoint
from spillover.runtime.network import events as ev
from spillover.runtime.network.buffers import NetworkBuffer

if TYPE_CHECKING:
    from spillover.runtime.checkpointing.barriers.handler import BarrierHandler


class BarrierState:
    """A state; the defaults are what a state without a checkpoint does."""

    checkpoint_id = -1

    def barrier(
        self,
        h: BarrierHandler,
        ch: int,
        barrier: ev.CheckpointBarrier,
        overtaken: list[NetworkBuffer],
    ) -> BarrierState:
        """Channel ``ch`` delivered ``barrier`` (``overtaken``: the data it overtook in
        the channel's receive queue, input state of an unaligned checkpoint)."""
        raise NotImplementedError

    def data(self, h: BarrierHandler, ch: int, buf: NetworkBuffer) -> BarrierState:
        """A data buffer of ``ch`` is about to be processed."""
        return self

    def end_of_partition(self, h: BarrierHandler, ch: int) -> BarrierState:
        """Channel ``ch`` ended: it brings no more barriers."""
        return self

    def timeout(self, h: BarrierHandler, cid: int) -> BarrierState:
        """The coordinator's word that checkpoint ``cid``'s alignment timed out: its
        own checkpoint's is none of a state's business unless it alternates; another
        one's barrier may be queued (``timed_out_before_barrier``)."""
        if cid == self.checkpoint_id:
            return self
        return h.timed_out_before_barrier(self, cid)

    def abort(self, h: BarrierHandler, cid: int) -> BarrierState:
        """Checkpoint ``cid`` was cancelled upstream or aborted: ends this state's
        checkpoint if it is that one."""
        if cid != self.checkpoint_id:
            return self
        self.give_up(h)
        return WAITING

    def give_up(self, h: BarrierHandler) -> None:
        """This state's checkpoint cannot complete: declined, its channels freed."""

    def newer(
        self,
        h: BarrierHandler,
        ch: int,
        barrier: ev.CheckpointBarrier,
        overtaken: list[NetworkBuffer],
    ) -> BarrierState:
        """A barrier of another checkpoint than this state's: a straggler, or a newer
        one that ends this one (Flink subsumes it) and starts afresh."""
        if h.stale(barrier.checkpoint_id):
            return self
        self.give_up(h)
        return WAITING.barrier(h, ch, barrier, overtaken)

    def end(self, h: BarrierHandler) -> None:
        """The task ends: let go of what this state holds."""

    def reap(self, h: BarrierHandler) -> None:
        """Called often on the task thread."""


class WaitingForFirstBarrier(BarrierState):
    """No checkpoint in progress: the first barrier of a newer one starts it."""

    def barrier(
        self,
        h: BarrierHandler,
        ch: int,
        barrier: ev.CheckpointBarrier,
        overtaken: list[NetworkBuffer],
    ) -> BarrierState:
        cid = barrier.checkpoint_id
        if h.stale(cid):
            return self  # a straggler of a checkpoint this task is done with
        if barrier.kind == ev.BarrierKind.UNALIGNED or h.timed_out_early(cid):
            return h.start_unaligned(barrier, frozenset({ch}), None, (ch, overtaken))
        h.begin(cid)
        stats = AlignmentStats(cid, time.monotonic())
        state: CollectingAligned = (
            CollectingAlignedWithTimeout(barrier, stats)
            if barrier.kind == ev.BarrierKind.ALIGNED_WITH_TIMEOUT
            else CollectingAligned(barrier, stats)
        )
        return state.barrier(h, ch, barrier, overtaken)


WAITING = WaitingForFirstBarrier()


class CollectingAligned(BarrierState):
    """Aligning checkpoint ``barrier``: the channels in ``seen`` are blocked."""

    def __init__(self, barrier: ev.CheckpointBarrier, stats: AlignmentStats) -> None:
        self.checkpoint_id = barrier.checkpoint_id
        self.first = barrier
        self.stats = stats
        self.seen: set[int] = set()

    def barrier(
        self,
        h: BarrierHandler,
        ch: int,
        barrier: ev.CheckpointBarrier,
        overtaken: list[NetworkBuffer],
    ) -> BarrierState:
        cid = barrier.checkpoint_id
        if cid == self.checkpoint_id:
            if barrier.kind == ev.BarrierKind.UNALIGNED:
                return self.switch(h, (ch, overtaken))  # an upstream switched
            self.seen.add(ch)
            h.channels.block(ch)
            return self._maybe_complete(h)
        return self.newer(h, ch, barrier, overtaken)

    def data(self, h: BarrierHandler, ch: int, buf: NetworkBuffer) -> BarrierState:
        self.stats.bytes_during_alignment += len(buf)
        return self

    def end_of_partition(self, h: BarrierHandler, ch: int) -> BarrierState:
        return self._maybe_complete(h)

    def end(self, h: BarrierHandler) -> None:
        h.channels.unblock_all()

    def switch(
        self, h: BarrierHandler, first: tuple[int, list[NetworkBuffer]] | None
    ) -> BarrierState:
        """Goes on unaligned: the channels whose barrier came are done."""
        h.channels.unblock_all()
        done = frozenset(self.seen) | ({first[0]} if first is not None else frozenset())
        return h.start_unaligned(self.first, done, self.stats, first)

    def _maybe_complete(self, h: BarrierHandler) -> BarrierState:
        if len(self.seen | h.ended | h.exempt) < h.num_channels:
            return self
        self.stats.aligned_at = time.monotonic()
        h.channels.unblock_all()
        first, stats, seen = self.first, self.stats, frozenset(self.seen)
        h.then(lambda: h.after.aligned(first, stats, seen))
        return WAITING

    def give_up(self, h: BarrierHandler) -> None:
        h.channels.unblock_all()
        h.ctrl.decline(self.checkpoint_id, "alignment aborted")
        h.ctrl.cancel_downstream(self.checkpoint_id)


class CollectingAlignedWithTimeout(CollectingAligned):
    """Aligning an aligned-with-timeout checkpoint: unaligned once it times out."""

    def timeout(self, h: BarrierHandler, cid: int) -> BarrierState:
        if cid == self.checkpoint_id:
            return self.switch(h, None)
        return h.timed_out_before_barrier(self, cid)


class CollectingUnaligned(BarrierState):
    """Persisting the input of the channels whose barrier of ``inf`` has not come."""

    def __init__(self, inf: InFlightCheckpoint) -> None:
        self.checkpoint_id = inf.checkpoint_id
        self.inf = inf

    def barrier(
        self,
        h: BarrierHandler,
        ch: int,
        barrier: ev.CheckpointBarrier,
        overtaken: list[NetworkBuffer],
    ) -> BarrierState:
        cid = barrier.checkpoint_id
        if cid == self.checkpoint_id:
            if ch in self.inf.pending:
                for b in overtaken:
                    self.inf.add_input(ch, b)
            return self.channel_done(h, ch)
        return self.newer(h, ch, barrier, overtaken)

    def data(self, h: BarrierHandler, ch: int, buf: NetworkBuffer) -> BarrierState:
        inf = self.inf
        if ch in inf.pending:
            inf.add_input(ch, buf)
            if inf.over_limit():
                # The bound on in-flight data: persist no more, align the rest. A
                # channel whose upstream ended is not held (reap): that upstream may
                # have exited without this checkpoint, so its barrier may never come.
                inf.limited = True
                for c in inf.pending:
                    if not h.channels.has_ended(c):
                        h.channels.block(c)
        return self

    def end_of_partition(self, h: BarrierHandler, ch: int) -> BarrierState:
        return self.channel_done(h, ch)

    def end(self, h: BarrierHandler) -> None:
        self.inf.writer.discard()

    def reap(self, h: BarrierHandler) -> None:
        inf = self.inf
        inf.writer.reap()
        if inf.limited:
            for c in inf.pending:
                if h.channels.is_blocked(c) and h.channels.has_ended(c):
                    h.channels.unblock(c)

    def channel_done(self, h: BarrierHandler, ch: int) -> BarrierState:
        """Channel ``ch``'s barrier came (or it ended): its input state is complete."""
        inf = self.inf
        if ch not in inf.pending:
            return self
        inf.pending.discard(ch)
        if inf.limited:
            h.channels.unblock(ch)
        if not inf.done:
            return self
        h.acks.complete(inf)
        return WAITING

    def give_up(self, h: BarrierHandler) -> None:
        if self.inf.limited:
            h.channels.unblock_all()
        h.acks.abort(self.inf)
