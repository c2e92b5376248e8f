"""The input loop's run of buffers (``TaskInput._take_run``) over a real input gate:
what ends a run, and what a run leaves in the gate for the loop's next turn."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from spillover.records import RecordWriter
from spillover.runtime import taskinput
from spillover.runtime.lifecycle import TaskLifecycle
from spillover.runtime.network import events as ev
from spillover.runtime.network.buffers import NetworkBuffer
from spillover.runtime.network.errors import ChannelCancelledError
from spillover.runtime.network.gate import InputGate
from spillover.runtime.taskinput import RUN_BUFFERS, InputChannelInfo, TaskInput


class FakeClock:
    """``time.monotonic()`` as the input loop reads it: moves only when told."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(taskinput, "time", fake)
    return fake


class RecordingTask:
    """The task as the input loop sees it: records each processed buffer's record and
    each barrier, in the order the loop handles them. ``mail_at`` posts mail once
    that many buffers were processed; ``output_moves`` is what ``drain()`` answers;
    ``due`` is the output's flush deadline; with a ``clock``, a buffer takes ``tick``
    seconds and a barrier ``barrier_wait``."""

    def __init__(self, clock: FakeClock | None = None) -> None:
        self.name = "t"
        self.life = TaskLifecycle()
        self.handled: list[int | ev.CheckpointBarrier] = []
        self.cp = SimpleNamespace(on_data=lambda ch, buf: None, on_barrier=self._barrier)
        self.clock = None
        self.chain = SimpleNamespace(head=SimpleNamespace(process=self._process), opened=[])
        self.head = None
        self.replay = None
        self.mail_at: int | None = None
        self.output_moves = True
        self.due = math.inf
        self.fake_clock = clock
        self.tick = self.barrier_wait = 0.0

    def _process(self, batch: Any, input_index: int) -> None:
        self.handled.extend(int(v) for v in batch)
        if self.fake_clock is not None:
            self.fake_clock.now += self.tick

    def _barrier(self, ch: int, barrier: ev.CheckpointBarrier) -> None:
        self.handled.append(barrier)
        if self.fake_clock is not None:
            self.fake_clock.now += self.barrier_wait

    def has_mail(self) -> bool:
        processed = sum(isinstance(h, int) for h in self.handled)
        return self.mail_at is not None and processed >= self.mail_at

    def drain(self) -> bool:
        return self.output_moves

    def flush_deadline(self) -> float:
        return self.due

    def check_operator(self, records: int) -> None:
        pass


def record(value: int) -> NetworkBuffer:
    """A data buffer holding one int64 record."""
    writer = RecordWriter(64)
    assert not writer.write_fixed(np.array([value], np.int64).view(np.uint8), 8)
    return NetworkBuffer.unpooled(writer.flush())


def setup(
    buffers: int, clock: FakeClock | None = None
) -> tuple[RecordingTask, InputGate, TaskInput]:
    """A task whose one-channel gate holds records 0 .. ``buffers - 1``, a buffer each."""
    task = RecordingTask(clock)
    gate = InputGate(1, floating_buffers=0, buffers_per_channel=16, name="g")
    channels = [InputChannelInfo(0, Any, 0, np.int64)]
    vertex = SimpleNamespace(loop=None, is_iteration_head=False)
    loop = TaskInput(task, gate, channels, Any, vertex, flush_interval=0.005)  # type: ignore[arg-type]
    for i in range(buffers):
        gate.channel(0).push_data(record(i))
    return task, gate, loop


def run(gate: InputGate, loop: TaskInput, limit: int = RUN_BUFFERS) -> None:
    """One turn's run, as the loop starts it: with the buffer it polled."""
    item = gate.poll(0.0)
    assert item is not None
    loop._take_run(item, limit)


def queued(gate: InputGate) -> int:
    return gate.channel(0).queued_buffers


def test_a_run_takes_what_the_gate_holds_up_to_its_limit() -> None:
    task, gate, loop = setup(RUN_BUFFERS + 2)
    run(gate, loop)
    assert task.handled == list(range(RUN_BUFFERS))
    assert queued(gate) == 2
    run(gate, loop, limit=1)  # a loop-head or replaying task: one a turn
    assert task.handled == list(range(RUN_BUFFERS + 1))
    assert queued(gate) == 1


def test_a_run_ends_when_the_gate_holds_nothing_more() -> None:
    task, gate, loop = setup(3)
    run(gate, loop)
    assert task.handled == [0, 1, 2]


def test_mail_posted_during_a_run_ends_it() -> None:
    task, gate, loop = setup(4)
    task.mail_at = 1  # posted once the first buffer was processed
    run(gate, loop)
    assert task.handled == [0]
    assert queued(gate) == 3


def test_a_priority_barrier_behind_data_is_handled_next_and_ends_the_run() -> None:
    task, gate, loop = setup(3)
    item = gate.poll(0.0)  # the loop polled the first buffer; then the barrier came
    assert item is not None
    barrier = ev.CheckpointBarrier(1, 0, ev.BarrierKind.UNALIGNED)
    for b in gate.channel(0).push_event(ev.to_buffer(barrier), priority=True):
        b.release()  # (what it overtook stays queued: these are extra references)
    loop._take_run(item, RUN_BUFFERS)
    assert task.handled == [0, barrier]
    assert queued(gate) == 2  # the data it overtook comes in the next turns


def test_an_output_that_does_not_move_on_at_once_ends_the_run() -> None:
    task, gate, loop = setup(4)
    task.output_moves = False
    run(gate, loop)
    assert task.handled == [0]
    assert queued(gate) == 3


def test_a_run_ends_once_the_flush_is_due(clock: FakeClock) -> None:
    """A partly filled output buffer waits no longer than the buffer timeout: once
    the flush is due, the run ends and the loop flushes."""
    task, gate, loop = setup(6, clock)
    task.tick = 1.0  # each buffer takes a second
    task.due = 2.5
    run(gate, loop)
    assert task.handled == [0, 1, 2]  # done at 1, 2 and 3 s: due after the third
    assert queued(gate) == 3


class _Paced:
    """An operator that paces itself: ready again ``per_buffer`` seconds of the clock
    after each buffer (as ``ThrottledSink`` does at its rate)."""

    def __init__(self, clock: FakeClock, task: RecordingTask, per_buffer: float) -> None:
        self.clock, self.task, self.per_buffer = clock, task, per_buffer

    def ready_at(self) -> float:
        taken = sum(isinstance(h, int) for h in self.task.handled)
        return taken * self.per_buffer


@pytest.mark.parametrize(("per_buffer", "taken"), [(0.5, 4), (2.0, 1)])
def test_a_paced_operator_ends_the_run_once_it_must_wait(
    clock: FakeClock, per_buffer: float, taken: int
) -> None:
    """A paced sink takes buffers in runs while it keeps up (an unreachable pace: the
    whole run) and the run ends as soon as it must wait for its pace."""
    task, gate, loop = setup(6, clock)
    task.tick = 1.0  # each buffer takes a second
    loop._paced = [_Paced(clock, task, per_buffer)]
    run(gate, loop, limit=4)
    assert task.handled == list(range(taken))


def test_a_task_holding_a_stops_savepoint_holds_one_buffer_a_run() -> None:
    task, gate, loop = setup(4)
    task.life.suspend_announced(1)
    task.life.snapshot_taken(1)
    assert task.life.suspended
    run(gate, loop)
    assert task.handled == []
    assert loop.held == 1
    assert queued(gate) == 3


@pytest.mark.parametrize("limit", [1, RUN_BUFFERS])
def test_only_data_counts_as_busy_time(clock: FakeClock, limit: int) -> None:
    """An event's handling may wait for credit (aligned barrier forwarding, the
    EndOfData flush), which counts as backpressure: it is not busy time, so busy and
    backpressured time never add up to more than the clock."""
    task, gate, loop = setup(1, clock)
    barrier = ev.CheckpointBarrier(1, 0, ev.BarrierKind.ALIGNED)
    gate.channel(0).push_event(ev.to_buffer(barrier))
    task.tick, task.barrier_wait = 1.0, 5.0
    run(gate, loop, limit)
    if limit == 1:  # one a turn: the barrier comes in the next
        run(gate, loop, limit)
    assert task.handled == [0, barrier]
    assert clock.now == 6.0
    assert loop.busy_seconds == 1.0


class StoppingTask(RecordingTask):
    """A task holding stop's savepoint 1 that hears how the savepoint ended
    (``completed`` or not: aborted) in its second run of the mailbox: after the input
    loop's first turn polled the gate."""

    def __init__(self, completed: bool, mails_before: int = 2) -> None:
        super().__init__()
        self.life.suspend_announced(1)
        self.life.snapshot_taken(1)
        self.cp.reap = lambda: None
        self.completed, self.mails_before = completed, mails_before

    def mail(self, block: bool = False, timeout: float | None = None) -> float:
        self.mails_before -= 1
        if self.mails_before == 0:
            if self.completed:
                self.life.checkpoint_completed(1)
            else:
                self.life.checkpoint_aborted(1)
        return 0.0

    def maybe_flush(self) -> None:
        pass


def stopping(completed: bool) -> tuple[StoppingTask, InputGate, TaskInput]:
    """A stopping task whose one input channel was cancelled before it heard how its
    savepoint ended: its upstream, on another worker, heard first and ended."""
    task = StoppingTask(completed)
    gate = InputGate(1, floating_buffers=0, buffers_per_channel=16, name="sink#1")
    channels = [InputChannelInfo(0, Any, 0, np.int64)]
    vertex = SimpleNamespace(loop=None, is_iteration_head=False)
    loop = TaskInput(task, gate, channels, Any, vertex, flush_interval=0.005)  # type: ignore[arg-type]
    gate.channel(0).fail(ChannelCancelledError("result partition 'source#0' was cancelled"))
    return task, gate, loop


def test_a_channel_cancelled_before_the_stops_savepoint_completed_ends_the_task_cleanly() -> None:
    """The stop's savepoint completed: its upstream ended (its channel cancelled) before
    this task heard so; the task ends as stopped, not failed."""
    task, _, loop = stopping(completed=True)
    loop.run()
    assert task.life.exit_requested
    assert task.life.suspended  # ended holding the savepoint: no EndOfPartition follows


def test_a_channel_cancelled_while_holding_a_savepoint_that_is_aborted_fails_the_task() -> None:
    """Aborted, the savepoint no longer explains the cancelled channel: the task fails
    as it would have without the stop."""
    task, _, loop = stopping(completed=False)
    with pytest.raises(ChannelCancelledError, match="channel 0 of input gate 'sink#1'"):
        loop.run()
    assert not task.life.suspended


def test_a_channel_failed_while_running_fails_the_task_at_once() -> None:
    task, _, loop = stopping(completed=True)
    task.life.checkpoint_aborted(1)  # not suspended: the failure is the task's own
    task.mails_before = -1
    with pytest.raises(ChannelCancelledError):
        loop.run()
