"""The iteration head (FLIP-15): where a loop's barriers start and where it learns
that it is done. A task whose vertex is an iteration head composes a
:class:`LoopHead`; the head acts on its task only through :class:`HeadTask`.

Its input gate has the loop's regular channels (input 0) and its feedback channels
(input 1, from the loop's tail). Checkpoints:

- **aligned**: the barrier is aligned over the regular channels only (a feedback
  barrier comes after the head forwarded it; one that comes early, sent round by
  another head subtask, blocks its channel like any aligned barrier). Then the
  head snapshots, forwards the barrier in line and logs (:class:`FeedbackLog`):
  what comes back on each feedback channel until that channel's barrier returns
  is processed as usual and also persisted as the channel's input state. The log
  is exactly the data that was in transit around the loop; it is the feedback
  edge's channel state, written and replayed by the engine like any other. Each
  checkpoint has its own log, so concurrent checkpoints each log in full.
- **unaligned** (and timeout, and bounded in-flight data): as for any task, the
  first barrier starts the checkpoint and every channel whose barrier has not come,
  feedback ones included, is persisted until it comes; the tail's barrier
  overtakes its feedback queue, spilled part included (``feedback.py``).
- As a **root** (once its regular inputs ended, FLIP-147) it starts the
  checkpoint itself and logs its feedback all the same.

Termination (``termination.py``): once the regular input ended, the head runs
probe rounds and reports the quiet ones; when every head of the loop reported
the same round quiet the coordinator posts ``LoopDone`` and the head ends its
input, so EndOfData flows round the loop and the final checkpoint commits.
A stop-with-savepoint without drain, aligned or unaligned, persists the loop's
content (the aligned one through the feedback log) and ends without running the
loop empty.
"""

from __future__ import annotations

import time
from typing import Protocol

from spillover.errors import SpilloverError
from spillover.runtime.checkpointing.barriers.alignment import AlignmentStats
from spillover.runtime.checkpointing.barriers.handler import BarrierHandler
from spillover.runtime.checkpointing.inflight import InFlightCheckpoint
from spillover.runtime.network import events as ev
from spillover.runtime.network.buffers import NetworkBuffer

# After a quiet round the next probe waits this long: an idle loop's head does not
# spin while the other heads still work (termination is a round or two later).
QUIET_ROUND_PAUSE_S = 0.002


class IterationError(SpilloverError, RuntimeError):
    """A loop was used in a way its protocol cannot keep exact."""


class HeadTask(Protocol):
    """The task of a head subtask, as the head acts on it."""

    name: str

    @property
    def records_in(self) -> int: ...
    def send_probe(self, round: int) -> None:
        """``LoopProbe(round)`` on the loop's outputs, behind everything before it."""
        ...

    def loop_quiet(self, round: int) -> None:
        """Tells the coordinator that round ``round`` brought nothing back."""
        ...

    def end_feedback(self) -> None:
        """The loop is empty: the feedback input ends (EndOfData round the loop)."""
        ...


class FeedbackLog:
    """The head's logging policy: after an aligned snapshot, the feedback of each
    channel whose barrier has not come back is that checkpoint's input state."""

    def __init__(self, feedback: frozenset[int]) -> None:
        self.feedback = feedback
        self.logs: dict[int, InFlightCheckpoint] = {}
        self._handler: BarrierHandler | None = None

    def bind(self, handler: BarrierHandler) -> None:
        self._handler = handler

    @property
    def handler(self) -> BarrierHandler:
        assert self._handler is not None
        return self._handler

    def aligned(
        self, barrier: ev.CheckpointBarrier, stats: AlignmentStats | None, seen: frozenset[int]
    ) -> None:
        """The regular channels aligned (or a root trigger): snapshot, and log the
        feedback channels whose barrier has yet to come back."""
        h = self.handler
        pending = set(self.feedback - seen - h.ended)
        if not pending:
            h.ctrl.snapshot(barrier, stats, None)
            return
        inf = h.open_checkpoint(barrier, pending, stats)
        # The log must be whole: a bound on in-flight data would block the channels
        # its own barrier has to come back on.
        inf.max_inflight_bytes = None
        self.logs[barrier.checkpoint_id] = inf

    def on_data(self, ch: int, buf: NetworkBuffer) -> None:
        for inf in self.logs.values():
            if ch in inf.pending:
                inf.add_input(ch, buf)

    def on_barrier(self, ch: int, barrier: ev.CheckpointBarrier) -> bool:
        """True if ``barrier`` closed a log on ``ch`` (the handler does not see it)."""
        inf = self.logs.get(barrier.checkpoint_id)
        if inf is None or ch not in inf.pending:
            return False
        self._channel_done(inf, ch)
        return True

    def on_end_of_partition(self, ch: int) -> None:
        for inf in list(self.logs.values()):
            self._channel_done(inf, ch)

    def on_cancel(self, checkpoint_id: int) -> None:
        inf = self.logs.pop(checkpoint_id, None)
        if inf is not None:
            self.handler.acks.abort(inf)

    def reap(self) -> None:
        for inf in self.logs.values():
            inf.writer.reap()

    def release(self) -> None:
        logs, self.logs = self.logs, {}
        for inf in logs.values():
            inf.writer.discard()

    def _channel_done(self, inf: InFlightCheckpoint, ch: int) -> None:
        if ch not in inf.pending:
            return
        inf.pending.discard(ch)
        if inf.done:
            del self.logs[inf.checkpoint_id]
            self.handler.acks.complete(inf)


class LoopHead:
    """One head subtask: its feedback log and the loop's termination rounds."""

    def __init__(self, task: HeadTask, feedback: frozenset[int], regular: frozenset[int]) -> None:
        self.task = task
        self.feedback = feedback
        self.regular = regular
        self.log = FeedbackLog(feedback)
        self.round = 0  # the probe round running (0: none yet)
        self._round_records = 0  # records_in when the round's probe left
        self._round_back: set[int] = set()  # feedback channels its probe came back on
        self._next_probe_at: float | None = None
        self.regular_ended = False
        self.loop_ended = False
        self.loop_ended_at = 0.0  # time.time() when it ended (a benchmark's figure)
        self.rounds_quiet = 0

    def check_data(self, ch: int) -> None:
        if ch in self.feedback and self.loop_ended:
            raise IterationError(
                f"{self.task.name}: records came back into the loop after it ended",
                hint="a loop body emits in response to its input only: not from "
                "finish(), timers or threads of its own",
            )

    def regular_input_ended(self) -> None:
        """Stopped without drain too (an aligned stop processes what is in flight
        first): the loop runs empty, then ends without finishing an operator."""
        self.regular_ended = True
        if self.round == 0 and not self.loop_ended:
            self._next_round()

    def tick(self) -> None:
        """Called often: starts the next probe round when its pause is over."""
        at = self._next_probe_at
        if at is not None and time.monotonic() >= at:
            self._next_probe_at = None
            self._next_round()

    def _next_round(self) -> None:
        if self.loop_ended:
            return
        self.round += 1
        self._round_records = self.task.records_in
        self._round_back = set()
        self.task.send_probe(self.round)

    def probe_back(self, ch: int, round: int, ended: set[int]) -> None:
        """Round ``round``'s probe came back on feedback channel ``ch``."""
        if round != self.round or self.loop_ended:
            return
        self._round_back.add(ch)
        if not (self.feedback - ended) <= self._round_back:
            return
        if self.task.records_in == self._round_records:  # nothing came back this round
            self.rounds_quiet += 1
            self.task.loop_quiet(round)
            self._next_probe_at = time.monotonic() + QUIET_ROUND_PAUSE_S
        else:
            self._next_round()

    def loop_done(self) -> None:
        """Every head reported the same round quiet: no record is left in the loop."""
        if self.loop_ended or not self.regular_ended:
            return
        self.loop_ended = True
        self.loop_ended_at = time.time()
        self._next_probe_at = None
        self.task.end_feedback()

    def metrics(self) -> dict[str, float]:
        return {
            "loop_rounds": float(self.round),
            "loop_rounds_quiet": float(self.rounds_quiet),
            "loop_ended_at": self.loop_ended_at,
        }
