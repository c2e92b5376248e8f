"""Pure-Python reader and writer of state-file format v1 (``docs/format.md``).

This is the readable twin of the native implementation: the tests use it as the
oracle and the benchmarks as the baseline. It favours clarity over speed and
shares no code with the native path.

Errors name the file (``path``) and the byte ``offset`` of the problem: the
field's offset for the state header, and the offset of the frame header for a
frame or the trailer (the detail then names the field).

It stays one module on purpose: a reader can check it against ``docs/format.md``
from top to bottom, as the oracle it is.
"""

from __future__ import annotations

import io
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import IO, Any, Protocol

import lz4.block

from spillover.errors import (
    BadMagicError,
    ClosedError,
    CorruptFrameError,
    CorruptHeaderError,
    StorageError,
    TruncatedFileError,
    UnsupportedVersionError,
)

__all__ = [
    "CODEC_LZ4",
    "CODEC_NONE",
    "DATA",
    "EVENT",
    "FORMAT_VERSION",
    "FRAME_HEADER_SIZE",
    "GATE_INPUT",
    "GATE_OUTPUT",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_FRAME_LENGTH",
    "TRAILER",
    "TRAILER_CHANNEL",
    "TRAILER_SIZE",
    "Frame",
    "ReferenceWriter",
    "StateHeader",
    "crc32c",
    "iter_frames",
    "read_state_file",
]

MAGIC = b"\x89SPL\r\n\x1a\n"
FORMAT_VERSION = 1
HEADER_SIZE = 64
FRAME_HEADER_SIZE = 24
TRAILER_BODY_SIZE = 40
TRAILER_SIZE = FRAME_HEADER_SIZE + TRAILER_BODY_SIZE
TRAILER_CHANNEL = 0xFFFFFFFF
MAX_FRAME_LENGTH = 2**31 - 1

# Frame data types.
DATA = 0
EVENT = 1
TRAILER = 255

# Codecs (state header and frames).
CODEC_NONE = 0
CODEC_LZ4 = 1

# Gate kinds.
GATE_INPUT = 0
GATE_OUTPUT = 1

# State header bytes 0-59; the CRC of those bytes follows as a u32.
_HEADER = struct.Struct("<8sHHIQIIBB6s16s4s")
# Frame header bytes 0-19; the CRC of those bytes follows as a u32.
_FRAME = struct.Struct("<IBBHIII")
_TRAILER_BODY = struct.Struct("<QQQ16s")
_U32 = struct.Struct("<I")

assert _HEADER.size == HEADER_SIZE - 4
assert _FRAME.size == FRAME_HEADER_SIZE - 4
assert _TRAILER_BODY.size == TRAILER_BODY_SIZE

_DATA_TYPES = (DATA, EVENT)
_CODECS = (CODEC_NONE, CODEC_LZ4)
_GATE_KINDS = (GATE_INPUT, GATE_OUTPUT)


# --------------------------------------------------------------------- CRC32C


def _make_crc32c_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return tuple(table)


_CRC32C_TABLE = _make_crc32c_table()


def _crc32c_pure(data: Any, value: int = 0) -> int:
    """CRC32C of ``data`` continuing from the CRC ``value``, one table lookup per byte."""
    table = _CRC32C_TABLE
    crc = value ^ 0xFFFFFFFF
    for byte in memoryview(data).cast("B"):
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _select_crc32c() -> Any:
    if os.environ.get("SPILLOVER_PURE_CRC") == "1":
        return _crc32c_pure
    try:
        from crc32c import crc32c as library_crc32c
    except ImportError:
        return _crc32c_pure
    return library_crc32c


_crc_impl = _select_crc32c()
CRC_IMPLEMENTATION = "pure" if _crc_impl is _crc32c_pure else "crc32c"


def crc32c(data: Any, value: int = 0) -> int:
    """CRC32C (Castagnoli) of a bytes-like ``data``, continuing from the CRC ``value``.

    Uses the ``crc32c`` package when importable and ``SPILLOVER_PURE_CRC`` is not
    ``1``; otherwise the pure-Python table implementation.
    """
    return int(_crc_impl(data, value))


# --------------------------------------------------------------- state header


def _check_range(name: str, value: int, bits: int) -> None:
    if not 0 <= value < 2**bits:
        raise ValueError(f"{name} must be in [0, 2**{bits}), got {value}")


@dataclass(frozen=True)
class StateHeader:
    """The 64-byte state header: which checkpoint, subtask and gate a file holds."""

    checkpoint_id: int
    subtask_index: int
    gate_id: int
    gate_kind: int
    codec: int
    file_id: bytes

    def __post_init__(self) -> None:
        _check_range("checkpoint_id", self.checkpoint_id, 64)
        _check_range("subtask_index", self.subtask_index, 32)
        _check_range("gate_id", self.gate_id, 32)
        if self.gate_kind not in _GATE_KINDS:
            raise ValueError(f"gate_kind must be 0 (input) or 1 (output), got {self.gate_kind}")
        if self.codec not in _CODECS:
            raise ValueError(f"codec must be 0 (none) or 1 (lz4), got {self.codec}")
        if not isinstance(self.file_id, bytes) or len(self.file_id) != 16:
            raise ValueError("file_id must be 16 bytes")

    def pack(self) -> bytes:
        """The header's 64 bytes."""
        body = _HEADER.pack(
            MAGIC,
            FORMAT_VERSION,
            HEADER_SIZE,
            0,
            self.checkpoint_id,
            self.subtask_index,
            self.gate_id,
            self.gate_kind,
            self.codec,
            bytes(6),
            self.file_id,
            bytes(4),
        )
        return body + _U32.pack(crc32c(body))

    @classmethod
    def unpack(cls, data: Any, *, path: str | None = None) -> StateHeader:
        """Parse and check the first 64 bytes of ``data`` in the order the spec gives.

        A ``data`` shorter than 64 bytes is ``TruncatedFileError`` once the
        magic and version it holds have been checked.
        """
        view = memoryview(data).cast("B")
        head = bytes(view[:HEADER_SIZE])
        seen = min(len(head), len(MAGIC))
        if head[:seen] != MAGIC[:seen]:
            raise BadMagicError(
                "not a spillover state file",
                path=path,
                offset=0,
                detail=f"starts with {head[:8].hex(' ')}, expected {MAGIC.hex(' ')}",
                hint="a text-mode transfer mangles the magic; copy state files as binary",
            )
        if len(head) >= 10:
            (version,) = struct.unpack_from("<H", head, 8)
            if version != FORMAT_VERSION:
                raise UnsupportedVersionError(
                    "unsupported state file format version",
                    path=path,
                    offset=8,
                    detail=f"the file has format version {version}; "
                    f"this reader reads version {FORMAT_VERSION}",
                    hint="read it with the spillover release that wrote it, or a newer one",
                )
        if len(head) < HEADER_SIZE:
            raise TruncatedFileError(
                "state file ends inside its state header",
                path=path,
                offset=len(head),
                detail=f"{len(head)} of {HEADER_SIZE} header bytes present",
            )

        (
            _magic,
            _version,
            header_length,
            flags,
            checkpoint_id,
            subtask_index,
            gate_id,
            gate_kind,
            codec,
            reserved_a,
            file_id,
            reserved_b,
        ) = _HEADER.unpack_from(head)
        (stored_crc,) = _U32.unpack_from(head, 60)

        def corrupt(offset: int, detail: str) -> CorruptHeaderError:
            return CorruptHeaderError(
                "corrupt state header", path=path, offset=offset, detail=detail
            )

        if header_length != HEADER_SIZE:
            raise corrupt(10, f"header_length is {header_length}, expected {HEADER_SIZE}")
        if flags != 0:
            raise corrupt(12, f"unknown flags {flags:#010x}")
        for start, reserved in ((34, reserved_a), (56, reserved_b)):
            if any(reserved):
                first = next(i for i, b in enumerate(reserved) if b)
                raise corrupt(start + first, "reserved bytes are not zero")
        if gate_kind not in _GATE_KINDS:
            raise corrupt(32, f"unknown gate_kind {gate_kind}")
        if codec not in _CODECS:
            raise corrupt(33, f"unknown codec {codec}")
        actual_crc = crc32c(head[:60])
        if actual_crc != stored_crc:
            raise corrupt(
                60, f"header_crc is {stored_crc:#010x}, bytes 0-59 give {actual_crc:#010x}"
            )
        return cls(checkpoint_id, subtask_index, gate_id, gate_kind, codec, file_id)


# --------------------------------------------------------------------- frames


@dataclass(frozen=True)
class Frame:
    """One buffer read back: ``data`` is the decoded payload, ``offset`` where its header starts."""

    channel_id: int
    data_type: int
    codec: int
    data: bytes
    offset: int


def _frame_header(
    channel_id: int, data_type: int, codec: int, stored: Any, raw_length: int
) -> bytes:
    """The 24 frame-header bytes for a payload ``stored`` (as written)."""
    body = _FRAME.pack(channel_id, data_type, codec, 0, len(stored), raw_length, crc32c(stored))
    return body + _U32.pack(crc32c(body))


def _trailer(frame_count: int, raw_bytes: int, stored_bytes: int, file_id: bytes) -> bytes:
    body = _TRAILER_BODY.pack(frame_count, raw_bytes, stored_bytes, file_id)
    return _frame_header(TRAILER_CHANNEL, TRAILER, CODEC_NONE, body, len(body)) + body


class ReferenceWriter:
    """Writes one state file to a binary file object; the caller owns and closes the file.

    The header is written at construction, one frame per :meth:`append`, and
    the trailer by :meth:`close`. Used as a context manager, an exception in
    the block leaves the file without a trailer, so readers refuse it.
    """

    def __init__(
        self,
        fileobj: IO[bytes],
        *,
        checkpoint_id: int = 0,
        subtask_index: int = 0,
        gate_id: int = 0,
        gate_kind: int = GATE_INPUT,
        codec: int = CODEC_NONE,
        file_id: bytes | None = None,
    ) -> None:
        self.header = StateHeader(
            checkpoint_id,
            subtask_index,
            gate_id,
            gate_kind,
            codec,
            os.urandom(16) if file_id is None else bytes(file_id),
        )
        self._file = fileobj
        self._size = 0
        self._frame_count = 0
        self._raw_bytes = 0
        self._stored_bytes = 0
        self._channels: dict[int, list[int]] = {}
        self._summary: dict[str, Any] | None = None
        self._closed = False
        self._write(self.header.pack())

    @property
    def closed(self) -> bool:
        return self._closed

    def _write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self._size += len(view)
        while view:
            written = self._file.write(view)
            # Raw (unbuffered) files may write less than asked.
            if written is None or written >= len(view):
                break
            view = view[written:]

    def append(self, channel_id: int, buffer: Any, data_type: int = DATA) -> None:
        """Write ``buffer`` (any contiguous bytes-like object) as one frame of ``channel_id``."""
        if self._closed:
            raise ClosedError("append() on a closed state file writer")
        _check_range("channel_id", channel_id, 32)
        if data_type not in _DATA_TYPES:
            raise ValueError(f"data_type must be 0 (data) or 1 (event), got {data_type}")
        view = memoryview(buffer)
        if not view.c_contiguous:
            raise ValueError("buffer must be C-contiguous")
        raw = view.cast("B")
        if len(raw) > MAX_FRAME_LENGTH:
            raise ValueError(f"buffer of {len(raw)} bytes exceeds the frame limit 2**31-1")

        codec, stored = CODEC_NONE, raw
        if self.header.codec == CODEC_LZ4:
            compressed = lz4.block.compress(raw, store_size=False)
            if len(compressed) < len(raw):
                codec, stored = CODEC_LZ4, memoryview(compressed)
        try:
            self._write(_frame_header(channel_id, data_type, codec, stored, len(raw)))
            self._write(stored)
        except BaseException:
            # The file may now end inside a frame: never seal it with a trailer.
            self.abandon()
            raise

        self._frame_count += 1
        self._raw_bytes += len(raw)
        self._stored_bytes += len(stored)
        per_channel = self._channels.setdefault(channel_id, [0, 0])
        per_channel[0] += 1
        per_channel[1] += len(raw)

    def close(self) -> dict[str, Any]:
        """Write the trailer and return a summary; later calls return the same summary.

        The summary holds ``frame_count``, ``raw_bytes``, ``stored_bytes``,
        ``file_id`` (hex), ``size`` (bytes in the file) and ``channels``
        (``{channel_id: [frames, raw_bytes]}``).
        """
        if self._summary is not None:
            return self._summary
        if self._closed:
            raise ClosedError("close() on a state file writer that was abandoned")
        self._write(
            _trailer(self._frame_count, self._raw_bytes, self._stored_bytes, self.header.file_id)
        )
        self._closed = True
        self._summary = {
            "frame_count": self._frame_count,
            "raw_bytes": self._raw_bytes,
            "stored_bytes": self._stored_bytes,
            "file_id": self.header.file_id.hex(),
            "size": self._size,
            "channels": {ch: list(stats) for ch, stats in self._channels.items()},
        }
        return self._summary

    def abandon(self) -> None:
        """Stop without a trailer, so readers refuse the file as not cleanly closed."""
        self._closed = True

    def __enter__(self) -> ReferenceWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abandon()


# -------------------------------------------------------------------- reading


class _Source(Protocol):
    size: int

    def read_at(self, offset: int, length: int) -> bytes: ...


class _BytesSource:
    def __init__(self, data: Any) -> None:
        self._view = memoryview(data).cast("B")
        self.size = len(self._view)

    def read_at(self, offset: int, length: int) -> bytes:
        return bytes(self._view[offset : offset + length])


class _FileSource:
    def __init__(self, fileobj: IO[bytes], path: str | None) -> None:
        self._file = fileobj
        self._path = path
        try:
            self.size = fileobj.seek(0, io.SEEK_END)
        except OSError as exc:
            raise StorageError(
                "cannot seek in state file", path=path, errno=exc.errno, detail=str(exc)
            ) from exc

    def read_at(self, offset: int, length: int) -> bytes:
        chunks = []
        try:
            self._file.seek(offset)
            while length > 0:
                chunk = self._file.read(length)
                if not chunk:
                    break
                chunks.append(chunk)
                length -= len(chunk)
        except OSError as exc:
            raise StorageError(
                "cannot read state file",
                path=self._path,
                offset=offset,
                errno=exc.errno,
                detail=str(exc),
            ) from exc
        return b"".join(chunks)


def _looks_like_trailer(tail: bytes, file_id: bytes) -> bool:
    """Whether the last 64 bytes are a trailer, perhaps damaged, rather than a cut file.

    A damaged trailer still repeats the header's file_id or has an intact frame
    header marking it as the trailer; bytes from inside a cut file do neither.
    """
    channel_id, data_type = struct.unpack_from("<IB", tail)
    (header_crc,) = _U32.unpack_from(tail, 20)
    intact = crc32c(tail[:20]) == header_crc
    marked = intact and channel_id == TRAILER_CHANNEL and data_type == TRAILER
    return tail[FRAME_HEADER_SIZE + 24 :] == file_id or marked


class _StateFileReader:
    """Checks the header and trailer at once, then yields frames on demand."""

    def __init__(self, source: _Source, path: str | None) -> None:
        self._source = source
        self._path = path
        size = source.size
        self.header = StateHeader.unpack(source.read_at(0, HEADER_SIZE), path=path)
        if size < HEADER_SIZE + TRAILER_SIZE:
            raise TruncatedFileError(
                "state file too short to hold a trailer",
                path=path,
                offset=size,
                detail=f"{size} bytes, a closed file has at least {HEADER_SIZE + TRAILER_SIZE}",
                hint="the writer did not close the file cleanly",
            )
        self.trailer_offset = size - TRAILER_SIZE
        self._read_trailer(source.read_at(self.trailer_offset, TRAILER_SIZE))

    def _read_trailer(self, tail: bytes) -> None:
        path, offset = self._path, self.trailer_offset
        if not _looks_like_trailer(tail, self.header.file_id):
            raise TruncatedFileError(
                "state file does not end in a trailer",
                path=path,
                offset=self._source.size,
                detail="the file was cut, never closed cleanly, or has bytes appended",
            )

        def corrupt(detail: str) -> CorruptHeaderError:
            return CorruptHeaderError("corrupt trailer", path=path, offset=offset, detail=detail)

        channel_id, data_type, codec, flags, stored, raw, payload_crc = _FRAME.unpack_from(tail)
        (header_crc,) = _U32.unpack_from(tail, 20)
        if crc32c(tail[:20]) != header_crc:
            raise corrupt("frame header checksum mismatch")
        if (channel_id, data_type, codec, flags) != (TRAILER_CHANNEL, TRAILER, CODEC_NONE, 0):
            raise corrupt(
                f"channel_id={channel_id:#x} data_type={data_type} codec={codec} "
                f"flags={flags:#x}, expected 0xffffffff/255/0/0"
            )
        if stored != TRAILER_BODY_SIZE or raw != TRAILER_BODY_SIZE:
            raise corrupt(f"stored_length={stored} raw_length={raw}, expected 40")
        body = tail[FRAME_HEADER_SIZE:]
        if crc32c(body) != payload_crc:
            raise corrupt("body checksum mismatch")
        self.frame_count, self.raw_bytes, self.stored_bytes, file_id = _TRAILER_BODY.unpack(body)
        if file_id != self.header.file_id:
            raise corrupt(
                f"trailer file_id {file_id.hex()} differs from the header's "
                f"{self.header.file_id.hex()}"
            )

    def frames(self) -> Iterator[Frame]:
        path, end = self._path, self.trailer_offset
        offset = HEADER_SIZE
        count = raw_total = stored_total = 0
        while offset < end:
            frame, stored_length = self._read_frame(offset, end)
            yield frame
            count += 1
            raw_total += len(frame.data)
            stored_total += stored_length
            offset += FRAME_HEADER_SIZE + stored_length
        if (count, raw_total, stored_total) != (
            self.frame_count,
            self.raw_bytes,
            self.stored_bytes,
        ):
            raise CorruptHeaderError(
                "trailer does not match the frames",
                path=path,
                offset=end,
                detail=f"trailer says {self.frame_count} frames, {self.raw_bytes} raw and "
                f"{self.stored_bytes} stored bytes; the file holds {count}, {raw_total} "
                f"and {stored_total}",
            )

    def _read_frame(self, offset: int, end: int) -> tuple[Frame, int]:
        """The frame whose header starts at ``offset``, and its stored length."""
        path = self._path

        def corrupt(detail: str) -> CorruptHeaderError:
            return CorruptHeaderError(
                "corrupt frame header", path=path, offset=offset, detail=detail
            )

        if end - offset < FRAME_HEADER_SIZE:
            raise corrupt(
                f"frames do not tile the file: {end - offset} bytes left before the trailer"
            )
        head = self._source.read_at(offset, FRAME_HEADER_SIZE)
        channel_id, data_type, codec, flags, stored, raw, payload_crc = _FRAME.unpack_from(head)
        (header_crc,) = _U32.unpack_from(head, 20)
        # The header CRC covers the lengths: check it before trusting them.
        if crc32c(head[:20]) != header_crc:
            raise corrupt("frame header checksum mismatch")
        if data_type == TRAILER:
            raise corrupt("a trailer before the end of the file")
        if data_type not in _DATA_TYPES:
            raise corrupt(f"unknown data_type {data_type}")
        if codec not in _CODECS:
            raise corrupt(f"unknown codec {codec}")
        if flags != 0:
            raise corrupt(f"unknown flags {flags:#06x}")
        if stored > MAX_FRAME_LENGTH or raw > MAX_FRAME_LENGTH:
            raise corrupt(f"stored_length {stored} or raw_length {raw} above 2**31-1")
        if codec == CODEC_NONE and stored != raw:
            raise corrupt(f"codec none with stored_length {stored} != raw_length {raw}")
        if codec == CODEC_LZ4 and stored > raw:
            raise corrupt(f"lz4 frame with stored_length {stored} > raw_length {raw}")
        payload_offset = offset + FRAME_HEADER_SIZE
        if payload_offset + stored > end:
            raise corrupt(
                f"payload of {stored} bytes runs {payload_offset + stored - end} bytes "
                "into the trailer"
            )

        payload = self._source.read_at(payload_offset, stored)
        if crc32c(payload) != payload_crc:
            raise CorruptFrameError(
                "frame payload checksum mismatch",
                path=path,
                offset=offset,
                detail=f"channel {channel_id}, {stored} stored bytes",
            )
        data = payload if codec == CODEC_NONE else self._decode_lz4(payload, raw, offset)
        return Frame(channel_id, data_type, codec, data, offset), stored

    def _decode_lz4(self, payload: bytes, raw_length: int, offset: int) -> bytes:
        try:
            data: bytes = lz4.block.decompress(payload, uncompressed_size=raw_length)
        except lz4.block.LZ4BlockError as exc:
            raise CorruptFrameError(
                "lz4 payload does not decode", path=self._path, offset=offset, detail=str(exc)
            ) from exc
        if len(data) != raw_length:
            raise CorruptFrameError(
                "lz4 payload decodes to the wrong length",
                path=self._path,
                offset=offset,
                detail=f"{len(data)} bytes, raw_length says {raw_length}",
            )
        return data


def _default_path(fileobj: Any, path: str | None) -> str | None:
    if path is not None:
        return path
    name = getattr(fileobj, "name", None)
    return name if isinstance(name, str) else None


def iter_frames(fileobj: IO[bytes], *, path: str | None = None) -> Iterator[Frame]:
    """Stream the frames of a seekable binary file, one payload in memory at a time.

    The header and trailer are checked before this returns; the trailer's
    counts can only be compared once every frame was read, so that mismatch is
    raised after the last frame.
    """
    path = _default_path(fileobj, path)
    return _StateFileReader(_FileSource(fileobj, path), path).frames()


def read_state_file(source: Any, *, path: str | None = None) -> tuple[StateHeader, list[Frame]]:
    """Read a whole state file from bytes-like ``source`` or a seekable binary file object."""
    if hasattr(source, "read") and hasattr(source, "seek"):
        path = _default_path(source, path)
        reader = _StateFileReader(_FileSource(source, path), path)
    else:
        reader = _StateFileReader(_BytesSource(source), path)
    return reader.header, list(reader.frames())
