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

The spill side (the segment files, a subpartition's queue, the overtaken buffers
read back) is ``spill.py``.

Priority overtaking. An unaligned barrier (``broadcast_event(..., priority=True)``)
overtakes everything: it goes straight into the inner partition, and what it
overtook becomes channel state: per subpartition the buffers queued in the channel,
then copies of the data still in the queue, read lazily from the segment files. The
queue itself is unchanged: its items still follow the barrier.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from collections.abc import Iterable

import numpy as np

from spillover.errors import ClosedError, ConfigError
from spillover.runtime.iteration.spill import Overtaken, SpillDirectory, SpillQueue
from spillover.runtime.network.buffers import BufferPool, NetworkBuffer, NetworkTimeoutError
from spillover.runtime.network.errors import ChannelCancelledError
from spillover.runtime.network.errors import deadline as _deadline
from spillover.runtime.network.errors import failure as _failure
from spillover.runtime.network.events import Event, to_buffer
from spillover.runtime.network.partition import ResultPartition, Subpartition
from spillover.storage import DataType

__all__ = ["FeedbackPartition"]

# Whether wiring lets feedback edges spill (a test hook: without it a loop under
# backpressure deadlocks, which the tests show).
SPILLING = True

_DATA = DataType.DATA
_EVENT = DataType.EVENT
_KiB = 1024
_MAX_PAUSE = 0.005  # pump_blocking's longest sleep between attempts


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
        self._snapshots: weakref.WeakSet[Overtaken] = weakref.WeakSet()

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
                    lazy = Overtaken(self._dir, [*bufs, *head], segments)
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
    if isinstance(overtaken, Overtaken):
        overtaken.close()
    else:
        for b in overtaken:
            b.release()
