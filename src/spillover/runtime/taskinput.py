"""A task's input: its input gate's buffers and events, read by the input loop.

Data buffers are deserialized a buffer at a time and handed to the chain's head;
events go where they belong: barriers, cancel markers and EndOfPartition to the
task's checkpoints (``taskcheckpoints.py``), watermarks to its clock, EndOfData to
the end of its inputs, loop probes to the loop's relay or head. A task holding a
stop's savepoint holds what comes meanwhile, in arrival order, until the savepoint
completes (it ends: the held input is in the savepoint) or is aborted (it is
processed then, as if the task had never stopped).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from spillover.records import FixedWidthSerializer, RecordReader
from spillover.runtime.api import Operator
from spillover.runtime.chain import OperatorChain
from spillover.runtime.eventtime.clock import TaskClock
from spillover.runtime.graph import JobEdge, JobGraph, Vertex
from spillover.runtime.iteration.head import LoopHead
from spillover.runtime.iteration.operator import IterationHead
from spillover.runtime.iteration.probes import ProbeRelay
from spillover.runtime.lifecycle import TaskLifecycle
from spillover.runtime.network import events as ev
from spillover.runtime.network.buffers import NetworkBuffer
from spillover.runtime.network.errors import ChannelFailedError
from spillover.runtime.network.gate import InputGate
from spillover.runtime.recovery.channels import ChannelStateReplay
from spillover.runtime.taskcheckpoints import TaskCheckpoints
from spillover.runtime.taskoutput import TaskOutput
from spillover.storage.handle import DataType

# The longest a backpressured task waits for its output to move before it looks
# again: returned credit and permits wake it at once (OutputWaker), so this only
# bounds a wait no wake reaches.
OUTPUT_WAIT = 0.005
_POLL = 0.005  # seconds an idle input loop waits before it looks around again
# The most buffers one turn of the input loop takes from what its gate already holds
# (``TaskInput._take_run``): the loop's own checks run once per turn.
RUN_BUFFERS = 8
# What a task holding a stop's savepoint still handles as it comes: what completes or
# aborts checkpoints. Data and every other event are held until the savepoint
# completes (the task ends: they are in it) or is aborted (they run then).
_WHILE_SUSPENDED = (ev.CheckpointBarrier, ev.CancelCheckpointMarker, ev.EndOfPartition)


@dataclass
class InputChannelInfo:
    """Which logical input and upstream subtask a gate channel carries."""

    input_index: int
    edge: JobEdge
    upstream_subtask: int
    dtype: Any


class InputTask(Protocol):
    """The task, as its input loop acts on it."""

    name: str
    life: TaskLifecycle
    cp: TaskCheckpoints
    clock: TaskClock
    chain: OperatorChain
    head: LoopHead | None
    replay: ChannelStateReplay | None

    def mail(self, block: bool = False, timeout: float | None = None) -> float: ...
    def has_mail(self) -> bool: ...
    def drain(self) -> bool: ...
    def maybe_flush(self) -> None: ...
    def flush_deadline(self) -> float: ...
    def end_of_data(self, drain: bool) -> None:
        """Every input ended (``drain``: none was stopped without draining)."""
        ...

    def take_deferred_trigger(self) -> bool: ...
    def check_operator(self, records: int) -> None: ...
    def send_probe(self, round: int) -> None: ...


class TaskInput:
    """The input gate of one task and what it has read of each channel."""

    def __init__(
        self,
        task: InputTask,
        gate: InputGate,
        channels: list[InputChannelInfo],
        graph: JobGraph,
        vertex: Vertex,
        flush_interval: float,
    ) -> None:
        self.task = task
        self.gate = gate
        self.channels = channels
        self.readers = [RecordReader() for _ in channels]
        self._serializers = [FixedWidthSerializer(c.dtype) for c in channels]
        self._debloater = gate.debloater
        # The longest an input wait lasts before the loop looks around again.
        self._poll = min(flush_interval, _POLL)
        # Operators that pace themselves (``ready_at``; set by ``run``): most chains none.
        self._paced: list[Any] = []
        self.records_in = 0
        self.busy_seconds = 0.0
        self.output_wait_seconds = 0.0  # waiting for the output to drain: backpressure
        self._data_ended: set[int] = set()
        self.inputs_ended: set[int] = set()
        n_inputs = 1 + max((c.input_index for c in channels), default=0)
        self._input_channels = {
            i: {ch for ch, c in enumerate(channels) if c.input_index == i} for i in range(n_inputs)
        }
        self.no_drain_channels: set[int] = set()  # channels whose EndOfData said "stop"
        # Taken in while holding a stop's savepoint, neither processed nor dropped:
        # (channel, data bytes or in-line event), in arrival order.
        self._held: list[tuple[int, bytes | ev.Event]] = []
        self.probes: ProbeRelay | None = None
        if vertex.loop is not None and not vertex.is_iteration_head:
            # A loop body: passes the loop's termination probes on.
            edges = [c.edge for c in channels]
            self.probes = ProbeRelay(graph.loop_channels(vertex, edges), task.send_probe)

    @property
    def held(self) -> int:
        """How many buffers and events it holds for a stop's savepoint."""
        return len(self._held)

    def can_be_root(self) -> bool:
        """Whether a checkpoint trigger can be taken now: no channel is left that could
        still bring its barrier (an iteration head: no regular one)."""
        head = self.task.head
        if head is not None:
            return head.regular <= self.task.cp.barriers.ended
        return self.gate.finished

    def inputs_done(self) -> bool:
        """Whether the input loop is over: every channel ended. Once a loop ended and
        its final checkpoint completed, the feedback brings nothing but its
        EndOfPartition, which comes only after the head's own: it does not wait."""
        head = self.task.head
        return self.gate.finished or (
            head is not None
            and head.loop_ended
            and self.task.life.final_done
            and self.can_be_root()
        )

    def run(self) -> None:
        """The input loop: until every channel ended, or the task must exit."""
        task = self.task
        paced = [op for op in task.chain.opened if type(op).ready_at is not Operator.ready_at]
        self._paced = paced
        while not self.inputs_done():
            task.mail()
            task.cp.reap()
            if task.life.exit_requested:
                break
            if not task.drain():
                # Backpressured: process no new input, but take priority events.
                self.output_wait_seconds += self.take_priority(OUTPUT_WAIT)
                continue
            pause = max(op.ready_at() for op in paced) - time.monotonic() if paced else 0.0
            if pause > 0:
                # An operator paces itself: wait, still taking unaligned barriers.
                self.take_priority(min(pause, self._poll))
                task.maybe_flush()
                continue
            if self._held:  # (the check inline: this runs once per buffer)
                self.release_held()
            replay = task.replay
            if replay is not None and replay.active and not task.life.suspended:
                self.take_priority(0.0)  # unaligned barriers may come first
                t = time.monotonic()
                replay.step()  # one block of recovered input state
                self.busy_seconds += time.monotonic() - t
                task.maybe_flush()
                continue
            item = self._poll_gate(self._poll)
            if item is None:
                task.maybe_flush()
                continue
            # A loop head or an active replay: one buffer a turn, so their checks run
            # before every buffer (a paced operator ends a run once it must wait).
            single = task.head is not None or (replay is not None and replay.active)
            self._take_run(item, 1 if single else RUN_BUFFERS)
            task.maybe_flush()

    def _take_run(self, item: tuple[int, NetworkBuffer], limit: int) -> None:
        """Handles ``item`` and then, up to ``limit`` buffers in all, what the gate
        already holds, while the output moves on at once and nothing else asks for
        the loop: mail, an event, a held stop's savepoint, a due flush of the output
        (a partly filled buffer waits no longer than the buffer timeout), an operator
        that paces itself and is not ready for more. The loop's
        checks (mail, reaping, pacing, replay) run once per run instead of once per
        buffer; a run takes what it finds and never waits. Each buffer is released
        here; only data counts as busy time."""
        task, gate = self.task, self.gate
        due = task.flush_deadline()
        for i in range(limit):
            ch, buf = item
            try:
                if buf.data_type == DataType.EVENT:
                    # Not busy time: an event's credit waits count as backpressure.
                    self.on_event(ch, ev.deserialize(buf.data))
                    return  # the loop's checks run after every event, as before
                t = time.monotonic()
                self.on_data(ch, buf)
                now = time.monotonic()
                self.busy_seconds += now - t
            finally:
                buf.release()
            if i == limit - 1 or self._held or now >= due:
                return
            if self._paced and max(op.ready_at() for op in self._paced) > now:
                return  # the loop waits for it, taking unaligned barriers meanwhile
            if task.has_mail() or not task.drain():
                return
            got = gate.poll(0.0)
            if got is None:
                return
            item = got

    def take_priority(self, timeout: float) -> float:
        """Waits up to ``timeout`` for a priority event (an unaligned barrier) and
        handles it; returns the seconds spent waiting."""
        t = time.monotonic()
        item = self._poll_gate(timeout, priority_only=True)
        waited = time.monotonic() - t
        if item is not None:
            ch, buf = item
            try:
                self.on_event(ch, ev.deserialize(buf))
            finally:
                buf.release()
        return waited

    def _poll_gate(
        self, timeout: float, priority_only: bool = False
    ) -> tuple[int, NetworkBuffer] | None:
        """``InputGate.poll``, except while the task holds a stop's savepoint: then a
        failed channel is not its failure yet. Its upstream tasks end once that
        savepoint completed, each as it hears so, and a remote one's channel is
        cancelled when its worker closes it: heard before this task's own
        completion, it would fail the stopped job. Until the savepoint completes (the
        task ends) or is aborted (the next poll raises), the wait is only a wait."""
        try:
            return self.gate.poll(timeout, priority_only=priority_only)
        except ChannelFailedError:
            if not self.task.life.suspended:
                raise
        if timeout > 0:
            time.sleep(timeout)  # the mail it waits for comes between two polls
        return None

    def on_data(self, ch: int, buf: NetworkBuffer) -> None:
        task = self.task
        if task.head is not None:
            task.head.check_data(ch)
        if self._debloater is not None:
            self._debloater.consumed(len(buf))
        task.cp.on_data(ch, buf)
        if task.life.suspended:
            self._held.append((ch, bytes(buf)))
        else:
            self.process(ch, buf)

    def process(self, ch: int, buf: Any) -> None:
        """Processes a buffer of channel ``ch``: one strided view of its records
        (joined with one carried over from the previous buffer), one call per buffer
        to keep batches large."""
        batch = self._serializers[ch].read_buffer(self.readers[ch], buf)
        if not len(batch):
            return
        self.records_in += len(batch)
        self.task.chain.head.process(batch, self.channels[ch].input_index)
        self.task.check_operator(self.records_in)

    def on_event(self, ch: int, event: ev.Event) -> None:
        task = self.task
        head = task.head
        if head is not None and ch in head.feedback and self._on_feedback(ch, event):
            return
        if isinstance(event, ev.CheckpointBarrier):
            task.life.barrier_seen(event.checkpoint_id)
        self.release_held()  # it came before this event: a barrier must follow it
        if task.life.suspended and not isinstance(event, _WHILE_SUSPENDED):
            self._held.append((ch, event))
            return
        if isinstance(event, ev.Watermark | ev.WatermarkStatus):
            task.clock.on_event(ch, event)
        elif isinstance(event, ev.CheckpointBarrier):
            task.cp.on_barrier(ch, event)
        elif isinstance(event, ev.CancelCheckpointMarker):
            task.cp.on_cancel(event.checkpoint_id)
        elif isinstance(event, ev.EndOfData):
            self._end_of_data(ch, event.drain)
        elif isinstance(event, ev.LoopProbe):
            if self.probes is not None:
                self.probes.on_probe(ch, event.round)
        elif isinstance(event, ev.EndOfPartition):
            self.gate.channel_finished(ch)
            task.cp.on_end_of_partition(ch)
            if self.probes is not None:
                self.probes.channel_ended(ch)
            if head is not None and self.can_be_root():
                while task.take_deferred_trigger():  # the regular upstream exited
                    pass

    def _on_feedback(self, ch: int, event: ev.Event) -> bool:
        """An iteration head's feedback channel: True if ``event`` was its alone."""
        head = self.task.head
        assert head is not None
        if isinstance(event, ev.Watermark | ev.WatermarkStatus):
            return True  # derived from the head's own output: no event-time progress
        if isinstance(event, ev.LoopProbe):
            head.probe_back(ch, event.round, self.task.cp.barriers.ended)
            return True
        if isinstance(event, ev.EndOfData):  # the loop ended it (LoopDone)
            self.readers[ch].finish()
            self._data_ended.add(ch)
            return True
        return False

    def _end_of_data(self, ch: int, drain: bool) -> None:
        task = self.task
        self.readers[ch].finish()
        self._data_ended.add(ch)
        if not drain:
            self.no_drain_channels.add(ch)
        else:  # a drained channel no longer holds the watermark back
            task.clock.channel_ended(ch)
        idx = self.channels[ch].input_index
        if idx in self.inputs_ended or not self._input_channels[idx] <= self._data_ended:
            return
        self.inputs_ended.add(idx)
        drained = not (self._input_channels[idx] & self.no_drain_channels)
        if not task.life.restored_finished and drained:
            task.chain.head.end_input(idx)
        if len(self.inputs_ended) == len(self._input_channels):
            task.end_of_data(not self.no_drain_channels)
        elif task.head is not None and idx == IterationHead.REGULAR:
            task.head.regular_input_ended()

    def end_feedback(self) -> None:
        """The loop ended: the head's feedback input ended, and with it every input."""
        self.inputs_ended.add(IterationHead.FEEDBACK)
        self.task.end_of_data(not self.no_drain_channels)

    def release_held(self) -> None:
        """Once a stop's savepoint it held was aborted (or superseded): what the task
        took in meanwhile is processed now, in the order it came. Called before
        anything that could start a checkpoint."""
        if not self._held or self.task.life.suspended:
            return
        held, self._held = self._held, []
        for ch, item in held:
            if isinstance(item, bytes):
                self.process(ch, item)
            else:
                self.on_event(ch, item)


class TaskCancelled(Exception):
    """The task was cancelled (the job is failing over or stopping)."""


class SourceTask(Protocol):
    """A source's task, as its loop acts on it."""

    name: str
    life: TaskLifecycle
    chain: OperatorChain
    clock: TaskClock
    output: TaskOutput
    cancelled: threading.Event

    @property
    def mailbox(self) -> TaskMailboxView: ...

    def mail(self, block: bool = False, timeout: float | None = None) -> float: ...
    def maybe_flush(self) -> None: ...
    def end_of_data(self, drain: bool) -> None: ...
    def check_operator(self, records: int) -> None: ...


class TaskMailboxView(Protocol):
    @property
    def stop_request(self) -> bool | None:
        """A stop-with-savepoint's drain, once one asked the source to stop."""
        ...


class SourceInput:
    """A source task's loop: the source emits a batch at a time while its output
    has room, until it runs out, is stopped, or its final checkpoint completed."""

    def __init__(self, task: SourceTask) -> None:
        self.task = task
        self.busy_seconds = 0.0
        self.output_wait_seconds = 0.0  # waiting for the output to drain: backpressure

    def run(self, restored_finished: bool) -> None:
        task = self.task
        src = task.chain.head
        exhausted = restored_finished
        if exhausted:
            task.end_of_data(True)
        while not task.life.may_end:
            task.mail()
            if task.cancelled.is_set():
                raise TaskCancelled(task.name)
            stop = task.mailbox.stop_request
            if stop is not None and not exhausted:
                exhausted = True  # stop-with-savepoint: nothing more is emitted
                task.end_of_data(stop)
            if exhausted or not task.life.takes_input:
                task.mail(block=True, timeout=0.05)
                continue
            if not task.output.drain():
                # Backpressured: wait a little, staying responsive to the mailbox;
                # only the waiting counts (messages run meanwhile have their own).
                self.output_wait_seconds += task.mail(block=True, timeout=OUTPUT_WAIT)
                continue
            t = time.monotonic()
            more = src.on_timer()
            if more:
                task.clock.poll_source()
            self.busy_seconds += time.monotonic() - t
            task.check_operator(task.output.net.records)
            if not more:
                exhausted = True
                task.end_of_data(True)
            task.maybe_flush()


__all__ = [
    "OUTPUT_WAIT",
    "InputChannelInfo",
    "InputTask",
    "SourceInput",
    "TaskCancelled",
    "TaskInput",
]
