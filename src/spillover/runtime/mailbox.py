"""A task's mailbox: what it is told between buffers (checkpoint triggers for
roots, the coordinator's completions and aborts, stops, termination), run on the
task thread, one message at a time."""

from __future__ import annotations

import time
from collections import deque
from typing import Protocol

from spillover import netio
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
)
from spillover.runtime.failures import FailureInjector
from spillover.runtime.graph import Vertex
from spillover.runtime.iteration.head import LoopHead
from spillover.runtime.lifecycle import TaskLifecycle
from spillover.runtime.taskcheckpoints import TaskCheckpoints
from spillover.runtime.taskinput import TaskCancelled, TaskInput
from spillover.storage.options import pure_selected


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
    request for a source, and root triggers that came before every input ended.

    A message is queued, then ``signal`` posted; the task waits on ``signal``. A
    source's output waker shares it (``signal``'s armed flag): a TCP channel's
    credit reader wakes a source waiting for credit natively, without a message
    and without the interpreter lock (``netio.read_credit``)."""

    def __init__(self, task: MailTask) -> None:
        self.task = task
        self.messages: deque[MailboxMessage] = deque()
        self.signal: netio.WakeCell = netio.PyWake() if pure_selected() else netio.Wake()
        self.stop_request: bool | None = None  # a StopSource's drain, until handled
        self.deferred: list[TriggerCheckpoint] = []

    def put(self, message: MailboxMessage) -> None:
        self.messages.append(message)
        self.signal.post()

    def pending(self) -> int:
        """Messages queued now."""
        return len(self.messages)

    def run(self, block: bool = False, timeout: float | None = None) -> float:
        """Runs the queued messages (``block``: if none is queued, waits up to
        ``timeout`` for a message or a wake of the output); returns the seconds spent
        waiting."""
        waited = 0.0
        messages = self.messages
        if block and not messages:
            t = time.monotonic()
            self.signal.wait(timeout)
            waited = time.monotonic() - t
        while messages:
            self._on(messages.popleft())
        return waited

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
                task.cp.completed(cid)  # the next one's channel state opened ahead
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
