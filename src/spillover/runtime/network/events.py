"""Events that travel between subtasks in their own buffers, and their wire format.

Every event is serialized to a few bytes: a version byte, a one-byte type tag,
then fixed little-endian fields (docs/network.md has the table). Readers refuse
unknown versions and tags with :class:`EventFormatError`.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any

from spillover.errors import FormatError
from spillover.runtime.network.buffers import NetworkBuffer
from spillover.storage import DataType

__all__ = [
    "EVENT_FORMAT_VERSION",
    "MAX_WATERMARK",
    "MIN_WATERMARK",
    "BarrierKind",
    "CancelCheckpointMarker",
    "CheckpointBarrier",
    "EndOfData",
    "EndOfPartition",
    "Event",
    "EventFormatError",
    "UnsupportedEventVersionError",
    "Watermark",
    "WatermarkStatus",
    "deserialize",
    "is_priority",
    "serialize",
    "to_buffer",
]

EVENT_FORMAT_VERSION = 1

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
MIN_WATERMARK = _INT64_MIN
"""No event time has passed yet: what every channel starts at."""
MAX_WATERMARK = _INT64_MAX
"""The end of event time: sent at the end of input (and on a drain); fires every timer."""


class EventFormatError(FormatError):
    """Bytes that should hold an event do not: unknown tag, wrong length, bad field."""


class UnsupportedEventVersionError(EventFormatError):
    """The event was written in a wire-format version this reader does not know."""


class BarrierKind(enum.IntEnum):
    """How a subtask aligns a checkpoint barrier on its inputs."""

    ALIGNED = 0
    UNALIGNED = 1  # overtakes in-flight buffers on the priority path
    ALIGNED_WITH_TIMEOUT = 2  # aligned, switches to unaligned after the alignment timeout


def _check_int64(name: str, value: int, minimum: int = _INT64_MIN) -> None:
    if not minimum <= value <= _INT64_MAX:
        raise ValueError(f"{name} must be an int64 >= {minimum}, not {value}")


@dataclass(frozen=True)
class CheckpointBarrier:
    """Marks the point in a stream where checkpoint ``checkpoint_id`` cuts it.

    ``alignment_timeout_ms`` is the aligned-checkpoint timeout of an
    ``ALIGNED_WITH_TIMEOUT`` barrier (0 means switch to unaligned at once) and 0
    for the other kinds.
    """

    checkpoint_id: int
    timestamp_ms: int
    kind: BarrierKind = BarrierKind.ALIGNED
    alignment_timeout_ms: int = 0

    def __post_init__(self) -> None:
        _check_int64("checkpoint_id", self.checkpoint_id, 0)
        _check_int64("timestamp_ms", self.timestamp_ms)
        object.__setattr__(self, "kind", BarrierKind(self.kind))
        _check_int64("alignment_timeout_ms", self.alignment_timeout_ms, 0)
        if self.alignment_timeout_ms and self.kind is not BarrierKind.ALIGNED_WITH_TIMEOUT:
            raise ValueError(f"a {self.kind.name} barrier has no alignment timeout")

    @property
    def is_unaligned(self) -> bool:
        return self.kind is BarrierKind.UNALIGNED

    def as_unaligned(self) -> CheckpointBarrier:
        """The same checkpoint's barrier, to be handled unaligned (its timeout expired)."""
        return CheckpointBarrier(self.checkpoint_id, self.timestamp_ms, BarrierKind.UNALIGNED)


@dataclass(frozen=True)
class CancelCheckpointMarker:
    """Tells downstream subtasks that checkpoint ``checkpoint_id`` was aborted."""

    checkpoint_id: int

    def __post_init__(self) -> None:
        _check_int64("checkpoint_id", self.checkpoint_id, 0)


@dataclass(frozen=True)
class EndOfData:
    """The producer emitted its last record; ``drain`` is False when it stopped
    without draining (stop-with-savepoint without ``--drain``)."""

    drain: bool = True


@dataclass(frozen=True)
class EndOfPartition:
    """The last buffer of a subpartition: nothing follows on this channel."""


@dataclass(frozen=True)
class Watermark:
    """Event time ``timestamp_ms`` has passed on this channel: no record with a
    timestamp at or below it should follow. Travels in line with the data."""

    timestamp_ms: int

    def __post_init__(self) -> None:
        _check_int64("timestamp_ms", self.timestamp_ms)


@dataclass(frozen=True)
class WatermarkStatus:
    """The producer goes idle (``idle``: it emits no records and no watermarks for a
    while, so it must not hold the watermark back) or active again."""

    idle: bool


@dataclass(frozen=True)
class LoopProbe:
    """Round ``round`` of a loop's termination protocol (``runtime/iteration``): the
    iteration head sends it in line behind its output once its regular input ended;
    loop tasks pass it on once it came on every loop channel; it returns to the head
    over the feedback edge behind every record derived from what preceded it."""

    round: int

    def __post_init__(self) -> None:
        _check_int64("round", self.round, 0)


Event = (
    CheckpointBarrier
    | CancelCheckpointMarker
    | EndOfData
    | EndOfPartition
    | Watermark
    | WatermarkStatus
    | LoopProbe
)

_TAG_BARRIER, _TAG_CANCEL, _TAG_END_OF_DATA, _TAG_END_OF_PARTITION = 1, 2, 3, 4
_TAG_WATERMARK, _TAG_WATERMARK_STATUS, _TAG_LOOP_PROBE = 5, 6, 7
_HEAD = struct.Struct("<BB")  # version, tag
_BARRIER = struct.Struct("<BBBqqq")  # + kind, checkpoint id, timestamp, alignment timeout
_CANCEL = struct.Struct("<BBq")  # + checkpoint id
_END_OF_DATA = struct.Struct("<BBB")  # + drain flag
_WATERMARK = struct.Struct("<BBq")  # + timestamp
_WATERMARK_STATUS = struct.Struct("<BBB")  # + idle flag
_LOOP_PROBE = struct.Struct("<BBq")  # + round
_END_OF_PARTITION_BYTES = _HEAD.pack(EVENT_FORMAT_VERSION, _TAG_END_OF_PARTITION)
_SIZES = {
    _TAG_BARRIER: _BARRIER.size,
    _TAG_CANCEL: _CANCEL.size,
    _TAG_END_OF_DATA: _END_OF_DATA.size,
    _TAG_END_OF_PARTITION: _HEAD.size,
    _TAG_WATERMARK: _WATERMARK.size,
    _TAG_WATERMARK_STATUS: _WATERMARK_STATUS.size,
    _TAG_LOOP_PROBE: _LOOP_PROBE.size,
}


def serialize(event: Event) -> bytes:
    """The event's wire bytes."""
    v = EVENT_FORMAT_VERSION
    if isinstance(event, CheckpointBarrier):
        return _BARRIER.pack(
            v,
            _TAG_BARRIER,
            event.kind,
            event.checkpoint_id,
            event.timestamp_ms,
            event.alignment_timeout_ms,
        )
    if isinstance(event, CancelCheckpointMarker):
        return _CANCEL.pack(v, _TAG_CANCEL, event.checkpoint_id)
    if isinstance(event, EndOfData):
        return _END_OF_DATA.pack(v, _TAG_END_OF_DATA, int(event.drain))
    if isinstance(event, EndOfPartition):
        return _END_OF_PARTITION_BYTES
    if isinstance(event, Watermark):
        return _WATERMARK.pack(v, _TAG_WATERMARK, event.timestamp_ms)
    if isinstance(event, WatermarkStatus):
        return _WATERMARK_STATUS.pack(v, _TAG_WATERMARK_STATUS, int(event.idle))
    if isinstance(event, LoopProbe):
        return _LOOP_PROBE.pack(v, _TAG_LOOP_PROBE, event.round)
    raise TypeError(f"not an event: {type(event).__name__}")


def deserialize(buffer: Any) -> Event:
    """The event in ``buffer`` (any contiguous buffer, e.g. a :class:`NetworkBuffer`).

    Raises :class:`EventFormatError` (or its subclass for an unknown version) when
    the bytes are not exactly one event.
    """
    size = memoryview(buffer).nbytes
    if size < _HEAD.size:
        raise EventFormatError("event too short", detail=f"{size} bytes")
    version, tag = _HEAD.unpack_from(buffer)
    if version != EVENT_FORMAT_VERSION:
        raise UnsupportedEventVersionError(
            f"event format version {version} is not supported",
            detail=f"this reader knows version {EVENT_FORMAT_VERSION}",
            hint="every subtask of a job must run the same spillover version",
        )
    expected = _SIZES.get(tag)
    if expected is None:
        raise EventFormatError(f"unknown event tag {tag}", detail=f"{size} bytes")
    if size != expected:
        raise EventFormatError(
            f"event with tag {tag} has {size} bytes", detail=f"expected {expected}"
        )
    try:
        if tag == _TAG_BARRIER:
            _, _, kind, cid, ts, timeout = _BARRIER.unpack_from(buffer)
            return CheckpointBarrier(cid, ts, BarrierKind(kind), timeout)
        if tag == _TAG_CANCEL:
            return CancelCheckpointMarker(_CANCEL.unpack_from(buffer)[2])
        if tag == _TAG_END_OF_DATA:
            return EndOfData(_flag("drain", _END_OF_DATA.unpack_from(buffer)[2]))
        if tag == _TAG_WATERMARK:
            return Watermark(_WATERMARK.unpack_from(buffer)[2])
        if tag == _TAG_WATERMARK_STATUS:
            return WatermarkStatus(_flag("idle", _WATERMARK_STATUS.unpack_from(buffer)[2]))
        if tag == _TAG_LOOP_PROBE:
            return LoopProbe(_LOOP_PROBE.unpack_from(buffer)[2])
    except ValueError as e:
        raise EventFormatError(f"event with tag {tag} has a bad field", detail=str(e)) from e
    return EndOfPartition()


def _flag(name: str, value: int) -> bool:
    """A one-byte yes/no field: 0 or 1, anything else is damage."""
    if value > 1:
        raise ValueError(f"{name} flag must be 0 or 1, not {value}")
    return bool(value)


def is_priority(event: Event) -> bool:
    """Whether ``event`` travels on the priority path (overtaking queued buffers)."""
    return isinstance(event, CheckpointBarrier) and event.kind is BarrierKind.UNALIGNED


def to_buffer(event: Event) -> NetworkBuffer:
    """A new unpooled event buffer holding ``serialize(event)`` (one reference)."""
    return NetworkBuffer.unpooled(serialize(event), DataType.EVENT)
