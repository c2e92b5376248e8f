"""State handles: the small, serialisable record a closed storer returns."""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from spillover.errors import FormatError
from spillover.storage.channel_index import INDEX_ENTRY, resolve

HANDLE_SCHEMA = 1


class GateKind(enum.IntEnum):
    """Which side of a subtask a gate is: an input gate or an output (result partition)."""

    INPUT = 0
    OUTPUT = 1

    @classmethod
    def parse(cls, value: GateKind | str | int) -> GateKind:
        if isinstance(value, str):
            kind = _KIND_NAMES.get(value)  # a dict, not Enum.__getitem__: once per gate read
            if kind is not None:
                return kind
            try:
                return cls[value.upper()]
            except KeyError:
                raise ValueError(f"gate kind must be 'input' or 'output', not {value!r}") from None
        return cls(value)

    @property
    def prefix(self) -> str:
        return "in" if self is GateKind.INPUT else "out"


_KIND_NAMES = {"input": GateKind.INPUT, "output": GateKind.OUTPUT}


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


@dataclass(frozen=True, slots=True)
class IndexRef:
    """Where a gate's channel maps live when the handle does not hold them: one
    channel index entry, ``length`` bytes at ``offset`` of the object ``uri``: the
    checkpoint's ``_channel_index`` (metadata version 2), or, since version 3, the
    gate's own state file (an index section after its gate's section) or its
    subtask's index object (docs/format.md, "Channel index";
    ``spillover.storage.channel_index`` reads them)."""

    uri: str
    offset: int
    length: int


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

    ``index`` is set, and ``channels`` and ``channel_ranges`` are empty, for a handle
    read from checkpoint metadata of version 2 or 3, which keeps the per-channel maps
    in channel index entries instead (``channel_index.resolve`` fills them in), and
    for a handle in a task's acknowledgement: the task wrote its gate's entry beside
    the state itself (version 3), so neither the acknowledgement nor the driver
    carries the maps. A closed gate's handle has both its maps and ``index``.
    ``entry`` is set, and the maps are empty, for a handle of the version 2
    acknowledgement form, which carried the encoded entry itself; it is still read
    (``channel_index.resolve`` decodes it; a metadata write puts it into a
    ``_channel_index``).
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
    index: IndexRef | None = None
    entry: bytes | None = field(default=None, repr=False)

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

    def to_dict(
        self, index_uri: str | None = None, place: Callable[[bytes], int] | None = None
    ) -> dict[str, Any]:
        """Plain JSON types. A handle whose maps are in a channel index names its entry:
        ``[offset, length]`` when the index is ``index_uri`` (the checkpoint's own, in
        its metadata: version 2), ``{"offset", "length"}`` when it is the gate's own
        file (version 3: an index section), else ``{"uri", "offset", "length"}``. A
        handle that carries its
        encoded entry (``entry``) names it at the offset ``place`` gives it in index
        ``index_uri`` (the metadata's write concatenates them); without ``place`` its
        maps are decoded and written inline."""
        if self.entry is not None and (place is None or index_uri is None):
            return resolve(self).to_dict(index_uri)
        d: dict[str, Any] = {
            "uri": self.uri,
            "gate_id": self.gate_id,
            "gate_kind": self.gate_kind.name.lower(),
            "checkpoint_id": self.checkpoint_id,
            "subtask_index": self.subtask_index,
            "file_id": self.file_id,
            "size": self.size,
            "frame_count": self.frame_count,
            "raw_bytes": self.raw_bytes,
            "stored_bytes": self.stored_bytes,
            "codec": self.codec.label,
            "format_version": self.format_version,
        }
        ref = self.index
        if self.entry is not None:
            assert place is not None and index_uri is not None
            ref = IndexRef(index_uri, place(self.entry), len(self.entry))
        if ref is None:
            d["channels"] = {str(k): list(v) for k, v in sorted(self.channels.items())}
        if self.channel_ranges:
            d["channel_ranges"] = {str(k): list(v) for k, v in sorted(self.channel_ranges.items())}
        if self.offset is not None:  # a section of a shared file; else reads as before
            d["offset"] = self.offset
        if ref is not None:
            if ref.uri == index_uri:
                d["index"] = [ref.offset, ref.length]
            elif ref.uri == self.uri:
                d["index"] = {"offset": ref.offset, "length": ref.length}
            else:
                d["index"] = {"uri": ref.uri, "offset": ref.offset, "length": ref.length}
        d["schema"] = HANDLE_SCHEMA
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], index_uri: str | None = None) -> GateStateHandle:
        """A handle as :meth:`to_dict` wrote it; ``index_uri`` is the checkpoint's
        channel index, which ``"index": [offset, length]`` names (``{"offset",
        "length"}`` names the gate's own file)."""
        if not isinstance(d, dict):
            raise FormatError("malformed state handle", detail=f"a {type(d).__name__}, not a dict")
        if d.get("schema") != HANDLE_SCHEMA:
            raise FormatError(
                "unsupported state-handle schema",
                detail=f"found {d.get('schema')!r}, this version reads {HANDLE_SCHEMA}",
            )
        entry = d.get(INDEX_ENTRY)
        if entry is not None:  # an acknowledgement's: its maps as one encoded entry, kept
            if not isinstance(entry, _BYTES):
                raise FormatError("malformed state handle", detail=f"{INDEX_ENTRY} is not bytes")
            entry = bytes(entry)
        inline = "index" not in d and entry is None  # else the maps are elsewhere
        try:
            fields = {
                "uri": str(d["uri"]),
                "gate_id": int(d["gate_id"]),
                "gate_kind": GateKind.parse(d["gate_kind"]),
                "checkpoint_id": int(d["checkpoint_id"]),
                "subtask_index": int(d["subtask_index"]),
                "file_id": str(d["file_id"]),
                "size": int(d["size"]),
                "frame_count": int(d["frame_count"]),
                "raw_bytes": int(d["raw_bytes"]),
                "stored_bytes": int(d["stored_bytes"]),
                "codec": Codec.parse(d["codec"]),
                "format_version": int(d["format_version"]),
                "channels": _maps(d["channels"]) if inline else {},
                "channel_ranges": _maps(d["channel_ranges"]) if "channel_ranges" in d else {},
                "offset": _offset(d.get("offset")),
                "index": _index(d.get("index"), index_uri, d["uri"]),
                "entry": entry,
            }
        except (AttributeError, KeyError, IndexError, TypeError, ValueError, OverflowError) as e:
            raise FormatError("malformed state handle", detail=str(e)) from e
        # What __init__ makes, every field given and checked above, without its
        # object.__setattr__ per field (a frozen dataclass's): at 1,000 subtasks those
        # alone cost the coordinator more than writing the handles (docs/scaling.md).
        handle = object.__new__(cls)
        handle.__dict__.update(fields)
        return handle


_BYTES = (bytes, bytearray, memoryview)


def _maps(value: Any) -> dict[int, tuple[int, int]]:
    return {int(k): (int(v[0]), int(v[1])) for k, v in value.items()}


def _offset(value: Any) -> int | None:
    if value is None:
        return None
    offset = int(value)
    if offset < 0:
        raise ValueError(f"offset {offset} is negative")
    return offset


def _index(value: Any, index_uri: str | None, own: Any) -> IndexRef | None:
    if value is None:
        return None
    if isinstance(value, dict):
        uri = str(value["uri"]) if "uri" in value else str(own)
        offset, length = int(value["offset"]), int(value["length"])
    elif index_uri is None:
        raise ValueError("the gate names a channel index entry, the metadata no channel index")
    else:
        uri, (offset, length) = index_uri, (int(value[0]), int(value[1]))
    if offset < 0 or length < 0:
        raise ValueError(f"channel index entry {offset}+{length} is negative")
    return IndexRef(uri, offset, length)
