"""A task's lifecycle as one value: where it is between start and end, and what a
checkpoint records of it.

A task runs, its input ends (or its source runs out, or a stop ends its data), its
chain finishes (``finish()``, unless stopped without drain) and it waits for a
checkpoint taken after that to complete (FLIP-147), then ends; a task restored
finished starts there. A stop-with-savepoint suspends the task once it took the
savepoint: it takes no more input, and does not end, until the savepoint completes
(the task ends) or is aborted (it goes on exactly where it was). Every transition is
a method of :class:`TaskLifecycle`, called on the task thread; nothing else writes
its fields.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Phase(enum.Enum):
    """Where a task is in its life."""

    RUNNING = "running"
    # Its data ended: a drained end finished the chain, a stop without drain did not;
    # either way it waits for a checkpoint taken from now on to complete.
    FINISHED = "finished"
    STOPPED = "stopped"
    # Restored from a checkpoint that recorded it finished: nothing of its chain runs.
    RESTORED_FINISHED = "restored-finished"


class LifecycleError(RuntimeError):
    """A transition the lifecycle does not allow (a bug in the caller)."""


@dataclass
class TaskLifecycle:
    """The one owner of a task's lifecycle flags. ``suspended`` is orthogonal to the
    phase: a running or stopped task that took a stop's savepoint."""

    phase: Phase = Phase.RUNNING
    data_ended: bool = False  # EndOfData went downstream: it waits for its final checkpoint
    final_checkpoint_id: int | None = None  # the first checkpoint taken after the end
    final_done: bool = False  # ... completed: the task may end
    suspend_at: int | None = None  # a stop's savepoint, announced before its barrier
    suspended: bool = False  # took that savepoint: processes no more input
    exit_requested: bool = False  # Terminate, or the stop's savepoint completed
    last_snapshot_id: int = -1  # the newest checkpoint it took

    @classmethod
    def restored(cls, finished: bool) -> TaskLifecycle:
        return cls(Phase.RESTORED_FINISHED if finished else Phase.RUNNING)

    # -- what others read ----------------------------------------------------------

    @property
    def restored_finished(self) -> bool:
        return self.phase is Phase.RESTORED_FINISHED

    @property
    def finished_in_checkpoint(self) -> bool:
        """Whether a checkpoint records the subtask as finished: its chain finished, or
        it was restored finished (then nothing of it may run again, whether or not its
        EndOfData went out yet)."""
        return self.phase in (Phase.FINISHED, Phase.RESTORED_FINISHED)

    @property
    def takes_input(self) -> bool:
        """Whether it may process input now (not while it holds a stop's savepoint)."""
        return not self.suspended

    @property
    def may_end(self) -> bool:
        """Whether the task may end now: terminated, its stop's savepoint completed, or
        its final checkpoint completed while it holds no stop's savepoint. A task
        holding one ends with it: ended then, it would send no EndOfPartition (the
        savepoint holds what follows), and if the savepoint were aborted the tasks
        behind it would wait for that end, or a barrier, forever."""
        return self.exit_requested or (self.final_done and not self.suspended)

    def describe(self) -> str:
        """Its phase and the flags that say what it waits for, in one line."""
        parts = [self.phase.value]
        if self.data_ended:
            parts.append(f"data ended, final checkpoint {self.final_checkpoint_id}")
            parts.append("completed" if self.final_done else "pending")
        if self.suspend_at is not None:
            state = "holding" if self.suspended else "announced"
            parts.append(f"stop's savepoint {self.suspend_at} {state}")
        if self.exit_requested:
            parts.append("exit requested")
        parts.append(f"last snapshot {self.last_snapshot_id}")
        return ", ".join(parts)

    # -- transitions ---------------------------------------------------------------

    def end_data(self, drain: bool) -> bool:
        """Its data ends; returns whether the chain must run ``finish()`` now (a
        drained end of a chain that never finished)."""
        if self.data_ended:
            raise LifecycleError("the data of a task ended twice")
        self.data_ended = True
        if self.phase is Phase.RESTORED_FINISHED:
            return False
        if not drain:
            self.phase = Phase.STOPPED
            return False
        self.phase = Phase.FINISHED
        return True

    def without_checkpoints(self) -> None:
        """A job without checkpointing: no final checkpoint to wait for."""
        self.final_done = True

    def snapshot_taken(self, checkpoint_id: int) -> None:
        self.last_snapshot_id = max(self.last_snapshot_id, checkpoint_id)
        if self.data_ended and self.final_checkpoint_id is None:
            self.final_checkpoint_id = checkpoint_id  # its completion lets the task end
        if checkpoint_id == self.suspend_at:
            self.suspended = True

    def suspend_announced(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` is a stop's savepoint (told before its barrier
        can come; a task that took it already suspends now)."""
        self.suspend_at = checkpoint_id
        self.suspended = self.last_snapshot_id >= checkpoint_id

    def barrier_seen(self, checkpoint_id: int) -> None:
        """A barrier came: one of a checkpoint newer than the stop's savepoint this
        task holds means that savepoint cannot complete any more (this task declines
        it), whether or not its abort was heard yet: the task goes on."""
        if self.suspended and self.suspend_at is not None and checkpoint_id > self.suspend_at:
            self.suspend_at, self.suspended = None, False

    def checkpoint_completed(self, checkpoint_id: int) -> None:
        if self.final_checkpoint_id is not None and checkpoint_id >= self.final_checkpoint_id:
            self.final_done = True
        if self.suspended and self.suspend_at is not None and checkpoint_id >= self.suspend_at:
            self.exit_requested = True  # the stop's savepoint: this task ends

    def checkpoint_aborted(self, checkpoint_id: int) -> None:
        if checkpoint_id == self.suspend_at:  # the stop failed: go on as before
            self.suspend_at, self.suspended = None, False

    def terminate(self) -> None:
        self.exit_requested = True
