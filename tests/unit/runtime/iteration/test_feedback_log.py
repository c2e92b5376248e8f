"""An iteration head's feedback log with concurrent aligned checkpoints: each
checkpoint logs, as its own input state, exactly the feedback that came back before
its barrier returned on that channel, and each completes, whatever the checkpoints
after it do meanwhile."""

from __future__ import annotations

from dataclasses import dataclass

from spillover.runtime.checkpointing.barriers.handler import BarrierHandler
from spillover.runtime.iteration.head import FeedbackLog
from spillover.runtime.network.events import CheckpointBarrier
from support.barrier_task import RecordingTask, recording_handler

REGULAR, FEEDBACK = 0, 1


@dataclass
class Buf:
    seq: int

    def __len__(self) -> int:
        return 1


def _head() -> tuple[BarrierHandler, FeedbackLog, RecordingTask]:
    log = FeedbackLog(frozenset({FEEDBACK}))
    handler, _, task = recording_handler(2, exempt=frozenset({FEEDBACK}), after=log)
    log.bind(handler)
    return handler, log, task


def _logged(task: RecordingTask) -> dict[int, list[int]]:
    """Per completed checkpoint, the feedback it logged (its records' numbers)."""
    return {cid: [b.seq for b in ch.get(FEEDBACK, [])] for cid, ch in task.persisted.items()}


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
    assert head.of("snapshot+inflight") == [1, 2] and head.of("declined") == []
    assert _logged(head) == {1: [10, 11], 2: [11, 12]}


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
    assert head.of("declined") == [1] and _logged(head) == {2: [10, 11]}
