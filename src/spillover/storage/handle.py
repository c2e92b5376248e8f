"""State handles: the small, serialisable record a closed storer returns."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from spillover.errors import FormatError

HANDLE_SCHEMA = 1


class GateKind(enum.IntEnum):
    """Which side of a subtask a gate is: an input gate or an output (result partition)."""

    INPUT = 0
    OUTPUT = 1

    @classmethod
    def parse(cls, value: GateKind | str | int) -> GateKind:
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                raise ValueError(f"gate kind must be 'input' or 'output', not {value!r}") from None
        return cls(value)

    @property
    def prefix(self) -> str:
        return "in" if self is GateKind.INPUT else "out"


class DataType(enum.IntEnum):
    """What a stored buffer holds."""

    DATA = 0
    EVENT = 1


class Codec(enum.IntEnum):
    """How a frame's payload is encoded."""

    NONE = 0
    LZ4 = 1

    @classmethod
    def parse(cls, value: str | None) -> Codec:
        if value is None or value == "none":
            return cls.NONE
        if value == "lz4":
            return cls.LZ4
        raise ValueError(f"compression must be None or 'lz4', not {value!r}")

    @property
    def label(self) -> str | None:
        return None if self is Codec.NONE else "lz4"


def state_file_name(gate_id: int, kind: GateKind) -> str:
    """``in-00003.spill`` / ``out-00003.spill`` (docs/format.md)."""
    return f"{kind.prefix}-{gate_id:05d}.spill"


@dataclass(frozen=True)
class GateStateHandle:
    """Where one gate's in-flight state lives and what it holds.

    Cheap to keep in checkpoint metadata: ``to_dict()`` gives plain JSON types.
    ``channels`` maps channel id to ``(frames, raw bytes)``. ``channel_ranges`` (the
    channel index; empty in handles written before it existed) maps channel id to
    the byte range ``(start, end)`` from its first frame header to the end of its
    last frame, so a reader of some channels reads only the span that holds them.

    ``offset`` is None for a file of its own. A gate written into a file shared by
    several subtasks (docs/format.md, "Shared files") is a section of that file: a
    whole format-v1 gate file (header, frames, trailer) starting at byte ``offset``
    and ``size`` bytes long; ``channel_ranges`` and every other offset stay relative
    to the section's start.
    """

    uri: str
    gate_id: int
    gate_kind: GateKind
    checkpoint_id: int
    subtask_index: int
    file_id: str
    size: int
    frame_count: int
    raw_bytes: int
    stored_bytes: int
    codec: Codec = Codec.NONE
    format_version: int = 1
    channels: dict[int, tuple[int, int]] = field(default_factory=dict)
    channel_ranges: dict[int, tuple[int, int]] = field(default_factory=dict)
    offset: int | None = None

    @property
    def key(self) -> tuple[str, int]:
        """What tells two gates' bytes apart: the file and the section's start."""
        return (self.uri, self.offset or 0)

    def byte_range(self, channels: Iterable[int]) -> tuple[int, int] | None:
        """The byte range holding every frame of ``channels``; ``None`` when the handle
        has no complete channel index (read the whole file then)."""
        ranges = self.channel_ranges
        if set(ranges) != set(self.channels):
            return None
        spans = [ranges[c] for c in set(channels) if c in ranges]
        if not spans:
            return (64, 64)  # none of them has a frame: an empty range after the header
        return min(s for s, _ in spans), max(e for _, e in spans)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["schema"] = HANDLE_SCHEMA
        d["gate_kind"] = self.gate_kind.name.lower()
        d["codec"] = self.codec.label
        d["channels"] = {str(k): list(v) for k, v in sorted(self.channels.items())}
        d["channel_ranges"] = {str(k): list(v) for k, v in sorted(self.channel_ranges.items())}
        if not self.channel_ranges:
            del d["channel_ranges"]
        if self.offset is None:  # a file of its own: the handle reads as before
            del d["offset"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GateStateHandle:
        if not isinstance(d, dict):
            raise FormatError("malformed state handle", detail=f"a {type(d).__name__}, not a dict")
        if d.get("schema") != HANDLE_SCHEMA:
            raise FormatError(
                "unsupported state-handle schema",
                detail=f"found {d.get('schema')!r}, this version reads {HANDLE_SCHEMA}",
            )
        try:
            return cls(
                uri=str(d["uri"]),
                gate_id=int(d["gate_id"]),
                gate_kind=GateKind.parse(d["gate_kind"]),
                checkpoint_id=int(d["checkpoint_id"]),
                subtask_index=int(d["subtask_index"]),
                file_id=str(d["file_id"]),
                size=int(d["size"]),
                frame_count=int(d["frame_count"]),
                raw_bytes=int(d["raw_bytes"]),
                stored_bytes=int(d["stored_bytes"]),
                codec=Codec.parse(d["codec"]),
                format_version=int(d["format_version"]),
                channels={int(k): (int(v[0]), int(v[1])) for k, v in d["channels"].items()},
                channel_ranges={
                    int(k): (int(v[0]), int(v[1])) for k, v in d.get("channel_ranges", {}).items()
                },
                offset=_offset(d.get("offset")),
            )
        except (AttributeError, KeyError, IndexError, TypeError, ValueError, OverflowError) as e:
            raise FormatError("malformed state handle", detail=str(e)) from e


def _offset(value: Any) -> int | None:
    if value is None:
        return None
    offset = int(value)
    if offset < 0:
        raise ValueError(f"offset {offset} is negative")
    return offset
