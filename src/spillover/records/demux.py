"""The key-group filter: records split (or kept) by key group or by a custom
partitioner, per channel, block by block."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from spillover._native import _records
from spillover.errors import ConfigError, CorruptRecordError
from spillover.keygroups import (
    check_max_parallelism,
)
from spillover.records.framing import (
    DEFAULT_BUFFER_SIZE,
    MAX_RECORD_SIZE,
    Buffer,
    RecordBatch,
    RecordReader,
    _check_buffer_size,
    _check_max_record_size,
    _offsets,
)
from spillover.records.keys import (
    _KINDS,
    FieldKey,
    Key,
    _key_group_fn,
)

# ---- the filter ----

INT64_AT_0 = FieldKey(0, "int64")  # the default key: an int64 at the start of the record


_ROWS = object()  # the channel of push_rows' framed fallback: whole records, never cut


class _Demux:
    """What both demultiplexers share: :meth:`finish` over :meth:`flush` and :meth:`pending`."""

    def flush(self) -> list[tuple[int, Buffer]]:
        raise NotImplementedError

    def pending(self) -> dict[object, int]:
        raise NotImplementedError

    def finish(self) -> list[tuple[int, Buffer]]:
        """:meth:`flush`, after checking that no channel ended inside a record."""
        pending = self.pending()
        if pending:
            raise CorruptRecordError(
                "input channels end in the middle of a record",
                detail=", ".join(f"channel {c!r}: {n} bytes" for c, n in pending.items()),
                hint="a buffer is missing, or channels were mixed up",
            )
        return self.flush()


class KeyGroupDemux(_Demux):
    """Routes records to outputs by key group, packing each output into network buffers.

    ``kg_to_output`` (one int per key group, e.g. from
    :func:`~spillover.keygroups.key_group_table`) names each key group's output
    in ``0 .. n_outputs - 1``, or -1 to drop its records. Input buffers come
    through :meth:`push`, tagged with their channel: a record cut by a buffer
    boundary is completed from the same channel's next buffer. Each output is a
    stream of ``buffer_size`` buffers framed like the input (valid input for a
    :class:`RecordReader`); records keep their input order within each output.
    ``whole_records`` cuts buffers short rather than split records, as
    :class:`RecordWriter` does.

    With a :class:`FieldKey` the whole loop (framing, key, Java hash, murmur,
    modulo, routing, copy) is native with the GIL released; a
    :class:`SelectorKey` calls Python once per record. After an error the
    demux refuses further use.
    """

    def __init__(
        self,
        max_parallelism: int,
        kg_to_output: npt.ArrayLike,
        n_outputs: int,
        key: Key = INT64_AT_0,
        buffer_size: int = DEFAULT_BUFFER_SIZE,
        max_record_size: int = MAX_RECORD_SIZE,
        whole_records: bool = False,
    ) -> None:
        check_max_parallelism(max_parallelism)
        _check_buffer_size(buffer_size)
        _check_max_record_size(max_record_size)
        if not 1 <= n_outputs < 1 << 31:
            raise ConfigError(f"n_outputs must be at least 1, got {n_outputs}")
        table = np.array(kg_to_output, dtype=np.int64).reshape(-1)
        if table.shape != (max_parallelism,):
            raise ConfigError(
                f"kg_to_output needs one entry per key group ({max_parallelism}), got {table.size}"
            )
        if ((table < -1) | (table >= n_outputs)).any():
            raise ConfigError(f"kg_to_output entries must be -1 or in 0..{n_outputs - 1}")
        self.max_parallelism = max_parallelism
        self.n_outputs = n_outputs
        self.key = key
        self.buffer_size = buffer_size
        field = key if isinstance(key, FieldKey) else FieldKey(0, "bytes")
        self._selector = None if isinstance(key, FieldKey) else _key_group_fn(key, max_parallelism)
        self._core = _records.Demux(
            table.astype(np.int32),
            n_outputs,
            buffer_size,
            _KINDS[field.type],
            field.offset,
            field.length_prefixed,
            max_record_size,
            whole_records,
        )

    def push(self, buffer: object, channel: object = 0) -> list[tuple[int, Buffer]]:
        """Routes one input buffer; returns the output buffers it filled as ``(output, buffer)``."""
        return self._core.push(buffer, channel, self._selector)

    def push_rows(self, rows: npt.NDArray[Any]) -> list[tuple[int, Buffer]]:
        """Routes a batch of fixed-width records (a structured array, or bytes as
        ``(n, width)`` uint8) as :meth:`push` would route them framed, without
        framing them first: with a :class:`FieldKey` one native pass, GIL released,
        from the rows in place into the output buffers."""
        n = len(rows)
        if not n:
            return []
        data = np.ascontiguousarray(rows).view(np.uint8).reshape(n, -1)
        if self._selector is not None:
            framed = np.empty((n, 4 + data.shape[1]), np.uint8)
            framed[:, :4] = np.frombuffer(np.uint32(data.shape[1]).tobytes(), np.uint8)
            framed[:, 4:] = data
            return self.push(framed.reshape(-1), _ROWS)
        return self._core.push_rows(data)

    def push_frames(
        self,
        data: object,
        offsets: npt.NDArray[np.int64],
        lengths: npt.NDArray[np.int64],
        slots: npt.NDArray[np.int32],
        channels: list[object],
    ) -> list[tuple[int, Buffer]]:
        """Routes many input buffers at once, as ``push`` would one by one.

        Buffer ``i`` is ``data[offsets[i]:offsets[i] + lengths[i]]`` of channel
        ``channels[slots[i]]`` (skipped when ``slots[i] < 0``), e.g. the frames of a
        read-ahead block (``Retriever.poll_frames``). With a :class:`FieldKey` the
        whole call runs natively with the GIL released.
        """
        if self._selector is not None:
            out: list[tuple[int, Buffer]] = []
            view = np.frombuffer(data, np.uint8)  # type: ignore[call-overload]
            for i in np.flatnonzero(slots >= 0).tolist():
                o = int(offsets[i])
                buf = view[o : o + int(lengths[i])]
                out += self._core.push(buf, channels[slots[i]], self._selector)
            return out
        return self._core.push_frames(data, offsets, lengths, slots, channels)

    def keep_all(self) -> None:
        """Sends every record to output 0 without reading its key: a channel taken whole
        (reassembled and repacked only)."""
        self._core.set_keep_all(True)

    def flush(self) -> list[tuple[int, Buffer]]:
        """Hands out every partly filled output buffer too (records begun on a channel stay)."""
        return self._core.flush()

    def pending(self) -> dict[object, int]:
        """``{channel: bytes}`` of records begun and not yet complete."""
        return self._core.pending()

    @property
    def routed(self) -> int:
        """Records routed to an output so far."""
        return self._core.routed

    @property
    def dropped(self) -> int:
        """Records dropped so far (their key group maps to -1)."""
        return self._core.dropped


def partitioner_name(p: object) -> str:
    """A partitioner's qualified name, for errors and checkpoint fingerprints."""
    owner = p if hasattr(p, "__qualname__") else type(p)
    return f"{getattr(owner, '__module__', '?')}.{getattr(owner, '__qualname__', '?')}"


def partitions_of(
    partitioner: Callable[[npt.NDArray[np.int64], int], npt.ArrayLike], keys: object, n: int
) -> npt.NDArray[np.int64]:
    """``partitioner(keys, n)``, checked: one integer per key, each in ``0 .. n - 1``.

    Anything else raises :class:`~spillover.errors.ConfigError` naming the partitioner.
    """
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    name = partitioner_name(partitioner)
    try:
        subs = np.asarray(partitioner(keys, n))
    except Exception as e:
        raise ConfigError(
            f"the custom partitioner {name} failed: {e}",
            hint="a partitioner takes an int64 key array and the subtask count",
        ) from e
    if subs.shape != keys.shape or not np.issubdtype(subs.dtype, np.integer):
        raise ConfigError(
            f"the custom partitioner {name} must return one integer per key: "
            f"got {subs.dtype} of shape {subs.shape} for {keys.shape[0]} keys"
        )
    subs = subs.astype(np.int64, copy=False)
    if len(subs) and (int(subs.min()) < 0 or int(subs.max()) >= n):
        bad = subs[(subs < 0) | (subs >= n)][0]
        raise ConfigError(f"the custom partitioner {name} picked subtask {bad}, outside 0..{n - 1}")
    return subs


class PartitionerDemux(_Demux):
    """Like :class:`KeyGroupDemux`, but a user partitioner routes each record.

    ``partitioner(keys, n_partitions)`` gets the int64 (or int32) key field of
    every record a pushed buffer completes, in one call, and returns each
    record's partition; ``partition_to_output`` maps partitions to outputs (-1
    drops). Reassembly and packing are native; only the partitioner and a
    numpy gather run per buffer, never Python per record.
    """

    def __init__(
        self,
        partitioner: Callable[[npt.NDArray[np.int64], int], npt.ArrayLike],
        partition_to_output: npt.ArrayLike,
        n_outputs: int,
        key: FieldKey = INT64_AT_0,
        buffer_size: int = DEFAULT_BUFFER_SIZE,
        max_record_size: int = MAX_RECORD_SIZE,
    ) -> None:
        _check_buffer_size(buffer_size)
        _check_max_record_size(max_record_size)
        if not isinstance(key, FieldKey) or key.type not in ("int32", "int64"):
            raise ConfigError("a partitioner routes by an int32 or int64 FieldKey")
        table = np.array(partition_to_output, dtype=np.int64).reshape(-1)
        if not len(table) or ((table < -1) | (table >= n_outputs)).any():
            raise ConfigError(f"partition_to_output entries must be -1 or in 0..{n_outputs - 1}")
        self.partitioner = partitioner
        self.n_partitions = len(table)
        self.n_outputs = n_outputs
        self.key = key
        self._table = table
        self._width = 8 if key.type == "int64" else 4
        self._max_record_size = max_record_size
        self._readers: dict[object, RecordReader] = {}
        self._packer = _records.Packer(buffer_size, n_outputs)
        self.routed = 0
        self.dropped = 0

    def push(self, buffer: object, channel: object = 0) -> list[tuple[int, Buffer]]:
        """Routes one input buffer; returns the output buffers it filled as ``(output, buffer)``."""
        reader = self._readers.get(channel)
        if reader is None:
            reader = self._readers[channel] = RecordReader(self._max_record_size)
        out: list[tuple[int, Buffer]] = []
        for batch in reader.feed(buffer):
            out.extend(self._route(batch))
        return out

    def _route(self, batch: RecordBatch) -> list[tuple[int, Buffer]]:
        data = np.frombuffer(batch.data, np.uint8)
        offsets, lengths = batch.offsets, batch.lengths
        if (lengths < self.key.offset + self._width).any():
            raise CorruptRecordError(
                f"a record is too short for its key at byte {self.key.offset}",
                detail=f"shortest record: {int(lengths.min())} bytes",
            )
        at = (offsets + self.key.offset)[:, None] + np.arange(self._width)
        dtype = "<i8" if self._width == 8 else "<i4"
        keys = data[at].view(dtype).reshape(-1).astype(np.int64)
        outs = self._table[partitions_of(self.partitioner, keys, self.n_partitions)]
        out: list[tuple[int, Buffer]] = []
        for o in np.unique(outs[outs >= 0]).tolist():
            sel = outs == o
            starts, lens = offsets[sel], lengths[sel]
            ends = np.cumsum(lens)
            idx = np.repeat(starts - (ends - lens), lens) + np.arange(int(ends[-1]))
            payload = data[idx]
            out.extend(self._packer.put_batch(o, payload, _offsets(np.concatenate(([0], ends)))))
        kept = int((outs >= 0).sum())
        self.routed += kept
        self.dropped += len(outs) - kept
        return out

    def flush(self) -> list[tuple[int, Buffer]]:
        """Hands out every partly filled output buffer too (records begun on a channel stay)."""
        return list(self._packer.flush())

    def pending(self) -> dict[object, int]:
        """``{channel: bytes}`` of records begun and not yet complete."""
        return {c: r.pending_bytes for c, r in self._readers.items() if r.pending_bytes}
