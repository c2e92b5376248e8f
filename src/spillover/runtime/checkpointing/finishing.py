"""How a task ends (FLIP-147): once its input ended (or its source ran out, or
stop-with-savepoint stopped it) it finishes its chain, unless stopped without
drain, sends EndOfData and stays until a checkpoint it took after that completed,
so that two-phase-commit sinks commit its last data. The task loop calls these on
its own thread; the state they read and write is the task's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from spillover.runtime.network import events as ev

if TYPE_CHECKING:
    from spillover.runtime.task import Task

# The id operators see when a job without checkpointing commits at its end.
FINAL_WITHOUT_CHECKPOINTS = 2**62


def end_of_data(task: Task, drain: bool = True) -> None:
    """All input ended (or the source is exhausted, or stopped): finish the chain
    (unless stopped without drain), tell downstream."""
    if drain:
        task.clock.end_of_time()
    if not task.life.end_data(drain):
        _after_finish(task, drain)
        return
    if task.vertex.is_source:
        task.ops[0].finish()
        rest = task.ops[1:]
    else:
        rest = task.ops
    for i, op in enumerate(rest):
        if i > 0 or task.vertex.is_source:
            op.end_input(0)
        op.finish()
    _after_finish(task)


def _after_finish(task: Task, drain: bool = True) -> None:
    """Flushes and tells downstream that data ended. Without checkpointing there
    is no final checkpoint to commit two-phase-commit sinks, and no recovery a
    commit could break, so the operators commit here on their own. Stopped
    without drain, no operator finished: the task waits for the savepoint and
    ends, and downstream tasks do the same."""
    if not task.checkpointing:
        task.life.without_checkpoints()  # no checkpoint to wait for
    for w in task.writers:
        w.flush()
    task.drain_responsive()
    if not task.checkpointing and not task.life.restored_finished and drain:
        snaps = [op.snapshot(FINAL_WITHOUT_CHECKPOINTS) for op in task.ops]
        for snap in snaps:
            if snap.finalize is not None:
                snap.finalize("")
        for op in task.ops:
            op.notify_checkpoint_complete(FINAL_WITHOUT_CHECKPOINTS)
    for p in task.partitions:
        p.broadcast_event(ev.EndOfData(drain))
    # The final checkpoint waits until every task processed all its input.
    task.coordinator.end_of_data(task.vertex.uid, task.subtask)


def end_of_inputs(task: Task) -> None:
    """EndOfData came on every input channel."""
    # One input stopped without draining: nothing finishes (Flink's rule).
    drain = not task.no_drain_channels
    if drain:
        task.clock.end_of_time()
    if task.life.end_data(drain):
        for i, op in enumerate(task.ops):
            if i > 0:
                op.end_input(0)
            op.finish()
    _after_finish(task, drain)


def await_final(task: Task) -> None:
    """Every input ended: stays until a checkpoint taken after ``finish()``
    completed (its commit is this task's last work), taking the triggers it is
    the root of meanwhile."""
    if not task.life.data_ended:  # ended early (terminated)
        return
    while True:
        while task.deferred_triggers:
            task.trigger_root(task.deferred_triggers.pop(0))
        if task.life.may_end:
            return
        task.unaligned.reap()
        task.mail(block=True, timeout=0.05)
