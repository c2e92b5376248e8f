"""The aligned states of a task's barrier handling: a channel that delivered barrier
n is blocked until every live channel has; a newer barrier or a cancel marker
aborts; ended channels do not hold it up; an aligned-with-timeout checkpoint goes
unaligned when it times out and an aligned one never does."""

from __future__ import annotations

from typing import Any

from spillover.runtime.checkpointing.barriers.handler import BarrierHandler
from spillover.runtime.checkpointing.barriers.states import (
    WAITING,
    CollectingAligned,
    CollectingUnaligned,
)
from spillover.runtime.network.events import BarrierKind, CheckpointBarrier
from support.barrier_task import StillChannels, recording_handler


def _handler(n: int) -> tuple[BarrierHandler, StillChannels, list[Any]]:
    h, channels, task = recording_handler(n)
    return h, channels, task.log


def test_alignment_blocks_each_channel_until_all_delivered() -> None:
    h, gate, log = _handler(3)
    h.on_barrier(0, CheckpointBarrier(1, 0))
    h.on_data(1, memoryview(b"x" * 100))  # type: ignore[arg-type]
    h.on_barrier(2, CheckpointBarrier(1, 0))
    assert gate.blocked == {0, 2} and log == []
    state = h.state
    assert isinstance(state, CollectingAligned) and state.stats.bytes_during_alignment == 100
    h.on_barrier(1, CheckpointBarrier(1, 0))
    assert log == [("snapshot", 1)] and gate.blocked == set() and h.state is WAITING


def test_newer_barrier_aborts_the_alignment_in_progress() -> None:
    h, gate, log = _handler(2)
    h.on_barrier(0, CheckpointBarrier(1, 0))
    h.on_barrier(1, CheckpointBarrier(2, 0))  # n+1 overtook n on another channel
    assert log == [("declined", 1)] and gate.blocked == {1}
    h.on_barrier(1, CheckpointBarrier(1, 0))  # the straggler of the aborted one
    assert log == [("declined", 1)]
    h.on_barrier(0, CheckpointBarrier(2, 0))
    assert log == [("declined", 1), ("snapshot", 2)]


def test_cancel_marker_aborts_and_late_barriers_are_ignored() -> None:
    h, gate, log = _handler(2)
    h.on_barrier(0, CheckpointBarrier(5, 0))
    h.on_cancel(5)
    assert log == [("declined", 5)] and gate.blocked == set()
    h.on_barrier(1, CheckpointBarrier(5, 0))
    assert log == [("declined", 5)] and h.state is WAITING


def test_ended_channels_no_longer_hold_up_alignment() -> None:
    h, _, log = _handler(3)
    h.on_end_of_partition(2)
    h.on_barrier(0, CheckpointBarrier(1, 0))
    h.on_barrier(1, CheckpointBarrier(1, 0))
    assert log == [("snapshot", 1)]
    h2, _, log2 = _handler(2)
    h2.on_barrier(0, CheckpointBarrier(1, 0))
    h2.on_end_of_partition(1)  # the last missing channel ends while aligning
    assert log2 == [("snapshot", 1)]


def test_only_an_aligned_with_timeout_checkpoint_goes_unaligned_when_it_times_out() -> None:
    h, gate, log = _handler(2)
    h.on_barrier(0, CheckpointBarrier(1, 0))
    h.on_timeout(1)  # an aligned checkpoint: the timeout is not its
    assert isinstance(h.state, CollectingAligned) and gate.blocked == {0}
    h.on_barrier(1, CheckpointBarrier(1, 0))
    h.on_barrier(0, CheckpointBarrier(2, 0, BarrierKind.ALIGNED_WITH_TIMEOUT))
    h.on_timeout(2)
    assert isinstance(h.state, CollectingUnaligned) and gate.blocked == set()
    assert h.state.inf.pending == {1}  # channel 0 delivered its barrier already
    assert log == [("snapshot", 1), ("forwarded", 2), ("snapshot+inflight", 2)]
    h.on_barrier(1, CheckpointBarrier(2, 0, BarrierKind.ALIGNED_WITH_TIMEOUT))
    assert h.state is WAITING and log[-1] == ("completed", 2)
