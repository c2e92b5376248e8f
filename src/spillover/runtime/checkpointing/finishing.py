"""How a task ends (FLIP-147): once its input ended (or its source ran out, or
stop-with-savepoint stopped it) it finishes its chain, unless stopped without
drain, sends EndOfData and stays until a checkpoint it took after that completed,
so that two-phase-commit sinks commit its last data. The task loop calls these on
its own thread, through :class:`FinishingTask`."""

from __future__ import annotations

from typing import Protocol

from spillover.runtime.lifecycle import TaskLifecycle

# The id operators see when a job without checkpointing commits at its end.
FINAL_WITHOUT_CHECKPOINTS = 2**62


class FinishingTask(Protocol):
    """The task, as its ending acts on it."""

    life: TaskLifecycle
    checkpointing: bool  # whether the job takes checkpoints

    def end_of_time(self) -> None:
        """MAX_WATERMARK through the chain: every event-time timer fires."""
        ...

    def finish_chain(self) -> None: ...
    def commit_without_checkpoints(self) -> None: ...
    def flush_output(self) -> None:
        """Flushes the writers and hands everything on, staying responsive."""
        ...

    def send_end_of_data(self, drain: bool) -> None:
        """EndOfData downstream, then the coordinator's word that data ended here."""
        ...

    def take_deferred_trigger(self) -> bool:
        """Takes one root trigger that waited for the inputs to end; False if none."""
        ...

    def idle(self) -> None:
        """Waits a little for mail, giving back written buffers first."""
        ...


def end_of_data(task: FinishingTask, drain: bool = True) -> None:
    """All input ended (or the source is exhausted, or stopped): finish the chain
    (unless stopped without drain), tell downstream."""
    if drain:
        task.end_of_time()
    if task.life.end_data(drain):
        task.finish_chain()
    _after_finish(task, drain)


def _after_finish(task: FinishingTask, drain: bool) -> None:
    """Flushes and tells downstream that data ended. Without checkpointing there
    is no final checkpoint to commit two-phase-commit sinks, and no recovery a
    commit could break, so the operators commit here on their own. Stopped
    without drain, no operator finished: the task waits for the savepoint and
    ends, and downstream tasks do the same."""
    if not task.checkpointing:
        task.life.without_checkpoints()  # no checkpoint to wait for
    task.flush_output()
    if not task.checkpointing and not task.life.restored_finished and drain:
        task.commit_without_checkpoints()
    task.send_end_of_data(drain)


def await_final(task: FinishingTask) -> None:
    """Every input ended: stays until a checkpoint taken after ``finish()``
    completed (its commit is this task's last work), taking the triggers it is
    the root of meanwhile."""
    if not task.life.data_ended:  # ended early (terminated)
        return
    while True:
        while task.take_deferred_trigger():
            pass
        if task.life.may_end:
            return
        task.idle()
