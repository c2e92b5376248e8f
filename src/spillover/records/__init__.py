"""Records in network buffers: framing, serializers, keys and the key-group filter.

Every record is a 4-byte little-endian length (0 .. 2**31 - 1) followed by
that many bytes of serialized payload. Buffers of one channel are a stream of
such records; a record (its length prefix included) may be cut anywhere by a
buffer boundary and continue in the channel's next buffer. See
``docs/records-and-keygroups.md`` for the byte layout.

All loops over records run natively with the GIL released; Python code here
touches buffers, never records, except in the documented slow paths
(:class:`SelectorKey`, :class:`PickleSerializer`, per-record convenience
methods such as :meth:`RecordBatch.to_list`).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from spillover._native import _records
from spillover.errors import ConfigError, CorruptRecordError
from spillover.keygroups import (
    KeyType,
    _byte_view,
    assign_to_key_group,
    check_max_parallelism,
)

__all__ = [
    "MAX_RECORD_SIZE",
    "BytesSerializer",
    "FieldKey",
    "FixedWidthSerializer",
    "FrameJoiner",
    "Key",
    "KeyGroupDemux",
    "PickleSerializer",
    "RecordBatch",
    "RecordReader",
    "RecordWriter",
    "SelectorKey",
    "Serializer",
    "key_groups_of",
    "read_records",
    "write_records",
]

MAX_RECORD_SIZE: int = _records.MAX_RECORD_LENGTH
"""Largest payload a length prefix can announce (2**31 - 1, a Java int)."""

DEFAULT_BUFFER_SIZE = 32 * 1024
"""Flink's default network buffer size (``taskmanager.memory.segment-size``)."""

Buffer = npt.NDArray[np.uint8]
T = TypeVar("T")


def _check_buffer_size(buffer_size: int) -> None:
    if not 1 <= buffer_size <= 1 << 31:
        raise ConfigError(f"buffer_size must be in 1..2**31, got {buffer_size}")


def _check_max_record_size(max_record_size: int) -> None:
    if not 0 <= max_record_size <= MAX_RECORD_SIZE:
        raise ConfigError(f"max_record_size must be in 0..{MAX_RECORD_SIZE}, got {max_record_size}")


def _offsets(offsets: npt.ArrayLike) -> npt.NDArray[np.int64]:
    return np.ascontiguousarray(offsets, dtype=np.int64).reshape(-1)


# ---- batches, writer and reader ----


@dataclass(frozen=True, slots=True)
class RecordBatch:
    """Records as payload slices of one array: record ``i`` is ``data[offsets[i]:][:lengths[i]]``.

    ``copied`` is False when ``data`` is a view of the caller's buffer (valid as
    long as that buffer is not changed), True when the records were copied out
    (a record that spanned buffers).
    """

    data: Buffer
    offsets: npt.NDArray[np.int64]
    lengths: npt.NDArray[np.int64]
    copied: bool

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> memoryview:
        o = int(self.offsets[i])
        return self.data.data[o : o + int(self.lengths[i])]

    def __iter__(self) -> Iterator[memoryview]:
        mv = self.data.data
        for o, n in zip(self.offsets.tolist(), self.lengths.tolist(), strict=True):
            yield mv[o : o + n]

    def to_list(self) -> list[bytes]:
        """Every payload as ``bytes`` (one Python object per record: not for hot paths)."""
        return [bytes(m) for m in self]


class RecordWriter:
    """Packs records into fixed-size buffers with length-prefix framing.

    Every buffer handed out is exactly ``buffer_size`` bytes long except the
    one :meth:`flush` returns; records and length prefixes are split across
    buffers where they do not fit. Buffers are new numpy ``uint8`` arrays the
    caller owns.
    """

    def __init__(self, buffer_size: int = DEFAULT_BUFFER_SIZE) -> None:
        _check_buffer_size(buffer_size)
        self.buffer_size = buffer_size
        self._packer = _records.Packer(buffer_size, 1)

    def write(self, record: object) -> list[Buffer]:
        """Appends one record (any contiguous buffer); returns the buffers it filled."""
        return [b for _, b in self._packer.put(0, record)]

    def write_batch(self, data: object, offsets: npt.ArrayLike) -> list[Buffer]:
        """Appends records ``data[offsets[i]:offsets[i+1]]`` in one native call.

        ``offsets`` has one entry more than there are records, like Arrow's.
        """
        return [b for _, b in self._packer.put_batch(0, data, _offsets(offsets))]

    def flush(self) -> Buffer | None:
        """The partly filled last buffer (shorter than ``buffer_size``), or None if empty."""
        out = self._packer.flush()
        return out[0][1] if out else None

    @property
    def pending_bytes(self) -> int:
        """Bytes written but not yet handed out."""
        return self._packer.pending_bytes()


class FrameJoiner:
    """Joins each channel's buffers into one byte stream cut into ``buffer_size`` buffers.

    ``put_frames`` takes many buffers at once (for instance one read-ahead block's
    frames, ``Retriever.poll_frames``) and appends each, raw, to its output in one
    native call with the GIL released. Records stay framed and may be cut at the new
    buffer boundaries, as in any channel stream: read each output with its own
    :class:`RecordReader`. Fewer, larger buffers mean less Python per byte.
    """

    def __init__(self, n_outputs: int, buffer_size: int = 1 << 20) -> None:
        _check_buffer_size(buffer_size)
        if not 1 <= n_outputs < 1 << 31:
            raise ConfigError(f"n_outputs must be at least 1, got {n_outputs}")
        self.n_outputs = n_outputs
        self._packer = _records.Packer(buffer_size, n_outputs)

    def put_frames(
        self,
        data: object,
        offsets: npt.NDArray[np.int64],
        lengths: npt.NDArray[np.int64],
        outputs: npt.NDArray[np.int32],
    ) -> list[tuple[int, Buffer]]:
        """Appends ``data[offsets[i]:offsets[i] + lengths[i]]`` to output ``outputs[i]``
        (skipped when negative); returns the full buffers as ``(output, buffer)``."""
        return self._packer.put_frames(
            data,
            np.ascontiguousarray(offsets, np.int64),
            np.ascontiguousarray(lengths, np.int64),
            np.ascontiguousarray(outputs, np.int32),
        )

    def flush(self) -> list[tuple[int, Buffer]]:
        """Every partly filled buffer too, as ``(output, buffer)``."""
        return self._packer.flush()

    @property
    def pending_bytes(self) -> int:
        """Bytes joined but not yet handed out."""
        return self._packer.pending_bytes()


class RecordReader:
    """Turns one channel's buffers, fed in order, back into records.

    Records lying wholly in a buffer come back as zero-copy views of it; a
    record that spans buffers is reassembled into a new array (the only copy).
    A length prefix above ``max_record_size`` raises
    :class:`~spillover.errors.CorruptRecordError`, so garbage cannot ask for
    gigabytes of memory.
    """

    def __init__(self, max_record_size: int = MAX_RECORD_SIZE) -> None:
        _check_max_record_size(max_record_size)
        self._core = _records.Reassembler(max_record_size)

    def feed(self, buffer: object) -> list[RecordBatch]:
        """The records that end in ``buffer``, as at most two batches.

        First (if any) the record that began in an earlier buffer (a copy), then
        the records that lie wholly in ``buffer`` (views of it).
        """
        carried, offsets, lengths = self._core.feed(buffer)
        out = []
        if carried is not None:
            n = len(carried)
            out.append(
                RecordBatch(carried, np.zeros(1, np.int64), np.full(1, n, np.int64), copied=True)
            )
        if len(offsets):
            data = np.frombuffer(buffer, dtype=np.uint8)  # type: ignore[call-overload]
            out.append(RecordBatch(data, offsets, lengths, False))
        return out

    @property
    def pending_bytes(self) -> int:
        """Bytes of a record begun and not yet complete."""
        return self._core.pending_bytes

    def pending_raw(self) -> bytes:
        """The framed bytes of the record in progress, as they stood in the buffers.

        An unaligned checkpoint persists them: replayed into a fresh reader before the
        rest of the channel, they complete the record."""
        return self._core.pending_raw()

    def finish(self) -> None:
        """Checks that the stream ended on a record boundary."""
        if self._core.pending_bytes:
            pending = self._core.pending_bytes
            self._core.reset()
            raise CorruptRecordError(
                "the buffers end in the middle of a record",
                detail=f"{pending} bytes of an incomplete record",
                hint="a buffer of this channel is missing, or the stream was cut",
            )


def write_records(
    records: Iterable[object], buffer_size: int = DEFAULT_BUFFER_SIZE
) -> list[Buffer]:
    """Packs records into buffers, the last one possibly short (for tests and tools)."""
    w = RecordWriter(buffer_size)
    out = [b for r in records for b in w.write(r)]
    last = w.flush()
    return [*out, last] if last is not None else out


def read_records(buffers: Iterable[object], max_record_size: int = MAX_RECORD_SIZE) -> list[bytes]:
    """Every record of one channel's buffers as ``bytes`` (per-record Python: tests, tools)."""
    r = RecordReader(max_record_size)
    out = [rec for b in buffers for batch in r.feed(b) for rec in batch.to_list()]
    r.finish()
    return out


# ---- serializers ----


class Serializer(Protocol[T]):
    """Turns values into record payloads and back."""

    def serialize(self, value: T) -> bytes: ...

    def deserialize(self, payload: object) -> T: ...

    def serialize_batch(self, values: Any) -> tuple[Buffer, npt.NDArray[np.int64]]:
        """``(data, offsets)`` for :meth:`RecordWriter.write_batch`."""
        ...

    def deserialize_batch(self, batch: RecordBatch) -> Sequence[T]: ...


class BytesSerializer:
    """Records are raw bytes."""

    def serialize(self, value: object) -> bytes:
        return bytes(_byte_view(value))

    def deserialize(self, payload: object) -> bytes:
        return bytes(_byte_view(payload))

    def serialize_batch(self, values: Iterable[object]) -> tuple[Buffer, npt.NDArray[np.int64]]:
        parts = [bytes(_byte_view(v)) for v in values]
        offsets = np.zeros(len(parts) + 1, dtype=np.int64)
        np.cumsum([len(p) for p in parts], out=offsets[1:])
        return np.frombuffer(b"".join(parts), dtype=np.uint8), offsets

    def deserialize_batch(self, batch: RecordBatch) -> list[bytes]:
        return batch.to_list()


class FixedWidthSerializer:
    """Records are the bytes of one item of a numpy (structured) dtype.

    A batch deserializes to a numpy array: a zero-copy strided view of the
    buffer when the records sit at a regular stride (always the case within one
    buffer of fixed-width records), a gathered copy otherwise.
    """

    def __init__(self, dtype: npt.DTypeLike) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype.hasobject or self.dtype.itemsize == 0:
            raise ConfigError(f"dtype {self.dtype} has no fixed-width byte layout")

    def serialize(self, value: object) -> bytes:
        return np.asarray(value, dtype=self.dtype).tobytes()

    def deserialize(self, payload: object) -> Any:
        mv = _byte_view(payload)
        self._check_lengths(np.array([len(mv)]))
        return np.frombuffer(mv, dtype=self.dtype)[0]

    def serialize_batch(self, values: npt.ArrayLike) -> tuple[Buffer, npt.NDArray[np.int64]]:
        arr = np.ascontiguousarray(values, dtype=self.dtype).reshape(-1)
        offsets = np.arange(len(arr) + 1, dtype=np.int64) * self.dtype.itemsize
        return arr.view(np.uint8), offsets

    def _check_lengths(self, lengths: npt.NDArray[np.int64]) -> None:
        if (lengths != self.dtype.itemsize).any():
            bad = int(lengths[lengths != self.dtype.itemsize][0])
            raise CorruptRecordError(
                f"a record of {bad} bytes cannot be a {self.dtype} ({self.dtype.itemsize} bytes)"
            )

    def deserialize_batch(self, batch: RecordBatch) -> npt.NDArray[Any]:
        n = len(batch)
        self._check_lengths(batch.lengths)
        if n == 0:
            return np.empty(0, dtype=self.dtype)
        steps = np.diff(batch.offsets)
        stride = int(steps[0]) if n > 1 else self.dtype.itemsize
        if (steps == stride).all() and stride >= self.dtype.itemsize:
            view: npt.NDArray[Any] = np.ndarray(
                (n,), self.dtype, buffer=batch.data, offset=int(batch.offsets[0]), strides=(stride,)
            )
            return view
        idx = batch.offsets[:, None] + np.arange(self.dtype.itemsize)
        gathered: npt.NDArray[Any] = batch.data[idx].reshape(-1).view(self.dtype)
        return gathered


class PickleSerializer:
    """Records are pickles: slow, runs code on load, and breaks across versions.

    Only for values that never outlive the process that wrote them (tests,
    prototypes). It is never fit for anything persisted, such as a checkpoint
    restored by another version, so it refuses to work unless
    ``allow_unsafe=True``.
    """

    def __init__(self, *, allow_unsafe: bool = False, protocol: int = 5) -> None:
        if not allow_unsafe:
            raise ConfigError(
                "PickleSerializer refuses to run without allow_unsafe=True",
                detail="pickles execute code when loaded and break when classes change",
                hint="use FixedWidthSerializer or a schema-based serializer for persisted data",
            )
        self.protocol = protocol

    def serialize(self, value: object) -> bytes:
        return pickle.dumps(value, protocol=self.protocol)

    def deserialize(self, payload: object) -> Any:
        return pickle.loads(_byte_view(payload))

    def serialize_batch(self, values: Iterable[object]) -> tuple[Buffer, npt.NDArray[np.int64]]:
        return BytesSerializer().serialize_batch(self.serialize(v) for v in values)

    def deserialize_batch(self, batch: RecordBatch) -> list[Any]:
        return [pickle.loads(m) for m in batch]


# ---- keys ----

_KINDS = {
    "int32": _records.KEY_INT32,
    "int64": _records.KEY_INT64,
    "str": _records.KEY_STR,
    "bytes": _records.KEY_BYTES,
}


@dataclass(frozen=True, slots=True)
class FieldKey:
    """The key is a field of each payload, read natively.

    ``int32``/``int64``: a little-endian integer at byte ``offset``.
    ``str``/``bytes``: with ``length_prefixed`` (default), a 4-byte
    little-endian length then that many bytes (UTF-8 for ``str``) at
    ``offset``; without, the payload from ``offset`` to its end.
    """

    offset: int
    type: KeyType
    length_prefixed: bool = True

    def __post_init__(self) -> None:
        if self.type not in _KINDS:
            raise ConfigError(f"key type must be one of {sorted(_KINDS)}, got {self.type!r}")
        if not 0 <= self.offset < 1 << 31:
            raise ConfigError(f"key offset must be in 0..2**31-1, got {self.offset}")


@dataclass(frozen=True, slots=True)
class SelectorKey:
    """The key is what a Python function returns for a payload (``bytes``).

    The slow path: one Python call per record. The key is hashed as
    :func:`~spillover.keygroups.assign_to_key_group` does, with ``key_type``.
    """

    selector: Callable[[bytes], object]
    key_type: KeyType | None = None


Key = FieldKey | SelectorKey


def _key_group_fn(key: SelectorKey, max_parallelism: int) -> Callable[[bytes], int]:
    sel, kt = key.selector, key.key_type
    return lambda payload: assign_to_key_group(sel(payload), max_parallelism, kt)


def key_groups_of(
    buffer: object, max_parallelism: int, key: Key = FieldKey(0, "int64")
) -> npt.NDArray[np.int32]:
    """Key group (int32) of every record of a buffer that holds whole records only."""
    check_max_parallelism(max_parallelism)
    mv = _byte_view(buffer)
    if isinstance(key, FieldKey):
        kgs, end = _records.key_groups_of_buffer(
            mv, max_parallelism, _KINDS[key.type], key.offset, key.length_prefixed, MAX_RECORD_SIZE
        )
    else:
        offsets, lengths, end = _records.scan_records(mv, MAX_RECORD_SIZE)
        fn = _key_group_fn(key, max_parallelism)
        kgs = np.fromiter(
            (
                fn(bytes(mv[o : o + n]))
                for o, n in zip(offsets.tolist(), lengths.tolist(), strict=True)
            ),
            dtype=np.int32,
            count=len(offsets),
        )
    if end != len(mv):
        raise CorruptRecordError(
            "the buffer does not end on a record boundary",
            detail=f"{len(mv) - end} bytes of an incomplete record at byte {end}",
            hint="use KeyGroupDemux for buffers whose records span buffers",
        )
    return kgs


# ---- the filter ----


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
        key: Key = FieldKey(0, "int64"),
        buffer_size: int = DEFAULT_BUFFER_SIZE,
        max_record_size: int = MAX_RECORD_SIZE,
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
        )

    def push(self, buffer: object, channel: object = 0) -> list[tuple[int, Buffer]]:
        """Routes one input buffer; returns the output buffers it filled as ``(output, buffer)``."""
        return self._core.push(buffer, channel, self._selector)

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
        key: FieldKey = FieldKey(0, "int64"),
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
