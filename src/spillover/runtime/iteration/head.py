"""The iteration head's task (FLIP-15): where a loop's barriers start and where it
learns that it is done.

Its input gate has the loop's regular channels (input 0) and its feedback channels
(input 1, from the loop's tail). Checkpoints:

- **aligned**: the barrier is aligned over the regular channels only (a feedback
  barrier comes after the head forwarded it; one that comes early, sent round by
  another head subtask, blocks its channel like any aligned barrier). Then the
  head snapshots, forwards the barrier in line and goes into *logging mode*: what
  comes back on each feedback channel until that channel's barrier returns is
  processed as usual and also persisted as the channel's input state. The log is
  exactly the data that was in transit around the loop; it is the feedback edge's
  channel state, written and replayed by the engine like any other, so a restore
  replays it lazily, filtered by key group when rescaled.
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
Stopped without drain (an aligned stop-with-savepoint) the loop runs empty the
same way, as an aligned stop processes everything in flight, and ends without
finishing an operator. An unaligned stop persists the loop's content instead.
"""

from __future__ import annotations

import time
from typing import Any

from spillover.errors import SpilloverError
from spillover.runtime.checkpointing.aligned import AlignmentStats
from spillover.runtime.checkpointing.finishing import end_of_inputs
from spillover.runtime.checkpointing.messages import TriggerCheckpoint
from spillover.runtime.iteration.operator import IterationHead
from spillover.runtime.iteration.probes import loop_outputs, send_probe
from spillover.runtime.network import events as ev
from spillover.runtime.network.buffers import NetworkBuffer
from spillover.runtime.task import Task

# After a quiet round the next probe waits this long: an idle loop's head does not
# spin while the other heads still work (termination is a round or two later).
QUIET_ROUND_PAUSE_S = 0.002


class IterationError(SpilloverError, RuntimeError):
    """A loop was used in a way its protocol cannot keep exact."""


class IterationHeadTask(Task):
    """The task of an iteration head (``IterationHead``) subtask."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.feedback = frozenset(ch for ch, c in enumerate(self.channels) if c.edge.feedback)
        self.regular = frozenset(range(len(self.channels))) - self.feedback
        assert self.barriers is not None
        self.barriers.exempt = self.feedback
        if self.clock.valve is not None:
            for ch in self.feedback:  # its own output coming back holds no watermark back
                self.clock.valve.on_end(ch)
        self.loop_outputs = loop_outputs(self)
        self.round = 0  # the probe round running (0: none yet)
        self._round_records = 0  # records_in when the round's probe left
        self._round_back: set[int] = set()  # feedback channels its probe came back on
        self._next_probe_at: float | None = None
        self.loop_ended = False
        self.loop_ended_at = 0.0  # time.time() when it ended (a benchmark's figure)
        self.rounds_quiet = 0

    # -- checkpoints -----------------------------------------------------------------------

    def can_be_root(self) -> bool:
        assert self.barriers is not None
        return self.regular <= self.barriers.ended

    def _on_aligned(self, barrier: ev.CheckpointBarrier, stats: AlignmentStats) -> None:
        assert self.barriers is not None
        pending = set(self.feedback - self.barriers.last_seen - self.barriers.ended)
        self._snapshot_logging(barrier, pending, stats)

    def trigger_root(self, trigger: TriggerCheckpoint) -> None:
        if trigger.checkpoint_id <= self.life.last_snapshot_id:
            return
        assert self.barriers is not None
        barrier = ev.CheckpointBarrier(
            trigger.checkpoint_id,
            trigger.trigger_ms,
            ev.BarrierKind(trigger.kind),
            trigger.timeout_ms,
        )
        self._snapshot_logging(barrier, set(self.feedback - self.barriers.ended), None)

    def _snapshot_logging(
        self, barrier: ev.CheckpointBarrier, pending: set[int], stats: AlignmentStats | None
    ) -> None:
        """Snapshots and forwards ``barrier``, then logs the ``pending`` feedback
        channels until it comes back on each."""
        if not pending:
            self.snapshot(barrier.checkpoint_id, barrier.timestamp_ms, stats, barrier)
            return
        inf = self.unaligned.start(barrier, pending, stats)
        # The log must be whole: a bound on in-flight data would block the channels
        # its own barrier has to come back on. Unaligned barriers overtake; the
        # bound holds for them.
        if barrier.kind != ev.BarrierKind.UNALIGNED:
            inf.max_inflight_bytes = None

    # -- input -----------------------------------------------------------------------------

    def _on_data(self, ch: int, buf: NetworkBuffer) -> None:
        if ch in self.feedback and self.loop_ended:
            raise IterationError(
                f"{self.name}: records came back into the loop after it ended",
                hint="a loop body emits in response to its input only: not from "
                "finish(), timers or threads of its own",
            )
        super()._on_data(ch, buf)

    def _on_event(self, ch: int, event: ev.Event) -> None:
        if ch in self.feedback:
            if isinstance(event, ev.Watermark | ev.WatermarkStatus):
                return  # derived from the head's own output: no event-time progress
            if isinstance(event, ev.LoopProbe):
                self._probe_back(ch, event.round)
                return
            if isinstance(event, ev.EndOfData):
                # The loop ended it (LoopDone): nothing more to decide.
                self.readers[ch].finish()
                self._data_ended.add(ch)
                return
        super()._on_event(ch, event)
        if ch in self.feedback:
            return
        if isinstance(event, ev.EndOfData) and IterationHead.REGULAR in self._inputs_ended:
            # Stopped without drain too (an aligned stop processes what is in flight
            # first): the loop runs empty, then ends without finishing an operator.
            if self.round == 0 and not self.loop_ended:
                self._next_round()
        elif isinstance(event, ev.EndOfPartition) and self.can_be_root():
            while self.deferred_triggers:  # the regular upstream exited: a root now
                self.trigger_root(self.deferred_triggers.pop(0))

    def inputs_done(self) -> bool:
        # Once the loop ended and its final checkpoint completed, the feedback brings
        # nothing but its EndOfPartition, which comes only after the head's own (the
        # tail waits for it): the head does not wait for it.
        assert self.barriers is not None
        return self.gate.finished or (
            self.loop_ended and self.life.final_done and self.regular <= self.barriers.ended
        )

    def _maybe_flush(self) -> None:
        super()._maybe_flush()
        at = self._next_probe_at
        if at is not None and time.monotonic() >= at:
            self._next_probe_at = None
            self._next_round()

    # -- termination -----------------------------------------------------------------------

    def _next_round(self) -> None:
        if self.loop_ended:
            return
        self.round += 1
        self._round_records = self.records_in
        self._round_back = set()
        send_probe(self, self.loop_outputs, self.round)

    def _probe_back(self, ch: int, round: int) -> None:
        if round != self.round or self.loop_ended:
            return
        self._round_back.add(ch)
        assert self.barriers is not None
        if not (self.feedback - self.barriers.ended) <= self._round_back:
            return
        if self.records_in == self._round_records:  # nothing came back this round
            self.rounds_quiet += 1
            self.coordinator.loop_quiet(self.vertex.uid, self.subtask, round)
            self._next_probe_at = time.monotonic() + QUIET_ROUND_PAUSE_S
        else:
            self._next_round()

    def loop_done(self, round: int) -> None:
        """Every head reported round ``round`` quiet: no record is left in the loop."""
        if not self.loop_ended and IterationHead.REGULAR in self._inputs_ended:
            self._end_loop()

    def _end_loop(self) -> None:
        self.loop_ended = True
        self.loop_ended_at = time.time()
        self._next_probe_at = None
        self._inputs_ended.add(IterationHead.FEEDBACK)
        end_of_inputs(self)

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        out["loop_rounds"] = float(self.round)
        out["loop_rounds_quiet"] = float(self.rounds_quiet)
        out["loop_ended_at"] = self.loop_ended_at
        return out
