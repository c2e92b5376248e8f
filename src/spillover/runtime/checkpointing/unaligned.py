"""Unaligned checkpoints of one task: persisting in-flight buffers through the engine.

When the first barrier of checkpoint n reaches a task (on the priority path, or
when an aligned-with-timeout checkpoint switches), the task forwards the barrier
at the head of every output queue and snapshots its operators at once.
The checkpoint then also holds:

- output state: the data buffers the forwarded barrier overtook in each output
  queue (``broadcast_event(priority=True)`` hands them back);
- input state: per input channel, the bytes of a record the task had begun
  reading, then every buffer the task processes from that channel until the
  channel's own barrier n arrives (a channel whose barrier already came adds
  nothing more).

Each record stream thus replays as "this task's input state for the channel,
then the upstream's output state for it", which is also how rescaling reads it.
Buffers go to the storer without a copy (``OnRelease`` returns them to their
pool once written); the writer thread does the I/O (``channel_state.py``).

The aligned-with-timeout policy starts as the aligned one (``aligned.py``) and
switches here when the coordinator says the alignment timed out: the channels
whose barrier came are done, the others' data is persisted until theirs comes.
Over TCP, data the sender had already written to the socket cannot be overtaken
at the producer: the receiver hands the buffers a priority barrier overtook in its
receive queue to the task (``overtaken``), and they become input state of that
channel.

A bound on in-flight data (``max_inflight_bytes``): once a task has persisted
that many bytes of input state for checkpoint n, it blocks the channels whose
barrier has not come, as an aligned checkpoint would, so it persists no more. A
channel whose upstream ended is not held: that upstream may have exited without
checkpoint n (FLIP-147), so its barrier may never come, and what is left on the
channel is bounded by its credit; it flows, as input state, up to its end.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spillover.rescale.pieces import Reference
from spillover.runtime.checkpointing.aligned import AlignmentStats
from spillover.runtime.checkpointing.channel_state import ChannelState, open_channel_state
from spillover.runtime.checkpointing.messages import Ack
from spillover.runtime.network import events as ev
from spillover.runtime.network.buffers import NetworkBuffer

if TYPE_CHECKING:
    from spillover.runtime.task import Task


@dataclass
class InFlightCheckpoint:
    """A task's unaligned checkpoint while its input state is still being persisted:
    the state "collecting unaligned" of the task's barrier handling."""

    checkpoint_id: int
    writer: ChannelState
    pending: set[int]  # input channels whose barrier has not come yet
    trigger_ms: int
    started: float
    # Task input channel -> (input gate, channel) of the channel state's layout.
    gate_of: Sequence[tuple[int, int]] = ()
    max_inflight_bytes: int | None = None
    limited: bool = False  # the bound was reached: pending channels are blocked
    # The acknowledgement's two halves, done side by side on the task's two snapshot
    # threads: the operator part (None if it failed: operator_error says why) and the
    # channel state's finished files (None if closing them failed: channel_error).
    operator_part: Ack | None = None
    operator_error: str | None = None
    channel_state: dict[str, Any] | None = None
    channel_error: str | None = None
    close_ms: float = 0.0
    closed_here: bool = False  # finished on the task thread (QUICK_CLOSE_BYTES)
    forwarded: bool = False  # the barrier went ahead of the output (forward_unaligned)
    inputs_done: float = 0.0  # when the last input's barrier came (monotonic)
    _halves_left: int = 2
    _halves_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # Recovered input state not yet replayed, referenced in old files (recovery/).
    references: list[Reference] = field(default_factory=list)
    recovering: bool = False  # taken while recovered input state was being replayed

    @property
    def done(self) -> bool:
        return not self.pending

    def half_done(self) -> bool:
        """One half of the acknowledgement is in; True for the second (which sends it)."""
        with self._halves_lock:
            self._halves_left -= 1
            return self._halves_left == 0

    def add_input(self, channel: int, buffer: Any) -> None:
        """Persists ``buffer`` (or the bytes of a begun record) as input state of the
        task's input ``channel``: the one way a task buffer becomes input state."""
        self.writer.add_input(*self.gate_of[channel], buffer)

    def over_limit(self) -> bool:
        return (
            self.max_inflight_bytes is not None
            and not self.limited
            and self.writer.input_bytes >= self.max_inflight_bytes
        )


def forward_unaligned(
    task: Task, barrier: ev.CheckpointBarrier, inflight: InFlightCheckpoint
) -> None:
    """Sends an unaligned barrier ahead of every output queue, once (again, nothing
    happens); what it overtook (in the channels, then still in the outboxes, records
    the task's writers still held included) becomes the checkpoint's output state."""
    if inflight.forwarded:
        return
    for w in task.writers:
        w.flush()
    writer = inflight.writer
    for index, p in enumerate(task.partitions):
        box = task.outboxes[index]
        for sub, overtaken in enumerate(p.broadcast_event(barrier, priority=True)):
            for b in overtaken:
                writer.add_output(index, sub, b, submit=False)
                b.release()
            for array in box.queues[sub]:
                # In-line events (watermarks) are not channel state: derived again.
                if box.is_data(array):
                    writer.add_output(index, sub, array, submit=False)
    writer.submit()  # one batch, not one hand-off per buffer
    inflight.forwarded = True


def barrier_of(cid: int, found: list[Any] | None = None) -> Callable[[Any], bool]:
    """A matcher for ``InputGate.overtake``: checkpoint ``cid``'s barrier (appended to
    ``found`` when given)."""

    def match(buf: Any) -> bool:
        event = ev.deserialize(buf)
        if isinstance(event, ev.CheckpointBarrier) and event.checkpoint_id == cid:
            if found is not None:
                found.append(event)
            return True
        return False

    return match


class UnalignedCheckpoints:
    """The unaligned, aligned-with-timeout and bounded policies of one task.

    States: idle (``inflight`` None), or collecting one checkpoint's in-flight data
    (``inflight`` set) until every channel's barrier came. Runs on the task thread,
    except :meth:`overtaken` (a TCP receiving thread) and :meth:`request_unaligned`
    (the coordinator's thread); the acknowledgement runs on the snapshot threads.
    """

    def __init__(self, task: Task) -> None:
        self.task = task
        self.inflight: InFlightCheckpoint | None = None
        self.done_checkpoints: set[int] = set()
        self._switched: set[int] = set()  # timed out before any of their barriers came
        self._switch_requested = -1  # the checkpoint whose alignment timed out, if any
        # Buffers a priority barrier overtook in a remote channel's receive queue, per
        # channel: (checkpoint id, buffers), recorded by the TCP receiver (overtaken).
        self._overtaken: dict[int, deque[tuple[int, list[NetworkBuffer]]]] = {}
        self._overtaken_lock = threading.Lock()

    # -- from other threads ----------------------------------------------------------

    def overtaken(self, ch: int, event: ev.Event, buffers: list[NetworkBuffer]) -> None:
        """From a TCP receiving thread, before a priority event of input channel ``ch``
        can be polled: the data buffers it overtook in the receive queue. For a
        barrier they belong to that checkpoint's input state of ``ch`` (the producer
        could not persist them: they had left it); the task takes them with the event."""
        if not isinstance(event, ev.CheckpointBarrier) or not buffers:
            for b in buffers:
                b.release()
            return
        with self._overtaken_lock:
            self._overtaken.setdefault(ch, deque()).append((event.checkpoint_id, buffers))

    def request_unaligned(self, cid: int) -> None:
        """Checkpoint ``cid``'s alignment timed out: seen at once by a task draining
        its output for that barrier (:meth:`drain_unless_switched`)."""
        self._switch_requested = cid

    # -- the task thread ---------------------------------------------------------------

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

    def release_overtaken(self) -> None:
        with self._overtaken_lock:
            for q in self._overtaken.values():
                for _, bufs in q:
                    for b in bufs:
                        b.release()
            self._overtaken.clear()

    def release(self) -> None:
        """The task ends: lets go of what an unfinished checkpoint holds, the buffers
        overtaken and the writer of the checkpoint in flight (its open files, staged
        sections and network buffers); nothing would close that writer any more."""
        self.release_overtaken()
        inf, self.inflight = self.inflight, None
        if inf is not None:
            with contextlib.suppress(Exception):
                inf.writer.discard()

    def reap(self) -> None:
        """Gives back the network buffers already written, and lets the bound's
        blocked channels that ended flow (called often)."""
        inf = self.inflight
        if inf is not None:
            inf.writer.reap()
            if inf.limited:
                gate = self.task.gate
                for c in inf.pending:
                    if gate.is_blocked(c) and gate.has_ended(c):
                        gate.unblock(c)

    def on_data(self, ch: int, buf: NetworkBuffer) -> None:
        """A data buffer of ``ch`` about to be processed: input state while that
        channel's barrier is still to come."""
        inf = self.inflight
        if inf is not None and ch in inf.pending:
            inf.add_input(ch, buf)
            if inf.over_limit():
                inf.limited = True
                gate = self.task.gate
                for c in inf.pending:
                    if not gate.has_ended(c):  # (reap): its barrier may never come
                        gate.block(c)

    def on_barrier(self, ch: int, barrier: ev.CheckpointBarrier) -> bool:
        """Takes ``barrier`` if it belongs to unaligned handling (the running unaligned
        checkpoint, an unaligned barrier, a switched checkpoint); False leaves it to
        the aligned policy."""
        cid = barrier.checkpoint_id
        inf = self.inflight
        overtaken = self._take_overtaken(ch, cid)
        try:
            if inf is not None and inf.checkpoint_id == cid:
                if ch in inf.pending:
                    for b in overtaken:
                        inf.add_input(ch, b)
                self.channel_done(ch)
            elif barrier.kind == ev.BarrierKind.UNALIGNED or cid in self._switched:
                self.go_unaligned(barrier, ch, overtaken)
            else:
                return False
        finally:
            for b in overtaken:
                b.release()
        return True

    def on_cancel(self, checkpoint_id: int) -> None:
        """A cancel marker or an abort notification for ``checkpoint_id``."""
        if self.inflight is not None and self.inflight.checkpoint_id == checkpoint_id:
            self.abort()

    def go_unaligned(
        self,
        barrier: ev.CheckpointBarrier,
        first_channel: int | None,
        overtaken: Sequence[NetworkBuffer] = (),
    ) -> None:
        """The first barrier of an unaligned checkpoint (or a switched one) is here;
        ``overtaken``: what it overtook in ``first_channel``'s receive queue."""
        task = self.task
        h = task.barriers
        assert h is not None
        cid = barrier.checkpoint_id
        if cid in self.done_checkpoints or cid < h.latest:
            return  # a straggler of a checkpoint this task is done with
        if self.inflight is not None:
            self.abort()  # a newer checkpoint: the older cannot complete
        done: set[int] = set()
        stats = None
        if h.aligning:
            if h.current == cid:
                done |= h.seen  # those channels already delivered their barrier
                stats = h.stats
                h.current, h.seen = -1, set()
                task.gate.unblock_all()
            else:
                h.abort_current()
        h.latest = max(h.latest, cid)
        self._switched.discard(cid)
        if first_channel is not None:
            done.add(first_channel)
        pending = set(range(len(task.channels))) - done - h.ended
        first = (first_channel, overtaken) if first_channel is not None and overtaken else None
        inf = self.start(barrier.as_unaligned(), pending, stats, first)
        # Barriers of this checkpoint still queued in line overtake the data ahead.
        for ch in sorted(inf.pending):
            ahead = task.gate.overtake(ch, barrier_of(cid))
            if ahead is not None:
                for b in ahead:
                    inf.add_input(ch, b)
                    b.release()
                self.channel_done(ch)

    def on_timeout(self, cid: int) -> None:
        """The coordinator's word (through the mailbox) that checkpoint ``cid``'s
        alignment timed out."""
        task = self.task
        if task.vertex.is_source or cid in self.done_checkpoints:
            return
        if self.inflight is not None and self.inflight.checkpoint_id == cid:
            return
        h = task.barriers
        assert h is not None
        if h.aligning and h.current == cid:
            self.go_unaligned(h.barrier, None)
            return
        if cid < h.latest:
            return
        # No barrier of it seen yet: one may be queued behind data.
        for ch in range(len(task.channels)):
            found: list[ev.CheckpointBarrier] = []
            ahead = task.gate.overtake(ch, barrier_of(cid, found))
            if ahead is None:
                continue
            self.go_unaligned(found[0], None)
            inf = self.inflight
            if inf is None or inf.checkpoint_id != cid:
                for b in ahead:  # completed already (its only channel): nothing to add
                    b.release()
                return
            for b in ahead:
                inf.add_input(ch, b)
                b.release()
            self.channel_done(ch)
            return
        self._switched.add(cid)

    def drain_unless_switched(self, cid: int) -> bool:
        """Drains the task's outboxes; True when the switch to unaligned came first."""
        task = self.task
        while not task.drain():
            if self._switch_requested == cid:
                return True
            if task.has_input:
                task.output_wait_seconds += task.take_priority(0.0002)
            else:
                time.sleep(0.0002)
                task.output_wait_seconds += 0.0002
        return False

    def _open(self, barrier: ev.CheckpointBarrier, pending: set[int]) -> InFlightCheckpoint:
        task = self.task
        cid = barrier.checkpoint_id
        writer = open_channel_state(
            task.checkpoint_dir,
            cid,
            task.vertex.uid,
            task.subtask,
            task.channel_compression,
            task.channel_group,
        )
        inf = InFlightCheckpoint(
            cid,
            writer,
            set(pending),
            barrier.timestamp_ms,
            time.monotonic(),
            task.gate_of,
            task.max_inflight_bytes,
        )
        self.inflight = inf
        return inf

    def switched_output_state(self, barrier: ev.CheckpointBarrier) -> InFlightCheckpoint:
        """An in-flight checkpoint for a barrier that switched while the task drained:
        its inputs are aligned already, only its output state is left to persist."""
        return self._open(barrier, set())

    def start(
        self,
        barrier: ev.CheckpointBarrier,
        pending: set[int],
        stats: AlignmentStats | None,
        first: tuple[int, Sequence[NetworkBuffer]] | None = None,
    ) -> InFlightCheckpoint:
        """Starts collecting checkpoint ``barrier``'s in-flight data: forwards an
        unaligned barrier ahead of the output, snapshots the operators, and persists
        the input of the ``pending`` channels until their barriers come."""
        task = self.task
        cid = barrier.checkpoint_id
        inf = self._open(barrier, pending)
        # Recovered input state not replayed yet is referenced, not written again:
        # everything joined is processed first, then each channel's rest is cut at
        # the start of the record its reader has begun. Processed, so before the
        # barrier: their output goes out ahead of it (as overtaken output state).
        replay = task.replay
        inf.references = replay.references(task.readers) if replay is not None else []
        if barrier.kind == ev.BarrierKind.UNALIGNED and task.checkpoint_dir is not None:
            # The barrier leaves next: downstream starts on it while this task
            # persists its input state and snapshots its operators.
            forward_unaligned(task, barrier, inf)
        recovering = replay.recovering_channels() if replay is not None else set()
        # A record begun in a buffer before the cut: its head is state too.
        for ch, reader in enumerate(task.readers):
            raw = reader.pending_raw() if ch not in recovering else b""
            if raw:
                inf.add_input(ch, raw)
        if first is not None:  # what the barrier overtook on its channel comes next
            for b in first[1]:
                inf.add_input(first[0], b)
        inf.recovering = replay is not None and replay.active
        task.snapshot(cid, barrier.timestamp_ms, stats, barrier, inf)
        if inf.done:
            self.complete()
        return inf

    def channel_done(self, ch: int) -> None:
        """Channel ``ch``'s barrier came (or the channel ended): its input state is
        complete."""
        inf = self.inflight
        if inf is None or ch not in inf.pending:
            return
        inf.pending.discard(ch)
        if inf.limited:
            self.task.gate.unblock(ch)
        if inf.done:
            self.complete()

    def complete(self) -> None:
        inf = self.inflight
        assert inf is not None
        self.inflight = None
        self.done_checkpoints.add(inf.checkpoint_id)
        inf.inputs_done = time.monotonic()
        snapshots = self.task.snapshots
        # Small and local: finished here, without a hand-off (QUICK_CLOSE_BYTES), if no
        # earlier checkpoint's close or acknowledgement is still to go out.
        if not (snapshots.channels_idle() and self._close_channels(inf, quick=True)):
            snapshots.submit_channels(self._close_channels, inf)

    def abort(self) -> None:
        inf = self.inflight
        if inf is None:
            return
        task = self.task
        self.inflight = None
        self.done_checkpoints.add(inf.checkpoint_id)
        if inf.limited:
            task.gate.unblock_all()
        task.snapshots.submit_channels(inf.writer.discard)
        task.coordinator.decline(
            inf.checkpoint_id, task.vertex.uid, task.subtask, "unaligned checkpoint aborted"
        )

    def operator_part_done(
        self, inf: InFlightCheckpoint, ack: Ack | None, error: str | None = None
    ) -> None:
        """On the snapshot thread: the operator half of ``inf`` is done (``ack``; the
        checkpoint is acknowledged once its channel state is finished too), or failed
        (``error``: declined now, not after the inputs' barriers)."""
        inf.operator_part, inf.operator_error = ack, error
        if error is not None:
            task = self.task
            task.coordinator.decline(inf.checkpoint_id, task.vertex.uid, task.subtask, error)
        if inf.half_done():
            self._acknowledge(inf)

    def _close_channels(self, inf: InFlightCheckpoint, quick: bool = False) -> bool:
        """On the channel-state thread, beside the operator part: finishes the files
        (drops them when the operator part failed already). ``quick`` (the task
        thread): only if that cannot wait on storage; False, having done nothing, if
        it could."""
        t = time.monotonic()
        try:
            if inf.operator_error is None:
                state = inf.writer.close(quick)
                if state is None:
                    return False
                inf.channel_state = state
            elif quick:
                return False
            else:
                inf.writer.discard()
        except BaseException as e:
            inf.channel_error = f"persisting in-flight data failed: {e!r}"
            with contextlib.suppress(Exception):
                inf.writer.discard()  # its files, staged sections and held buffers
        inf.close_ms = (time.monotonic() - t) * 1000
        inf.closed_here = quick
        if inf.half_done():
            self._acknowledge(inf)
        return True

    def _acknowledge(self, inf: InFlightCheckpoint) -> None:
        """On whichever snapshot thread finished its half last: acknowledges, or
        declines whatever went wrong (an exception here would otherwise vanish in the
        pool and hang the checkpoint)."""
        task = self.task
        try:
            self._acknowledge_parts(inf)
        except BaseException as e:
            with contextlib.suppress(Exception):
                inf.writer.discard()  # no half-written channel files left behind
            task.coordinator.decline(
                inf.checkpoint_id,
                task.vertex.uid,
                task.subtask,
                f"completing the unaligned checkpoint failed: {type(e).__name__}: {e}",
            )

    def _acknowledge_parts(self, inf: InFlightCheckpoint) -> None:
        task = self.task
        ack, channel_state = inf.operator_part, inf.channel_state
        if inf.operator_error is not None:
            return  # declined when it failed; its channel files are dropped or swept
        if ack is None or channel_state is None:
            reason = inf.channel_error or "unaligned checkpoint failed"
            task.coordinator.decline(inf.checkpoint_id, task.vertex.uid, task.subtask, reason)
            return
        # Taken while recovered input state was still being replayed (a metric, so
        # tests and operators can tell such checkpoints apart).
        ack.metrics["recovering"] = 1.0 if inf.recovering else 0.0
        if inf.references:
            channel_state["references"] = [r.to_dict() for r in inf.references]
            pieces = [p for r in inf.references for p in r.pieces]
            ack.metrics["referenced_bytes"] = float(sum(max(0, p.nbytes - p.skip) for p in pieces))
        ack.channel_state = channel_state
        ack.metrics["inflight_bytes"] = float(channel_state["bytes"])
        ack.metrics["close_ms"] = inf.close_ms
        ack.metrics["closed_on_task_thread"] = 1.0 if inf.closed_here else 0.0
        ack.metrics["inputs_ms"] = (inf.inputs_done - inf.started) * 1000
        ack.metrics["persist_ms"] = (time.monotonic() - inf.started) * 1000
        task.coordinator.acknowledge(ack)
