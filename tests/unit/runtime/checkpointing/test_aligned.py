"""The aligned policy: a channel that delivered barrier n is blocked until every live
channel has; a newer barrier or a cancel marker aborts; ended channels do not hold
it up."""

from __future__ import annotations

from typing import Any

from spillover.runtime.checkpointing.aligned import BarrierHandler
from spillover.runtime.network.events import CheckpointBarrier

# --- barrier alignment ------------------------------------------------------------------------


class FakeGate:
    def __init__(self) -> None:
        self.blocked: set[int] = set()

    def block(self, channel: int) -> None:
        self.blocked.add(channel)

    def unblock_all(self) -> None:
        self.blocked.clear()


def _handler(n: int) -> tuple[BarrierHandler, FakeGate, list[Any]]:
    gate = FakeGate()
    log: list[Any] = []
    h = BarrierHandler(
        gate,
        n,
        lambda b, s: log.append(("aligned", b.checkpoint_id)),
        lambda cid: log.append(("aborted", cid)),
    )
    return h, gate, log


def test_alignment_blocks_each_channel_until_all_delivered() -> None:
    h, gate, log = _handler(3)
    h.on_barrier(0, CheckpointBarrier(1, 0))
    h.record_bytes(100)
    h.on_barrier(2, CheckpointBarrier(1, 0))
    assert gate.blocked == {0, 2} and log == []
    assert h.stats is not None and h.stats.bytes_during_alignment == 100
    h.on_barrier(1, CheckpointBarrier(1, 0))
    assert log == [("aligned", 1)] and gate.blocked == set()


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
    assert log == [("aborted", 5)] and not h.aligning


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
