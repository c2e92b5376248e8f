"""Keyed state and its snapshots: against a dict/list model, through files, across rescaling."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillover.errors import (
    BadMagicError,
    ConfigError,
    CorruptFrameError,
    ForeignFileError,
    FormatError,
    KeyGroupRangeError,
    RescaleError,
    StateFileExistsError,
    StateFileNotFoundError,
    TruncatedFileError,
    UnsupportedVersionError,
)
from spillover.keygroups import KeyGroupRange, key_group_range_for_operator, key_groups
from spillover.runtime.api import StateDescriptor
from spillover.runtime.state import (
    FORMAT_NAME,
    FORMAT_VERSION,
    HeapKeyedStateBackend,
    HeapListState,
    HeapSumState,
    split_even,
    union,
)

MAXP = 128
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
KEY_POOL = [*range(-6, 14), INT64_MIN, INT64_MAX, 1 << 40]
RECORD = np.dtype([("a", "<i4"), ("b", "<f8")])


def full_backend(**kw: Any) -> HeapKeyedStateBackend:
    return HeapKeyedStateBackend(MAXP, KeyGroupRange(0, MAXP - 1), **kw)


def arr(xs: list[int]) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


class Model:
    """The plain-dict reference of one state."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.d: dict[int, Any] = {}

    def put(self, keys: list[int], values: list[Any]) -> None:
        for k, v in zip(keys, values, strict=True):
            if self.kind == "value":
                self.d[k] = v
            elif self.kind == "sum":
                self.d[k] = self.d.get(k, 0) + v
            else:
                self.d.setdefault(k, []).append(v)

    def clear(self, keys: list[int]) -> None:
        for k in keys:
            self.d.pop(k, None)

    def rows(self) -> list[tuple[int, Any]]:
        if self.kind == "list":
            return [(k, v) for k in sorted(self.d) for v in self.d[k]]
        return [(k, self.d[k]) for k in sorted(self.d)]


def check_against(state: Any, model: Model, queries: list[int]) -> None:
    keys, values = state.items()
    assert keys.dtype == np.int64
    assert list(zip(keys.tolist(), values.tolist(), strict=True)) == model.rows()
    got, mask = state.get(arr(queries))
    assert mask.tolist() == [q in model.d for q in queries]
    if model.kind == "list":
        flat, offsets = state.get_lists(arr(queries))
        assert offsets.tolist()[0] == 0 and len(offsets) == len(queries) + 1
        for i, q in enumerate(queries):
            assert flat[offsets[i] : offsets[i + 1]].tolist() == model.d.get(q, [])
        assert got.tolist() == flat.tolist()
    else:
        assert got.tolist() == [model.d.get(q, 0) for q in queries]


key_lists = st.lists(st.sampled_from(KEY_POOL), max_size=12)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), key_lists, st.integers(0, 1 << 20)),
        st.tuples(st.just("clear"), key_lists, st.just(0)),
        st.tuples(st.just("check"), key_lists, st.just(0)),
    ),
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(
    kind=st.sampled_from(["value", "sum", "list"]),
    merge_rows=st.sampled_from([0, 1, 3, None]),
    steps=ops,
)
def test_state_matches_dict_model(kind: str, merge_rows: int | None, steps: list[Any]) -> None:
    backend = full_backend(merge_rows=merge_rows)
    state = backend.state(StateDescriptor("s", kind))
    assert backend.state(StateDescriptor("s", kind)) is state
    model = Model(kind)
    for op, keys, seed in steps:
        if op == "put":
            values = np.random.default_rng(seed).integers(-1000, 1000, len(keys)).tolist()
            state.put(arr(keys), arr(values))
            model.put(keys, values)
        elif op == "clear":
            state.clear(arr(keys))
            model.clear(keys)
        else:
            check_against(state, model, keys)
    check_against(state, model, KEY_POOL)


@settings(max_examples=100, deadline=None)
@given(
    merge_rows=st.sampled_from([0, 1, 3, None]),
    puts=st.lists(st.tuples(key_lists, st.integers(0, 1 << 20)), max_size=20),
)
def test_sum_add_is_put_then_get(merge_rows: int | None, puts: list[Any]) -> None:
    """``add`` (what keyed aggregates use) leaves the state as ``put`` would and returns
    the touched keys, distinct and in the order the batch first has them, with what
    ``get`` gives for them."""
    added = full_backend(merge_rows=merge_rows).state(StateDescriptor("s", "sum"))
    model = full_backend(merge_rows=merge_rows).state(StateDescriptor("s", "sum"))
    assert isinstance(added, HeapSumState)
    for keys, seed in puts:
        values = arr(np.random.default_rng(seed).integers(-1000, 1000, len(keys)).tolist())
        uniq, totals = added.add(arr(keys), values)
        model.put(arr(keys), values)
        assert uniq.tolist() == list(dict.fromkeys(keys))
        assert totals.tolist() == model.get(uniq)[0].tolist()
    assert [a.tolist() for a in added.items()] == [m.tolist() for m in model.items()]


def by_key(keys: np.ndarray, totals: np.ndarray) -> dict[int, int]:
    return dict(zip(keys.tolist(), totals.tolist(), strict=True))


def reference_add(state: HeapSumState, keys: np.ndarray, values: np.ndarray | None) -> Any:
    """``add`` as numpy does it (the path before the native one, kept for float sums)."""
    q = state._keys(keys)
    v = np.ones(q.size, np.int64) if values is None else state._values(values, q.size)
    return state._add_numpy(q, v)


range_backends = st.builds(
    lambda start, length, merge_rows: HeapKeyedStateBackend(
        MAXP, KeyGroupRange(start, min(MAXP - 1, start + length)), merge_rows=merge_rows
    ),
    st.integers(0, MAXP - 1),
    st.integers(0, MAXP),
    st.sampled_from([0, 1, 3, None]),
)
wide_keys = st.one_of(
    st.integers(-50, 200), st.integers(INT64_MIN, INT64_MAX), st.sampled_from(KEY_POOL)
)


@settings(max_examples=150, deadline=None)
@given(
    backend=range_backends,
    batches=st.lists(
        st.tuples(st.lists(wide_keys, max_size=40), st.booleans(), st.integers(0, 1 << 20)),
        max_size=12,
    ),
    strided=st.booleans(),
)
def test_native_sum_add_matches_the_numpy_reference(
    backend: HeapKeyedStateBackend, batches: list[Any], strided: bool
) -> None:
    """For any key batches and key-group range, the native ``add`` (or ``add_rows``,
    its result as ``(key, sum)`` rows) gives the numpy path's distinct keys and totals
    and leaves the same state; a batch with a key outside the range is refused by
    both, changing nothing."""
    twin = HeapKeyedStateBackend(
        MAXP, backend.key_group_range, merge_rows=backend._merge_rows, name="twin"
    )
    native = backend.state(StateDescriptor("s", "sum"))
    ref = twin.state(StateDescriptor("s", "sum"))
    assert isinstance(native, HeapSumState) and isinstance(ref, HeapSumState)
    rng = backend.key_group_range
    for keys, count, seed in batches:
        # Keep mostly keys of the range, so that most batches get through.
        kg = key_groups(arr(keys), MAXP) if keys else np.zeros(0, np.int32)
        inside = [k for k, g in zip(keys, kg.tolist(), strict=True) if rng.start <= g <= rng.end]
        use = keys if seed % 4 == 0 else inside
        values = None if count else arr(np.random.default_rng(seed).integers(-9, 9, len(use)))
        k = arr(use)
        if strided:  # a field of a record batch: read in place, unaligned
            rows = np.zeros(len(use), dtype=[("a", "<i4"), ("key", "<i8"), ("v", "<i8")])
            rows["key"] = k
            k = rows["key"]
            if values is not None:
                rows["v"] = values
                values = rows["v"]
        outside = len(use) != len(inside)
        as_rows = (seed >> 2) & 1 == 1  # independent of the outside-keys draw (seed % 4)
        if outside:
            for s in (native, ref):
                with pytest.raises(KeyGroupRangeError):
                    if s is ref:
                        reference_add(s, k, values)
                    elif as_rows:
                        s.add_rows(k, values)
                    else:
                        s.add(k, values)
        else:
            if as_rows:
                rows = native.add_rows(k, values)
                assert rows.shape == (len(set(use)), 2) and rows.flags.c_contiguous
                got = rows[:, 0], rows[:, 1]
            else:
                got = native.add(k, values)
            want = reference_add(ref, k, values)
            assert got[0].tolist() == list(dict.fromkeys(use))  # first-seen order
            assert want[0].tolist() == sorted(set(use))
            assert by_key(*got) == by_key(*want)
        assert [a.tolist() for a in native.items()] == [a.tolist() for a in ref.items()]


def test_native_sum_add_of_a_large_batch_wraps_like_numpy() -> None:
    """A batch past NOGIL_MIN_BYTES (the GIL released around the loop) sums as numpy
    does, int64 wrapping included."""
    big = np.random.default_rng(3).integers(0, 5_000, 20_000)
    values = np.full(big.size, INT64_MAX // 3, dtype=np.int64)
    native = full_backend().state(StateDescriptor("s", "sum"))
    ref = full_backend().state(StateDescriptor("s", "sum"))
    assert isinstance(native, HeapSumState) and isinstance(ref, HeapSumState)
    for part in (big[:7_000], big, big[::-1].copy()):
        v = values[: part.size]
        got, want = native.add(part, v), reference_add(ref, part, v)
        assert by_key(*got) == by_key(*want)
    counted, _ = native.add(big)
    assert counted.size == np.unique(big).size


def test_repeated_keys_within_one_put() -> None:
    b = full_backend()
    v, s, lst = (b.state(StateDescriptor(k, k)) for k in ("value", "sum", "list"))
    keys, vals = arr([5, 7, 5, 5, 7]), arr([1, 2, 3, 4, 5])
    for st_ in (v, s, lst):
        st_.put(keys, vals)
    assert v.get(arr([5, 7]))[0].tolist() == [4, 5]  # last in array order wins
    assert s.get(arr([5, 7]))[0].tolist() == [8, 7]
    assert isinstance(lst, HeapListState)
    flat, offsets = lst.get_lists(arr([7, 5, 7]))
    assert flat.tolist() == [2, 5, 1, 3, 4, 2, 5] and offsets.tolist() == [0, 2, 5, 7]


def test_float_sum_and_structured_values() -> None:
    b = full_backend(merge_rows=1)
    s = b.state(StateDescriptor("f", "sum", np.float64))
    rng = np.random.default_rng(1)
    keys = rng.integers(0, 50, 2000)
    vals = rng.random(2000)
    for part in range(4):
        s.put(keys[part::4], vals[part::4])
    got, mask = s.get(np.arange(50))
    expected = np.zeros(50)
    np.add.at(expected, keys, vals)
    np.testing.assert_allclose(got, expected)
    assert mask.tolist() == [k in set(keys.tolist()) for k in range(50)]
    with pytest.raises(TypeError):
        b.state(StateDescriptor("i", "sum")).put(arr([1]), np.array([0.5]))

    rec = b.state(StateDescriptor("r", "value", RECORD))
    batch = np.array([(1, 0.5), (2, 1.5), (3, 2.5)], dtype=RECORD)
    rec.put(arr([9, 8, 9]), batch)
    got, mask = rec.get(arr([9, 8, 1]))
    assert got[:2].tolist() == [(3, 2.5), (2, 1.5)] and mask.tolist() == [True, True, False]
    # A field subset of a wider record batch converts by field.
    wide = np.zeros(2, dtype=[("key", "<i8"), ("a", "<i4"), ("b", "<f8")])
    wide["a"], wide["b"] = [7, 8], [0.25, 0.75]
    rec.put(arr([1, 2]), wide[["a", "b"]])
    assert rec.get(arr([1, 2]))[0].tolist() == [(7, 0.25), (8, 0.75)]


def test_descriptor_checks() -> None:
    b = full_backend()
    b.state(StateDescriptor("x", "value"))
    with pytest.raises(ConfigError):
        b.state(StateDescriptor("x", "list"))
    with pytest.raises(ConfigError):
        b.state(StateDescriptor("x", "value", np.float64))
    with pytest.raises(ConfigError):
        b.state(StateDescriptor("y", "sum", np.int32))
    with pytest.raises(ConfigError):
        b.state(StateDescriptor("y", "reduce"))
    with pytest.raises(ConfigError):
        b.state(StateDescriptor("y", "value", np.dtype("U4")))
    with pytest.raises(ConfigError):
        b.state(StateDescriptor("y", "list", np.dtype([("n", [("m", "<i4")])])))
    s = b.state(StateDescriptor("x", "value"))
    with pytest.raises(ValueError):
        s.put(arr([1, 2]), arr([1]))
    with pytest.raises(TypeError):
        s.put(np.array([1.0]), arr([1]))
    with pytest.raises(TypeError):
        s.get(np.array([1], dtype=np.uint64))


def test_keys_outside_the_range_are_refused() -> None:
    rng = key_group_range_for_operator(MAXP, 4, 1)
    b = HeapKeyedStateBackend(MAXP, rng)
    keys = np.arange(1000, dtype=np.int64)
    kg = key_groups(keys, MAXP)
    inside, outside = keys[(kg >= rng.start) & (kg <= rng.end)], keys[kg > rng.end]
    for kind in ("value", "sum", "list"):
        s = b.state(StateDescriptor(kind, kind))
        s.put(inside, inside)
        calls: list[tuple[Callable[..., Any], tuple[Any, ...]]] = [
            (s.put, (outside, outside)),
            (s.get, (outside,)),
            (s.clear, (outside,)),
        ]
        for method, args in calls:
            with pytest.raises(KeyGroupRangeError) as ei:
                method(*args)
            assert ei.value.detail is not None
        assert s.items()[0].size == np.unique(inside).size
    unchecked = HeapKeyedStateBackend(MAXP, rng, check_key_groups=False)
    unchecked.state(StateDescriptor("v", "value")).put(outside, outside)
    with pytest.raises(ConfigError):
        HeapKeyedStateBackend(MAXP, KeyGroupRange(0, MAXP))


def test_state_bytes_follows_the_state() -> None:
    b = full_backend()
    assert b.state_bytes() == 0
    s = b.state(StateDescriptor("l", "list"))
    s.put(np.arange(10_000), np.arange(10_000))
    grown = b.state_bytes()
    assert grown >= 10_000 * 16
    s.clear(np.arange(10_000))
    s.items()
    assert b.state_bytes() < grown


# ---- snapshots ----


def fill(b: HeapKeyedStateBackend, keys: np.ndarray, values: np.ndarray) -> dict[str, Model]:
    """Puts ``keys``/``values`` into a value, a sum, a list and a structured list state."""
    models = {}
    for kind in ("value", "sum", "list"):
        b.state(StateDescriptor(kind, kind)).put(keys, values)
        models[kind] = Model(kind)
        models[kind].put(keys.tolist(), values.tolist())
    rec = np.zeros(keys.size, dtype=RECORD)
    rec["a"], rec["b"] = values, values / 4
    b.state(StateDescriptor("rec", "list", RECORD)).put(keys, rec)
    models["rec"] = Model("list")
    models["rec"].put(keys.tolist(), rec.tolist())
    return models


def descriptor(name: str) -> StateDescriptor:
    return StateDescriptor(name, "list", RECORD) if name == "rec" else StateDescriptor(name, name)


def test_snapshot_is_isolated_from_later_changes(tmp_path: Path) -> None:
    b = full_backend(merge_rows=2)
    keys = arr([1, 2, 3, 2, 1])
    models = fill(b, keys, keys * 10)
    write = b.snapshot()
    for name in models:
        s = b.state(descriptor(name))
        s.put(arr([1, 4]), np.zeros(2, dtype=s.items()[1].dtype))
        s.clear(arr([2]))
    handle = write(str(tmp_path))
    restored = full_backend()
    restored.restore([handle])
    for name, model in models.items():
        check_against(restored.state(descriptor(name)), model, [1, 2, 3, 4])


def test_write_restore_round_trip_on_every_backend(
    storage_location: tuple[str, dict[str, Any]],
) -> None:
    uri, _ = storage_location
    b = HeapKeyedStateBackend.for_subtask(MAXP, 2, 1, name="win/op 1")
    keys = np.arange(-200, 200, dtype=np.int64)
    keys = keys[key_groups(keys, MAXP) >= 64]
    keys = np.concatenate([keys, keys[::3]])
    models = fill(b, keys, np.arange(keys.size, dtype=np.int64))
    handle = json.loads(json.dumps(b.snapshot()(uri)))  # the handle is plain JSON
    assert handle["format"] == FORMAT_NAME and handle["version"] == FORMAT_VERSION
    assert handle["max_parallelism"] == MAXP and handle["key_group_range"] == [64, 127]
    assert [e["rows"] for e in handle["states"]] == [len(m.rows()) for m in models.values()]
    assert handle["bytes"] == sum(e["bytes"] for e in handle["states"]) > 0
    assert all("win_op_1" in e["uri"] for e in handle["states"])
    r = HeapKeyedStateBackend.for_subtask(MAXP, 2, 1)
    r.restore([handle])
    assert r.state_names() == list(models)
    for name, model in models.items():
        check_against(r.state(descriptor(name)), model, keys[:20].tolist())
    with pytest.raises(StateFileExistsError):
        b.snapshot()(uri)


def test_file_layout(tmp_path: Path) -> None:
    b = full_backend()
    keys = np.random.default_rng(3).integers(-(10**9), 10**9, 500)
    fill(b, keys, keys)
    handle = b.snapshot()(str(tmp_path))
    for entry in handle["states"]:
        table = pa.ipc.open_file(pa.memory_map(entry["uri"])).read_all()
        assert table.schema.names == ["key_group", "key", "value"]
        assert table.schema.field("key_group").type == pa.int32()
        assert table.schema.field("key").type == pa.int64()
        meta = {k.decode(): v.decode() for k, v in table.schema.metadata.items()}
        assert meta["spillover.format"] == FORMAT_NAME
        assert meta["spillover.format_version"] == str(FORMAT_VERSION)
        assert meta["spillover.state.name"] == entry["name"]
        assert meta["spillover.state.kind"] == entry["kind"]
        assert meta["spillover.max_parallelism"] == str(MAXP)
        kg = table.column("key_group").to_numpy()
        k = table.column("key").to_numpy()
        assert np.array_equal(kg, key_groups(k, MAXP))
        order = np.lexsort((k, kg))  # sorted by key group, then key; append order kept
        assert np.array_equal(order, np.arange(k.size))
        assert os.path.getsize(entry["uri"]) == entry["bytes"]
    rec = next(e for e in handle["states"] if e["name"] == "rec")
    table = pa.ipc.open_file(pa.memory_map(rec["uri"])).read_all()
    assert table.schema.field("value").type == pa.struct([("a", pa.int32()), ("b", pa.float64())])


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 8), m=st.integers(1, 8), seed=st.integers(0, 2**32 - 1))
def test_restore_at_another_parallelism(n: int, m: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    keys = rng.integers(-(10**6), 10**6, int(rng.integers(0, 400)))
    keys = np.concatenate([keys, rng.choice(keys, keys.size // 2)]) if keys.size else keys
    values = rng.integers(0, 1000, keys.size)
    owner = key_groups(keys, MAXP).astype(np.int64) * n // MAXP
    models = {k: Model("list" if k == "rec" else k) for k in ("value", "sum", "list", "rec")}
    with tempfile.TemporaryDirectory() as d:
        handles = []
        for i in range(n):
            old = HeapKeyedStateBackend.for_subtask(MAXP, n, i)
            mine = owner == i
            for name, model in fill(old, keys[mine], values[mine]).items():
                models[name].d.update(model.d)  # old subtasks hold disjoint keys
            handles.append(old.snapshot()(d))  # every old subtask writes into one directory
        seen: dict[str, list[tuple[int, Any]]] = {k: [] for k in models}
        for j in range(m):
            new = HeapKeyedStateBackend.for_subtask(MAXP, m, j)
            new.restore(handles)
            rng_j = new.key_group_range
            for name in models:
                got_keys, got_values = new.state(descriptor(name)).items()
                kg = key_groups(got_keys, MAXP)
                assert ((kg >= rng_j.start) & (kg <= rng_j.end)).all()
                seen[name].extend(zip(got_keys.tolist(), got_values.tolist(), strict=True))
    for name, model in models.items():
        assert sorted(seen[name]) == sorted(model.rows())
        if name != "list":
            continue
        for k, vs in model.d.items():  # order of each key's list is kept
            assert [v for kk, v in seen[name] if kk == k] == vs


# ---- refusals ----


def snapshot_handle(tmp_path: Path) -> dict[str, Any]:
    b = full_backend()
    b.state(StateDescriptor("v", "value")).put(arr([1, 2, 3]), arr([4, 5, 6]))
    handle: dict[str, Any] = b.snapshot()(str(tmp_path))
    return handle


def rewrite_metadata(path: str, **changes: str) -> None:
    table = pa.ipc.open_file(pa.memory_map(path)).read_all()
    meta = dict(table.schema.metadata)
    meta.update({f"spillover.{k}".encode(): v.encode() for k, v in changes.items()})
    table = table.replace_schema_metadata(meta)
    with pa.OSFile(path, "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)


def test_unknown_versions_are_refused(tmp_path: Path) -> None:
    handle = snapshot_handle(tmp_path)
    with pytest.raises(UnsupportedVersionError):
        full_backend().restore([{**handle, "version": 2}])
    path = handle["states"][0]["uri"]
    rewrite_metadata(path, format_version="2")
    with pytest.raises(UnsupportedVersionError) as ei:
        full_backend().restore([handle])
    assert ei.value.path == path and path in str(ei.value)


def test_other_max_parallelism_is_refused(tmp_path: Path) -> None:
    handle = snapshot_handle(tmp_path)
    with pytest.raises(RescaleError):
        HeapKeyedStateBackend(256, KeyGroupRange(0, 255)).restore([handle])
    path = handle["states"][0]["uri"]
    rewrite_metadata(path, max_parallelism="256")
    with pytest.raises(RescaleError) as ei:
        full_backend().restore([handle])
    assert ei.value.path == path


def test_damaged_or_foreign_files_are_refused(tmp_path: Path) -> None:
    handle = snapshot_handle(tmp_path / "a")
    path = handle["states"][0]["uri"]
    data = Path(path).read_bytes()

    Path(path).write_bytes(data[: len(data) // 2])
    with pytest.raises(TruncatedFileError) as ei:
        full_backend().restore([handle])
    assert ei.value.path == path

    Path(path).write_bytes(b"PAR1" + data[4:])
    with pytest.raises(BadMagicError):
        full_backend().restore([handle])

    table = pa.table({"key_group": pa.array([0], pa.int32()), "key": [1], "value": [1]})
    with pa.OSFile(path, "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    with pytest.raises(BadMagicError):
        full_backend().restore([handle])

    Path(path).write_bytes(data)
    with pytest.raises(ForeignFileError):
        full_backend().restore([{**handle, "states": [{**handle["states"][0], "rows": 4}]}])
    rewrite_metadata(path, **{"state.name": "w"})
    with pytest.raises(ForeignFileError):
        full_backend().restore([handle])

    Path(path).write_bytes(data)
    table = pa.ipc.open_file(pa.memory_map(path)).read_all()
    swapped = table.set_column(1, "key", pa.array([3, 2, 1], pa.int64()))
    with pa.OSFile(path, "wb") as f, pa.ipc.new_file(f, swapped.schema) as w:
        w.write_table(swapped)
    with pytest.raises(CorruptFrameError):
        full_backend().restore([handle])

    os.unlink(path)
    with pytest.raises(StateFileNotFoundError):
        full_backend().restore([handle])
    with pytest.raises(FormatError):
        full_backend().restore([{"format": "something else"}])


def test_restore_checks_how_handles_fit(tmp_path: Path) -> None:
    handle = snapshot_handle(tmp_path)
    with pytest.raises(RescaleError):
        full_backend().restore([handle, handle])
    # A handle whose range misses this backend's is not even opened.
    missing = {
        **handle,
        "key_group_range": [0, 63],
        "states": [{**handle["states"][0], "uri": "/nope"}],
    }
    HeapKeyedStateBackend.for_subtask(MAXP, 2, 1).restore([missing])
    declared = full_backend()
    declared.state(StateDescriptor("v", "list"))
    with pytest.raises(ConfigError):
        declared.restore([handle])
    # Restored rows are added as put adds them.
    b = full_backend()
    s = b.state(StateDescriptor("v", "value"))
    s.put(arr([1, 9]), arr([0, 9]))
    b.restore([handle])
    assert s.items()[1].tolist() == [4, 5, 6, 9]


# ---- operator state redistribution ----

partitions = st.lists(st.lists(st.integers(), max_size=10), max_size=8)


@given(parts=partitions, p=st.integers(1, 12))
def test_split_even_loses_nothing_and_balances(parts: list[list[int]], p: int) -> None:
    out = split_even(parts, p)
    assert len(out) == p
    assert [x for chunk in out for x in chunk] == [x for part in parts for x in part]
    sizes = [len(chunk) for chunk in out]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    with pytest.raises(ConfigError):
        split_even(parts, 0)


@given(parts=partitions)
def test_union_gives_everything(parts: list[list[int]]) -> None:
    assert union(parts) == [x for part in parts for x in part]
    assert split_even([union(parts)], 1) == [union(parts)]
