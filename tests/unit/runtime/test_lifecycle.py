"""A task's lifecycle driven through random sequences of ends, snapshots, stops,
completions, aborts and restores, against a small model of what must hold:
``finish()`` runs at most once along any chain of restores, a checkpoint records a
subtask finished exactly when nothing of its chain may run again, and a task that
holds a stop's savepoint takes no input until the savepoint completes (it ends) or
is aborted (it goes on); one whose final checkpoint completed ends, unless it
holds a stop's savepoint: then it ends with that savepoint (chaos 83-224)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from spillover.runtime.lifecycle import LifecycleError, TaskLifecycle


@dataclass(frozen=True)
class Taken:
    """What the model remembers of a checkpoint the task took."""

    finished: bool  # what the checkpoint recorded
    finishes: int  # finish() runs in the lineage the checkpoint captured


class LifecycleMachine(RuleBasedStateMachine):
    """The real lifecycle beside a model of the stop protocol: the savepoint
    announced (``announced``), whether the task holds it, whether it must end."""

    def __init__(self) -> None:
        super().__init__()
        self.life = TaskLifecycle()
        self.finishes = 0  # finish() runs in the current lineage (restores roll back)
        self.next_id = 1
        self.taken: dict[int, Taken] = {}
        self.completed: list[int] = []
        self.newest_here = -1  # the newest checkpoint this incarnation took
        self.announced: int | None = None
        self.holding = False
        self.must_end = False
        self.data_ended = False
        self.final_at: int | None = None  # the first checkpoint taken after its data ended
        self.final_completed = False

    @rule(drain=st.booleans())
    def data_ends(self, drain: bool) -> None:
        if self.life.data_ended:
            with pytest.raises(LifecycleError):
                self.life.end_data(drain)
            return
        self.data_ended = True
        if self.life.end_data(drain):
            self.finishes += 1

    @rule()
    def takes_a_snapshot(self) -> None:
        cid, self.next_id = self.next_id, self.next_id + 1
        self.life.snapshot_taken(cid)
        self.taken[cid] = Taken(self.life.finished_in_checkpoint, self.finishes)
        self.newest_here = cid
        if self.data_ended and self.final_at is None:
            self.final_at = cid
        if cid == self.announced:
            self.holding = True

    @precondition(lambda self: bool(self.taken))
    @rule(data=st.data())
    def checkpoint_completes(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(sorted(self.taken)))
        self.life.checkpoint_completed(cid)
        self.completed.append(cid)
        if self.final_at is not None and cid >= self.final_at:
            self.final_completed = True
        if self.holding and self.announced is not None and cid >= self.announced:
            self.must_end = True  # the stop's savepoint completed: the task ends

    @rule(ahead=st.integers(0, 2))
    def a_stop_is_announced(self, ahead: int) -> None:
        cid = self.next_id + ahead - 1
        self.life.suspend_announced(cid)
        self.announced, self.holding = cid, self.newest_here >= cid  # taken already

    @rule(ahead=st.integers(-1, 2))
    def a_checkpoint_is_aborted(self, ahead: int) -> None:
        cid = self.next_id + ahead - 1
        self.life.checkpoint_aborted(cid)
        if cid == self.announced:  # the stop failed: the task goes on as before
            self.announced, self.holding = None, False

    @rule(ahead=st.integers(0, 2))
    def a_barrier_comes(self, ahead: int) -> None:
        cid = self.next_id + ahead
        self.life.barrier_seen(cid)
        if self.holding and self.announced is not None and cid > self.announced:
            # A newer checkpoint: the held savepoint cannot complete any more.
            self.announced, self.holding = None, False

    @rule()
    def terminated(self) -> None:
        self.life.terminate()
        self.must_end = True

    @precondition(lambda self: bool(self.completed))
    @rule(data=st.data())
    def restores(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(self.completed))
        point = self.taken[cid]
        self.life = TaskLifecycle.restored(point.finished)
        self.finishes = point.finishes
        self.announced, self.holding, self.must_end = None, False, False
        self.data_ended, self.final_at, self.final_completed = False, None, False
        self.newest_here = -1
        self.completed = [c for c in self.completed if c <= cid]
        self.taken = {c: t for c, t in self.taken.items() if c <= cid}

    @invariant()
    def finish_runs_at_most_once_along_every_lineage(self) -> None:
        assert self.finishes <= 1

    @invariant()
    def a_checkpoint_after_finish_records_it_finished(self) -> None:
        for point in self.taken.values():
            assert point.finished or point.finishes == 0

    @invariant()
    def the_task_holds_a_savepoint_exactly_when_the_model_says(self) -> None:
        assert self.life.suspended == self.holding
        assert self.life.takes_input == (not self.holding)

    @invariant()
    def the_task_ends_when_its_stop_completed_or_it_was_terminated(self) -> None:
        assert self.life.exit_requested == self.must_end

    @invariant()
    def a_task_holding_a_stops_savepoint_ends_only_with_it(self) -> None:
        assert self.life.may_end == (self.must_end or (self.final_completed and not self.holding))


LifecycleMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40)
test_lifecycle = LifecycleMachine.TestCase


class LifecycleAtLength(LifecycleMachine):
    """CI's slow group: many more interleavings."""


LifecycleAtLength.TestCase.settings = settings(
    max_examples=2_000, stateful_step_count=60, deadline=None
)
test_lifecycle_at_length = pytest.mark.slow(LifecycleAtLength.TestCase)


def test_a_subtask_restored_finished_is_recorded_finished_before_its_end_of_data() -> None:
    """The shrunk case of the issue: restored finished, a barrier overtakes its queued
    EndOfData; the snapshot must record it finished, or a restore of that checkpoint
    runs ``finish()`` a second time."""
    life = TaskLifecycle.restored(True)
    life.snapshot_taken(5)  # before its EndOfData was processed
    assert life.finished_in_checkpoint
    assert not life.end_data(drain=True)  # and its chain never finishes again


def test_a_task_whose_final_checkpoint_completes_while_it_holds_a_stops_savepoint_stays() -> None:
    """Chaos 83-224, shrunk: the data ended, final checkpoint 2 was taken, then the
    stop's savepoint 3; 2 completes. Ended now, the task would hold 3 and send no
    EndOfPartition; it stays until 3 is decided, and goes on to its end if aborted."""
    life = TaskLifecycle()
    life.end_data(drain=True)
    life.snapshot_taken(2)
    life.suspend_announced(3)
    life.snapshot_taken(3)
    life.checkpoint_completed(2)
    assert life.final_done and life.suspended and not life.may_end
    life.checkpoint_aborted(3)
    assert life.may_end and not life.suspended
