"""Turning batches into network buffers for one output edge.

Records are framed as in ``spillover.records`` (length prefix + row bytes). Each
subpartition gets its own stream of full buffers, so a record cut by a buffer
boundary is completed in the next buffer of the same channel. Buffers are cut at
``segment_size``, or smaller while the edge's consumers take less (buffer
debloating, :class:`Debloat`): the in-flight data then stays about ``target``
seconds' worth of what they take, which keeps checkpoints under backpressure short.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spillover.keygroups import key_group_range_for_operator, key_group_table
from spillover.records import FieldKey, KeyGroupDemux, RecordWriter, partitions_of
from spillover.runtime.api import Batch, EdgeKind, Partitioner
from spillover.runtime.network.events import LoopProbe, Watermark, WatermarkStatus, to_buffer
from spillover.storage.handle import DataType

InLineEvent = Watermark | WatermarkStatus | LoopProbe
"""The events an outbox queues in line with the data (they need no credit)."""
_IN_LINE = (Watermark, WatermarkStatus, LoopProbe)


@dataclass(frozen=True)
class Debloat:
    """Buffer debloating of one output edge (``taskmanager.network.memory.buffer-debloat.*``).

    Every ``period_s`` the writer measures the bytes per second each subpartition
    took and cuts its buffers at ``rate * target_s / buffers_in_flight`` bytes,
    between ``min_size`` and the segment size: the ``buffers_in_flight`` buffers a
    channel can hold (its credit window and its share of the producer's pool) then
    carry about ``target_s`` seconds of data. Under backpressure the rate is what
    the consumers take (the task emits only as fast as its output drains); a free
    flowing edge stays at the segment size. The size changes only when the new one
    differs by more than ``threshold`` (a fraction) or reaches a bound.

    Measured at the producer, not (as Flink does) at the consumer: right after a
    consumer slows down, the full-size buffers already in flight drain slowly and the
    producer sees less than the consumer takes, so sizes undershoot until they
    drain; a paced sink can then starve for a while (docs/runtime.md).
    """

    target_s: float
    period_s: float
    min_size: int
    buffers_in_flight: int
    threshold: float = 0.25
    clock: Callable[[], float] = field(default=time.monotonic, compare=False)


class _Debloater:
    """Measures one edge's per-subpartition rate and proposes buffer sizes (:class:`Debloat`)."""

    def __init__(self, settings: Debloat, max_size: int) -> None:
        self.settings = settings
        self.max_size = max_size
        self.size = max_size  # until a rate is known
        self.clock = settings.clock
        self._bytes = 0
        self._since = self.clock()
        self._rate: float | None = None  # smoothed bytes/s per subpartition

    def account(self, nbytes: int, per_subpartition: int) -> int | None:
        """Counts ``nbytes`` emitted, spread over ``per_subpartition`` subpartitions;
        returns a new buffer size when one period ended and the size should change."""
        self._bytes += nbytes // per_subpartition
        now = self.clock()
        elapsed = now - self._since
        st = self.settings
        if elapsed < st.period_s:
            return None
        rate = self._bytes / elapsed
        self._bytes, self._since = 0, now
        self._rate = rate if self._rate is None else 0.5 * (self._rate + rate)
        want = self._rate * st.target_s / st.buffers_in_flight
        size = min(self.max_size, max(st.min_size, int(want)))
        bound = size in (st.min_size, self.max_size)
        if size == self.size or (not bound and abs(size - self.size) <= st.threshold * self.size):
            return None
        self.size = size
        return size


def frame(batch: Batch) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The framed bytes of a batch: every row behind its 4-byte little-endian length."""
    n, width = len(batch), batch.dtype.itemsize
    out = np.empty((n, 4 + width), np.uint8)
    out[:, :4] = np.frombuffer(np.uint32(width).tobytes(), np.uint8)
    out[:, 4:] = np.ascontiguousarray(batch).view(np.uint8).reshape(n, width)
    return out.reshape(-1)


class PartitionWriter:
    """Routes the batches of one output edge to the subpartitions of its partition.

    ``send(subpartition, array)`` hands a filled buffer on (it may block: that is
    where backpressure reaches the task); ``send_all(array)`` gives one buffer to
    every subpartition (broadcast).
    """

    def __init__(
        self,
        kind: EdgeKind,
        dtype: Any,
        n_subpartitions: int,
        subtask_index: int,
        segment_size: int,
        max_parallelism: int,
        key_field: str | None,
        send: Any,
        send_all: Any,
        partitioner: Partitioner | None = None,
        debloat: Debloat | None = None,
    ) -> None:
        self.kind = kind
        self.n = n_subpartitions
        self.segment_size = segment_size
        self._send = send
        self._send_all = send_all
        self._next = subtask_index % n_subpartitions  # rebalance spreads from here
        self._subtask = subtask_index
        self.records_out = 0
        self._width = np.dtype(dtype).itemsize + 4  # a framed record's bytes
        # What one subpartition gets of an emitted batch: a share, or all of it.
        spread = kind in (EdgeKind.KEY_BY, EdgeKind.REBALANCE, EdgeKind.CUSTOM)
        self._share = n_subpartitions if spread else 1
        self._debloater = _Debloater(debloat, segment_size) if debloat is not None else None
        self.resized = 0  # times debloating changed the buffer size
        if kind is EdgeKind.KEY_BY:
            assert key_field is not None
            dt = np.dtype(dtype)
            offset = dt.fields[key_field][1]
            ranges = [
                key_group_range_for_operator(max_parallelism, n_subpartitions, i)
                for i in range(n_subpartitions)
            ]
            self._key = FieldKey(offset, "int64")
            self._table = key_group_table(max_parallelism, ranges)
            self._max_parallelism = max_parallelism
        self._cut_at(self._debloater.size if self._debloater is not None else segment_size)
        if kind is EdgeKind.CUSTOM:
            assert key_field is not None and partitioner is not None
            self._partitioner = partitioner
            self._key_field = key_field

    @property
    def buffer_size(self) -> int:
        """Where buffers are cut now: the segment size, or less while debloated."""
        return self._size

    def _cut_at(self, size: int) -> None:
        """(Re)builds the packers to cut buffers at ``size`` bytes (after a flush)."""
        self._size = size
        if self.kind is EdgeKind.KEY_BY:
            self._demux = KeyGroupDemux(self._max_parallelism, self._table, self.n, self._key, size)
        elif self.kind is EdgeKind.BROADCAST:
            self._writers = [RecordWriter(size)]
        else:
            self._writers = [RecordWriter(size) for _ in range(self.n)]

    def _debloat(self, records: int) -> None:
        assert self._debloater is not None
        size = self._debloater.account(records * self._width, self._share)
        if size is not None:
            self.flush()  # what is packed goes at the old size; a cut record is fine
            self._cut_at(size)
            self.resized += 1

    def emit(self, batch: Batch) -> None:
        if len(batch) == 0:
            return
        self.records_out += len(batch)
        if self._debloater is not None:
            self._debloat(len(batch))
        if self.kind is EdgeKind.KEY_BY:
            for sub, buf in self._demux.push(frame(batch)):
                self._send(sub, buf)
            return
        data = np.ascontiguousarray(batch).view(np.uint8)
        offsets = np.arange(len(batch) + 1, dtype=np.int64) * batch.dtype.itemsize
        if self.kind is EdgeKind.BROADCAST:
            for buf in self._writers[0].write_batch(data, offsets):
                self._send_all(buf)
            return
        if self.kind is EdgeKind.CUSTOM:
            subs = partitions_of(self._partitioner, batch[self._key_field], self.n)
            # One stable gather groups the records by subtask, each in batch order.
            order = np.argsort(subs, kind="stable")
            grouped = np.ascontiguousarray(batch[order]).view(np.uint8)
            counts = np.bincount(subs, minlength=self.n)
            ends = np.cumsum(counts) * batch.dtype.itemsize
            for sub in np.flatnonzero(counts).tolist():
                start = int(ends[sub - 1]) if sub else 0
                rows = grouped[start : int(ends[sub])]
                offs = np.arange(0, len(rows) + 1, batch.dtype.itemsize, dtype=np.int64)
                for buf in self._writers[sub].write_batch(rows, offs):
                    self._send(sub, buf)
            return
        if self.kind is EdgeKind.FORWARD:
            sub = self._subtask
        else:
            sub = self._next
            self._next = (self._next + 1) % self.n
        for buf in self._writers[sub].write_batch(data, offsets):
            self._send(sub, buf)

    def flush(self) -> None:
        """Sends every partly filled buffer (before a barrier, and on the flush timer)."""
        if self.kind is EdgeKind.KEY_BY:
            for sub, buf in self._demux.flush():
                self._send(sub, buf)
            return
        for sub, w in enumerate(self._writers):
            last = w.flush()
            if last is None:
                continue
            if self.kind is EdgeKind.BROADCAST:
                self._send_all(last)
            else:
                self._send(sub, last)


class Outbox:
    """Buffers a task produced for one result partition and has not handed over yet.

    Writers never block: they append here, and the task moves buffers on only as
    far as the partition has credit and buffer budget, so a backpressured task still
    runs its mailbox and takes its unaligned barriers. The task processes new input
    only once its outboxes are empty, which bounds them to what one input buffer or
    one source batch produces. An unaligned barrier overtakes what is here too.

    Watermarks and watermark statuses wait here in line too (:meth:`send_event`),
    behind the buffers queued before them; they go on as soon as they reach the
    head of their queue, without credit. A snapshot persists only the buffers.
    """

    def __init__(self, partition: Any, pool: Any) -> None:
        self.partition = partition
        self.pool = pool
        self.queues: list[deque[Any]] = [deque() for _ in range(partition.num_subpartitions)]
        self.count = 0

    def send(self, sub: int, array: Any) -> None:
        self.queues[sub].append(array)
        self.count += 1

    def send_all(self, array: Any) -> None:
        for q in self.queues:
            q.append(array)
        self.count += len(self.queues)

    def send_event(self, event: InLineEvent) -> None:
        """Queues ``event`` in every subpartition, behind what is queued there."""
        for q in self.queues:
            q.append(event)
        self.count += len(self.queues)

    def drain(self) -> bool:
        """Hands on what can go without waiting; True when nothing is left."""
        if not self.count:
            return True
        part, pool = self.partition, self.pool
        for sub, q in enumerate(self.queues):
            while q:
                head = q[0]
                if not isinstance(head, _IN_LINE):
                    if part.credit(sub) <= 0 or pool.available <= 0:
                        break
                    part.emit(sub, pool.wrap(q.popleft(), DataType.DATA))
                else:
                    part.emit(sub, to_buffer(q.popleft()))
                self.count -= 1
        return self.count == 0

    def drain_blocking(self) -> None:
        """Hands on everything, waiting for credit (before in-line events)."""
        for sub, q in enumerate(self.queues):
            while q:
                head = q.popleft()
                if not isinstance(head, _IN_LINE):
                    self.partition.emit(sub, self.pool.wrap(head, DataType.DATA))
                else:
                    self.partition.emit(sub, to_buffer(head))
                self.count -= 1

    @staticmethod
    def is_data(item: Any) -> bool:
        """Whether a queued item is a buffer's bytes (not an in-line event)."""
        return not isinstance(item, _IN_LINE)
