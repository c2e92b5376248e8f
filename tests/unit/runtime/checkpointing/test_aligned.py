"""The aligned states of a task's barrier handling: a channel that delivered barrier
n is blocked until every live channel has; a newer barrier or a cancel marker
aborts; ended channels do not hold it up; an aligned-with-timeout checkpoint goes
unaligned when it times out and an aligned one never does."""

from __future__ import annotations

from typing import Any

from spillover.runtime.checkpointing.barriers.controller import RecoveredCut
from spillover.runtime.checkpointing.barriers.handler import BarrierHandler
from spillover.runtime.checkpointing.barriers.states import (
    WAITING,
    CollectingAligned,
    CollectingUnaligned,
)
from spillover.runtime.network.events import BarrierKind, CheckpointBarrier


class FakeChannels:
    def __init__(self) -> None:
        self.blocked: set[int] = set()

    def block(self, channel: int) -> None:
        self.blocked.add(channel)

    def unblock(self, channel: int) -> None:
        self.blocked.discard(channel)

    def unblock_all(self) -> None:
        self.blocked.clear()

    def is_blocked(self, channel: int) -> bool:
        return channel in self.blocked

    def has_ended(self, channel: int) -> bool:
        return False

    def overtake(self, channel: int, match: Any) -> None:
        return None


class FakeWriter:
    input_bytes = 0

    def add_input(self, *args: Any) -> None: ...


class FakeController:
    """Records what the handler does to its task."""

    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def open_inflight(self, barrier: CheckpointBarrier, pending: set[int]) -> Any:
        from spillover.runtime.checkpointing.inflight import InFlightCheckpoint

        return InFlightCheckpoint(barrier.checkpoint_id, FakeWriter(), set(pending), 0, 0.0)  # type: ignore[arg-type]

    def cut_recovered(self) -> RecoveredCut:
        return RecoveredCut([], frozenset(), False)

    def forward_unaligned(self, barrier: CheckpointBarrier, inf: Any) -> None:
        self.log.append(("forwarded", barrier.checkpoint_id))

    def begun_records(self, skip: frozenset[int]) -> list[tuple[int, bytes]]:
        return []

    def snapshot(self, barrier: CheckpointBarrier, stats: Any, inf: Any) -> None:
        kind = "unaligned" if inf is not None else "aligned"
        self.log.append((kind, barrier.checkpoint_id))

    def decline(self, checkpoint_id: int, reason: str) -> None:
        self.log.append(("aborted", checkpoint_id))

    def cancel_downstream(self, checkpoint_id: int) -> None: ...


class FakeAcks:
    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def complete(self, inf: Any) -> None:
        self.log.append(("completed", inf.checkpoint_id))

    def abort(self, inf: Any) -> None:
        self.log.append(("aborted", inf.checkpoint_id))


def _handler(n: int) -> tuple[BarrierHandler, FakeChannels, list[Any]]:
    channels = FakeChannels()
    log: list[Any] = []
    h = BarrierHandler(FakeController(log), channels, FakeAcks(log), n)  # type: ignore[arg-type]
    return h, channels, log


def test_alignment_blocks_each_channel_until_all_delivered() -> None:
    h, gate, log = _handler(3)
    h.on_barrier(0, CheckpointBarrier(1, 0))
    h.on_data(1, memoryview(b"x" * 100))  # type: ignore[arg-type]
    h.on_barrier(2, CheckpointBarrier(1, 0))
    assert gate.blocked == {0, 2} and log == []
    state = h.state
    assert isinstance(state, CollectingAligned) and state.stats.bytes_during_alignment == 100
    h.on_barrier(1, CheckpointBarrier(1, 0))
    assert log == [("aligned", 1)] and gate.blocked == set() and h.state is WAITING


def test_newer_barrier_aborts_the_alignment_in_progress() -> None:
    h, gate, log = _handler(2)
    h.on_barrier(0, CheckpointBarrier(1, 0))
    h.on_barrier(1, CheckpointBarrier(2, 0))  # n+1 overtook n on another channel
    assert log == [("aborted", 1)] and gate.blocked == {1}
    h.on_barrier(1, CheckpointBarrier(1, 0))  # the straggler of the aborted one
    assert log == [("aborted", 1)]
    h.on_barrier(0, CheckpointBarrier(2, 0))
    assert log == [("aborted", 1), ("aligned", 2)]


def test_cancel_marker_aborts_and_late_barriers_are_ignored() -> None:
    h, gate, log = _handler(2)
    h.on_barrier(0, CheckpointBarrier(5, 0))
    h.on_cancel(5)
    assert log == [("aborted", 5)] and gate.blocked == set()
    h.on_barrier(1, CheckpointBarrier(5, 0))
    assert log == [("aborted", 5)] and h.state is WAITING


def test_ended_channels_no_longer_hold_up_alignment() -> None:
    h, _, log = _handler(3)
    h.on_end_of_partition(2)
    h.on_barrier(0, CheckpointBarrier(1, 0))
    h.on_barrier(1, CheckpointBarrier(1, 0))
    assert log == [("aligned", 1)]
    h2, _, log2 = _handler(2)
    h2.on_barrier(0, CheckpointBarrier(1, 0))
    h2.on_end_of_partition(1)  # the last missing channel ends while aligning
    assert log2 == [("aligned", 1)]


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
    assert log == [("aligned", 1), ("forwarded", 2), ("unaligned", 2)]
    h.on_barrier(1, CheckpointBarrier(2, 0, BarrierKind.ALIGNED_WITH_TIMEOUT))
    assert h.state is WAITING and log[-1] == ("completed", 2)
