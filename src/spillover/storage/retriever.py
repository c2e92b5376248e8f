"""Retriever: stream a gate's persisted buffers back, in the order they were stored,
with bounded memory (FLIP-76's PersistentInFlightDataRetriever)."""

from __future__ import annotations

import io
import os
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from spillover._native import _storage as native
from spillover.errors import (
    ClosedError,
    ConfigError,
    CorruptHeaderError,
    ForeignFileError,
    TruncatedFileError,
)
from spillover.storage.backends import (
    Backend,
    SectionFile,
    backend_for,
    name_file_offset,
    open_section,
    readinto_exact,
)
from spillover.storage.frames import FrameArrays
from spillover.storage.handle import Codec, GateKind, GateStateHandle
from spillover.storage.location import Location
from spillover.storage.options import StorageOptions, pure_selected

__all__ = ["FrameArrays", "RetrievedBuffer", "Retriever", "check_ends", "open_retriever"]

RetrievedBuffer = native.RetrievedBuffer

_END = object()


def _looks_like_trailer(tail: bytes | bytearray, file_id: bytes) -> bool:
    """Whether the last 64 bytes are a trailer, perhaps damaged, rather than a cut file:
    a damaged trailer still repeats the file id or keeps its intact trailer marking."""
    if bytes(tail[-16:]) == file_id:
        return True
    intact = native.crc32c(memoryview(tail)[:20]) == int.from_bytes(tail[20:24], "little")
    return intact and tail[:5] == b"\xff\xff\xff\xff\xff"


class Retriever:
    """Streams the buffers of one state file back, in the order they were stored.

    A reader thread reads blocks ahead (at most ``read_ahead_bytes``) and checks every
    frame before it is handed out. ``poll_next()`` never blocks: it returns the next
    :class:`RetrievedBuffer`, or ``None`` when nothing is ready yet or the file is done
    (``finished`` tells which); ``wait()`` blocks until one is ready. Iterating blocks
    and yields every buffer.

    Returned buffers are read-only views into the read-ahead blocks, not copies. A
    block is reused only after every buffer pointing into it has been dropped, so a
    buffer stays valid as long as you hold it; holding many keeps their blocks alive.

    The header and trailer are checked when the retriever opens, so a file that was
    not closed cleanly is refused before any buffer is returned. Errors found later
    (a damaged frame) are raised by the call that reaches them.
    """

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
        # section: (offset, size) of one gate in a shared file; every offset below is
        # relative to it, and only the native reader needs the file's own.
        self._file, self.size = open_section(backend, name, section)
        try:
            self.header, self.trailer = read_ends(self._file, self.size, self.uri)
            if expect is not None:
                check_expected(expect, self.header, self.size, self.uri)
        except BaseException as e:
            name_file_offset(self._file, e)  # the native reader's offsets are the file's
            self._file.close()
            raise
        self.gate_id = int(self.header["gate_id"])
        self.kind = GateKind(self.header["gate_kind"])
        data_start, data_end = native.HEADER_SIZE, self.size - native.TRAILER_SIZE
        self._whole = byte_range is None or tuple(byte_range) == (data_start, data_end)
        if byte_range is not None:
            start, end = byte_range
            if not data_start <= start <= end <= data_end:
                self._file.close()
                raise ValueError(
                    f"byte_range {byte_range} is not inside the frames [{data_start}, {data_end})"
                )
            data_start, data_end = start, end
        self._data_range = (data_start, data_end)
        self._batch: Any = None
        self._finished = False
        self._closed = False
        max_queued = max(1, options.read_ahead_bytes // options.read_block_bytes - 1)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queued)
        self._stop = threading.Event()
        self._pool: list[Any] = []
        self._native: Any = None
        self._thread: threading.Thread | None = None
        decompress = self._decompressor()
        raw, base = self._file, 0
        if isinstance(raw, SectionFile):
            raw, base = raw.raw, raw.base
        fileno = getattr(raw, "fileno", None)
        if isinstance(raw, io.FileIO) and fileno is not None:
            # Local file: a native thread reads ahead, never needing the GIL.
            t = self.trailer
            self._native = native.NativeReader(
                fileno(),
                base + data_start,
                base + data_end,
                options.read_block_bytes,
                max_queued,
                t["frame_count"],
                t["raw_bytes"],
                t["stored_bytes"],
                options.verify_checksums,
                decompress,
                self.uri,
                self._whole,
            )
        else:
            self._thread = threading.Thread(
                target=self._read_loop, name=f"spillover-read {name}", daemon=True
            )
            self._thread.start()

    def _decompressor(self) -> Any:
        t = self.trailer
        if self.header["codec"] == Codec.LZ4 or t["stored_bytes"] != t["raw_bytes"]:
            import lz4.block

            return lz4.block.decompress
        return None

    # -- reader thread -------------------------------------------------------

    def _acquire_block(self, capacity: int) -> Any:
        for b in self._pool:
            if b.users == 0 and b.capacity >= capacity:
                return b
        block = native.Block(capacity)
        limit = self._queue.maxsize + 3
        if len(self._pool) >= limit:
            # Blocks still referenced by the consumer's buffers are forgotten here;
            # they are freed when those buffers go.
            self._pool = [b for b in self._pool if b.users == 0][: limit - 1]
        self._pool.append(block)
        return block

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _read_loop(self) -> None:
        try:
            self._read_frames()
        except BaseException as e:  # handed to the consumer, raised there
            self._put(e)
        finally:
            self._file.close()

    def _read_frames(self) -> None:
        opts = self._opts
        decompress = None
        if (
            self.header["codec"] == Codec.LZ4
            or self.trailer["stored_bytes"] != self.trailer["raw_bytes"]
        ):
            import lz4.block

            decompress = lz4.block.decompress
        pos, end = self._data_range
        self._file.seek(pos)
        carry: Any = None
        carry_start = carry_len = 0
        need = native.FRAME_HEADER_SIZE
        frames = raw = stored = 0
        while not self._stop.is_set():
            left = end - pos
            if left == 0:
                if carry_len:
                    raise CorruptHeaderError(
                        "a frame runs past the end of the data",
                        path=self.uri,
                        offset=pos - carry_len,
                        detail=f"{carry_len} bytes left before the trailer are no whole frame",
                    )
                break
            if need - carry_len > left:
                raise CorruptHeaderError(
                    "a frame runs past the end of the data",
                    path=self.uri,
                    offset=pos - carry_len,
                    detail=f"it needs {need} bytes, {carry_len + left} remain before the trailer",
                )
            block = self._acquire_block(max(opts.read_block_bytes, need))
            if carry_len:
                carry.move_tail(block, carry_start, carry_start + carry_len)
            want = min(block.capacity - carry_len, left)
            got = readinto_exact(self._file, memoryview(block)[carry_len : carry_len + want])
            if got != want:
                raise TruncatedFileError(
                    "state file shrank while reading", path=self.uri, offset=pos + got
                )
            pos += got
            length = carry_len + got
            batch, consumed, need, n, r, s = native.scan_block(
                block, length, pos - length, opts.verify_checksums, decompress, self.uri
            )
            frames, raw, stored = frames + n, raw + r, stored + s
            if n and not self._put(batch):
                return
            del batch
            carry, carry_start, carry_len = block, consumed, length - consumed
        t = self.trailer
        if self._whole and (frames, raw, stored) != (
            t["frame_count"],
            t["raw_bytes"],
            t["stored_bytes"],
        ):
            raise CorruptHeaderError(
                "trailer does not match the frames",
                path=self.uri,
                offset=self.size - native.TRAILER_SIZE,
                detail=f"trailer: {t['frame_count']} frames, {t['raw_bytes']} raw bytes, "
                f"{t['stored_bytes']} stored; read: {frames}, {raw}, {stored}",
            )
        self._put(_END)

    # -- consumer side -------------------------------------------------------

    def _next_batch(self, timeout: float) -> bool:
        """Takes the next batch (``timeout`` < 0 waits for ever, 0 polls); False when
        none was ready. Marks the end; raises what the reader found wrong."""
        if self._native is not None:
            try:
                item = self._native.next_batch(timeout)
            except BaseException:
                self._finished = True
                raise
            if item is None:
                return False
            if item is False:
                self._finished = True
                return True
            self._batch = item
            return True
        try:
            item = (
                self._queue.get_nowait()
                if timeout == 0
                else self._queue.get(timeout=None if timeout < 0 else timeout)
            )
        except queue.Empty:
            return False
        if item is _END:
            self._finished = True
        elif isinstance(item, BaseException):
            self._finished = True
            raise item
        else:
            self._batch = item
        return True

    def poll_next(self) -> RetrievedBuffer | None:
        """The next buffer if one is ready, else ``None`` (see ``finished``)."""
        if self._closed:
            raise ClosedError("retriever is closed", path=self.uri)
        while True:
            batch = self._batch
            if batch is not None:
                buf: RetrievedBuffer | None = batch.next()
                if buf is not None:
                    return buf
                self._batch = None
            if self._finished or not self._next_batch(0):
                return None

    def poll_frames(self) -> FrameArrays | None:
        """Every frame of the next read-ahead block not yet returned, at once, or ``None``
        when nothing is ready yet or the file is done (see ``finished``).

        The batch counterpart of ``poll_next``: one call per block (about
        ``read_block_bytes``), no Python object per buffer, checksums checked with the
        GIL released. Both calls may be mixed; each frame comes out once."""
        if self._closed:
            raise ClosedError("retriever is closed", path=self.uri)
        while True:
            batch = self._batch
            if batch is not None:
                self._batch = None
                if batch.remaining:
                    return FrameArrays(*batch.take_all())
            if self._finished or not self._next_batch(0):
                return None

    def iter_frames(self) -> Iterator[FrameArrays]:
        """Blocks of frames (``poll_frames``), waiting as needed, until the file is done."""
        while True:
            arrays = self.poll_frames()
            if arrays is not None:
                yield arrays
            elif self.finished:
                return
            else:
                self.wait()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until ``poll_next()`` has a buffer or the file is done; False on timeout."""
        if self._closed:
            raise ClosedError("retriever is closed", path=self.uri)
        if self._finished or (self._batch is not None and self._batch.remaining):
            return True
        return self._next_batch(-1.0 if timeout is None else timeout)

    @property
    def finished(self) -> bool:
        """True once every buffer has been returned."""
        return self._finished and (self._batch is None or not self._batch.remaining)

    def __iter__(self) -> Iterator[RetrievedBuffer]:
        if self._closed:
            raise ClosedError("retriever is closed", path=self.uri)
        while True:
            if self._batch is not None:
                yield from self._batch  # the batch iterates in C
                self._batch = None
            if self._finished:
                return
            self._next_batch(-1.0)

    def close(self) -> None:
        """Stops reading ahead and releases the file. Buffers already returned stay valid."""
        if self._closed:
            return
        self._closed = True
        self._batch = None
        if self._native is not None:
            self._native.close()
            self._file.close()
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        while not self._queue.empty():
            self._queue.get_nowait()

    def __enter__(self) -> Retriever:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self._stop.set()


def read_ends(file: Any, size: int, uri: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The header and trailer of a state file of ``size`` bytes open as ``file``,
    checked (magic, version, checksums, matching file ids; a file that does not end
    in a trailer was not closed cleanly), without reading any frame. Leaves ``file``
    at the first frame."""
    hs, ts = native.HEADER_SIZE, native.TRAILER_SIZE
    if size < hs + ts:
        raise TruncatedFileError(
            "state file is shorter than a header and a trailer",
            path=uri,
            offset=size,
            detail=f"{size} bytes; an empty gate takes {hs + ts}",
        )
    head = bytearray(hs)
    file.seek(0)
    readinto_exact(file, memoryview(head))
    header = native.decode_state_header(head, uri)
    tail = bytearray(ts)
    file.seek(size - ts)
    if readinto_exact(file, memoryview(tail)) != ts:
        raise TruncatedFileError("state file shrank while opening", path=uri)
    if not _looks_like_trailer(tail, header["file_id"]):
        raise TruncatedFileError(
            "state file does not end in a trailer",
            path=uri,
            offset=size - ts,
            hint="the storer was not closed (crashed or still writing), or the file was cut",
        )
    trailer = native.decode_trailer(tail, uri, size - ts)
    if trailer["file_id"] != header["file_id"]:
        raise CorruptHeaderError(
            "trailer belongs to another file",
            path=uri,
            offset=size - ts,
            detail="header and trailer file ids differ",
        )
    file.seek(hs)
    return header, trailer


def check_expected(h: GateStateHandle, header: dict[str, Any], size: int, uri: str) -> None:
    """Raises :class:`ForeignFileError` unless the file whose header was read is the
    one handle ``h`` names (same file id and size)."""
    found = header["file_id"].hex()
    if found != h.file_id or size != h.size:
        raise ForeignFileError(
            "state file is not the one the handle names",
            path=uri,
            offset=0,
            detail=f"handle: id {h.file_id}, {h.size} bytes; file: id {found}, {size} bytes",
            hint="the file was replaced or belongs to another checkpoint",
        )


def check_ends(handle: GateStateHandle, *, filesystem: Any = None) -> None:
    """Checks that the state file (or shared-file section) ``handle`` names is there,
    of the handle's size, and ends as the handle says (header, trailer, file id and
    the trailer's sums), reading only its two ends: a cheap check before reusing a
    file whose frames a reader checks anyway as it reads them. Raises the file's
    :class:`~spillover.errors.SpilloverError` (or OSError) when it is not."""
    loc = Location.parse(handle.uri, filesystem)
    backend = backend_for(loc.parent)
    section = None if handle.offset is None else (handle.offset, handle.size)
    file, size = open_section(backend, loc.name, section)
    try:
        uri = backend.uri_of(loc.name)
        header, trailer = read_ends(file, size, uri)
        check_expected(handle, header, size, uri)
        sums = (trailer["frame_count"], trailer["raw_bytes"], trailer["stored_bytes"])
        if sums != (handle.frame_count, handle.raw_bytes, handle.stored_bytes):
            raise ForeignFileError(
                "state file's trailer differs from its handle",
                path=uri,
                offset=size - native.TRAILER_SIZE,
                detail=f"handle: {handle.frame_count} frames, {handle.raw_bytes} raw and "
                f"{handle.stored_bytes} stored bytes; trailer: {sums[0]}, {sums[1]}, {sums[2]}",
            )
    except BaseException as e:
        name_file_offset(file, e)
        raise
    finally:
        file.close()


def open_retriever(
    source: GateStateHandle | str | os.PathLike[str],
    *,
    filesystem: Any = None,
    channels: Iterable[int] | None = None,
    **options: Any,
) -> Retriever:
    """A retriever for a state file, named by its handle or its URI.

    With a handle, the file must be the very one the handle describes (same file id and
    size), else :class:`ForeignFileError`; a handle of a section of a shared file
    reads only that section. ``channels`` (with a handle that has a
    channel index) reads only the byte range that holds those channels' frames;
    frames of other channels inside that range still come out, and the caller counts
    the frames it wants, since the trailer's sums cover the whole file.
    """
    expect = source if isinstance(source, GateStateHandle) else None
    uri = source.uri if isinstance(source, GateStateHandle) else os.fspath(source)
    if not uri.partition("?")[0].rpartition("/")[2]:
        raise ValueError(f"not a state-file URI: {uri!r}")
    loc = Location.parse(uri, filesystem)
    try:
        opts = StorageOptions(**options)
    except TypeError as e:
        raise ConfigError("unknown storage option", detail=str(e)) from e
    backend = backend_for(loc.parent)
    name = loc.name
    byte_range = None
    if channels is not None and expect is not None:
        byte_range = expect.byte_range(channels)
    section = None
    if expect is not None and expect.offset is not None:
        section = (expect.offset, expect.size)
    if pure_selected():
        from spillover.storage import pure  # the twin loads only when asked for

        return pure.PureRetriever(backend, name, opts, expect, byte_range, section)  # type: ignore[return-value]
    return Retriever(backend, name, opts, expect, byte_range, section)
