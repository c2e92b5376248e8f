"""The job event log's segment files, byte for byte (docs/format.md, "Job event log
(format v1)"): a checksummed header, checksummed records, an end marker that counts
them. :func:`encode_segment` writes one, :func:`parse_segment` reads one as far as it
is valid and says where and why it stops. Storage and the log's rules (which tails
are torn, which corruption is an error) are ``log.py``'s.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from spillover.errors import ForeignFileError, UnsupportedVersionError
from spillover.storage.location import Location
from spillover.storage.reference import crc32c

__all__ = [
    "KIND_EVENTS",
    "KIND_SNAPSHOT",
    "LOG_FORMAT_VERSION",
    "Segment",
    "SegmentHeader",
    "encode_segment",
    "parse_segment",
    "record_at",
    "valid_record_after",
]

# v2 added the kinds command-received, stop-requested and stop-abandoned; a v2
# reader reads v1 segments as they are (docs/format.md).
LOG_FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)

SEGMENT_MAGIC = b"\x89SPJ\r\n\x1a\n"
RECORD_MAGIC = b"\x8aEVR"
KIND_EVENTS, KIND_SNAPSHOT = 0, 1
RECORD_EVENT, RECORD_END = 1, 255

# magic, version, header_length, kind, flags, reserved, seq, first_index, log_id,
# reserved, header_crc (over bytes 0-59)
_HEADER = struct.Struct("<8sHHBBHQQ16s12s")
_HEADER_SIZE = _HEADER.size + 4
# magic, type, flags, reserved, index, length, payload_crc, header_crc (over 0-23)
_RECORD = struct.Struct("<4sBBHQII")
_RECORD_SIZE = _RECORD.size + 4
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class SegmentHeader:
    kind: int
    seq: int
    first_index: int
    log_id: bytes


@dataclass
class Segment:
    """One segment file as read: its valid records and, when it is not complete,
    where and why reading stopped and whether a valid record lies beyond."""

    seq: int
    location: Location
    data: bytes = field(repr=False)
    header: SegmentHeader | None = None
    records: list[tuple[int, int, bytes]] = field(default_factory=list)  # index, offset, payload
    complete: bool = False
    bad_offset: int = 0
    reason: str = ""
    valid_after: bool = False

    @property
    def snapshot(self) -> bool:
        return self.header is not None and self.header.kind == KIND_SNAPSHOT


def encode_segment(
    kind: int, seq: int, first_index: int, log_id: bytes, payloads: Sequence[bytes]
) -> bytes:
    head = _HEADER.pack(
        SEGMENT_MAGIC,
        LOG_FORMAT_VERSION,
        _HEADER_SIZE,
        kind,
        0,
        0,
        seq,
        first_index,
        log_id,
        bytes(12),
    )
    parts = [head, _U32.pack(crc32c(head))]
    for i, p in enumerate(payloads):
        parts.append(_record(RECORD_EVENT, first_index + i, p))
    parts.append(_record(RECORD_END, first_index + len(payloads), _U64.pack(len(payloads))))
    return b"".join(parts)


def _record(rtype: int, index: int, payload: bytes) -> bytes:
    head = _RECORD.pack(RECORD_MAGIC, rtype, 0, 0, index, len(payload), crc32c(payload))
    return head + _U32.pack(crc32c(head)) + payload


def record_at(data: bytes, off: int) -> tuple[int, int, bytes] | str:
    """``(type, index, payload)`` of the record at ``off``, or why there is none."""
    if len(data) - off < _RECORD_SIZE:
        return "torn record header"
    magic, rtype, flags, reserved, index, length, payload_crc = _RECORD.unpack_from(data, off)
    (header_crc,) = _U32.unpack_from(data, off + _RECORD.size)
    if magic != RECORD_MAGIC or crc32c(data[off : off + _RECORD.size]) != header_crc:
        return "corrupt record header"
    if rtype not in (RECORD_EVENT, RECORD_END) or flags or reserved:
        return "record header with unknown type or flags"
    start = off + _RECORD_SIZE
    if len(data) - start < length:
        return "torn record"
    payload = data[start : start + length]
    if crc32c(payload) != payload_crc:
        return "corrupt record payload"
    return rtype, index, payload


def valid_record_after(data: bytes, start: int) -> bool:
    """Whether a checksummed record starts anywhere at or after ``start``. Event
    payloads are ASCII, so the record magic (non-ASCII) never hides inside one."""
    i = data.find(RECORD_MAGIC, start)
    while i != -1:
        if not isinstance(record_at(data, i), str):
            return True
        i = data.find(RECORD_MAGIC, i + 1)
    return False


def parse_segment(seq: int, location: Location, data: bytes) -> Segment:
    seg = Segment(seq, location, data)

    def stop(offset: int, reason: str, *, intact: bool = False) -> Segment:
        """Reading ends at ``offset``; ``intact``: a record with right checksums starts
        there (only out of place), so valid data follows for sure."""
        seg.bad_offset, seg.reason = offset, reason
        seg.valid_after = intact or valid_record_after(data, offset + 1 if offset else 0)
        return seg

    if len(data) >= 10 and data[:8] == SEGMENT_MAGIC:
        (version,) = struct.unpack_from("<H", data, 8)
        if version not in READABLE_VERSIONS:
            raise UnsupportedVersionError(
                "the job event log was written in a newer format",
                path=location.uri,
                detail=f"segment format v{version}; this reader knows v{LOG_FORMAT_VERSION}",
                hint="read the log with the spillover version that wrote it",
            )
    if len(data) < _HEADER_SIZE:
        return stop(0, "shorter than a segment header")
    magic, _, hlen, kind, flags, reserved, hseq, first_index, log_id, pad = _HEADER.unpack_from(
        data
    )
    (header_crc,) = _U32.unpack_from(data, _HEADER.size)
    if magic != SEGMENT_MAGIC:
        return stop(0, "not a segment (bad magic)")
    if (
        crc32c(data[: _HEADER.size]) != header_crc
        or hlen != _HEADER_SIZE
        or kind not in (KIND_EVENTS, KIND_SNAPSHOT)
        or flags
        or reserved
        or any(pad)
    ):
        return stop(0, "corrupt segment header")
    if hseq != seq:
        raise ForeignFileError(
            "a job event log segment carries another segment's number",
            path=location.uri,
            detail=f"its header says segment {hseq}",
            hint="segments are never renamed or copied between logs",
        )
    seg.header = SegmentHeader(kind, hseq, first_index, log_id)
    off, index = _HEADER_SIZE, first_index
    while True:
        if off == len(data):
            return stop(off, "ends without its end marker")
        rec = record_at(data, off)
        if isinstance(rec, str):
            return stop(off, rec)
        rtype, rindex, payload = rec
        if rindex != index:
            return stop(off, f"record index {rindex} where {index} belongs", intact=True)
        if rtype == RECORD_END:
            if len(payload) != 8 or _U64.unpack(payload)[0] != len(seg.records):
                return stop(off, "end marker with a wrong record count", intact=True)
            end = off + _RECORD_SIZE + len(payload)
            if end != len(data):
                return stop(end, "bytes after the end marker", intact=valid_record_after(data, end))
            seg.complete = True
            return seg
        seg.records.append((rindex, off, payload))
        off += _RECORD_SIZE + len(payload)
        index += 1
