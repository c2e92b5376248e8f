"""One task's barrier handling: the current state (``states.py``) and what every
state shares, the shape of Flink's ``SingleCheckpointBarrierHandler``.

The task hands it every barrier, cancel marker, EndOfPartition and data buffer of
its input, the coordinator's timeouts and aborts, and its root triggers; the
handler passes each to the current state and takes the state it returns. All
transitions happen here, on the task thread, except :meth:`overtaken` (a TCP
receiving thread) and :meth:`request_unaligned` (the coordinator's thread), which
only record what they are told.

Over TCP, data the sender had already written to the socket cannot be overtaken
at the producer: the receiver hands the buffers a priority barrier overtook in its
receive queue to the task (``overtaken``), and they become input state of that
channel.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from spillover.runtime.checkpointing.barriers.alignment import AlignmentStats
from spillover.runtime.checkpointing.barriers.controller import (
    AfterAlignment,
    Channels,
    Controller,
)
from spillover.runtime.checkpointing.barriers.states import (
    WAITING,
    BarrierState,
    CollectingUnaligned,
)
from spillover.runtime.checkpointing.inflight import InflightAcks, InFlightCheckpoint, barrier_of
from spillover.runtime.network import events as ev
from spillover.runtime.network.buffers import NetworkBuffer


class _Snapshot:
    """After an alignment, a plain task snapshots."""

    def __init__(self, ctrl: Controller) -> None:
        self.ctrl = ctrl

    def aligned(
        self, barrier: ev.CheckpointBarrier, stats: AlignmentStats | None, seen: frozenset[int]
    ) -> None:
        self.ctrl.snapshot(barrier, stats, None)


class BarrierHandler:
    """The barrier handling of one task's input gate of ``num_channels`` channels.

    ``exempt`` channels need not deliver an aligned barrier: an iteration head's
    feedback channels, whose barrier comes only after the head forwarded it. One
    that delivers it early (sent round by another head subtask) is blocked like
    the others. ``after`` is what completes an alignment (a snapshot by default).
    """

    def __init__(
        self,
        ctrl: Controller,
        channels: Channels,
        acks: InflightAcks,
        num_channels: int,
        exempt: frozenset[int] = frozenset(),
        after: AfterAlignment | None = None,
    ) -> None:
        self.ctrl = ctrl
        self.channels = channels
        self.acks = acks
        self.num_channels = num_channels
        self.exempt = exempt
        self.after: AfterAlignment = after or _Snapshot(ctrl)
        self.state: BarrierState = WAITING
        self.latest = 0  # the newest checkpoint started: older barriers are stragglers
        self._aborted: set[int] = set()  # newer ones aborted before any barrier came
        self.ended: set[int] = set()  # channels past EndOfPartition
        self._timed_out: set[int] = set()  # timed out before any of their barriers came
        self._switch_requested = -1  # the checkpoint whose alignment timed out, if any
        # Buffers a priority barrier overtook in a remote channel's receive queue, per
        # channel: (checkpoint id, buffers), recorded by the TCP receiver (overtaken).
        self._overtaken: dict[int, deque[tuple[int, list[NetworkBuffer]]]] = {}
        self._overtaken_lock = threading.Lock()
        # Work a transition leaves for after it (a snapshot may take priority events,
        # which must meet the next state, not the one being left).
        self._then: list[Callable[[], None]] = []

    @property
    def inflight(self) -> InFlightCheckpoint | None:
        """The unaligned checkpoint whose input state is being persisted, if any."""
        state = self.state
        return state.inf if isinstance(state, CollectingUnaligned) else None

    # -- events of the task thread ---------------------------------------------------

    def on_barrier(self, ch: int, barrier: ev.CheckpointBarrier) -> None:
        overtaken = self._take_overtaken(ch, barrier.checkpoint_id)
        try:
            self._enter(self.state.barrier(self, ch, barrier, overtaken))
        finally:
            for b in overtaken:
                b.release()

    def on_data(self, ch: int, buf: NetworkBuffer) -> None:
        """A data buffer of ``ch`` about to be processed."""
        if self.state is not WAITING:
            self.state = self.state.data(self, ch, buf)

    def on_end_of_partition(self, ch: int) -> None:
        self.ended.add(ch)
        self._enter(self.state.end_of_partition(self, ch))

    def on_cancel(self, checkpoint_id: int) -> None:
        """A cancel marker, or the coordinator's word that the checkpoint aborted
        (which may come before older checkpoints' barriers: those still count)."""
        if checkpoint_id > self.latest:
            self._aborted.add(checkpoint_id)
        self._enter(self.state.abort(self, checkpoint_id))

    def on_timeout(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id``'s alignment timed out (through the mailbox)."""
        self._enter(self.state.timeout(self, checkpoint_id))

    def _enter(self, state: BarrierState) -> None:
        """The one place the state changes; then what the transition left to do."""
        self.state = state
        while self._then:
            self._then.pop(0)()

    def then(self, fn: Callable[[], None]) -> None:
        """For a state: runs ``fn`` once the transition it returns is made."""
        self._then.append(fn)

    def trigger(self, barrier: ev.CheckpointBarrier) -> None:
        """A root trigger (a source, or a task whose regular input ended): no barrier
        comes on the channels that ended."""
        cid = barrier.checkpoint_id
        if barrier.kind == ev.BarrierKind.UNALIGNED:
            self._enter(self.start_unaligned(barrier, frozenset(), None, None))
        else:
            self.begin(cid)
            self.after.aligned(barrier, None, frozenset())

    def reap(self) -> None:
        """Gives back the network buffers already written (called often)."""
        self.state.reap(self)

    def release(self) -> None:
        """The task ends: lets go of the overtaken buffers and what the state holds
        (an unfinished checkpoint's open files, staged sections, network buffers)."""
        self._release_overtaken()
        state, self.state = self.state, WAITING
        state.end(self)

    # -- from other threads ------------------------------------------------------------

    def overtaken(self, ch: int, event: ev.Event, buffers: list[NetworkBuffer]) -> None:
        """From a TCP receiving thread, before a priority event of input channel ``ch``
        can be polled: the data buffers it overtook in the receive queue. For a
        barrier they belong to that checkpoint's input state of ``ch``."""
        if not isinstance(event, ev.CheckpointBarrier) or not buffers:
            for b in buffers:
                b.release()
            return
        with self._overtaken_lock:
            self._overtaken.setdefault(ch, deque()).append((event.checkpoint_id, buffers))

    def request_unaligned(self, cid: int) -> None:
        """From the coordinator: checkpoint ``cid``'s alignment timed out. A task
        draining its output for that barrier sees it at once (:meth:`switch_requested`)."""
        self._switch_requested = cid

    def switch_requested(self, cid: int) -> bool:
        return self._switch_requested == cid

    # -- for the states ----------------------------------------------------------------

    def stale(self, cid: int) -> bool:
        """Whether barriers of ``cid`` are stragglers: of a checkpoint this task
        started, or one aborted before it started here."""
        return cid <= self.latest or cid in self._aborted

    def begin(self, cid: int) -> None:
        """A newer checkpoint starts."""
        self.latest = max(self.latest, cid)
        if self._aborted:
            self._aborted = {c for c in self._aborted if c > self.latest}

    def timed_out_early(self, cid: int) -> bool:
        """Whether ``cid`` timed out before any of its barriers came (taken once)."""
        if cid in self._timed_out:
            self._timed_out.discard(cid)
            return True
        return False

    def timed_out_before_barrier(self, state: BarrierState, cid: int) -> BarrierState:
        """A timeout of a checkpoint ``state`` is not collecting: its barrier may be
        queued behind data, and starts it now, unaligned; otherwise it will when it
        comes."""
        if self.num_channels == 0 or self.stale(cid):
            return state
        for ch in range(self.num_channels):
            found: list[ev.CheckpointBarrier] = []
            ahead = self.channels.overtake(ch, barrier_of(cid, found))
            if ahead is None:
                continue
            try:
                state.give_up(self)  # the checkpoint in progress cannot complete now
                return self.start_unaligned(found[0], frozenset({ch}), None, (ch, ahead))
            finally:
                for b in ahead:
                    b.release()
        self._timed_out.add(cid)
        return state

    def start_unaligned(
        self,
        barrier: ev.CheckpointBarrier,
        done: frozenset[int],
        stats: AlignmentStats | None,
        first: tuple[int, list[NetworkBuffer]] | None,
    ) -> BarrierState:
        """Checkpoint ``barrier`` goes unaligned: the barrier goes ahead of the output,
        the operators are snapshot, and the input of every channel not ``done`` is
        persisted until its barrier comes (``first``: what the barrier overtook on
        its channel, input state of that channel)."""
        cid = barrier.checkpoint_id
        self.begin(cid)
        self._timed_out.discard(cid)
        pending = set(range(self.num_channels)) - done - self.ended
        inf = self.open_checkpoint(barrier.as_unaligned(), pending, stats, first)
        state: BarrierState = CollectingUnaligned(inf)
        if inf.done:
            self.acks.complete(inf)
            return WAITING
        # Barriers of this checkpoint still queued in line overtake the data ahead.
        for ch in sorted(inf.pending):
            ahead = self.channels.overtake(ch, barrier_of(cid))
            if ahead is None:
                continue
            for b in ahead:
                inf.add_input(ch, b)
                b.release()
            assert isinstance(state, CollectingUnaligned)
            state = state.channel_done(self, ch)
            if state is WAITING:
                break
        return state

    def open_checkpoint(
        self,
        barrier: ev.CheckpointBarrier,
        pending: set[int],
        stats: AlignmentStats | None,
        first: tuple[int, list[NetworkBuffer]] | None = None,
    ) -> InFlightCheckpoint:
        """Starts collecting checkpoint ``barrier``'s in-flight data: an unaligned
        barrier goes ahead of the output, the operators are snapshot, and the
        ``pending`` channels' input is persisted until their barriers come (an
        iteration head's aligned checkpoint logs its feedback the same way)."""
        inf = self.ctrl.open_inflight(barrier, pending)
        # Recovered input state not replayed yet is referenced, not written again:
        # everything joined is processed first, so its output goes out ahead of the
        # barrier (as overtaken output state).
        cut = self.ctrl.cut_recovered()
        inf.references = cut.references
        if barrier.kind == ev.BarrierKind.UNALIGNED:
            # The barrier leaves next: downstream starts on it while this task
            # persists its input state and snapshots its operators.
            self.ctrl.forward_unaligned(barrier, inf)
        for ch, raw in self.ctrl.begun_records(cut.recovering):  # heads of begun records
            inf.add_input(ch, raw)
        if first is not None:  # what the barrier overtook on its channel comes next
            for b in first[1]:
                inf.add_input(first[0], b)
        inf.recovering = cut.active
        self.ctrl.snapshot(barrier, stats, inf)
        return inf

    # -- overtaken buffers ------------------------------------------------------------

    def _take_overtaken(self, ch: int, cid: int) -> list[NetworkBuffer]:
        """The buffers checkpoint ``cid``'s barrier overtook on ``ch`` (older ones are
        stale and released)."""
        if not self._overtaken:
            return []
        out: list[NetworkBuffer] = []
        with self._overtaken_lock:
            q = self._overtaken.get(ch)
            while q and q[0][0] <= cid:
                c, bufs = q.popleft()
                if c == cid:
                    out.extend(bufs)
                else:
                    for b in bufs:
                        b.release()
        return out

    def _release_overtaken(self) -> None:
        with self._overtaken_lock:
            for q in self._overtaken.values():
                for _, bufs in q:
                    for b in bufs:
                        b.release()
            self._overtaken.clear()
