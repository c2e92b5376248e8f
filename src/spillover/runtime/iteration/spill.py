"""Where a feedback edge's spilled buffers live (the "Segments" and "Bounded
memory" parts of ``feedback.py``'s docstring): :class:`SpillDirectory`, one
partition's segment files; :class:`SpillQueue`, one subpartition's FIFO over them;
:class:`Overtaken`, one subpartition's buffers an unaligned barrier overtook, read
lazily from the segments. All of it goes through the engine (``spillover.storage``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import uuid
from collections import deque
from collections.abc import Iterator
from typing import Any

from spillover.errors import ClosedError, StorageError
from spillover.runtime.network.buffers import NetworkBuffer
from spillover.storage import (
    DataType,
    GateKind,
    RetrievedBuffer,
    Retriever,
    Storage,
    StorageOptions,
    Storer,
    open_storage,
)
from spillover.storage.handle import state_file_name

__all__ = ["Overtaken", "SpillDirectory", "SpillQueue"]

_DATA = DataType.DATA
_KiB = 1024


class SpillDirectory:
    """The segment files of one :class:`FeedbackPartition`, in a directory of its own.

    ``path`` is a fresh ``feedback-<uuid>`` under ``parent`` (a local directory), so
    partitions sharing ``parent`` never collide; it is created on the first spill.
    Segments are numbered in creation order (the storage's gate id, modulo 2**32).
    While a snapshot reads segments (:meth:`pin`), deletions wait until it is done.
    """

    def __init__(
        self, parent: str | os.PathLike[str], *, segment_size: int, compression: str | None
    ) -> None:
        self.path = os.path.join(os.fspath(parent), f"feedback-{uuid.uuid4().hex}")
        block = max(64 * _KiB, 2 * segment_size)
        self._options: dict[str, Any] = {
            "compression": compression,
            "blocking": False,  # append copies: the caller's buffer goes back at once
            "pool_bytes": max(256 * _KiB, 8 * segment_size),
            "read_block_bytes": block,
            "read_ahead_bytes": 4 * block,
        }
        StorageOptions(**self._options)  # a bad option fails now, not at the first spill
        self._storage: Storage | None = None
        self._next_id = 0
        self._lock = threading.Lock()
        self._pins = 0
        self._doomed: list[int] = []
        self._closed = False

    @property
    def storage(self) -> Storage:
        if self._closed:
            raise ClosedError(f"spill directory {self.path!r} is closed")
        if self._storage is None:
            self._storage = open_storage(self.path, **self._options)
        return self._storage

    def create_storer(self) -> tuple[int, Storer]:
        """A new segment: ``(segment id, storer)``."""
        storage = self.storage
        sid = self._next_id
        self._next_id = (sid + 1) % 2**32
        return sid, storage.create_storer(sid, kind=GateKind.OUTPUT)

    def open(self, segment: int) -> Retriever:
        """A retriever over a closed segment."""
        return self.storage.create_retriever(segment, kind=GateKind.OUTPUT)

    def delete(self, segment: int) -> None:
        """Deletes a used segment (later, if a snapshot is reading)."""
        with self._lock:
            if self._pins:
                self._doomed.append(segment)
                return
        self._unlink(segment)

    def _unlink(self, segment: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.path, state_file_name(segment, GateKind.OUTPUT)))

    def pin(self) -> None:
        with self._lock:
            self._pins += 1

    def unpin(self) -> None:
        with self._lock:
            self._pins -= 1
            doomed = [] if self._pins else self._doomed
            if not self._pins:
                self._doomed = []
        for segment in doomed:
            self._unlink(segment)

    def remove(self) -> None:
        """Deletes every segment file and the directory; idempotent."""
        with self._lock:
            self._closed = True
            self._doomed = []
        if self._storage is None:
            return
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.path, name))
        with contextlib.suppress(OSError):
            os.rmdir(self.path)


class SpillQueue:
    """One subpartition's FIFO of spilled buffers (data and events), on disk.

    Appends go to the writer's segment; :meth:`peek` reads the oldest item back
    (closing the writer's segment for reading when the reader has none left) and
    :meth:`pop` drops it once handed on. Only the peeked item stays in memory.
    Used from the producer's thread.
    """

    def __init__(self, directory: SpillDirectory, channel: int) -> None:
        self.directory = directory
        self.channel = channel
        self._writer: Storer | None = None
        self._writer_id = 0
        self._writer_items = 0
        self._sealed: deque[tuple[int, int]] = deque()  # (segment, items), oldest first
        self._reader: Retriever | None = None
        self._reader_id = 0
        self._reader_left = 0  # items of the reader's segment not yet peeked
        self._reader_taken = 0  # items of the reader's segment peeked so far
        self._head: RetrievedBuffer | None = None
        self.items = 0
        self.data_buffers = 0
        self.data_bytes = 0

    def __len__(self) -> int:
        return self.items

    def append(self, buffer: NetworkBuffer) -> None:
        """Stores a copy of ``buffer`` at the tail (the caller keeps its reference)."""
        if self._writer is None:
            self._writer_id, self._writer = self.directory.create_storer()
        self._writer.append(self.channel, buffer, buffer.data_type)
        self._writer_items += 1
        self.items += 1
        if buffer.data_type == _DATA:
            self.data_buffers += 1
            self.data_bytes += len(buffer)

    def peek(self) -> RetrievedBuffer | None:
        """The oldest item, or None if the queue is empty or it is not read back yet."""
        while self._head is None:
            if self._reader is not None:
                if self._reader_left:
                    buf = self._reader.poll_next()
                    if buf is None:
                        if self._reader.finished:
                            raise StorageError(
                                "spill segment ended early",
                                path=self._reader.uri,
                                detail=f"{self._reader_left} items missing",
                            )
                        return None  # the read-ahead has not got there yet
                    self._head = buf
                    self._reader_left -= 1
                    self._reader_taken += 1
                else:
                    self._drop_reader()
            elif self._sealed:
                self._reader_id, self._reader_left = self._sealed.popleft()
                self._reader_taken = 0
                self._reader = self.directory.open(self._reader_id)
            elif self._writer is not None:
                self._seal()
            else:
                return None
        return self._head

    def pop(self) -> None:
        """Drops the peeked item (it was handed on)."""
        head = self._head
        if head is None:
            raise RuntimeError("pop() without a peeked item")
        self._head = None
        self.items -= 1
        if head.data_type == _DATA:
            self.data_buffers -= 1
            self.data_bytes -= len(head)
        if self._reader is not None and not self._reader_left:
            self._drop_reader()  # used up: its file goes now, not at the next peek

    def _seal(self) -> None:
        assert self._writer is not None
        self._writer.close()
        self._sealed.append((self._writer_id, self._writer_items))
        self._writer = None
        self._writer_items = 0

    def _drop_reader(self) -> None:
        assert self._reader is not None
        self._reader.close()
        self._reader = None
        self.directory.delete(self._reader_id)

    def snapshot(self) -> tuple[list[NetworkBuffer], list[tuple[int, int]]]:
        """What a priority event overtakes here: a copy of the peeked item if it is
        data, and the segments holding the rest as ``(segment, items to skip)``.
        Closes the writer's segment so that it can be read."""
        if self._writer is not None:
            self._seal()
        head: list[NetworkBuffer] = []
        if self._head is not None and self._head.data_type == _DATA:
            head.append(NetworkBuffer.unpooled(self._head.tobytes()))
        segments = [(sid, 0) for sid, _ in self._sealed]
        if self._reader is not None and self._reader_left:
            segments.insert(0, (self._reader_id, self._reader_taken))
        return head, segments

    def close(self) -> None:
        """Drops the queue's handles (the directory deletes the files)."""
        self._head = None
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.discard()
            self._writer = None
        if self._reader is not None:
            with contextlib.suppress(Exception):
                self._reader.close()
            self._reader = None
        self._sealed.clear()
        self.items = self.data_buffers = self.data_bytes = 0


class Overtaken(Iterator[NetworkBuffer]):
    """One subpartition's overtaken buffers: those taken from the channel, then
    copies of the queue's data read lazily from its segments, one retriever at a
    time. Each buffer yielded belongs to the caller. Closing it (or exhausting or
    dropping it) releases what was not yielded and lets the segments be deleted;
    reading on after an early close (the partition closed or failed meanwhile)
    raises :class:`ClosedError` rather than cutting the channel state short."""

    def __init__(
        self, directory: SpillDirectory, ready: list[NetworkBuffer], segments: list[tuple[int, int]]
    ) -> None:
        self._dir = directory
        self._ready = deque(ready)
        self._segments = deque(segments)
        self._reader: Retriever | None = None
        self._frames: Iterator[RetrievedBuffer] | None = None
        self._done = False
        self._complete = False  # every buffer was yielded
        directory.pin()

    def __iter__(self) -> Overtaken:
        return self

    def __next__(self) -> NetworkBuffer:
        if self._ready:
            return self._ready.popleft()
        if self._done and not self._complete:
            raise ClosedError("overtaken buffers closed before they were all read")
        while not self._done:
            if self._frames is None:
                if not self._segments:
                    break
                segment, skip = self._segments.popleft()
                self._reader = self._dir.open(segment)
                self._frames = itertools.islice(self._reader, skip, None)
            for buf in self._frames:
                if buf.data_type == _DATA:
                    return NetworkBuffer.unpooled(buf.tobytes())
            self._frames = None
            if self._reader is not None:
                self._reader.close()
                self._reader = None
        self._complete = True
        self.close()
        raise StopIteration

    def close(self) -> None:
        if self._done:
            return
        self._done = True
        self._frames = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        while self._ready:
            self._ready.popleft().release()
        self._dir.unpin()

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            self.close()
