"""A task's lifecycle driven through random sequences of ends, snapshots, stops,
completions, aborts and restores, against a small model of what must hold:
``finish()`` runs at most once along any chain of restores, a checkpoint records a
subtask finished exactly when nothing of its chain may run again, and a task that
holds a stop's savepoint takes no input until the savepoint completes (it ends) or
is aborted (it goes on)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from spillover.runtime.lifecycle import LifecycleError, Phase, TaskLifecycle


@dataclass(frozen=True)
class Taken:
    """What the model remembers of a checkpoint the task took."""

    finished: bool  # what the checkpoint recorded
    finishes: int  # finish() runs in the lineage the checkpoint captured


class LifecycleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.life = TaskLifecycle()
        self.finishes = 0  # finish() runs in the current lineage (restores roll back)
        self.next_id = 1
        self.taken: dict[int, Taken] = {}
        self.completed: list[int] = []
        self.processed_while_holding = 0

    @rule(drain=st.booleans())
    def data_ends(self, drain: bool) -> None:
        if self.life.data_ended:
            with pytest.raises(LifecycleError):
                self.life.end_data(drain)
            return
        if self.life.end_data(drain):
            self.finishes += 1

    @rule()
    def takes_a_snapshot(self) -> None:
        cid, self.next_id = self.next_id, self.next_id + 1
        self.life.snapshot_taken(cid)
        self.taken[cid] = Taken(self.life.finished_in_checkpoint, self.finishes)

    @precondition(lambda self: self.next_id > 1)
    @rule(data=st.data())
    def checkpoint_completes(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(sorted(self.taken)))
        self.life.checkpoint_completed(cid)
        self.completed.append(cid)
        if self.life.final_checkpoint_id is not None and cid >= self.life.final_checkpoint_id:
            assert self.life.may_end

    @rule(ahead=st.integers(0, 2))
    def a_stop_is_announced(self, ahead: int) -> None:
        self.life.suspend_announced(self.next_id + ahead - 1)

    @rule(ahead=st.integers(-1, 2))
    def a_checkpoint_is_aborted(self, ahead: int) -> None:
        cid = self.next_id + ahead - 1
        was = self.life.suspend_at
        self.life.checkpoint_aborted(cid)
        if cid == was:
            assert not self.life.suspended and self.life.takes_input

    @rule(ahead=st.integers(0, 2))
    def a_barrier_comes(self, ahead: int) -> None:
        cid = self.next_id + ahead
        held = self.life.suspend_at
        self.life.barrier_seen(cid)
        if held is not None and cid > held:
            assert not self.life.suspended  # that savepoint cannot complete any more

    @rule()
    def input_comes(self) -> None:
        if not self.life.takes_input:
            return  # held, not processed
        if self.life.suspended:
            self.processed_while_holding += 1

    @precondition(lambda self: bool(self.completed))
    @rule(data=st.data())
    def restores(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(self.completed))
        point = self.taken[cid]
        self.life = TaskLifecycle.restored(point.finished)
        self.finishes = point.finishes

    @invariant()
    def finish_runs_at_most_once_along_every_lineage(self) -> None:
        assert self.finishes <= 1

    @invariant()
    def a_finished_record_means_nothing_runs_again(self) -> None:
        for point in self.taken.values():
            if point.finished:
                assert point.finishes <= 1
            if point.finishes == 1 and not point.finished:
                # Finished, but recorded running: only a stop without drain, never.
                raise AssertionError("a checkpoint after finish() recorded the task running")

    @invariant()
    def holding_a_savepoint_takes_no_input(self) -> None:
        assert self.processed_while_holding == 0
        assert self.life.takes_input == (not self.life.suspended)

    @invariant()
    def restored_finished_is_finished(self) -> None:
        if self.life.phase is Phase.RESTORED_FINISHED:
            assert self.life.finished_in_checkpoint


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
