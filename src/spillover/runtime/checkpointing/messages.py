"""Typed messages between a task and the checkpoint coordinator, and the Protocols
each side offers the other.

A task's mailbox takes :data:`MailboxMessage` values (the coordinator's triggers and
notifications, the executor's termination and cancellation); a task reports to
the coordinator through a :class:`CoordinatorGateway` (acknowledge, decline, end of
data, exit), and the coordinator reaches a task through a :class:`TaskGateway`. The local
coordinator and the tasks implement them in one process; on Spark a worker's relay
and the driver's remote-task proxies implement the same Protocols over the control
connection, which is why every message here pickles.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class TriggerCheckpoint:
    """A root of the checkpoint (a source, or a task whose inputs have all finished,
    FLIP-147): take checkpoint ``checkpoint_id`` now and send its barrier."""

    checkpoint_id: int
    trigger_ms: int
    kind: int = 0  # events.BarrierKind
    timeout_ms: int = 0  # the alignment timeout of an aligned-with-timeout barrier


@dataclass(frozen=True, slots=True)
class SwitchToUnaligned:
    """Checkpoint ``checkpoint_id``'s alignment timed out: persist in-flight data."""

    checkpoint_id: int


@dataclass(frozen=True, slots=True)
class NotifyComplete:
    """Checkpoint ``checkpoint_id`` completed: two-phase-commit operators commit."""

    checkpoint_id: int


@dataclass(frozen=True, slots=True)
class NotifyAborted:
    """Checkpoint ``checkpoint_id`` was aborted."""

    checkpoint_id: int


@dataclass(frozen=True, slots=True)
class StopSource:
    """Sources only: stop-with-savepoint. Emit nothing more and end the data now:
    with ``drain``, as if the source ran out (``finish()`` everywhere, the job
    finishes for good); without, no operator finishes (EndOfData(drain=False)), and
    the checkpoint that follows is a savepoint the job resumes from."""

    drain: bool = False


@dataclass(frozen=True, slots=True)
class Suspend:
    """Stop-with-savepoint, unaligned: checkpoint ``checkpoint_id`` is the savepoint.
    Once the task took it, it processes no more input (what was in flight is in the
    savepoint) and ends when it completes; aborted, the task goes on with what it
    held back."""

    checkpoint_id: int


@dataclass(frozen=True, slots=True)
class Terminate:
    """Sources only: stop emitting and finish (after the final checkpoint)."""


@dataclass(frozen=True, slots=True)
class LoopDone:
    """Iteration heads only: every head of the loop reported round ``round`` quiet,
    so no record is left in the loop; it ends (``runtime/iteration``)."""

    round: int


@dataclass(frozen=True, slots=True)
class Cancel:
    """Stop at once: the attempt is failing over or stopping."""


MailboxMessage = (
    TriggerCheckpoint
    | SwitchToUnaligned
    | NotifyComplete
    | NotifyAborted
    | StopSource
    | Suspend
    | Terminate
    | LoopDone
    | Cancel
)


@dataclass
class Ack:
    """A subtask's part of a checkpoint, sent to the coordinator."""

    checkpoint_id: int
    vertex_uid: str
    subtask: int
    operator_state: dict[str, Any]
    handles: dict[str, Any]
    keyed: dict[str, Any]
    metrics: dict[str, float]
    channel_state: dict[str, Any] = field(default_factory=dict)
    # Its operators finished (``finish()`` ran, or they were restored finished): the
    # checkpoint records the subtask as finished (FLIP-147).
    finished: bool = False


@dataclass(frozen=True, slots=True)
class Declined:
    """A subtask declined a checkpoint (its alignment was aborted, its snapshot or
    channel state failed)."""

    checkpoint_id: int
    vertex_uid: str
    subtask: int
    reason: str


@dataclass(frozen=True, slots=True)
class TaskEndedData:
    """A subtask processed all its input and emitted all its output (FLIP-147)."""

    vertex_uid: str
    subtask: int


@dataclass(frozen=True, slots=True)
class TaskExited:
    """A subtask ended cleanly after its final checkpoint: it takes no part in later
    checkpoints, and the tasks behind it may become roots (FLIP-147)."""

    vertex_uid: str
    subtask: int


@dataclass(frozen=True, slots=True)
class LoopQuiet:
    """An iteration head's termination round ``round`` brought no record back: no
    record came over its feedback edge between sending the round's probe and the
    probe's return on every feedback channel (docs/iterations.md)."""

    vertex_uid: str
    subtask: int
    round: int


@dataclass(frozen=True, slots=True)
class TriggerNow:
    """Trigger a checkpoint now (outside the interval)."""


@dataclass(frozen=True, slots=True)
class TriggerStop:
    """Stop-with-savepoint: the next checkpoint is the savepoint, of barrier ``kind``
    (``events.BarrierKind``); ``on_failed(reason)`` when the stop gives up (its
    attempts failed beyond the tolerated number): the job goes on as it was."""

    kind: int = 1
    on_failed: Callable[[str], None] | None = None


@dataclass(frozen=True, slots=True)
class StopCoordinator:
    """The attempt ends: stop triggering and abort what is pending."""


CoordinatorEvent = (
    Ack
    | Declined
    | TaskEndedData
    | TaskExited
    | LoopQuiet
    | TriggerNow
    | TriggerStop
    | StopCoordinator
)
"""What the coordinator's thread takes from its queue, in order."""


class CoordinatorGateway(Protocol):
    """What a task tells the checkpoint coordinator (from the task's threads)."""

    def acknowledge(self, ack: Ack) -> None: ...

    def decline(self, checkpoint_id: int, vertex_uid: str, subtask: int, reason: str) -> None: ...

    def end_of_data(self, vertex_uid: str, subtask: int) -> None: ...

    def task_exited(self, vertex_uid: str, subtask: int) -> None: ...

    def loop_quiet(self, vertex_uid: str, subtask: int, round: int) -> None: ...


class TaskGateway(Protocol):
    """What the coordinator (or the executor) may do to a task, from any thread."""

    def post(self, message: MailboxMessage) -> None: ...

    def request_unaligned(self, checkpoint_id: int) -> None: ...
