"""The channel index: a gate's per-channel maps (frames and raw bytes per channel,
and each channel's byte range in the gate's file), encoded as one small binary
entry, so that checkpoint metadata can keep them beside the state instead of
listing every channel of every gate (docs/format.md, "Channel index").

Since metadata version 3 each task writes its gates' entries itself, beside their
state: an index section right after each gate's section of a shared state file
(or inside the one object an object-store group publishes), or, for gates in files
of their own, one small object per subtask (:data:`INDEX_OBJECT`). A gate's handle
names its entry by URI, offset and length (:class:`IndexRef`), so the
acknowledgement and the driver carry references only. Version 2 concatenated every
entry into one object per checkpoint, ``chk-<id>/_channel_index``, written by the
coordinator; it is still read. A reader decodes only the entries of the gates it
reads (:func:`resolve`). Every entry carries its own CRC32C, checked before anything in
it is trusted: a truncated or damaged entry is :class:`CorruptIndexError`, never a
traceback.
"""

from __future__ import annotations

import dataclasses
import itertools
import struct
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from spillover.errors import CorruptIndexError, UnsupportedVersionError
from spillover.storage.location import Location
from spillover.storage.reference import crc32c

if TYPE_CHECKING:
    from spillover.storage.handle import GateStateHandle

__all__ = [
    "ENTRY_CACHE_BYTES",
    "ENTRY_OVERHEAD",
    "INDEX_ENTRY",
    "INDEX_FILE",
    "INDEX_MAGIC",
    "INDEX_OBJECT",
    "INDEX_VERSION",
    "ReadEntries",
    "check_index",
    "decode_entry",
    "encode_entry",
    "resolve",
    "resolve_all",
]

INDEX_ENTRY = "index_entry"
"""The key of an encoded entry in a gate's handle dict between the task's
acknowledgement and the metadata's write (never written to the metadata)."""
INDEX_FILE = "_channel_index"
"""The channel index object of a checkpoint, beside its ``_metadata`` (version 2)."""
INDEX_OBJECT = "_index"
"""A subtask's index object in its ``channels`` directory: the entries of its gates
that have files of their own (version 3), one after another."""
INDEX_MAGIC = b"\x89SCI"
INDEX_VERSION = 1
FLAG_RANGES = 1
_HEAD = struct.Struct("<4sHHI5B3s")  # magic, version, flags, count, 5 widths, reserved
_CRC = struct.Struct("<I")
_CODES = {1: "B", 2: "H", 4: "I", 8: "Q"}
MIN_ENTRY = _HEAD.size + _CRC.size


def _column(values: Sequence[int]) -> tuple[int, bytes]:
    """The narrowest of 1, 2, 4 or 8 bytes that holds every value, and the column."""
    top = max(values, default=0)
    width = 1 if top < 1 << 8 else 2 if top < 1 << 16 else 4 if top < 1 << 32 else 8
    col = array(_CODES[width], values)
    if col.itemsize != width:  # a platform whose C types differ: pack by hand
        return width, b"".join(v.to_bytes(width, "little") for v in values)
    if sys.byteorder != "little":
        col.byteswap()
    return width, col.tobytes()


def encode_entry(handle: GateStateHandle) -> bytes:
    """The entry of ``handle``'s channel maps: header, columns, CRC32C."""
    chans = sorted(handle.channels)
    ranges = handle.channel_ranges
    with_ranges = bool(ranges) and set(ranges) == set(chans)
    columns = [
        chans,
        [handle.channels[c][0] for c in chans],
        [handle.channels[c][1] for c in chans],
    ]
    if with_ranges:
        columns += [[ranges[c][0] for c in chans], [ranges[c][1] for c in chans]]
    encoded = [_column(c) for c in columns]
    widths = [w for w, _ in encoded] + [0] * (5 - len(encoded))
    flags = FLAG_RANGES if with_ranges else 0
    head = _HEAD.pack(INDEX_MAGIC, INDEX_VERSION, flags, len(chans), *widths, bytes(3))
    body = head + b"".join(b for _, b in encoded)
    return body + _CRC.pack(crc32c(body))


def decode_entry(
    data: bytes | bytearray | memoryview, where: str = "<channel index>", offset: int = 0
) -> tuple[dict[int, tuple[int, int]], dict[int, tuple[int, int]]]:
    """``(channels, channel_ranges)`` of one entry (exactly its bytes);
    :class:`CorruptIndexError` naming ``where`` and ``offset`` when it is not one
    intact entry, :class:`UnsupportedVersionError` for an intact entry of a newer
    version."""
    view = memoryview(data).cast("B")
    n = len(view)

    def bad(detail: str) -> CorruptIndexError:
        return CorruptIndexError(
            "damaged channel index entry", path=where, offset=offset, detail=detail
        )

    if n < MIN_ENTRY:
        raise bad(f"{n} bytes, an entry has at least {MIN_ENTRY}")
    (crc,) = _CRC.unpack_from(view, n - _CRC.size)
    if crc32c(view[: n - _CRC.size]) != crc:
        raise bad("checksum mismatch (truncated or corrupted)")
    magic, version, flags, count, *widths, reserved = _HEAD.unpack_from(view)
    if magic != INDEX_MAGIC:
        raise bad(f"bad magic {bytes(magic)!r}")
    if version != INDEX_VERSION:
        raise UnsupportedVersionError(
            "unsupported channel index version",
            path=where,
            offset=offset,
            detail=f"found {version}, this version reads {INDEX_VERSION}",
        )
    if flags & ~FLAG_RANGES:
        raise bad(f"unknown flags {flags:#x}")
    if reserved != bytes(3):
        raise bad("reserved bytes are not zero")
    ncols = 5 if flags & FLAG_RANGES else 3
    if any(w not in _CODES for w in widths[:ncols]) or any(widths[ncols:]):
        raise bad(f"bad column widths {widths}")
    if _HEAD.size + count * sum(widths) + _CRC.size != n:
        raise bad(f"{count} channels of widths {widths} do not fill {n} bytes")
    pos = _HEAD.size
    cols: list[list[int]] = []
    for w in widths[:ncols]:
        raw = view[pos : pos + count * w]
        col = array(_CODES[w])
        if col.itemsize == w:
            col.frombytes(raw)
            if sys.byteorder != "little":
                col.byteswap()
            cols.append(col.tolist())
        else:
            cols.append([int.from_bytes(raw[i : i + w], "little") for i in range(0, len(raw), w)])
        pos += count * w
    chans = cols[0]
    if any(b <= a for a, b in itertools.pairwise(chans)):
        raise bad("channel ids are not strictly ascending")
    channels = dict(zip(chans, zip(cols[1], cols[2], strict=True), strict=True))
    ranges = dict(zip(chans, zip(cols[3], cols[4], strict=True), strict=True)) if ncols == 5 else {}
    if any(e < s for s, e in ranges.values()):
        raise bad("a channel's range ends before it starts")
    return channels, ranges


def _resolved(
    handle: GateStateHandle, data: bytes | memoryview, where: str, offset: int
) -> GateStateHandle:
    """``handle`` with the maps of entry ``data``, read at ``offset`` of ``where``."""
    channels, ranges = decode_entry(data, where, offset)
    if sum(f for f, _ in channels.values()) != handle.frame_count:
        raise CorruptIndexError(
            "channel index entry does not match its gate",
            path=where,
            offset=offset,
            detail=f"{sum(f for f, _ in channels.values())} frames listed, the gate "
            f"{handle.uri} holds {handle.frame_count}",
        )
    return dataclasses.replace(
        handle, channels=channels, channel_ranges=ranges, index=None, entry=None
    )


def check_index(handles: Iterable[GateStateHandle]) -> None:
    """Every channel index these handles name exists and holds their entries'
    bytes (a restore's check before any task starts: one size per index, no entry
    read); :class:`StateFileNotFoundError` or :class:`CorruptIndexError` else."""
    ends: dict[str, tuple[int, int]] = {}
    for h in handles:
        ref = h.index
        if ref is not None and ref.offset + ref.length > ends.get(ref.uri, (-1, 0))[0]:
            ends[ref.uri] = (ref.offset + ref.length, ref.offset)
    for uri, (end, offset) in ends.items():
        where = Location.parse(uri)
        f = where.open_input("channel index")
        try:
            size = f.size()
        except OSError as e:
            raise where.error("cannot read channel index", e) from e
        finally:
            f.close()
        if size < end:
            raise CorruptIndexError(
                "channel index entry beyond the end of the index",
                path=uri,
                offset=offset,
                detail=f"entries up to byte {end}, the index has {size}",
            )


_Key = tuple[str, int, int, str]

ENTRY_OVERHEAD = 200
"""Bytes counted per kept entry beside its data and URI (its key, dict node and
object headers), so that many small entries do not outgrow the bound."""


class ReadEntries:
    """The channel index entries one execution attempt's restore has read here, by
    ``(index URI, offset, length, the gate's file id)``, least recently used first, at
    most ``limit`` bytes (each entry counted as its bytes, its URI and
    :data:`ENTRY_OVERHEAD`): when several new subtasks of a process replay the same
    old gates (a rescale: each reads every old upstream's output gate), each entry is
    read from storage once, not once per subtask.

    One is made per attempt where its tasks are built and handed to their replays
    (and to the shared reads); it goes when the last of them has resolved its plan,
    so nothing outlives the attempt. The bytes are kept, not the decoded maps (20
    times smaller): every resolve still checks the entry's CRC and its frame count
    against the handle. Keys never go stale within an attempt: a checkpoint's files
    are written once, and every gate has a random file id. Thread-safe: the tasks
    of a process resolve on their own threads."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = ENTRY_CACHE_BYTES if limit is None else limit
        self._entries: OrderedDict[_Key, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def cost(key: _Key, data: bytes) -> int:
        """What an entry counts toward the bound."""
        return len(data) + len(key[0]) + ENTRY_OVERHEAD

    def get(self, key: _Key) -> bytes | None:
        """The entry's bytes if this attempt has read them here, else None."""
        with self._lock:
            data = self._entries.get(key)
            if data is not None:
                self._entries.move_to_end(key)
            return data

    def put(self, key: _Key, data: bytes) -> None:
        """Keeps an entry that decoded, dropping the least recently used beyond the bound."""
        cost = self.cost(key, data)
        if cost > self.limit:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            self._bytes += cost - (self.cost(key, old) if old is not None else 0)
            self._entries[key] = data
            while self._bytes > self.limit:
                k, dropped = self._entries.popitem(last=False)
                self._bytes -= self.cost(k, dropped)

    @property
    def kept_bytes(self) -> int:
        """What the kept entries count toward the bound."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)


ENTRY_CACHE_BYTES = 64 << 20
"""The default bound of an attempt's :class:`ReadEntries` (entries of a gate of 1,000
channels take about 15 KB: 64 MiB holds more than 4,000 of them)."""


def resolve(handle: GateStateHandle, entries: ReadEntries | None = None) -> GateStateHandle:
    """``handle`` with its channel maps read from the index, or decoded from the entry
    it carries (itself when it has them); ``entries`` as in :func:`resolve_all`."""
    return resolve_all([handle], entries)[0]


def resolve_all(
    handles: Iterable[GateStateHandle], entries: ReadEntries | None = None
) -> list[GateStateHandle]:
    """Every handle with its channel maps, only the entries these handles name read,
    each index object opened once for those not read yet; an acknowledgement's
    handle decodes the entry it carries. Each entry is read once per call, and once
    per restore attempt in this process when the attempt's ``entries`` is given."""
    cache = entries if entries is not None else ReadEntries()
    out = list(handles)
    by_uri: dict[str, list[int]] = {}
    for i, h in enumerate(out):
        ref = h.index
        if h.entry is not None:
            out[i] = _resolved(h, h.entry, h.uri, 0)
        elif ref is not None:
            data = cache.get((ref.uri, ref.offset, ref.length, h.file_id))
            if data is not None:
                out[i] = _resolved(h, data, ref.uri, ref.offset)
            else:
                by_uri.setdefault(ref.uri, []).append(i)
    for uri, positions in by_uri.items():
        where = Location.parse(uri)
        f = where.open_input("channel index")
        try:
            size = f.size()
            for i in positions:
                ref = out[i].index
                assert ref is not None
                key = (uri, ref.offset, ref.length, out[i].file_id)
                data = cache.get(key)  # an earlier handle here named the same entry
                if data is None:
                    if ref.offset + ref.length > size:
                        raise CorruptIndexError(
                            "channel index entry beyond the end of the index",
                            path=uri,
                            offset=ref.offset,
                            detail=f"{ref.length} bytes at {ref.offset}, the index has {size}",
                        )
                    data = bytes(f.read_at(ref.length, ref.offset))
                    out[i] = _resolved(out[i], data, uri, ref.offset)
                    cache.put(key, data)  # only an entry that decoded
                else:
                    out[i] = _resolved(out[i], data, uri, ref.offset)
        except OSError as e:
            raise where.error("cannot read channel index", e) from e
        finally:
            f.close()
    return out
