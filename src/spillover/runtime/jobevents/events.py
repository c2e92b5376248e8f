"""The job event log's events and what replaying them gives (:class:`JobLogState`):
typed records a job master appends, encoded as ASCII JSON in the log's records."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from spillover.errors import (
    ConfigError,
    CorruptFrameError,
    UnsupportedVersionError,
)


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


@dataclass(frozen=True)
class Event:
    """One thing the job master records; subclasses name their ``KIND`` on disk."""

    KIND: ClassVar[str] = ""

    def payload(self) -> dict[str, Any]:
        """The event's fields as JSON values."""
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> Self:
        return cls(**payload)


@dataclass(frozen=True)
class JobSubmitted(Event):
    """A fresh run of the job: replay forgets what earlier runs recorded (savepoints
    aside). A master that resumes a run does not append this again.
    ``first_checkpoint_id``: the run's checkpoint ids start there (0: not recorded, a
    log of an earlier version), so a master resuming the run knows which of the
    job's checkpoints are the run's own to retain or delete, never an earlier run's."""

    KIND: ClassVar[str] = "job-submitted"
    job_name: str
    graph_fingerprint: str
    parallelism: int
    configuration: Mapping[str, Any] = field(default_factory=dict)
    run_id: str = ""
    first_checkpoint_id: int = 0

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> Self:
        return cls(**{**payload, "configuration": dict(payload["configuration"])})


@dataclass(frozen=True)
class GenerationStarted(Event):
    """An attempt of the job's subtasks began (``restore_path``: the checkpoint it
    restores, if any; ``first_checkpoint_id``: its checkpoints' ids start there, so a
    later master never reuses one)."""

    KIND: ClassVar[str] = "generation-started"
    generation: int
    parallelism: int
    cause: str
    restore_path: str | None = None
    first_checkpoint_id: int = 0


@dataclass(frozen=True)
class GenerationEnded(Event):
    KIND: ClassVar[str] = "generation-ended"
    generation: int
    cause: str


@dataclass(frozen=True)
class TaskFinished(Event):
    """A subtask finished; ``results`` describe what it produced (a batch job: the
    ``ResultHandle.to_dict()`` of each blocking result partition); ``parallelism``
    is its vertex's (0: not recorded), so a restart at another one does not reuse it."""

    KIND: ClassVar[str] = "task-finished"
    vertex_uid: str
    subtask: int
    generation: int = 0
    results: tuple[Mapping[str, Any], ...] = ()
    parallelism: int = 0

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> Self:
        return cls(**{**payload, "results": tuple(dict(r) for r in payload["results"])})


@dataclass(frozen=True)
class CheckpointCompleted(Event):
    KIND: ClassVar[str] = "checkpoint-completed"
    checkpoint_id: int
    metadata_path: str


@dataclass(frozen=True)
class SavepointCompleted(Event):
    KIND: ClassVar[str] = "savepoint-completed"
    savepoint_id: int
    path: str


@dataclass(frozen=True)
class RescaleDecided(Event):
    KIND: ClassVar[str] = "rescale-decided"
    from_parallelism: int
    to_parallelism: int
    cause: str = ""


@dataclass(frozen=True)
class SplitsAssigned(Event):
    """The splits a source's enumerator assigned, per subtask (the whole assignment)."""

    KIND: ClassVar[str] = "splits-assigned"
    source_uid: str
    assignment: Mapping[int, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> Self:
        assignment = {int(k): tuple(v) for k, v in payload["assignment"].items()}
        return cls(**{**payload, "assignment": assignment})


@dataclass(frozen=True)
class CommandReceived(Event):
    """An operator's command the job master accepted (``savepoint``, ``stop``,
    ``cancel``, ``rescale``), for people reading the log; replay keeps the latest
    :data:`COMMANDS_KEPT`."""

    KIND: ClassVar[str] = "command-received"
    command: str
    detail: str = ""


@dataclass(frozen=True)
class StopRequested(Event):
    """A stop-with-savepoint the master accepted. Until the run ends or the stop is
    given up (:class:`StopAbandoned`), a master that resumes the run carries it out."""

    KIND: ClassVar[str] = "stop-requested"
    drain: bool
    unaligned: bool
    savepoint_dir: str


@dataclass(frozen=True)
class StopAbandoned(Event):
    """The stop's savepoint attempts failed beyond the tolerated: the job went on."""

    KIND: ClassVar[str] = "stop-abandoned"
    reason: str = ""


@dataclass(frozen=True)
class JobTerminated(Event):
    """The job ended for good; ``STATUS`` says how."""

    STATUS: ClassVar[str] = ""
    cause: str = ""


@dataclass(frozen=True)
class JobFinished(JobTerminated):
    KIND: ClassVar[str] = "job-finished"
    STATUS: ClassVar[str] = "finished"


@dataclass(frozen=True)
class JobFailed(JobTerminated):
    KIND: ClassVar[str] = "job-failed"
    STATUS: ClassVar[str] = "failed"


@dataclass(frozen=True)
class JobCancelled(JobTerminated):
    KIND: ClassVar[str] = "job-cancelled"
    STATUS: ClassVar[str] = "cancelled"


EVENT_TYPES: dict[str, type[Event]] = {
    t.KIND: t
    for t in (
        JobSubmitted,
        GenerationStarted,
        GenerationEnded,
        TaskFinished,
        CheckpointCompleted,
        SavepointCompleted,
        RescaleDecided,
        SplitsAssigned,
        CommandReceived,
        StopRequested,
        StopAbandoned,
        JobFinished,
        JobFailed,
        JobCancelled,
    )
}


@dataclass(frozen=True)
class LogEntry:
    """An event as the log holds it: its index in the log, when it was appended
    (seconds since the epoch) and whether a snapshot restated it."""

    index: int
    at: float
    event: Event
    snapshot: bool = False


def encode_event(event: Event, at: float) -> bytes:
    kind = type(event).KIND
    if EVENT_TYPES.get(kind) is not type(event):
        raise ConfigError(
            "not a job event the log knows",
            detail=type(event).__name__,
            hint="append the event classes of spillover.runtime.jobevents",
        )
    try:
        text = json.dumps(
            {**event.payload(), "kind": kind, "at": at},
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=True,
            allow_nan=False,
        )
    except (TypeError, ValueError) as e:
        raise ConfigError(
            "a job event holds a value JSON cannot carry", detail=f"{kind}: {e}"
        ) from e
    return text.encode("ascii")


def decode_event(payload: bytes, where: str, offset: int) -> tuple[float, Event]:
    try:
        body = json.loads(payload)
        kind, at = body.pop("kind"), float(body.pop("at"))
        if not math.isfinite(at):
            raise ValueError(f"at is {at}")
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as e:
        raise CorruptFrameError(
            "a job event record does not decode", path=where, offset=offset, detail=str(e)
        ) from e
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        raise UnsupportedVersionError(
            "the job event log holds an event kind this version does not know",
            path=where,
            offset=offset,
            detail=repr(kind),
            hint="read the log with the spillover version that wrote it",
        )
    try:
        event = cls.from_payload(body)
        _check_types(event)
        return at, event
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as e:
        raise CorruptFrameError(
            "a job event record does not decode", path=where, offset=offset, detail=f"{kind}: {e}"
        ) from e


# What a scalar field's annotation allows in a decoded event (other fields are
# rebuilt by their ``from_payload``).
_SCALARS: dict[str, tuple[type, ...]] = {
    "bool": (bool,),
    "str": (str,),
    "int": (int,),
    "str | None": (str, type(None)),
}


def _check_types(event: Event) -> None:
    """Refuses (TypeError) a decoded event whose scalar fields have the wrong JSON
    type: replaying it would fail far from the record (an unhashable uid, say)."""
    for f in dataclasses.fields(event):
        allowed = _SCALARS.get(str(f.type))
        value = getattr(event, f.name)
        if allowed is None:
            continue
        if not isinstance(value, allowed) or (bool not in allowed and isinstance(value, bool)):
            raise TypeError(f"{f.name} is {type(value).__name__}, not {f.type}")


# ---------------------------------------------------------------------- summary

COMMANDS_KEPT = 100  # the operator commands a replay (and a snapshot) keeps


@dataclass(frozen=True)
class JobLogState:
    """What a log says about its job's current run, folded from its events.

    ``finished_tasks`` is keyed by ``(vertex_uid, subtask)``, ``splits`` by source
    uid (the newest assignment of each); ``checkpoint`` is the last completed one.
    """

    submitted: JobSubmitted | None = None
    generation: GenerationStarted | None = None
    generation_end: GenerationEnded | None = None
    checkpoint: CheckpointCompleted | None = None
    savepoints: tuple[SavepointCompleted, ...] = ()
    finished_tasks: Mapping[tuple[str, int], TaskFinished] = field(default_factory=dict)
    splits: Mapping[str, SplitsAssigned] = field(default_factory=dict)
    rescale: RescaleDecided | None = None
    stop: StopRequested | None = None  # a stop under way, not given up
    commands: tuple[CommandReceived, ...] = ()  # the latest, oldest first
    terminal: JobTerminated | None = None

    @property
    def status(self) -> str:
        """``empty`` (nothing submitted), ``running``, or how the job ended."""
        if self.terminal is not None:
            return self.terminal.STATUS
        return "empty" if self.submitted is None else "running"

    @classmethod
    def replay(cls, events: Iterable[Event]) -> JobLogState:
        s: dict[str, Any] = {}
        tasks: dict[tuple[str, int], TaskFinished] = {}
        splits: dict[str, SplitsAssigned] = {}
        savepoints: list[SavepointCompleted] = []
        commands: list[CommandReceived] = []
        for e in events:
            if isinstance(e, JobSubmitted):
                s = {"submitted": e}
                tasks, splits, commands = {}, {}, []
            elif isinstance(e, GenerationStarted):
                s["generation"], s["generation_end"] = e, None
            elif isinstance(e, GenerationEnded):
                s["generation_end"] = e
            elif isinstance(e, TaskFinished):
                tasks[(e.vertex_uid, e.subtask)] = e
            elif isinstance(e, CheckpointCompleted):
                s["checkpoint"] = e
            elif isinstance(e, SavepointCompleted):
                savepoints.append(e)
            elif isinstance(e, RescaleDecided):
                s["rescale"] = e
            elif isinstance(e, SplitsAssigned):
                splits[e.source_uid] = e
            elif isinstance(e, CommandReceived):
                commands = [*commands[1 - COMMANDS_KEPT :], e]
            elif isinstance(e, StopRequested):
                s["stop"] = e
            elif isinstance(e, StopAbandoned):
                s["stop"] = None
            elif isinstance(e, JobTerminated):
                s["terminal"], s["stop"] = e, None  # the run's end ends its stop
        return cls(
            **s,
            savepoints=tuple(savepoints),
            finished_tasks=tasks,
            splits=splits,
            commands=tuple(commands),
        )

    def to_events(self) -> list[Event]:
        """Events whose replay is this state: what a snapshot stores."""
        out: list[Event] = []
        out += [self.submitted] if self.submitted else []
        out += self.savepoints
        out += [e for e in (self.generation, self.generation_end, self.checkpoint) if e]
        out += [self.rescale] if self.rescale else []
        out += self.commands
        out += self.finished_tasks.values()
        out += self.splits.values()
        out += [self.terminal] if self.terminal else []
        out += [self.stop] if self.stop else []  # after the end it would clear
        return out
