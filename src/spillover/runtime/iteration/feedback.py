"""The feedback edge's partition: a producer that never waits for credit.

Why spill. A loop's feedback edge runs from the loop's tail back to its head. With
bounded buffers and credit-based flow control a loop can deadlock: the head waits
for credit to send into the body, the body waits on the tail, and the tail waits
for credit to send feedback to the head, which is not reading. FLIP-15 breaks the
cycle on the feedback edge: its producer never blocks. :class:`FeedbackPartition`
wraps the edge's real :class:`ResultPartition` and, whenever a subpartition has no
credit, writes what is sent to disk through the engine (``spillover.storage``)
instead of waiting; :meth:`FeedbackPartition.pump` moves it on as credit returns.

The FIFO rule. Each subpartition has a :class:`SpillQueue`. A buffer goes straight
to the inner partition only while that queue is empty (and, for data, the channel
has credit); otherwise it joins the queue. Data buffers and in-line events
(watermarks, aligned barriers, loop probes) share the queue, so the consumer sees
exactly the order they were sent in. ``finish()`` only records the request: the
EndOfPartition follows once every queue is empty.

Segments. A queue writes segment files through a :class:`Storer` (non-blocking
mode: ``append`` copies, so the caller's buffer and its pool segment are released at
once). A segment becomes readable when its storer is closed: when the reader has
used up its segment and the writer's holds items, the writer's is closed and a
:class:`Retriever` reads it while new appends start a new segment. Used segments
are deleted. Each partition's files live in a directory of their own (a fresh uuid
under ``spill_dir``), made on the first spill and removed by ``close``/``fail``.

Bounded memory. Nothing queued stays in memory: a queue holds at most the one
buffer it read and could not hand on yet, plus the storer's copy pool and the
retriever's read-ahead (both sized from the segment size), whatever the spill
size. A buffer read back is copied into a segment of the inner partition's pool,
so what is in flight is bounded by the pool like any other output. One permit of
that pool is kept free for the producer (unless the pool has a single segment):
the producer's own ``pool.wrap`` must never wait behind the feedback edge either.

Priority overtaking. An unaligned barrier (``broadcast_event(..., priority=True)``)
overtakes everything: it goes straight into the inner partition, and what it
overtook becomes channel state: per subpartition the buffers queued in the channel,
then copies of the data still in the queue, read lazily from the segment files. The
queue itself is unchanged: its items still follow the barrier.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from spillover.errors import ClosedError, ConfigError, StorageError
from spillover.runtime.network.buffers import BufferPool, NetworkBuffer, NetworkTimeoutError
from spillover.runtime.network.errors import ChannelCancelledError
from spillover.runtime.network.errors import deadline as _deadline
from spillover.runtime.network.errors import failure as _failure
from spillover.runtime.network.events import Event, to_buffer
from spillover.runtime.network.partition import ResultPartition, Subpartition
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

__all__ = ["FeedbackPartition", "SpillDirectory", "SpillQueue"]

# Whether wiring lets feedback edges spill (a test hook: without it a loop under
# backpressure deadlocks, which the tests show).
SPILLING = True

_DATA = DataType.DATA
_EVENT = DataType.EVENT
_KiB = 1024
_MAX_PAUSE = 0.005  # pump_blocking's longest sleep between attempts


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


class _Overtaken(Iterator[NetworkBuffer]):
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

    def __iter__(self) -> _Overtaken:
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


class FeedbackPartition:
    """A feedback edge's partition: :class:`ResultPartition`'s surface over ``inner``
    (connected to the iteration head's channels), but the producer never waits for
    credit: what a subpartition cannot take now is spilled to ``spill_dir`` in FIFO
    order and moved on by :meth:`pump` (see the module docstring).

    ``credit(sub)`` reports ``sys.maxsize`` and ``emit`` never waits (its ``timeout``
    is unused). With ``spilling=False`` every call goes straight to ``inner``: the
    plain, blocking partition (to show what a loop does without spilling).

    Called from the producer's thread, except :meth:`fail` and :meth:`cancel` (any
    thread). The caller calls :meth:`pump` often (from its drain loop) and
    :meth:`pump_blocking` when it ends, and :meth:`close` however it ends.
    """

    def __init__(
        self,
        inner: ResultPartition,
        spill_dir: str | os.PathLike[str],
        *,
        spilling: bool = True,
        compression: str | None = None,
    ) -> None:
        self.inner = inner
        self.spilling = spilling
        self._dir = SpillDirectory(
            spill_dir, segment_size=inner.pool.segment_size, compression=compression
        )
        n = inner.num_subpartitions
        self._queues = [SpillQueue(self._dir, i) for i in range(n)]
        # A permit kept free for the producer's own wrap (see the module docstring).
        self._reserve = 1 if inner.pool.num_segments > 1 else 0
        self._lock = threading.RLock()
        self._finish_requested = False
        self._closed = False
        self._cause: BaseException | None = None
        self._emitted = [[0, 0] for _ in range(n)]
        self._spilled_buffers = 0
        self._spilled_bytes = 0
        self._waited = 0.0
        self._snapshots: weakref.WeakSet[_Overtaken] = weakref.WeakSet()

    # -- the partition's surface ---------------------------------------------------

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def pool(self) -> BufferPool:
        """The inner partition's :class:`BufferPool` (producers wrap from it)."""
        return self.inner.pool

    @property
    def num_subpartitions(self) -> int:
        return self.inner.num_subpartitions

    @property
    def finished(self) -> bool:
        """True once :meth:`finish` was called (its EndOfPartition may still wait)."""
        return self._finish_requested or self.inner.finished

    @property
    def backpressured_seconds(self) -> float:
        """The inner partition's wait for credit, plus :meth:`pump_blocking`'s."""
        return self.inner.backpressured_seconds + self._waited

    @property
    def spill_path(self) -> str:
        """This partition's own directory of segment files (under ``spill_dir``)."""
        return self._dir.path

    def connect(self, subpartition: int, target: Subpartition) -> None:
        self.inner.connect(subpartition, target)

    def emit(self, subpartition: int, buffer: NetworkBuffer, timeout: float | None = None) -> None:
        """Sends ``buffer`` in line on one subpartition without waiting: straight into
        the inner partition if nothing is queued there and (for data) it has credit,
        else spilled. Takes over the caller's reference unless it raises."""
        if not self.spilling:
            self.inner.emit(subpartition, buffer, timeout)
            return
        with self._lock:
            self._check_open()
            self._route(subpartition, buffer)

    def broadcast(self, buffer: NetworkBuffer, timeout: float | None = None) -> None:
        """:meth:`emit` of the same buffer on every subpartition; takes over the
        caller's reference. If it raises, the subpartitions before got it."""
        if not self.spilling:
            self.inner.broadcast(buffer, timeout)
            return
        with self._lock:
            self._check_open()
            self._route_all(buffer)

    def broadcast_event(
        self, event: Event, priority: bool = False
    ) -> list[Iterable[NetworkBuffer]]:
        """Sends ``event`` on every subpartition; never waits.

        Without ``priority`` it goes in line (behind what is queued) and the result
        holds an empty list per subpartition. With ``priority`` (an unaligned barrier)
        it overtakes everything, and per subpartition the result holds what it
        overtook, in order, each buffer the caller's to release: the buffers queued
        in the channel, then copies of the data still spilled (events skipped). That
        is a list where nothing is spilled, else a lazy one-shot iterator reading the
        segments (memory stays bounded); consume or ``close()`` it. The spilled items
        stay queued and follow the event.
        """
        if not self.spilling:
            return list(self.inner.broadcast_event(event, priority))
        with self._lock:
            if not priority:
                self._check_open()
                buf = to_buffer(event)
                try:
                    self._route_all(buf)
                except BaseException:
                    buf.release()
                    raise
                return [[] for _ in self._queues]
            self._check()
            overtaken = self.inner.broadcast_event(event, priority=True)
            result: list[Iterable[NetworkBuffer]] = []
            try:
                for q, bufs in zip(self._queues, overtaken, strict=True):
                    if not q.items:
                        result.append(bufs)
                        continue
                    head, segments = q.snapshot()
                    lazy = _Overtaken(self._dir, [*bufs, *head], segments)
                    self._snapshots.add(lazy)
                    result.append(lazy)
            except BaseException:
                for bufs in overtaken[len(result) :]:
                    for b in bufs:
                        b.release()
                for done in result:
                    _discard(done)
                raise
            return result

    def finish(self) -> None:
        """Asks for EndOfPartition on every subpartition, in line: it is sent once
        every queue is empty (now, or from :meth:`pump`). Later emits raise
        :class:`ClosedError`. Idempotent."""
        if not self.spilling:
            self.inner.finish()
            return
        with self._lock:
            if self._finish_requested:
                return
            self._check()
            self._finish_requested = True
            if not any(q.items for q in self._queues):
                self.inner.finish()

    def fail(self, cause: BaseException) -> None:
        """Fails the inner partition (waking its waiters); later calls raise
        :class:`ChannelFailedError`. Any thread: the spill files are the producer's
        to delete (:meth:`close`, which the task runs as it ends), since its thread
        may be reading them right now."""
        if self._cause is None:
            self._cause = cause
        self.inner.fail(cause)

    def cancel(self) -> None:
        """:meth:`fail` with :class:`ChannelCancelledError`."""
        self.fail(ChannelCancelledError(f"feedback partition {self.name!r} was cancelled"))

    def close(self) -> None:
        """Deletes every spill file (what is still queued is lost); later calls raise
        :class:`ClosedError`. Idempotent."""
        with self._lock:
            self._closed = True
            self._discard_files()

    def credit(self, subpartition: int) -> int:
        """``sys.maxsize`` while spilling (emit never waits), else the inner credit."""
        if not self.spilling:
            return self.inner.credit(subpartition)
        self._check_open()
        return sys.maxsize

    def backlog(self, subpartition: int) -> tuple[int, int]:
        """``(buffers, bytes)`` of data not yet consumed: in the channel and spilled."""
        buffers, nbytes = self.inner.backlog(subpartition)
        q = self._queues[subpartition]
        return buffers + q.data_buffers, nbytes + q.data_bytes

    def emitted(self, subpartition: int) -> tuple[int, int]:
        """``(buffers, bytes)`` of data the producer sent on the subpartition so far
        (spilled or not)."""
        if not self.spilling:
            return self.inner.emitted(subpartition)
        buffers, nbytes = self._emitted[subpartition]
        return buffers, nbytes

    # -- spilling ------------------------------------------------------------------

    @property
    def spilled_buffers(self) -> int:
        """Buffers (data and events) ever written to disk."""
        return self._spilled_buffers

    @property
    def spilled_bytes(self) -> int:
        """Payload bytes ever written to disk."""
        return self._spilled_bytes

    @property
    def queued_buffers(self) -> int:
        """Buffers (data and events) spilled and not yet handed on."""
        return sum(q.items for q in self._queues)

    def pump(self) -> bool:
        """Moves spilled buffers on into the inner partition as far as credit and the
        pool allow, without waiting; sends the EndOfPartition once every queue is
        empty after :meth:`finish`. True when every queue is empty."""
        if not self.spilling:
            return True
        with self._lock:
            self._check()
            return self._pump_locked()

    def pump_blocking(self, timeout: float | None = None) -> None:
        """Pumps until every queue is empty (and the EndOfPartition is sent after
        :meth:`finish`), waiting for credit in short sleeps; at most ``timeout``
        seconds, then :class:`NetworkTimeoutError`."""
        if not self.spilling:
            return
        deadline = _deadline(timeout)
        pause = _MAX_PAUSE / 32
        while True:
            with self._lock:
                self._check()
                before = self.queued_buffers
                if self._pump_locked():
                    return
                progressed = self.queued_buffers < before
            pause = _MAX_PAUSE / 32 if progressed else min(2 * pause, _MAX_PAUSE)
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise NetworkTimeoutError(
                    f"feedback partition {self.name!r}: spilled buffers not consumed in time",
                    detail=f"{self.queued_buffers} buffers still queued",
                    hint="the iteration head is not reading its feedback",
                )
            time.sleep(pause if deadline is None else min(pause, deadline - now))
            self._waited += time.monotonic() - now

    # -- internals -----------------------------------------------------------------

    def _check(self) -> None:
        if self._cause is not None:
            raise _failure(f"feedback partition {self.name!r}", self._cause)
        if self._closed:
            raise ClosedError(f"feedback partition {self.name!r} is closed")

    def _check_open(self) -> None:
        self._check()
        if self._finish_requested:
            raise ClosedError(f"feedback partition {self.name!r} is finished")

    def _route(self, sub: int, buffer: NetworkBuffer) -> None:
        """Sends or spills one buffer; takes over the reference unless it raises."""
        q = self._queues[sub]
        inner = self.inner
        is_data = buffer.data_type == _DATA
        nbytes = len(buffer)
        sent = (
            not q.items
            and (not is_data or (inner.credit(sub) > 0 and inner.pool.available >= self._reserve))
            and self._send_now(sub, buffer)
        )
        if not sent:
            if is_data and nbytes > inner.pool.segment_size:
                raise ConfigError(
                    f"feedback partition {self.name!r}: a buffer of {nbytes} bytes exceeds "
                    f"the segment size of {inner.pool.segment_size}",
                    hint="spilled buffers come back in segments of the partition's pool",
                )
            q.append(buffer)
            self._spilled_buffers += 1
            self._spilled_bytes += nbytes
            buffer.release()
        if is_data:
            counts = self._emitted[sub]
            counts[0] += 1
            counts[1] += nbytes

    def _route_all(self, buffer: NetworkBuffer) -> None:
        """:meth:`_route` of one buffer to every subpartition; takes over the reference
        unless it raises."""
        for sub in range(len(self._queues)):
            buffer.retain()
            try:
                self._route(sub, buffer)
            except BaseException:
                buffer.release()
                raise
        buffer.release()

    def _send_now(self, sub: int, buffer: NetworkBuffer) -> bool:
        """Hands ``buffer`` to the inner partition without waiting (taking over the
        reference); False, the caller keeping it, when the credit seen before is gone:
        floating credit is shared with the gate's other channels."""
        try:
            self.inner.emit(sub, buffer, timeout=0.0)
        except NetworkTimeoutError:
            return False
        return True

    def _pump_locked(self) -> bool:
        inner = self.inner
        pool = inner.pool
        empty = True
        for sub, q in enumerate(self._queues):
            while q.items:
                item = q.peek()
                if item is None:
                    break
                if item.data_type == _DATA:
                    if inner.credit(sub) <= 0 or pool.available <= self._reserve:
                        break
                    n = len(item)
                    segment = pool.request_segment(0)  # a permit is free: no wait
                    segment[:n] = np.frombuffer(memoryview(item), dtype=np.uint8)
                    buf = pool.wrap(segment[:n], _DATA)
                    try:
                        sent = self._send_now(sub, buf)
                    except BaseException:
                        buf.release()
                        raise
                    if not sent:
                        buf.release()
                        break
                else:
                    inner.emit(sub, NetworkBuffer.unpooled(item.tobytes(), _EVENT))
                q.pop()
            if q.items:
                empty = False
        if empty and self._finish_requested and not inner.finished:
            inner.finish()
        return empty

    def _discard_files(self) -> None:
        for snapshot in list(self._snapshots):
            snapshot.close()
        for q in self._queues:
            q.close()
        self._dir.remove()

    def __repr__(self) -> str:
        return (
            f"FeedbackPartition({self.name!r}, {self.num_subpartitions} subpartitions, "
            f"{self.queued_buffers} queued)"
        )


def _discard(overtaken: Iterable[NetworkBuffer]) -> None:
    """Releases every buffer of one subpartition's overtaken result, unread."""
    if isinstance(overtaken, _Overtaken):
        overtaken.close()
    else:
        for b in overtaken:
            b.release()
