"""An iteration head's feedback log with concurrent aligned checkpoints: each
checkpoint logs, as its own input state, exactly the feedback that came back before
its barrier returned on that channel, and each completes, whatever the checkpoints
after it do meanwhile."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spillover.runtime.checkpointing.barriers.controller import RecoveredCut
from spillover.runtime.checkpointing.barriers.handler import BarrierHandler
from spillover.runtime.checkpointing.inflight import InFlightCheckpoint
from spillover.runtime.iteration.head import FeedbackLog
from spillover.runtime.network.events import CheckpointBarrier

REGULAR, FEEDBACK = 0, 1


@dataclass
class Buf:
    seq: int

    def __len__(self) -> int:
        return 1


class Writer:
    def __init__(self) -> None:
        self.inputs: list[int] = []
        self.input_bytes = 0

    def add_input(self, gate: int, channel: int, buf: Any) -> None:
        self.inputs.append(buf.seq)


class Channels:
    def block(self, channel: int) -> None: ...
    def unblock(self, channel: int) -> None: ...
    def unblock_all(self) -> None: ...
    def is_blocked(self, channel: int) -> bool:
        return False

    def has_ended(self, channel: int) -> bool:
        return False

    def overtake(self, channel: int, match: Any) -> None:
        return None


class Head:
    """The head task: its snapshots, completions and declines."""

    def __init__(self) -> None:
        self.snapshots: list[int] = []
        self.completed: dict[int, list[int]] = {}
        self.declined: list[int] = []

    def open_inflight(self, barrier: CheckpointBarrier, pending: set[int]) -> InFlightCheckpoint:
        gate_of = [(0, 0), (1, 0)]
        return InFlightCheckpoint(barrier.checkpoint_id, Writer(), set(pending), 0, 0.0, gate_of)  # type: ignore[arg-type]

    def cut_recovered(self) -> RecoveredCut:
        return RecoveredCut([], frozenset(), False)

    def forward_unaligned(self, barrier: CheckpointBarrier, inf: Any) -> None: ...
    def begun_records(self, skip: frozenset[int]) -> list[tuple[int, bytes]]:
        return []

    def snapshot(self, barrier: CheckpointBarrier, stats: Any, inf: Any) -> None:
        self.snapshots.append(barrier.checkpoint_id)

    def decline(self, checkpoint_id: int, reason: str) -> None:
        self.declined.append(checkpoint_id)

    def cancel_downstream(self, checkpoint_id: int) -> None: ...

    def complete(self, inf: InFlightCheckpoint) -> None:
        self.completed[inf.checkpoint_id] = list(inf.writer.inputs)  # type: ignore[attr-defined]

    def abort(self, inf: InFlightCheckpoint) -> None:
        self.declined.append(inf.checkpoint_id)


def _head() -> tuple[BarrierHandler, FeedbackLog, Head]:
    head = Head()
    log = FeedbackLog(frozenset({FEEDBACK}))
    handler = BarrierHandler(
        head,  # type: ignore[arg-type]
        Channels(),
        head,  # type: ignore[arg-type]
        2,
        exempt=frozenset({FEEDBACK}),
        after=log,
    )
    log.bind(handler)
    return handler, log, head


def _feedback(handler: BarrierHandler, log: FeedbackLog, seq: int) -> None:
    buf = Buf(seq)
    log.on_data(FEEDBACK, buf)  # type: ignore[arg-type]
    handler.on_data(FEEDBACK, buf)  # type: ignore[arg-type]


def _barrier(handler: BarrierHandler, log: FeedbackLog, ch: int, cid: int) -> None:
    barrier = CheckpointBarrier(cid, 0)
    if ch != FEEDBACK or not log.on_barrier(ch, barrier):
        handler.on_barrier(ch, barrier)


def test_concurrent_aligned_checkpoints_each_log_their_own_feedback() -> None:
    handler, log, head = _head()
    _barrier(handler, log, REGULAR, 1)  # aligned over the regular channel: logs 1
    _feedback(handler, log, 10)
    _barrier(handler, log, REGULAR, 2)  # the next checkpoint, before 1's barrier is back
    _feedback(handler, log, 11)
    _barrier(handler, log, FEEDBACK, 1)  # checkpoint 1 went round the loop
    _feedback(handler, log, 12)
    _barrier(handler, log, FEEDBACK, 2)
    assert head.snapshots == [1, 2] and head.declined == []
    assert head.completed == {1: [10, 11], 2: [11, 12]}


def test_an_aborted_checkpoint_drops_its_log_and_the_next_goes_on() -> None:
    handler, log, head = _head()
    _barrier(handler, log, REGULAR, 1)
    _barrier(handler, log, REGULAR, 2)
    _feedback(handler, log, 10)
    handler.on_cancel(1)
    log.on_cancel(1)
    _barrier(handler, log, FEEDBACK, 1)  # its straggler: nothing to log any more
    _feedback(handler, log, 11)
    _barrier(handler, log, FEEDBACK, 2)
    assert head.declined == [1] and head.completed == {2: [10, 11]}
