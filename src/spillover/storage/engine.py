"""Storage, Storer and Retriever: persist a gate's in-flight buffers, stream them back.

These are FLIP-76's PersistentInFlightDataStorage / Storer / Retriever. One
:class:`Storage` belongs to one subtask for one checkpoint; it makes one
:class:`Storer` and one :class:`Retriever` per gate. docs/embedding.md shows how
to use them and docs/format.md specifies the bytes.
"""

from __future__ import annotations

import io
import os
import queue
import threading
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from spillover._native import _storage as native
from spillover.errors import (
    ClosedError,
    ConfigError,
    CorruptHeaderError,
    ForeignFileError,
    TruncatedFileError,
)
from spillover.storage.backends import Backend, backend_for, readinto_exact
from spillover.storage.handle import Codec, DataType, GateKind, GateStateHandle, state_file_name

__all__ = [
    "FrameArrays",
    "RetrievedBuffer",
    "Retriever",
    "Storage",
    "StorageOptions",
    "Storer",
    "open_retriever",
    "open_storage",
]

RetrievedBuffer = native.RetrievedBuffer

KiB = 1024
MiB = 1024 * KiB


@dataclass(frozen=True)
class StorageOptions:
    """Tuning of a storage; every field has a keyword of the same name in open_storage.

    - ``compression``: ``None`` or ``"lz4"`` (per buffer; kept only where it shrinks it).
    - ``blocking``: append writes from the caller's thread without copying (the buffer is
      referenced until its batch is written), or, when False, copies into a bounded pool
      that a native writer thread persists.
    - ``batch_bytes``: bytes gathered per hand-off to the I/O thread in blocking mode
      (each written with one vectored write); at most four batches are in flight, so
      the storer references at most four times this much of the caller's memory.
    - ``pool_bytes``: the non-blocking pool; append waits while it is full.
    - ``fsync``: make files (and the directory entry) durable on close.
    - ``read_ahead_bytes`` / ``read_block_bytes``: the retriever reads blocks of
      ``read_block_bytes`` and keeps at most ``read_ahead_bytes`` of them ahead.
    - ``verify_checksums``: check every payload's CRC32C while reading.
    """

    compression: str | None = None
    blocking: bool = True
    batch_bytes: int = 1 * MiB
    pool_bytes: int = 16 * MiB
    fsync: bool = False
    read_ahead_bytes: int = 4 * MiB
    read_block_bytes: int = 1 * MiB
    verify_checksums: bool = True

    def __post_init__(self) -> None:
        if self.compression not in (None, "none", "lz4"):
            raise ConfigError(
                f"unknown compression {self.compression!r}",
                hint="use compression=None or compression='lz4'",
            )
        for name, low in (
            ("batch_bytes", 4 * KiB),
            ("pool_bytes", 64 * KiB),
            ("read_block_bytes", 4 * KiB),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an int of at least {low}, not {value!r}")
        if self.read_ahead_bytes < self.read_block_bytes:
            raise ConfigError(
                "read_ahead_bytes must be at least read_block_bytes",
                detail=f"{self.read_ahead_bytes} < {self.read_block_bytes}",
            )

    @property
    def codec(self) -> Codec:
        return Codec.parse(self.compression)


def open_storage(
    uri: str | os.PathLike[str],
    *,
    compression: str | None = None,
    blocking: bool = True,
    checkpoint_id: int = 0,
    subtask_index: int = 0,
    filesystem: Any = None,
    **options: Any,
) -> Storage:
    """Opens the storage directory of one subtask for one checkpoint.

    ``uri`` is a local path, a ``file://`` URI or any URI ``pyarrow.fs`` understands
    (``s3://bucket/ckpt/17/task-3``, ``gs://...``, ``hdfs://...``); ``filesystem`` passes a
    ready pyarrow filesystem instead. Further keywords are :class:`StorageOptions` fields.
    """
    try:
        opts = StorageOptions(compression=compression, blocking=blocking, **options)
    except TypeError as e:
        raise ConfigError(
            "unknown storage option", detail=str(e), hint="see StorageOptions for the options"
        ) from e
    if not 0 <= checkpoint_id < 2**64:
        raise ConfigError(f"checkpoint_id must fit in 64 bits, not {checkpoint_id}")
    if not 0 <= subtask_index < 2**32:
        raise ConfigError(f"subtask_index must fit in 32 bits, not {subtask_index}")
    return Storage(backend_for(uri, filesystem), opts, checkpoint_id, subtask_index)


class Storage:
    """The in-flight data of one subtask for one checkpoint: one state file per gate."""

    def __init__(
        self, backend: Backend, options: StorageOptions, checkpoint_id: int, subtask_index: int
    ) -> None:
        self.backend = backend
        self.options = options
        self.checkpoint_id = checkpoint_id
        self.subtask_index = subtask_index

    @property
    def uri(self) -> str:
        return self.backend.root

    def create_storer(self, gate_id: int, *, kind: GateKind | str = GateKind.INPUT) -> Storer:
        """A storer for one gate; fails if that gate's file exists already."""
        gk = GateKind.parse(kind)
        _check_u32("gate_id", gate_id)
        return Storer(self, gate_id, gk)

    def create_retriever(self, gate_id: int, *, kind: GateKind | str = GateKind.INPUT) -> Retriever:
        """A retriever streaming back one gate's buffers in the order they were stored."""
        gk = GateKind.parse(kind)
        _check_u32("gate_id", gate_id)
        return Retriever(self.backend, state_file_name(gate_id, gk), self.options)

    def gates(self) -> list[tuple[GateKind, int]]:
        """The gates that have a state file here, as ``(kind, gate_id)``."""
        found = []
        for name in self.backend.list():
            prefix, _, rest = name.partition("-")
            if rest.endswith(".spill") and prefix in ("in", "out") and rest[:-6].isdigit():
                kind = GateKind.INPUT if prefix == "in" else GateKind.OUTPUT
                found.append((kind, int(rest[:-6])))
        return sorted(found)


def _check_u32(name: str, value: int) -> None:
    if not isinstance(value, int) or not 0 <= value < 2**32:
        raise ValueError(f"{name} must be an int in [0, 2**32), not {value!r}")


class Storer:
    """Persists the buffers of one gate, in append order, into one state file.

    Lifecycle: ``append`` any number of times, then ``close()`` (which returns the
    :class:`GateStateHandle`) or ``discard()``. Used from one thread at a time.

    Buffer ownership: in blocking mode ``append`` keeps a reference to the caller's
    buffer, without copying it, until the batch holding it is written (after at most
    ``batch_bytes`` more, or at ``flush()`` / ``close()``); do not modify it until then
    (if you do, the checksum written with it no longer matches and reading it back
    fails). In non-blocking mode ``append`` copies the buffer and returns; the caller
    may reuse it at once. I/O errors are sticky: they are raised by the next
    ``append``, ``flush`` or ``close``, and what was appended before stays intact
    up to the failure.
    """

    def __init__(self, storage: Storage, gate_id: int, kind: GateKind) -> None:
        opts = storage.options
        self._backend = storage.backend
        self._name = state_file_name(gate_id, kind)
        self.gate_id = gate_id
        self.kind = kind
        self.checkpoint_id = storage.checkpoint_id
        self.subtask_index = storage.subtask_index
        self.uri = self._backend.uri_of(self._name)
        self._fsync = opts.fsync
        self._codec = opts.codec
        self._file_id = uuid.uuid4().bytes
        fd, write, self._close_file = self._backend.create(self._name)
        header = native.encode_state_header(
            self.checkpoint_id,
            self.subtask_index,
            gate_id,
            int(kind),
            int(self._codec),
            self._file_id,
        )
        compress = None
        if self._codec is Codec.LZ4:
            import lz4.block

            compress = lz4.block.compress
        try:
            self._native = native.NativeStorer(
                fd,
                write,
                header,
                self._file_id,
                compress,
                opts.batch_bytes,
                0 if opts.blocking else opts.pool_bytes,
                self.uri,
            )
        except BaseException:
            self._close_file(False)
            self._backend.delete(self._name)
            raise
        self._handle: GateStateHandle | None = None
        self._done = False
        # Binding the native method skips one Python frame per buffer.
        self.append = self._native.append  # type: ignore[method-assign]

    def append(self, channel_id: int, buffer: Any, data_type: int = DataType.DATA) -> None:
        """Stores one buffer of ``channel_id`` (data or event); see the class for ownership."""
        self._native.append(channel_id, buffer, data_type)

    def flush(self) -> None:
        """Writes everything appended so far and releases the held buffers."""
        self._native.flush()

    def submit(self) -> None:
        """Blocking mode: starts writing what was appended so far without waiting for
        it; pair with ``reap()`` to give buffers back as soon as they are written."""
        self._native.submit()

    def reap(self) -> None:
        """Blocking mode: releases the held buffers of everything already written."""
        self._native.reap()

    @property
    def frames(self) -> int:
        return int(self._native.frames)

    @property
    def raw_bytes(self) -> int:
        return int(self._native.raw_bytes)

    def close(self) -> GateStateHandle:
        """Writes the trailer, waits until every byte is stored (fsynced if asked) and
        returns the handle. Closing again returns the same handle."""
        if self._handle is not None:
            return self._handle
        if self._done:
            raise ClosedError("storer was discarded", path=self.uri)
        self._done = True
        try:
            size = self._native.finish(self._fsync)
        except BaseException:
            self._close_file(False)
            raise
        self._close_file(self._fsync)
        n = self._native
        self._handle = GateStateHandle(
            uri=self.uri,
            gate_id=self.gate_id,
            gate_kind=self.kind,
            checkpoint_id=self.checkpoint_id,
            subtask_index=self.subtask_index,
            file_id=self._file_id.hex(),
            size=int(size),
            frame_count=int(n.frames),
            raw_bytes=int(n.raw_bytes),
            stored_bytes=int(n.stored_bytes),
            codec=self._codec,
            format_version=native.FORMAT_VERSION,
            channels={int(k): (int(v[0]), int(v[1])) for k, v in n.channels.items()},
            channel_ranges={int(k): (int(v[0]), int(v[1])) for k, v in n.channel_ranges.items()},
        )
        return self._handle

    def discard(self) -> None:
        """Drops what is queued and deletes the file (an aborted checkpoint)."""
        if self._handle is not None or self._done:
            return
        self._done = True
        self._native.discard()
        try:
            self._close_file(False)
        finally:
            self._backend.delete(self._name)

    def __enter__(self) -> Storer:
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
            self.discard()


_END = object()


@dataclass(frozen=True, slots=True)
class FrameArrays:
    """The frames of one read-ahead block at once (``Retriever.poll_frames``).

    Frame ``i`` has payload ``data[offsets[i]:offsets[i] + lengths[i]]`` (raw bytes,
    decoded if it was compressed), channel ``channel_ids[i]``, ``data_types[i]``
    (0 data, 1 event) and its frame header at byte ``file_offsets[i]`` of the file.
    ``data`` is a read-only view of the block (no copy) and keeps it alive.
    """

    data: Any
    channel_ids: Any
    offsets: Any
    lengths: Any
    data_types: Any
    file_offsets: Any

    def __len__(self) -> int:
        return len(self.channel_ids)

    @property
    def nbytes(self) -> int:
        """Payload bytes of the frames."""
        return int(self.lengths.sum())


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
    ) -> None:
        self.uri = backend.uri_of(name)
        self._opts = options
        self._file, self.size = backend.open_read(name)
        try:
            self.header, self.trailer = self._read_ends()
            if expect is not None:
                self._check_expected(expect)
        except BaseException:
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
        fileno = getattr(self._file, "fileno", None)
        if isinstance(self._file, io.FileIO) and fileno is not None:
            # Local file: a native thread reads ahead, never needing the GIL.
            t = self.trailer
            self._native = native.NativeReader(
                fileno(),
                data_start,
                data_end,
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

    def _read_ends(self) -> tuple[dict[str, Any], dict[str, Any]]:
        hs, ts = native.HEADER_SIZE, native.TRAILER_SIZE
        if self.size < hs + ts:
            raise TruncatedFileError(
                "state file is shorter than a header and a trailer",
                path=self.uri,
                offset=self.size,
                detail=f"{self.size} bytes; an empty gate takes {hs + ts}",
            )
        head = bytearray(hs)
        self._file.seek(0)
        readinto_exact(self._file, memoryview(head))
        header = native.decode_state_header(head, self.uri)
        tail = bytearray(ts)
        self._file.seek(self.size - ts)
        if readinto_exact(self._file, memoryview(tail)) != ts:
            raise TruncatedFileError("state file shrank while opening", path=self.uri)
        if not _looks_like_trailer(tail, header["file_id"]):
            raise TruncatedFileError(
                "state file does not end in a trailer",
                path=self.uri,
                offset=self.size - ts,
                hint="the storer was not closed (crashed or still writing), or the file was cut",
            )
        trailer = native.decode_trailer(tail, self.uri, self.size - ts)
        if trailer["file_id"] != header["file_id"]:
            raise CorruptHeaderError(
                "trailer belongs to another file",
                path=self.uri,
                offset=self.size - ts,
                detail="header and trailer file ids differ",
            )
        self._file.seek(hs)
        return header, trailer

    def _check_expected(self, h: GateStateHandle) -> None:
        found = self.header["file_id"].hex()
        if found != h.file_id or self.size != h.size:
            raise ForeignFileError(
                "state file is not the one the handle names",
                path=self.uri,
                offset=0,
                detail=f"handle: id {h.file_id}, {h.size} bytes; file: id {found}, "
                f"{self.size} bytes",
                hint="the file was replaced or belongs to another checkpoint",
            )

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


def open_retriever(
    source: GateStateHandle | str | os.PathLike[str],
    *,
    filesystem: Any = None,
    channels: Iterable[int] | None = None,
    **options: Any,
) -> Retriever:
    """A retriever for a state file, named by its handle or its URI.

    With a handle, the file must be the very one the handle describes (same file id and
    size), else :class:`ForeignFileError`. ``channels`` (with a handle that has a
    channel index) reads only the byte range that holds those channels' frames;
    frames of other channels inside that range still come out, and the caller counts
    the frames it wants, since the trailer's sums cover the whole file.
    """
    expect = source if isinstance(source, GateStateHandle) else None
    uri = source.uri if isinstance(source, GateStateHandle) else os.fspath(source)
    base, sep, query = uri.partition("?")
    directory, _, name = base.rpartition("/")
    if not name:
        raise ValueError(f"not a state-file URI: {uri!r}")
    try:
        opts = StorageOptions(**options)
    except TypeError as e:
        raise ConfigError("unknown storage option", detail=str(e)) from e
    backend = backend_for((directory or ".") + sep + query, filesystem)
    byte_range = None
    if channels is not None and expect is not None:
        byte_range = expect.byte_range(channels)
    return Retriever(backend, name, opts, expect, byte_range)
