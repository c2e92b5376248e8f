"""Serializers: how a record's payload becomes bytes and back, per batch."""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from spillover.errors import ConfigError, CorruptRecordError
from spillover.keygroups import (
    _byte_view,
)
from spillover.records.framing import (
    Buffer,
    RecordBatch,
    RecordReader,
    T,
)

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

    def read_buffer(self, reader: RecordReader, buffer: Any) -> npt.NDArray[Any]:
        """The records that end in one network ``buffer`` of ``reader``'s channel as one
        array: a strided view of ``buffer`` (no copy, no per-buffer offsets), or, when a
        record spanned into it from the previous buffer, that record and the view
        joined (one copy). What ``deserialize_batch`` over ``reader.feed(buffer)``
        gives, joined, with less work per buffer."""
        width = self.dtype.itemsize
        carried, start, count = reader.feed_fixed(buffer, width)
        data = np.frombuffer(buffer, np.uint8)
        if carried is None:
            view: npt.NDArray[Any] = np.ndarray(
                (count,), self.dtype, buffer=data, offset=start, strides=(width + 4,)
            )
            return view
        # Joined as rows of bytes: numpy copies a structured dtype field by field.
        out: npt.NDArray[Any] = np.empty(count + 1, self.dtype)
        rows = out.view(np.uint8).reshape(count + 1, width)
        rows[0] = np.frombuffer(carried, np.uint8)
        if count:
            rows[1:] = np.ndarray(
                (count, width), np.uint8, buffer=data, offset=start, strides=(width + 4, 1)
            )
        return out

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
