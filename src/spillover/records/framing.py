"""Record framing: length-prefixed records in network buffers, written, read
and joined across buffer boundaries (natively, the GIL released)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from spillover._native import _records
from spillover.errors import ConfigError, CorruptRecordError

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
    buffers where they do not fit. With ``whole_records``, a record that does not
    fit in what is left of a buffer starts the next one instead, when at most an
    eighth of the buffer is left empty (the buffer goes out short): small records
    are then never split and a reader views them in place. Readers take both
    kinds of stream.
    Buffers are new numpy ``uint8`` arrays the caller owns.
    """

    def __init__(self, buffer_size: int = DEFAULT_BUFFER_SIZE, whole_records: bool = False) -> None:
        _check_buffer_size(buffer_size)
        self.buffer_size = buffer_size
        self._packer = _records.Packer(buffer_size, 1, whole_records)

    def write(self, record: object) -> list[Buffer]:
        """Appends one record (any contiguous buffer); returns the buffers it filled."""
        return [b for _, b in self._packer.put(0, record)]

    def write_batch(self, data: object, offsets: npt.ArrayLike) -> list[Buffer]:
        """Appends records ``data[offsets[i]:offsets[i+1]]`` in one native call.

        ``offsets`` has one entry more than there are records, like Arrow's.
        """
        return [b for _, b in self._packer.put_batch(0, data, _offsets(offsets))]

    def write_fixed(self, data: object, width: int) -> list[Buffer]:
        """Appends the records of ``data``, ``width`` bytes each back to back (the bytes
        of a structured batch), in one native call without an offsets array."""
        return [b for _, b in self._packer.put_fixed(0, data, width)]

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

    def feed_fixed(self, buffer: object, width: int) -> tuple[Buffer | None, int, int]:
        """:meth:`feed` for records of ``width`` bytes each, as ``(carried, start, count)``:
        ``carried`` the record that began in an earlier buffer (a copy) or None, then
        ``count`` records lying wholly in ``buffer`` at ``start + i * (width + 4)``, so a
        caller can view them with a stride instead of building offsets. A record of
        another length raises :class:`~spillover.errors.CorruptRecordError`."""
        carried, start, count, bad = self._core.feed_fixed(buffer, width)
        if bad < 0 and carried is not None and len(carried) != width:
            bad = len(carried)
        if bad >= 0:
            raise CorruptRecordError(
                f"a record of {bad} bytes where every record has {width}",
                hint="the channel carries records of another type",
            )
        return carried, start, count

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
