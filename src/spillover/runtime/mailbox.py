"""A task's mailbox: what it is told between buffers (checkpoint triggers for
roots, the coordinator's completions and aborts, stops, termination), run on the
task thread, one message at a time."""

from __future__ import annotations

import queue
import time
from typing import Protocol

from spillover.runtime.chain import OperatorChain
from spillover.runtime.checkpointing.messages import (
    Cancel,
    LoopDone,
    MailboxMessage,
    NotifyAborted,
    NotifyComplete,
    StopSource,
    Suspend,
    SwitchToUnaligned,
    Terminate,
    TriggerCheckpoint,
    Wake,
)
from spillover.runtime.failures import FailureInjector
from spillover.runtime.graph import Vertex
from spillover.runtime.iteration.head import LoopHead
from spillover.runtime.lifecycle import TaskLifecycle
from spillover.runtime.taskcheckpoints import TaskCheckpoints
from spillover.runtime.taskinput import TaskCancelled, TaskInput


class MailTask(Protocol):
    """The task, as its mail acts on it."""

    name: str
    vertex: Vertex
    subtask: int
    attempt: int
    failures: FailureInjector
    life: TaskLifecycle
    chain: OperatorChain
    cp: TaskCheckpoints
    head: LoopHead | None
    input: TaskInput | None


class TaskMailbox:
    """The messages for one task, and what they leave pending: a stop-with-savepoint
    request for a source, and root triggers that came before every input ended."""

    def __init__(self, task: MailTask) -> None:
        self.task = task
        self.queue: queue.SimpleQueue[MailboxMessage] = queue.SimpleQueue()
        self.stop_request: bool | None = None  # a StopSource's drain, until handled
        self.deferred: list[TriggerCheckpoint] = []

    def put(self, message: MailboxMessage) -> None:
        self.queue.put(message)

    def run(self, block: bool = False, timeout: float | None = None) -> float:
        """Runs the queued messages (``block``: waits up to ``timeout`` for the first);
        returns the seconds spent waiting for one."""
        waited = 0.0
        while True:
            try:
                if block:
                    t = time.monotonic()
                    message = self.queue.get(True, timeout)
                    waited = time.monotonic() - t
                else:
                    message = self.queue.get_nowait()
            except queue.Empty:
                return waited + (timeout or 0.0) if block else waited
            block = False
            self._on(message)

    def take_deferred_trigger(self) -> bool:
        """Takes one root trigger that waited for the inputs to end; False if none."""
        if not self.deferred:
            return False
        self.task.cp.trigger_root(self.deferred.pop(0))
        return True

    def _on(self, message: MailboxMessage) -> None:
        task = self.task
        match message:
            case Cancel():
                raise TaskCancelled(task.name)
            case TriggerCheckpoint():  # a root: a source, or inputs all ended
                if task.input is None or task.input.can_be_root():
                    task.cp.trigger_root(message)
                else:
                    # An upstream exited but its EndOfPartition is still on the way:
                    # the snapshot comes once every channel ended (no data can
                    # follow an exited upstream's EndOfData).
                    self.deferred.append(message)
            case SwitchToUnaligned(checkpoint_id=cid):
                if task.input is not None:
                    task.input.release_held()  # before the checkpoint it may start
                task.cp.barriers.on_timeout(cid)
            case NotifyComplete(checkpoint_id=cid):
                task.failures.check(
                    "commit", task.attempt, task.vertex.uid, task.subtask, checkpoint=cid
                )
                for op in task.chain.opened:
                    op.notify_checkpoint_complete(cid)
                task.life.checkpoint_completed(cid)
            case NotifyAborted(checkpoint_id=cid):
                task.life.checkpoint_aborted(cid)  # a stop's savepoint: go on
                task.cp.aborted(cid)
                for op in task.chain.opened:
                    op.notify_checkpoint_aborted(cid)
            case StopSource(drain=drain):
                self.stop_request = drain
            case Suspend(checkpoint_id=cid):
                task.life.suspend_announced(cid)
            case Terminate():
                task.life.terminate()
            case LoopDone():
                if task.head is not None:
                    task.head.loop_done()
            case Wake():
                pass
