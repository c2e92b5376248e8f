"""The pure-Python twin of the engine: format v1's reference writer and reader
(``reference.py``) behind the shapes of :class:`~spillover.storage.Storer` and
:class:`~spillover.storage.Retriever`.

``SPILLOVER_PURE=1`` in the environment makes ``open_storage`` / ``open_retriever``
(and ``Storage.create_storer`` / ``create_retriever``) use it, as msgpack does with
its fallback: the whole storage contract suite runs both ways, and it is the
readable oracle the native engine is held to. It writes the same bytes as the
native writer for the same input and file id, returns the same handles and raises
the same exceptions for the same conditions; it is slower, copies every buffer,
and reads without a read-ahead thread.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from spillover.errors import (
    ClosedError,
    ForeignFileError,
    SpilloverError,
    StorageError,
    TruncatedFileError,
)
from spillover.storage import reference as ref
from spillover.storage.backends import Backend, SectionFile, name_file_offset, open_section
from spillover.storage.frames import FrameArrays
from spillover.storage.handle import DataType, GateKind, GateStateHandle
from spillover.storage.options import StorageOptions
from spillover.storage.storer import GateFile

__all__ = ["PureBuffer", "PureRetriever", "PureStorer"]


class _Sink:
    """A binary file over a backend's fd or write callable, for ``ReferenceWriter``."""

    def __init__(self, fd: int, write: Any) -> None:
        self._fd, self._write = fd, write

    def write(self, data: Any) -> int:
        if self._fd >= 0:
            return os.write(self._fd, data)
        self._write(bytes(data))
        return len(data)


class PureStorer(GateFile):
    """:class:`~spillover.storage.Storer`'s twin: every ``append`` copies and writes
    the frame at once (so ``flush``, ``submit`` and ``reap`` have nothing to do)."""

    def __init__(
        self,
        backend: Backend,
        name: str,
        options: StorageOptions,
        checkpoint_id: int,
        subtask_index: int,
        gate_id: int,
        kind: GateKind,
        file_id: bytes,
    ) -> None:
        self._backend, self._name = backend, name
        self.gate_id, self.kind = gate_id, kind
        self.checkpoint_id, self.subtask_index = checkpoint_id, subtask_index
        self.uri = backend.uri_of(name)
        self._fsync = options.fsync
        self._codec = options.codec
        fd, write, self._close_file = backend.create(name)
        self._writer = ref.ReferenceWriter(
            _Sink(fd, write),  # type: ignore[arg-type]
            checkpoint_id=checkpoint_id,
            subtask_index=subtask_index,
            gate_id=gate_id,
            gate_kind=int(kind),
            codec=int(self._codec),
            file_id=file_id,
        )
        self._ranges: dict[int, list[int]] = {}
        self._handle: GateStateHandle | None = None
        self._error: StorageError | None = None
        self._done = False
        self.frames = 0
        self.raw_bytes = 0

    def _failed(self, e: OSError) -> StorageError:
        """The first I/O error, kept: every later call raises it again (as native)."""
        self._error = StorageError(
            "writing the state file failed",
            path=self.uri,
            offset=self._writer._size,
            detail=f"{type(e).__name__}: {e}",
            errno=e.errno,
        )
        self._error.__cause__ = e
        return self._error

    def append(self, channel_id: int, buffer: Any, data_type: int = DataType.DATA) -> None:
        if self._error is not None:
            raise self._error
        if self._done:
            raise ClosedError("storer is closed", path=self.uri)
        if not isinstance(channel_id, int) or not 0 <= channel_id < 2**32:
            raise ValueError(f"channel_id must be in [0, 2**32), not {channel_id!r}")
        if data_type not in (DataType.DATA, DataType.EVENT):
            raise ValueError(f"data_type must be 0 (data) or 1 (event), not {data_type!r}")
        view = memoryview(buffer)  # TypeError for what is not a buffer
        if not view.c_contiguous:
            raise BufferError("the buffer is not C-contiguous")
        start = self._writer._size
        try:
            self._writer.append(channel_id, view, int(data_type))
        except OSError as e:
            raise self._failed(e) from e
        span = self._ranges.setdefault(channel_id, [start, 0])
        span[1] = self._writer._size
        self.frames += 1
        self.raw_bytes += view.nbytes

    def flush(self) -> None:
        """Nothing waits: every append is written at once."""

    def submit(self) -> None:
        """Nothing waits: every append is written at once."""

    def reap(self) -> None:
        """No buffer is held: every append copies."""

    def close(self) -> GateStateHandle:
        if self._handle is not None:
            return self._handle
        if self._done:
            raise ClosedError("storer was discarded", path=self.uri)
        if self._error is not None:
            raise self._error
        self._done = True
        try:
            summary = self._writer.close()
        except OSError as e:
            self._close_file(False)
            raise self._failed(e) from e
        except BaseException:
            self._close_file(False)
            raise
        self._close_file(self._fsync)
        self._handle = GateStateHandle(
            uri=self.uri,
            gate_id=self.gate_id,
            gate_kind=self.kind,
            checkpoint_id=self.checkpoint_id,
            subtask_index=self.subtask_index,
            file_id=summary["file_id"],
            size=int(summary["size"]),
            frame_count=int(summary["frame_count"]),
            raw_bytes=int(summary["raw_bytes"]),
            stored_bytes=int(summary["stored_bytes"]),
            codec=self._codec,
            format_version=ref.FORMAT_VERSION,
            channels={int(c): (int(v[0]), int(v[1])) for c, v in summary["channels"].items()},
            channel_ranges={c: (s, e) for c, (s, e) in self._ranges.items()},
        )
        return self._handle

    def _abandon(self) -> None:
        self._writer.abandon()


class PureBuffer(bytes):
    """:class:`~spillover.storage.RetrievedBuffer`'s twin: one frame's payload (a bytes
    object, so that it exports the buffer protocol on every Python version)."""

    channel_id: int
    data_type: int
    codec: int
    offset: int
    stored_length: int
    more_available: bool

    @classmethod
    def of(cls, frame: ref.Frame, stored_length: int) -> PureBuffer:
        buf = cls(frame.data)
        buf.channel_id = frame.channel_id
        buf.data_type = frame.data_type
        buf.codec = frame.codec
        buf.offset = frame.offset
        buf.stored_length = stored_length
        buf.more_available = False
        return buf

    @property
    def is_event(self) -> bool:
        return self.data_type == DataType.EVENT

    def tobytes(self) -> bytes:
        return bytes(self)


class PureRetriever:
    """:class:`~spillover.storage.Retriever`'s twin: header and trailer checked when it
    opens, then one frame read (and checked) per call, on the caller's thread."""

    def __init__(
        self,
        backend: Backend,
        name: str,
        options: StorageOptions,
        expect: GateStateHandle | None = None,
        byte_range: tuple[int, int] | None = None,
        section: tuple[int, int] | None = None,
    ) -> None:
        self.uri = backend.uri_of(name)
        self._opts = options
        self._file, self.size = open_section(backend, name, section)
        try:
            hs, ts = ref.HEADER_SIZE, ref.TRAILER_SIZE
            if self.size < hs + ts:
                raise TruncatedFileError(
                    "state file is shorter than a header and a trailer",
                    path=self.uri,
                    offset=self.size,
                    detail=f"{self.size} bytes; an empty gate takes {hs + ts}",
                )
            self._reader = ref._StateFileReader(ref._FileSource(self._file, self.uri), self.uri)  # type: ignore[arg-type]
            h, r = self._reader.header, self._reader
            self.header: dict[str, Any] = {
                "format_version": ref.FORMAT_VERSION,
                "checkpoint_id": h.checkpoint_id,
                "subtask_index": h.subtask_index,
                "gate_id": h.gate_id,
                "gate_kind": h.gate_kind,
                "codec": h.codec,
                "file_id": h.file_id,
            }
            self.trailer: dict[str, Any] = {
                "frame_count": r.frame_count,
                "raw_bytes": r.raw_bytes,
                "stored_bytes": r.stored_bytes,
                "file_id": h.file_id,
            }
            if expect is not None and (
                h.file_id.hex() != expect.file_id or self.size != expect.size
            ):
                raise ForeignFileError(
                    "state file is not the one the handle names",
                    path=self.uri,
                    offset=0,
                    detail=f"handle: id {expect.file_id}, {expect.size} bytes; file: id "
                    f"{h.file_id.hex()}, {self.size} bytes",
                    hint="the file was replaced or belongs to another checkpoint",
                )
        except BaseException as e:
            name_file_offset(self._file, e)
            self._file.close()
            raise
        self._base = self._file.base if isinstance(self._file, SectionFile) else 0
        self.gate_id = int(h.gate_id)
        self.kind = GateKind(h.gate_kind)
        start, end = ref.HEADER_SIZE, self.size - ref.TRAILER_SIZE
        whole = byte_range is None or tuple(byte_range) == (start, end)
        if byte_range is not None:
            if not start <= byte_range[0] <= byte_range[1] <= end:
                self._file.close()
                raise ValueError(
                    f"byte_range {byte_range} is not inside the frames [{start}, {end})"
                )
            start, end = byte_range
        self._frames = self._read(whole, start, end)
        self._finished = False
        self._closed = False

    def _read(self, whole: bool, start: int, end: int) -> Iterator[PureBuffer]:
        try:
            if whole:  # the trailer's sums are checked after the last frame
                for frame in self._reader.frames():
                    yield PureBuffer.of(frame, self._stored_length(frame))
                return
            offset = start
            while offset < end:
                frame, stored = self._reader._read_frame(offset, end)
                yield PureBuffer.of(frame, stored)
                offset += ref.FRAME_HEADER_SIZE + stored
        except SpilloverError as e:
            name_file_offset(self._file, e)  # as the native reader names it
            raise

    def _stored_length(self, frame: ref.Frame) -> int:
        head = self._reader._source.read_at(frame.offset, ref.FRAME_HEADER_SIZE)
        return int.from_bytes(head[8:12], "little")  # the frame header's stored_length

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("retriever is closed", path=self.uri)

    def poll_next(self) -> PureBuffer | None:
        self._check_open()
        if self._finished:
            return None
        try:
            return next(self._frames)
        except StopIteration:
            self._finished = True
            return None
        except BaseException:
            self._finished = True
            raise

    def poll_frames(self) -> FrameArrays | None:
        """The next frames, up to ``read_block_bytes`` of payload, as arrays."""
        self._check_open()
        bufs: list[PureBuffer] = []
        size = 0
        while size < self._opts.read_block_bytes:
            buf = self.poll_next()
            if buf is None:
                break
            bufs.append(buf)
            size += len(buf)
        if not bufs:
            return None
        import numpy as np  # only this batch path needs it; importing the engine does not

        lengths = np.array([len(b) for b in bufs], dtype=np.int64)
        offsets = np.zeros(len(bufs), dtype=np.int64)
        np.cumsum(lengths[:-1], out=offsets[1:])
        data = np.frombuffer(b"".join(b.tobytes() for b in bufs), dtype=np.uint8)
        return FrameArrays(
            data,
            np.array([b.channel_id for b in bufs], dtype=np.uint32),
            offsets,
            lengths,
            np.array([b.data_type for b in bufs], dtype=np.uint8),
            np.array([b.offset for b in bufs], dtype=np.int64) + self._base,
        )

    def iter_frames(self) -> Iterator[FrameArrays]:
        while (arrays := self.poll_frames()) is not None:
            yield arrays

    def wait(self, timeout: float | None = None) -> bool:
        self._check_open()
        return True  # reading happens in poll_next: a buffer is always "ready"

    @property
    def finished(self) -> bool:
        return self._finished

    def __iter__(self) -> Iterator[PureBuffer]:
        self._check_open()
        while (buf := self.poll_next()) is not None:
            yield buf

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._file.close()

    def __enter__(self) -> PureRetriever:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
