"""Keyed-state files written from a learned layout are pyarrow's own, byte for byte."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillover.keygroups import KeyGroupRange
from spillover.runtime.api import StateDescriptor
from spillover.runtime.state import HeapKeyedStateBackend, files, ipcfile
from spillover.runtime.state.heap import KINDS

SCALARS = [
    np.dtype(t)
    for t in (
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.uint16,
        np.uint32,
        np.uint64,
        np.float16,
        np.float32,
        np.float64,
    )
]
scalar = st.sampled_from(SCALARS)
fields = st.lists(
    st.tuples(st.text("abcxyz_", min_size=1, max_size=6), scalar),
    min_size=1,
    max_size=4,
    unique_by=lambda f: f[0],
)
# Packed, aligned (padding between fields and after them), or fields out of order
# with room to spare: a structured value's field views are strided.
structured = st.one_of(
    fields.map(np.dtype),
    fields.map(lambda fs: np.dtype(fs, align=True)),
    fields.map(
        lambda fs: np.dtype(
            {
                "names": [n for n, _ in fs][::-1],
                "formats": [t for _, t in fs][::-1],
                "offsets": [8 * i for i in range(len(fs))][::-1],
                "itemsize": 8 * len(fs) + 3,
            }
        )
    ),
)
dtypes = st.one_of(scalar, structured)


def _schema(dtype: np.dtype[Any], name: str = "s", kind: str = "value") -> pa.Schema:
    return files._schema(name, kind, dtype, 128, 0, 63)


def _columns(dtype: np.dtype[Any], rows: int, seed: int) -> tuple[Any, Any, Any, Any]:
    gen = np.random.default_rng(seed)
    kg = gen.integers(0, 64, rows).astype(np.int32)
    keys = gen.integers(-(2**62), 2**62, rows)
    values = np.frombuffer(gen.bytes(rows * dtype.itemsize), dtype).copy()
    order = gen.permutation(rows).astype(np.intp)
    return kg, keys, values, order


def _pyarrow(dtype: np.dtype[Any], cols: tuple[Any, Any, Any, Any]) -> bytes:
    kg, keys, values, order = cols
    batch = pa.record_batch(
        [pa.array(kg[order]), pa.array(keys[order]), files._to_arrow(values[order], dtype)],
        schema=_schema(dtype),
    )
    return bytes(ipcfile.pyarrow_file(batch).to_pybytes())


@settings(max_examples=120, deadline=None)
@given(dtype=dtypes, rows=st.integers(1, 700), seed=st.integers(0, 2**32 - 1))
def test_a_learned_layout_writes_pyarrows_bytes(dtype: np.dtype[Any], rows: int, seed: int) -> None:
    """Any fixed-width state, any row count and order: the same file as pyarrow's
    writer, so every Arrow reader opens it as before (and nothing is versioned)."""
    layout = ipcfile.learn(_schema(dtype))
    assert layout is not None
    cols = _columns(dtype, rows, seed)
    kg, keys, values, order = cols
    leaves = [values] if dtype.names is None else [values[n] for n in dtype.names]
    got = layout.write([kg, keys, *leaves], order).tobytes()
    assert got == _pyarrow(dtype, cols)
    table = pa.ipc.open_file(pa.py_buffer(got)).read_all()
    assert np.array_equal(table.column("key").to_numpy(), keys[order])


def test_columns_that_are_not_fixed_width_bytes_get_no_layout() -> None:
    """Booleans are bits: such a state is written by pyarrow."""
    assert ipcfile.learn(_schema(np.dtype(np.bool_))) is None
    assert ipcfile.learn(_schema(np.dtype([("a", np.int64), ("b", np.bool_)]))) is None
    strings = pa.schema([("key", pa.int64()), ("value", pa.string())])
    assert ipcfile.learn(strings) is None


def test_a_layout_that_does_not_reproduce_pyarrows_files_is_not_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Learned from two files, a layout is checked against more before it is used:
    one that pads otherwise than the pyarrow installed is refused."""
    assert ipcfile.learn(_schema(np.dtype(np.float32))) is not None
    monkeypatch.setattr(ipcfile, "_pad", lambda n: (n + 15) & ~15)
    assert ipcfile.learn(_schema(np.dtype(np.float32))) is None


def test_a_layout_refuses_columns_that_do_not_fit_it() -> None:
    layout = ipcfile.learn(_schema(np.dtype(np.int64)))
    assert layout is not None and len(layout.dtypes) == 3
    kg, keys, values, order = _columns(np.dtype(np.int64), 4, 1)
    with pytest.raises(ValueError):
        layout.write([kg, keys], order)
    with pytest.raises(ValueError):
        layout.write([kg, keys, values.astype(np.int32)], order)
    with pytest.raises(ValueError):
        layout.write([kg[:0], keys[:0], values[:0]], order[:0])
    with pytest.raises(ValueError):  # the width of a key group, not its type
        layout.write([kg.astype(np.float32), keys, values], order)
    with pytest.raises(ValueError):  # shorter than the order
        layout.write([kg, keys, values[:3]], order)


def test_a_struct_without_fields_is_left_to_pyarrow() -> None:
    """Learning never raises: what pyarrow cannot write has no layout, and the
    write says why as before."""
    assert ipcfile.learn(_schema(np.dtype([]))) is None


def _fields(values: Any) -> list[bytes]:
    """A state's values as bytes, field by field (a structured dtype's padding is
    not part of the state)."""
    names = values.dtype.names or (None,)
    return [np.ascontiguousarray(values if n is None else values[n]).tobytes() for n in names]


@settings(max_examples=30, deadline=None)
@given(dtype=dtypes, rows=st.integers(0, 300), seed=st.integers(0, 2**32 - 1))
def test_snapshot_files_are_the_same_with_or_without_a_layout(
    tmp_path_factory: pytest.TempPathFactory, dtype: np.dtype[Any], rows: int, seed: int
) -> None:
    """A keyed snapshot's files and handle do not depend on how they were written,
    and restore the same rows (an empty state included)."""
    _, keys, values, _ = _columns(dtype, rows, seed)
    keys = np.unique(keys)
    values = values[: keys.size]
    rng = KeyGroupRange(0, 127)
    out = []
    for layout in (files.learn_layout("s", "value", dtype, 128, rng), None):
        root = tmp_path_factory.mktemp("w")
        copies = [("s", "value", dtype, keys, values, layout)]
        handle = files._write_snapshot(str(root), copies, 128, rng, "p", False)
        (entry,) = handle["states"]
        out.append((Path(entry["uri"]).read_bytes(), entry["bytes"], entry["rows"]))
        *_, got_keys, got_values = files._read_state_file(entry, handle, rng)
        by_key = np.argsort(got_keys, kind="stable")
        assert np.array_equal(got_keys[by_key], keys)
        assert _fields(got_values[by_key]) == _fields(values)  # (NaNs bit for bit)
    assert out[0] == out[1]
    assert out[0][1] == len(out[0][0])


@pytest.mark.parametrize("kind", KINDS)
def test_every_state_kind_is_written_from_a_layout(kind: str) -> None:
    """The dtypes each kind of state keeps (timers and sums int64 or float64, the
    others any numeric or structured numeric) are written without pyarrow's writer."""
    dtype = np.dtype(np.int64) if kind in ("timers", "sum") else np.dtype([("a", np.float32)])
    assert ipcfile.learn(_schema(dtype, kind=kind)) is not None


def test_a_state_learns_its_layout_when_declared_not_at_its_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The learning (a dozen pyarrow files, milliseconds cold) happens as an operator
    declares its state; its checkpoints, the first included, write from what it
    learned and restore as ever."""
    backend = HeapKeyedStateBackend(128, KeyGroupRange(0, 127))
    counts = backend.state(StateDescriptor("counts", "sum", np.int64))
    counts.put(np.arange(10, dtype=np.int64), np.ones(10, np.int64))

    def no_learning(schema: pa.Schema) -> None:
        raise AssertionError("a checkpoint learned a layout")

    monkeypatch.setattr(ipcfile, "learn", no_learning)
    monkeypatch.setattr(files, "learn", no_learning)
    monkeypatch.setattr(ipcfile, "pyarrow_file", no_learning)
    monkeypatch.setattr(files, "pyarrow_file", no_learning)
    handles = [backend.snapshot()(str(tmp_path / f"chk-{n}")) for n in (1, 2)]
    monkeypatch.undo()
    restored = HeapKeyedStateBackend(128, KeyGroupRange(0, 127))
    restored.restore([handles[-1]])
    got = restored.state(StateDescriptor("counts", "sum", np.int64))
    values, present = got.get(np.arange(10, dtype=np.int64))
    assert values.tolist() == [1] * 10 and present.all()
