"""One-batch Arrow IPC files of fixed-width columns, at the cost of gathering them.

A keyed-state file (:mod:`.files`) is one record batch of fixed-width columns in
Arrow's IPC file format. Apart from the columns, its bytes are a function of the
row count alone: the schema's message, the batch's metadata (its length, each
buffer's offset and length, the body's length) and the footer. A :class:`Layout`
learns that function once per schema from files pyarrow writes, checks it against
more of them, and then writes each file as those bytes with their numbers set and
the columns gathered straight into place (numpy; no pyarrow call, no batch). The
files are pyarrow's, byte for byte; a schema whose files do not check out (a
pyarrow that lays them out otherwise, a column that is not fixed-width) gets no
layout, and its caller writes with pyarrow as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

__all__ = ["Layout", "learn", "pyarrow_file"]

# The row counts a layout is learned from: odd, so that every offset differs from
# every length, and apart, so that every number the row count sets differs.
_PROBES = (37, 1001)
# And those it is checked against before it is used.
_CHECKS = (1, 2, 3, 4, 5, 7, 8, 64, 255, 256)


def _pad(n: int) -> int:
    return (n + 7) & ~7


def _columns(t: pa.DataType, widths: list[int], dtypes: list[np.dtype[Any]]) -> bool:
    """Appends each buffer's bytes per row of a column of type ``t``, in the order
    of the IPC body (a validity buffer: 0), and each column's numpy dtype; False
    unless it is fixed-width bytes."""
    if pa.types.is_struct(t):
        widths.append(0)
        return t.num_fields > 0 and all(
            _columns(t.field(i).type, widths, dtypes) for i in range(t.num_fields)
        )
    if not (pa.types.is_integer(t) or pa.types.is_floating(t)):
        return False  # booleans are bits, others have offsets or children
    widths.extend((0, t.bit_width // 8))
    dtypes.append(np.dtype(t.to_pandas_dtype()))
    return True


def _variables(widths: Sequence[int], rows: int) -> tuple[npt.NDArray[np.int64], list[int]]:
    """The numbers ``rows`` sets in a file: the rows, the body's length, each
    buffer's offset and length; and the offsets alone."""
    lengths = [w * rows for w in widths]
    offsets, at = [], 0
    for n in lengths:
        offsets.append(at)
        at += _pad(n)
    return np.array([rows, at, *offsets, *lengths], np.int64), offsets


class Layout:
    """The bytes of one schema's one-batch IPC files, as a function of the row count."""

    def __init__(
        self,
        widths: Sequence[int],
        dtypes: Sequence[np.dtype[Any]],
        prefix: bytes,
        meta: bytes,
        tail: bytes,
        slots: tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]],
        tail_slots: tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]],
    ) -> None:
        self.widths = tuple(widths)
        self.dtypes = tuple(dtypes)  # of the columns, in the body's order
        self._data = [i for i, w in enumerate(widths) if w]  # buffers holding columns
        self._prefix = np.frombuffer(prefix, np.uint8)
        self._meta = np.frombuffer(meta, np.uint8)
        self._tail = np.frombuffer(tail, np.uint8)
        self._body_at = len(prefix) + len(meta)
        self._slots, self._tail_slots = slots, tail_slots

    def write(
        self, sources: Sequence[npt.NDArray[Any]], order: npt.NDArray[np.intp]
    ) -> npt.NDArray[np.uint8]:
        """The file whose columns are ``sources`` (one per column, fields of a struct
        in turn, each as long as ``order``) taken in ``order`` (a permutation:
        ``np.argsort``'s; at least one row)."""
        rows = order.size
        if len(sources) != len(self.dtypes) or rows < 1:
            raise ValueError(f"{len(sources)} columns of {rows} rows")
        for src, dtype in zip(sources, self.dtypes, strict=True):
            if src.dtype != dtype or src.shape != (rows,):
                raise ValueError(f"a column of {src.shape} {src.dtype} for {rows} {dtype}")
        values, offsets = _variables(self.widths, rows)
        body_at = self._body_at
        tail_at = body_at + int(values[1])
        out = np.empty(tail_at + self._tail.size, np.uint8)
        out[: self._prefix.size] = self._prefix
        meta = out[self._prefix.size : body_at]
        meta[:] = self._meta
        words, which = self._slots
        meta.view(np.int64)[words] = values[which]
        for i, src in zip(self._data, sources, strict=True):
            n, at = self.widths[i] * rows, body_at + offsets[i]
            # (clip: in range by construction, and numpy then gathers straight into out)
            np.take(src, order, out=out[at : at + n].view(src.dtype), mode="clip")
            out[at + n : at + _pad(n)] = 0
        tail = out[tail_at:]
        tail[:] = self._tail
        words, which = self._tail_slots
        tail[: tail.size & ~7].view(np.int64)[words] = values[which]
        return out


def _leaves(t: pa.DataType, rows: int, gen: np.random.Generator) -> tuple[pa.Array, list[Any]]:
    """A column of type ``t`` with random values, and its leaves as numpy arrays."""
    if pa.types.is_struct(t):
        parts = [_leaves(t.field(i).type, rows, gen) for i in range(t.num_fields)]
        fields = [t.field(i) for i in range(t.num_fields)]
        array = pa.StructArray.from_arrays([a for a, _ in parts], fields=fields)
        return array, [leaf for _, leaves in parts for leaf in leaves]
    raw = gen.integers(0, 256, rows * (t.bit_width // 8), dtype=np.uint8)
    leaf = raw.view(t.to_pandas_dtype())
    return pa.array(leaf, type=t), [leaf]


def _sample(schema: pa.Schema, rows: int, seed: int) -> tuple[pa.Buffer, list[Any]]:
    gen = np.random.default_rng(seed)
    parts = [_leaves(field.type, rows, gen) for field in schema]
    batch = pa.record_batch([a for a, _ in parts], schema=schema)
    return pyarrow_file(batch), [leaf for _, leaves in parts for leaf in leaves]


def pyarrow_file(batch: pa.RecordBatch) -> pa.Buffer:
    """``batch`` as an IPC file written by pyarrow's own writer."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue()


def _split(data: bytes, body: int) -> tuple[bytes, bytes, bytes] | None:
    """A one-batch file's schema part, batch metadata and tail (its body cut out)."""
    at = 8
    parts = []
    for _ in range(2):  # the schema's message, then the batch's
        if data[at : at + 4] != b"\xff\xff\xff\xff":
            return None
        size = int.from_bytes(data[at + 4 : at + 8], "little")
        parts.append(at)
        at += 8 + size
    start, end = parts[1], at
    if start % 8 or end % 8 or len(data) < end + body:
        return None
    return data[:start], data[start:end], data[end + body :]


def _slots(
    a: bytes, b: bytes, va: npt.NDArray[np.int64], vb: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]] | None:
    """The 8-byte words that differ between ``a`` and ``b`` (the same bytes at two
    row counts), each with the variable it holds; None if one holds none."""
    n = len(a) & ~7
    wa, wb = np.frombuffer(a[:n], np.int64), np.frombuffer(b[:n], np.int64)
    words, which = [], []
    for w in np.flatnonzero(wa != wb):
        hits = np.flatnonzero((va == wa[w]) & (vb == wb[w]))
        if not hits.size:
            return None
        words.append(w)
        which.append(hits[0])
    if a[n:] != b[n:]:
        return None
    return np.array(words, np.intp), np.array(which, np.intp)


def learn(schema: pa.Schema) -> Layout | None:
    """The layout of ``schema``'s files, learned from pyarrow's and checked against
    more of them; None if its columns are not all fixed-width or its files do not
    follow one (the caller writes with pyarrow)."""
    widths: list[int] = []
    dtypes: list[np.dtype[Any]] = []
    if not all(_columns(field.type, widths, dtypes) for field in schema):
        return None
    try:
        return _learn(schema, widths, dtypes)
    except (pa.ArrowException, ValueError):
        return None  # pyarrow could not write it either: the caller's write will say why


def _learn(schema: pa.Schema, widths: list[int], dtypes: list[np.dtype[Any]]) -> Layout | None:
    (va, _), (vb, _) = (_variables(widths, n) for n in _PROBES)
    (fa, _), (fb, _) = (_sample(schema, n, n) for n in _PROBES)
    a, b = _split(fa.to_pybytes(), int(va[1])), _split(fb.to_pybytes(), int(vb[1]))
    if a is None or b is None or a[0] != b[0] or len(a[1]) != len(b[1]) or len(a[2]) != len(b[2]):
        return None
    meta, tail = _slots(a[1], b[1], va, vb), _slots(a[2], b[2], va, vb)
    if meta is None or tail is None:
        return None
    layout = Layout(widths, dtypes, a[0], a[1], a[2], meta, tail)
    for rows in _CHECKS:
        expected, leaves = _sample(schema, rows, rows)
        got = layout.write(leaves, np.arange(rows, dtype=np.intp))
        if got.tobytes() != expected.to_pybytes():
            return None
    return layout
