"""The Spark control protocol's messages, and the job master's events.

Over a worker's control connection (``control.py``, one pickled message a frame):

- worker -> master: :class:`Hello` (once), :class:`Wired`, then :class:`Acknowledge`,
  :class:`Decline`, :class:`EndOfData`, :class:`TaskExited` and :class:`LoopQuiet`
  (its subtasks' word to the coordinator),
  :class:`Fired` (an induced failure fired), :class:`Metrics`, :class:`Done` (a
  subtask ended), :class:`Synced`, and :class:`Finished` last, or :class:`Reset`
  (its subtasks of the generation cancelled, it waits for the next);
- master -> worker: :class:`Table` (the workers' data addresses), :class:`Go`, then
  :class:`Post` and :class:`SwitchToUnaligned` (the coordinator's word to a subtask),
  :class:`Sync` and :class:`CancelAll`; to restart in place, :class:`ResetTo` (cancel
  this generation's subtasks, keep the connections) and :class:`Rebuild` (the next
  generation's restore), then :class:`Go` again.

A generation's messages carry its number where one could outlive it (a
:class:`Post` queued before a reset, a :class:`Reset` or :class:`Wired` of the
previous generation): the receiving side drops those of another generation.

Anything else on a connection is a protocol error: the side that reads it closes
the connection, which the other side takes as the peer gone. docs/spark.md has the
sequence. The master's own event queue carries :data:`MasterEvent` values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from spillover.runtime.checkpointing.messages import Ack, MailboxMessage

Address = tuple[str, int]
ErrorInfo = tuple[str, str, str, bool]
"""``(type name, message, traceback, broken channel)`` of a subtask's error."""


# -- worker -> master ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    generation: int
    index: int
    address: Address  # where its TCP receiver listens
    pid: int
    host: str


@dataclass(frozen=True, slots=True)
class Wired:
    index: int
    generation: int = 0


@dataclass(frozen=True, slots=True)
class Acknowledge:
    ack: Ack


@dataclass(frozen=True, slots=True)
class Decline:
    checkpoint_id: int
    vertex_uid: str
    subtask: int
    reason: str


@dataclass(frozen=True, slots=True)
class EndOfData:
    vertex_uid: str
    subtask: int


@dataclass(frozen=True, slots=True)
class TaskExited:
    vertex_uid: str
    subtask: int


@dataclass(frozen=True, slots=True)
class LoopQuiet:
    vertex_uid: str
    subtask: int
    round: int


@dataclass(frozen=True, slots=True)
class Fired:
    index: int  # of the failure in the script
    attempt: int


@dataclass(frozen=True, slots=True)
class Metrics:
    metrics: dict[str, dict[str, float]]  # per "uid#i"


@dataclass(frozen=True, slots=True)
class Done:
    uid: str
    subtask: int
    error: ErrorInfo | None  # None: finished or cancelled
    metrics: dict[str, float]


@dataclass(frozen=True, slots=True)
class Synced:
    token: str


@dataclass(frozen=True, slots=True)
class Finished:
    index: int


@dataclass(frozen=True, slots=True)
class Reset:
    """Every subtask of ``generation`` on worker ``index`` ended and nothing of theirs
    will follow on the connection: the worker waits for a :class:`Rebuild`."""

    index: int
    generation: int


ToMaster = (
    Hello
    | Wired
    | Acknowledge
    | Decline
    | EndOfData
    | TaskExited
    | LoopQuiet
    | Fired
    | Metrics
    | Done
    | Synced
    | Finished
    | Reset
)

# -- master -> worker ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Table:
    addresses: dict[int, Address]


@dataclass(frozen=True, slots=True)
class Go:
    pass


@dataclass(frozen=True, slots=True)
class Post:
    uid: str
    subtask: int  # one the worker hosts
    message: MailboxMessage
    generation: int = 0  # a Post of another generation is dropped


@dataclass(frozen=True, slots=True)
class SwitchToUnaligned:
    uid: str
    subtask: int
    checkpoint_id: int
    generation: int = 0


@dataclass(frozen=True, slots=True)
class Sync:
    token: str


@dataclass(frozen=True, slots=True)
class CancelAll:
    pass


@dataclass(frozen=True, slots=True)
class ResetTo:
    """Cancel the subtasks of ``generation`` (a restart in place): keep the control
    connection and the TCP receiver, answer :class:`Reset` once they all ended."""

    generation: int


@dataclass(frozen=True, slots=True)
class Rebuild:
    """Build generation ``generation``'s subtasks, at the same placement, from
    ``payload``: ``(restore, failures)`` pickled with cloudpickle (a failure script
    may be a class the worker cannot import). Answered with :class:`Wired`."""

    generation: int
    payload: bytes


ToWorker = Table | Go | Post | SwitchToUnaligned | Sync | CancelAll | ResetTo | Rebuild

# -- the master's events ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerJoined:
    """A worker said hello (``kind`` "hello"), wired its channels ("wired"), finished
    ("finished") or cancelled its subtasks for a restart in place ("reset")."""

    kind: Literal["hello", "wired", "finished", "reset"]
    index: int


@dataclass(frozen=True, slots=True)
class WorkerLost:
    index: int
    reason: str


@dataclass(frozen=True, slots=True)
class SubtaskDone:
    key: tuple[str, int]
    error: ErrorInfo | None


@dataclass(frozen=True, slots=True)
class StageEnded:
    error: BaseException | None


@dataclass(frozen=True, slots=True)
class CoordinatorFailed:
    error: BaseException


MasterEvent = WorkerJoined | WorkerLost | SubtaskDone | StageEnded | CoordinatorFailed
