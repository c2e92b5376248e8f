"""Turning batches into network buffers for one output edge.

Records are framed as in ``spillover.records`` (length prefix + row bytes). Each
subpartition gets its own stream of full buffers, so a record cut by a buffer
boundary is completed in the next buffer of the same channel. Buffers are cut at
``segment_size``, or with debloating at its initial size until the consumer has
measured what it takes, then at the size it announced (``network/debloat.py``),
which keeps checkpoints under backpressure short.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import numpy.typing as npt

from spillover.keygroups import key_group_range_for_operator, key_group_table
from spillover.records import FieldKey, KeyGroupDemux, RecordWriter, partitions_of
from spillover.runtime.api import Batch, EdgeKind, Partitioner
from spillover.runtime.network.events import LoopProbe, Watermark, WatermarkStatus, to_buffer
from spillover.storage.handle import DataType

InLineEvent = Watermark | WatermarkStatus | LoopProbe
"""The events an outbox queues in line with the data (they need no credit)."""
_IN_LINE = (Watermark, WatermarkStatus, LoopProbe)


class PartitionWriter:
    """Routes the batches of one output edge to the subpartitions of its partition.

    ``send(subpartition, array)`` hands a filled buffer on (it may block: that is
    where backpressure reaches the task); ``send_all(array)`` gives one buffer to
    every subpartition (broadcast). Buffers are cut short rather than split a
    record when at most an eighth of one is left empty (``whole_records``), so the
    consumer views small records in place.
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
        sizes: Any = None,
    ) -> None:
        self.kind = kind
        self.n = n_subpartitions
        self.segment_size = segment_size
        self._send = send
        self._send_all = send_all
        self._next = subtask_index % n_subpartitions  # rebalance spreads from here
        self._subtask = subtask_index
        self.records_out = 0
        # The partition whose ``buffer_sizes`` (debloating's initial size, then what
        # its consumers announced) this writer follows; None: always the segment size.
        self._sizes = sizes
        self._seen = 0  # the ``sizes_version`` followed
        self.resized = 0  # times debloating changed a buffer size
        self._cut: list[int] = []  # each subpartition's cut size
        self._demux: KeyGroupDemux
        self._writers: list[RecordWriter] = []
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
        if sizes is not None:  # debloating's initial size, or what was announced already
            self._seen = sizes.sizes_version
            self._cut_at(list(sizes.buffer_sizes))
        else:
            self._cut_at([segment_size] * n_subpartitions)
        if kind is EdgeKind.CUSTOM:
            assert key_field is not None and partitioner is not None
            self._partitioner = partitioner
            self._key_field = key_field

    @property
    def buffer_size(self) -> int:
        """Where buffers are cut now (the smallest over subpartitions): the segment
        size, or with debloating its initial size until a consumer measured, then the
        size it announced."""
        return min(self._cut)

    def _cut_at(self, sizes: list[int]) -> None:
        """(Re)builds the packers to cut at ``sizes``, after sending what they hold
        (at a batch boundary: they hold whole records); a demux or a broadcast cuts
        every subpartition at the smallest size."""
        if self.kind in (EdgeKind.KEY_BY, EdgeKind.BROADCAST):
            sizes = [min(sizes)] * len(sizes)
        if sizes == self._cut:
            return
        if self._cut:
            self.flush()
        if self.kind is EdgeKind.KEY_BY:
            self._demux = KeyGroupDemux(
                self._max_parallelism,
                self._table,
                self.n,
                self._key,
                sizes[0],
                whole_records=True,
            )
        elif self.kind is EdgeKind.BROADCAST:
            self._writers = [RecordWriter(sizes[0], whole_records=True)]
        else:
            self._writers = [RecordWriter(size, whole_records=True) for size in sizes]
        self._cut = sizes

    def _follow_sizes(self) -> None:
        """Cuts at the sizes the consumers announced since the last batch (the version
        is read first: a size announced meanwhile is followed at the next batch)."""
        part = self._sizes
        self._seen = part.sizes_version
        before = self._cut
        self._cut_at(list(part.buffer_sizes))
        if self._cut != before:
            self.resized += 1

    def emit(self, batch: Batch) -> None:
        if len(batch) == 0:
            return
        self.records_out += len(batch)
        if self._sizes is not None and self._sizes.sizes_version != self._seen:
            self._follow_sizes()
        if self.kind is EdgeKind.KEY_BY:
            for sub, buf in self._demux.push_rows(batch):
                self._send(sub, buf)
            return
        width = batch.dtype.itemsize
        if self.kind is EdgeKind.CUSTOM:
            subs = partitions_of(self._partitioner, batch[self._key_field], self.n)
            # One stable gather groups the records by subtask, each in batch order.
            order = np.argsort(subs, kind="stable")
            grouped = np.ascontiguousarray(batch[order]).view(np.uint8)
            counts = np.bincount(subs, minlength=self.n)
            ends = np.cumsum(counts) * width
            for sub in np.flatnonzero(counts).tolist():
                start = int(ends[sub - 1]) if sub else 0
                rows = grouped[start : int(ends[sub])]
                for buf in _pack(self._writers[sub], rows, int(counts[sub]), width):
                    self._send(sub, buf)
            return
        data = np.ascontiguousarray(batch).view(np.uint8)
        if self.kind is EdgeKind.BROADCAST:
            for buf in _pack(self._writers[0], data, len(batch), width):
                self._send_all(buf)
            return
        if self.kind is EdgeKind.FORWARD:
            sub = self._subtask
        else:
            sub = self._next
            self._next = (self._next + 1) % self.n
        for buf in _pack(self._writers[sub], data, len(batch), width):
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


def _pack(
    writer: RecordWriter, rows: npt.NDArray[np.uint8], n: int, width: int
) -> list[npt.NDArray[np.uint8]]:
    """Frames ``n`` records of ``width`` bytes lying back to back in ``rows``."""
    if width:
        return writer.write_fixed(rows, width)
    return writer.write_batch(rows, np.zeros(n + 1, dtype=np.int64))  # empty records


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
