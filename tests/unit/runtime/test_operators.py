"""The built-in operators, sources and sinks, driven directly (no runtime).

A recording output, a dict-backed keyed state and a fake clock stand in for the
task; the lifecycle calls (open, restore, process, on_timer, snapshot, notify,
close) are made by hand in the order the runtime makes them.
"""

from __future__ import annotations

import copy
import json
import os
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillover.errors import (
    BatchTypeError,
    ConfigError,
    KeyGroupRangeError,
    StateFileExistsError,
    StateFileNotFoundError,
)
from spillover.keygroups import key_group_range_for_operator, key_groups
from spillover.runtime.api import (
    Batch,
    Operator,
    OperatorContext,
    OperatorSnapshot,
    StateDescriptor,
)
from spillover.runtime.checkpointing.finishing import FINAL_WITHOUT_CHECKPOINTS
from spillover.runtime.connectors.collecting import CollectingSink
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.connectors.parquet import (
    ParquetSink,
    ParquetSource,
    arrow_to_batch,
    byte_matrix,
)
from spillover.runtime.connectors.throttled import PACE_SLACK, ThrottledSink
from spillover.runtime.operators import (
    CoMap,
    FilterOperator,
    FlatMapOperator,
    KeyedCount,
    KeyedProcess,
    KeyedSum,
    MapOperator,
)
from spillover.runtime.state import HeapKeyedStateBackend

KV = np.dtype([("key", "<i8"), ("value", "<i8")])


# ---- test doubles ----


class RecordingOutput:
    """Keeps every emitted batch."""

    def __init__(self) -> None:
        self.batches: list[Batch] = []

    def emit(self, batch: Batch) -> None:
        self.batches.append(batch)

    def all(self, dtype: Any = None) -> Batch:
        if not self.batches:
            return np.empty(0, dtype=dtype)
        return np.concatenate(self.batches)


class DictKeyedState:
    """A keyed state in a dict (per-key Python is fine in a test double)."""

    def __init__(self, d: StateDescriptor) -> None:
        self.kind = d.kind
        self.dtype = np.dtype(d.dtype)
        self.data: dict[int, Any] = {}

    def get(self, keys: Any) -> tuple[Any, Any]:
        mask = np.array([int(k) in self.data for k in keys], dtype=bool)
        values = np.zeros(len(keys), dtype=self.dtype)
        for i, k in enumerate(keys):
            if mask[i]:
                values[i] = self.data[int(k)]
        return values, mask

    def put(self, keys: Any, values: Any) -> None:
        for k, v in zip(keys.tolist(), np.asarray(values).tolist(), strict=True):
            if self.kind == "sum":
                self.data[k] = self.data.get(k, 0) + v
            elif self.kind == "list":
                self.data.setdefault(k, []).append(v)
            else:
                self.data[k] = v

    def items(self) -> tuple[Any, Any]:
        keys = np.array(sorted(self.data), dtype=np.int64)
        return keys, np.array([self.data[int(k)] for k in keys], dtype=self.dtype)

    def clear(self, keys: Any) -> None:
        for k in keys.tolist():
            self.data.pop(k, None)


class DictKeyedBackend:
    def __init__(self) -> None:
        self.states: dict[str, DictKeyedState] = {}

    def state(self, descriptor: StateDescriptor) -> DictKeyedState:
        if descriptor.name not in self.states:
            self.states[descriptor.name] = DictKeyedState(descriptor)
        return self.states[descriptor.name]

    def snapshot(self) -> Callable[[str], dict[str, Any]]:
        raise NotImplementedError

    def restore(self, handles: list[dict[str, Any]]) -> None:
        raise NotImplementedError


class FakeClock:
    """Monotonic time that only moves when someone sleeps (or the test says so)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.sleeps.append(seconds)
        self.now += seconds


def opened(
    op: Operator,
    *,
    subtask: int = 0,
    parallelism: int = 1,
    attempt: int = 0,
    keyed: Any = None,
    uid: str = "op-0",
    job_run: str | None = None,
) -> RecordingOutput:
    """Opens ``op`` with a fresh context; returns its output."""
    out = RecordingOutput()
    op.open(
        OperatorContext(
            uid=uid,
            name=uid,
            subtask_index=subtask,
            parallelism=parallelism,
            max_parallelism=128,
            attempt=attempt,
            output=out,
            keyed=keyed,
            job_run=job_run,
        )
    )
    return out


def kv(keys: list[int], values: list[int]) -> Batch:
    b = np.empty(len(keys), dtype=KV)
    b["key"], b["value"] = keys, values
    return b


def drain(src: Operator, max_calls: int = 100_000) -> None:
    for _ in range(max_calls):
        if not src.on_timer():
            return
    raise AssertionError("the source did not end")


def json_roundtrip(snap: OperatorSnapshot) -> Any:
    return json.loads(json.dumps(snap.operator_state))


# ---- map, filter, flat_map ----


def test_map_emits_the_functions_batch_and_checks_its_dtype() -> None:
    out_dtype = np.dtype([("key", "<i8"), ("double", "<i8")])

    def double(b: Batch) -> Batch:
        r = np.empty(len(b), out_dtype)
        r["key"], r["double"] = b["key"], b["value"] * 2
        return r

    op = MapOperator(double, out_dtype)
    out = opened(op)
    op.process(kv([1, 2], [10, 20]))
    op.process(kv([], []))
    assert len(out.batches) == 1
    assert out.batches[0]["double"].tolist() == [20, 40]

    bad = MapOperator(lambda b: b, out_dtype)
    opened(bad)
    with pytest.raises(BatchTypeError, match="wrong dtype") as e:
        bad.process(kv([1], [1]))
    assert isinstance(e.value, TypeError)
    notarray = MapOperator(lambda b: b.tolist(), KV)
    opened(notarray)
    with pytest.raises(BatchTypeError, match="structured array"):
        notarray.process(kv([1], [1]))
    shrinking = MapOperator(lambda b: b[:1], KV)
    opened(shrinking)
    with pytest.raises(BatchTypeError, match="number of records"):
        shrinking.process(kv([1, 2], [1, 2]))


def test_filter_keeps_the_masked_records_and_checks_the_mask() -> None:
    op = FilterOperator(lambda b: b["value"] % 2 == 0, KV)
    out = opened(op)
    op.process(kv([1, 2, 3], [1, 2, 4]))
    op.process(kv([5], [5]))  # nothing kept: nothing emitted
    op.process(kv([6, 7], [6, 8]))  # everything kept
    assert [b["key"].tolist() for b in out.batches] == [[2, 3], [6, 7]]
    bad_masks: list[Any] = [
        lambda b: b["value"],  # not bool
        lambda b: np.ones(len(b) + 1, dtype=bool),  # wrong length
        lambda b: [True] * len(b),  # not an array
    ]
    for mask_fn in bad_masks:
        bad = FilterOperator(mask_fn)
        opened(bad)
        with pytest.raises(BatchTypeError, match="one boolean per record"):
            bad.process(kv([1, 2], [1, 2]))


def test_flat_map_emits_batches_of_any_length() -> None:
    op = FlatMapOperator(lambda b: np.repeat(b, b["value"]), KV)
    out = opened(op)
    op.process(kv([1, 2, 3], [2, 0, 3]))
    op.process(kv([4], [0]))
    assert [b["key"].tolist() for b in out.batches] == [[1, 1, 3, 3, 3]]
    none = FlatMapOperator(lambda b: None, KV)
    assert not opened(none).batches
    none.process(kv([1], [1]))
    bad = FlatMapOperator(lambda b: b["key"], KV)
    opened(bad)
    with pytest.raises(BatchTypeError):
        bad.process(kv([1], [1]))


# ---- keyed operators ----


batches_strategy = st.lists(
    st.lists(st.tuples(st.integers(-5, 5), st.integers(-(2**40), 2**40)), max_size=30),
    max_size=8,
)


@settings(max_examples=60, deadline=None)
@given(batches_strategy)
def test_keyed_sum_matches_a_dict_reference(batches: list[list[tuple[int, int]]]) -> None:
    backend = DictKeyedBackend()
    op = KeyedSum("key", "value")
    out = opened(op, keyed=backend)
    expected: dict[int, int] = defaultdict(int)
    for rows in batches:
        before = len(out.batches)
        op.process(kv([k for k, _ in rows], [v for _, v in rows]))
        for k, v in rows:
            expected[k] += v
        if not rows:
            assert len(out.batches) == before
            continue
        update = out.batches[-1]
        assert update.dtype == op.out_dtype
        # One row per key the batch touched, with the key's running total.
        assert sorted(update["key"].tolist()) == sorted({k for k, _ in rows})
        assert {int(k): int(t) for k, t in update} == {k: expected[k] for k, _ in rows}
    (state,) = backend.states.values()
    assert state.data == dict(expected)


def test_a_backends_own_add_method_is_not_taken_for_the_heaps() -> None:
    """Only the heap's sum state is asked to ``add`` (counting with ``values`` None);
    another backend's state with an ``add`` of its own gets ``put`` and ``get``."""

    class WithAdd(DictKeyedState):
        def add(self, keys: Any, values: Any) -> None:
            raise AssertionError("a user state's add was called")

    class Backend(DictKeyedBackend):
        def state(self, descriptor: StateDescriptor) -> DictKeyedState:
            return self.states.setdefault(descriptor.name, WithAdd(descriptor))

    count = KeyedCount("key")
    out = opened(count, keyed=Backend(), uid="count-1")
    count.process(kv([3, 1, 3], [0, 0, 0]))
    assert out.batches[0].tolist() == [(1, 1), (3, 2)]


def test_keyed_count_and_quiet_keyed_sum() -> None:
    backend = DictKeyedBackend()
    count = KeyedCount("key")
    out = opened(count, keyed=backend, uid="count-1")
    count.process(kv([3, 1, 3, 3], [0, 0, 0, 0]))
    count.process(kv([1], [0]))
    assert out.batches[0].tolist() == [(1, 1), (3, 3)]
    assert out.batches[1].tolist() == [(1, 2)]
    assert count.out_dtype.names == ("key", "count")

    quiet = KeyedSum("key", "value", out="none")
    out = opened(quiet, keyed=backend, uid="sum-2")
    quiet.process(kv([1, 1], [5, 6]))
    assert not out.batches
    assert backend.states["sum-2.sum"].data == {1: 11}
    assert backend.states["count-1.count"].data == {1: 2, 3: 3}


@settings(max_examples=60, deadline=None)
@given(
    batches=st.lists(st.lists(st.integers(-300, 300), max_size=60), max_size=10),
    sum_dtype=st.sampled_from([np.int64, np.float64]),
    subtask=st.integers(0, 2),
)
def test_keyed_aggregates_on_heap_state_emit_what_the_generic_path_emits(
    batches: list[list[int]], sum_dtype: Any, subtask: int
) -> None:
    """KeyedCount and KeyedSum on heap state (the native ``add`` for int64 sums) emit,
    batch by batch, exactly the rows of the generic path: group sums, ``put``, then
    ``get`` (here on the dict state); the native path in the order the batch first has
    the keys, the generic one ascending (a batch's rows have no promised order)."""
    rng = key_group_range_for_operator(128, 3, subtask)
    for make in (lambda: KeyedCount("key"), lambda: KeyedSum("key", "value", sum_dtype=sum_dtype)):
        op, ref = make(), make()
        heap = HeapKeyedStateBackend(128, rng)
        out = opened(op, keyed=heap, subtask=subtask, parallelism=3)
        ref_out = opened(ref, keyed=DictKeyedBackend(), subtask=subtask, parallelism=3)
        native = np.dtype(sum_dtype) == np.int64 or isinstance(op, KeyedCount)
        for keys in batches:
            groups = key_groups(np.array(keys, np.int64), 128).tolist()
            mine = [k for k, g in zip(keys, groups, strict=True) if g in rng]
            batch = kv(mine, [k * 7 - 3 for k in mine])
            op.process(batch)
            ref.process(batch)
            assert len(out.batches) == len(ref_out.batches)
            if mine:
                seen = list(dict.fromkeys(mine))
                assert out.batches[-1]["key"].tolist() == (seen if native else sorted(seen))
        for got, want in zip(out.batches, ref_out.batches, strict=True):
            assert got.dtype == want.dtype == op.out_dtype
            assert sorted(got.tolist()) == want.tolist()


def test_keyed_count_refuses_keys_of_another_subtask() -> None:
    """A batch with a key outside the subtask's key groups fails and counts nothing."""
    rng = key_group_range_for_operator(128, 2, 0)
    op = KeyedCount("key")
    out = opened(op, keyed=HeapKeyedStateBackend(128, rng), parallelism=2)
    keys = np.arange(40, dtype=np.int64)
    groups = key_groups(keys, 128)
    inside, outside = keys[groups <= rng.end], keys[groups > rng.end]
    op.process(kv(inside.tolist(), [0] * inside.size))
    with pytest.raises(KeyGroupRangeError):
        op.process(kv([*inside.tolist(), int(outside[0])], [0] * (inside.size + 1)))
    op.process(kv(inside[:1].tolist(), [0]))
    assert out.batches[-1].tolist() == [(int(inside[0]), 2)]


def test_keyed_operators_need_keyed_state() -> None:
    with pytest.raises(ConfigError, match="keyed state"):
        opened(KeyedSum("key", "value"))
    with pytest.raises(ConfigError):
        KeyedSum("key", "value", out="all")


def test_keyed_process_runs_user_logic_over_states() -> None:
    """Emits each key the first time it is seen, across batches."""

    def first_seen(batch: Batch, states: dict[str, Any]) -> Batch | None:
        keys, first = np.unique(batch["key"], return_index=True)
        _, seen = states["seen"].get(keys)
        states["seen"].put(keys[~seen], np.ones(int((~seen).sum()), dtype=bool))
        new = batch[np.sort(first[~seen])]
        return new if len(new) else None

    op = KeyedProcess(first_seen, [StateDescriptor("seen", "value", bool)], KV)
    out = opened(op, keyed=DictKeyedBackend())
    op.process(kv([5, 2, 5], [1, 2, 3]))
    op.process(kv([2, 2], [4, 5]))
    op.process(kv([7, 2], [6, 7]))
    assert out.all(KV).tolist() == [(5, 1), (2, 2), (7, 6)]
    with pytest.raises(ConfigError, match="unique"):
        KeyedProcess(first_seen, [StateDescriptor("a", "value")] * 2, KV)


def test_co_map_dispatches_by_input() -> None:
    other = np.dtype([("id", "<i8")])

    def from_other(b: Batch) -> Batch:
        r = np.zeros(len(b), KV)
        r["key"] = b["id"]
        return r

    op = CoMap(lambda b: b, from_other, KV)
    out = opened(op)
    op.process(kv([1], [10]), 0)
    op.process(np.array([(7,)], dtype=other), 1)
    assert out.all(KV).tolist() == [(1, 10), (7, 0)]
    with pytest.raises(ValueError):
        op.process(kv([1], [1]), 2)
    bad = CoMap(lambda b: b, lambda b: b, KV)
    opened(bad)
    with pytest.raises(BatchTypeError, match="second"):
        bad.process(np.array([(7,)], dtype=other), 1)


# ---- GeneratorSource ----


def run_source(src: Operator, **ctx: Any) -> Batch:
    out = opened(src, **ctx)
    drain(src)
    return out.all(src.out_dtype)


def test_generator_dtype_and_determinism() -> None:
    assert GeneratorSource.dtype(16) == np.dtype(
        [("partition", "<i4"), ("seq", "<i8"), ("key", "<i8"), ("payload", "S16")]
    )
    a = run_source(GeneratorSource(4, 300, payload_bytes=16, keys=50, batch_size=64, seed=7))
    b = run_source(GeneratorSource(4, 300, payload_bytes=16, keys=50, batch_size=100, seed=7))
    c = run_source(GeneratorSource(4, 300, payload_bytes=16, keys=50, batch_size=64, seed=8))
    order = np.lexsort((a["seq"], a["partition"]))
    assert np.array_equal(a[order], b[np.lexsort((b["seq"], b["partition"]))])
    assert not np.array_equal(a["key"], c["key"])
    assert a["key"].min() >= 0 and a["key"].max() < 50
    assert len(np.unique(a["key"])) == 50
    # Payload: letters from 'A' + seq % 26, never a NUL byte.
    row = a[(a["partition"] == 1) & (a["seq"] == 27)][0]
    assert row["payload"] == b"BCDEFGHIJKLMNOPQ"
    assert a.dtype == GeneratorSource.dtype(16)
    fresh = GeneratorSource(4, 300, payload_bytes=16, keys=50, seed=7)
    assert np.array_equal(fresh.keys_of(a["partition"], a["seq"]), a["key"])


def test_generator_partitions_belong_to_one_subtask_each_in_seq_order() -> None:
    p, partitions, n = 3, 7, 250
    seen = []
    for i in range(p):
        got = run_source(
            GeneratorSource(partitions, n, payload_bytes=4, batch_size=50),
            subtask=i,
            parallelism=p,
        )
        assert set(got["partition"].tolist()) == set(range(i, partitions, p))
        for part in range(i, partitions, p):
            assert got["seq"][got["partition"] == part].tolist() == list(range(n))
        seen.append(got)
    everything = np.concatenate(seen)
    assert len(everything) == partitions * n
    # More subtasks than partitions: the extra subtask ends at once.
    idle = GeneratorSource(2, None)
    out = opened(idle, subtask=2, parallelism=3)
    assert idle.on_timer() is False and not out.batches


def test_generator_resumes_exactly_after_the_checkpoint() -> None:
    full = run_source(GeneratorSource(5, 400, batch_size=64, seed=3), subtask=1, parallelism=2)
    first = GeneratorSource(5, 400, batch_size=64, seed=3)
    out = opened(first, subtask=1, parallelism=2)
    for _ in range(5):
        assert first.on_timer()
    state = json_roundtrip(first.snapshot(1))
    before = out.all(first.out_dtype)
    assert state == {"next_seq": {str(p): int((before["partition"] == p).sum()) for p in (1, 3)}}
    resumed = GeneratorSource(5, 400, batch_size=64, seed=3)
    out2 = opened(resumed, subtask=1, parallelism=2, attempt=1)
    resumed.restore(state)
    drain(resumed)
    rest = out2.all(resumed.out_dtype)
    both = np.concatenate([before, rest])
    key = np.lexsort((both["seq"], both["partition"]))
    assert np.array_equal(both[key], full[np.lexsort((full["seq"], full["partition"]))])


def test_generator_zipf_keys_are_skewed() -> None:
    got = run_source(GeneratorSource(2, 20_000, keys=1000, key_distribution="zipf", seed=1))
    counts = np.bincount(got["key"], minlength=1000)
    assert got["key"].max() < 1000
    assert counts[0] == counts.max()
    assert counts[:10].sum() > 0.3 * len(got)
    with pytest.raises(ConfigError):
        GeneratorSource(2, key_distribution="normal")


def test_generator_rate_limit_sleeps_and_never_spins() -> None:
    clock = FakeClock()
    src = GeneratorSource(
        4, None, rate_per_subtask=2000, batch_size=1024, clock=clock.monotonic, sleep=clock.sleep
    )
    out = opened(src)
    start = clock.now
    for _ in range(300):
        assert src.on_timer()
    emitted = sum(len(b) for b in out.batches)
    elapsed = clock.now - start
    assert emitted == pytest.approx(2000 * elapsed, abs=25)
    assert elapsed > 1.0
    # Emissions come in chunks of rate * 10 ms, and every wait is a sleep of at most that.
    assert clock.sleeps and max(clock.sleeps) <= 0.01 + 1e-9
    assert {len(b) for b in out.batches} <= {19, 20, 21}
    # After a long stall (backpressure), at most one batch catches up.
    clock.now += 60
    src.on_timer()
    assert len(out.batches[-1]) <= 1024


def test_generator_unpaced_never_sleeps() -> None:
    clock = FakeClock()
    src = GeneratorSource(2, 10_000, batch_size=1000, clock=clock.monotonic, sleep=clock.sleep)
    got = run_source(src)
    assert len(got) == 20_000 and not clock.sleeps


def test_a_generator_holding_its_end_idles_then_ends_with_the_same_records() -> None:
    """A run a test stops part way holds its end: after its last record the source
    sleeps (never spins) for the hold, emits nothing more, then ends."""
    clock = FakeClock()
    src = GeneratorSource(2, 1_000, batch_size=400, clock=clock.monotonic, sleep=clock.sleep)
    src.hold_end(2.0)
    out = opened(src)
    calls = 0
    while src.on_timer():
        calls += 1
        assert calls < 10_000, "it never ended"
    got = np.concatenate(out.batches)
    assert len(got) == 2_000  # the same records as without the hold
    assert sum(clock.sleeps) == pytest.approx(2.0)
    assert max(clock.sleeps) <= 0.005 + 1e-9
    with pytest.raises(ConfigError):
        src.hold_end(-1)


# ---- ParquetSource ----


@pytest.fixture
def parquet_input(tmp_path: Path) -> tuple[Path, pa.Table]:
    """Two files with several row groups, a variable-width and a fixed-width bytes column."""
    d = tmp_path / "input"
    d.mkdir()
    tables = []
    for f, n in enumerate((1000, 350)):
        ids = np.arange(n, dtype=np.int64) + 10_000 * f
        t = pa.table(
            {
                "id": ids,
                "x": (ids * 0.5).astype(np.float32),
                "name": pa.array([f"n{i % 97}" for i in ids.tolist()]),
                "tag": pa.array([bytes([65 + i % 3]) * 3 for i in ids.tolist()], pa.binary(3)),
                "flag": ids % 2 == 0,
            }
        )
        pq.write_table(t, d / f"part-{f}.parquet", row_group_size=300)
        tables.append(t)
    (d / "_SUCCESS").write_bytes(b"")
    return d, pa.concat_tables(tables)


def test_parquet_source_reads_every_row_once_over_subtasks(
    parquet_input: tuple[Path, pa.Table],
) -> None:
    d, table = parquet_input
    src = ParquetSource(str(d), batch_size=128, bytes_widths={"name": 4})
    assert src.out_dtype == np.dtype(
        [("id", "<i8"), ("x", "<f4"), ("name", "S4"), ("tag", "S3"), ("flag", "?")]
    )
    parts = [run_source(copy.deepcopy(src), subtask=i, parallelism=3) for i in range(3)]
    assert all(len(p) for p in parts)
    got = np.concatenate(parts)
    got = got[np.argsort(got["id"])]
    assert got["id"].tolist() == table["id"].to_pylist()
    assert got["name"].tolist() == [s.encode() for s in table["name"].to_pylist()]
    assert got["tag"].tolist() == table["tag"].to_pylist()
    assert np.array_equal(got["x"], table["x"].to_numpy())
    assert got["flag"].tolist() == table["flag"].to_pylist()


def test_parquet_source_resumes_at_the_exact_row(parquet_input: tuple[Path, pa.Table]) -> None:
    d, _ = parquet_input
    files = sorted(str(p) for p in d.glob("*.parquet"))
    src = ParquetSource(files, batch_size=128, columns=["id", "tag"])
    full = run_source(copy.deepcopy(src), subtask=1, parallelism=2)
    first = copy.deepcopy(src)
    out = opened(first, subtask=1, parallelism=2)
    for _ in range(2):  # row groups 1 and 3 of file 0, row group 1 of file 1: 300, 100, 50
        first.on_timer()
    state = json_roundtrip(first.snapshot(3))
    assert (state["file"], state["row_group"], state["row"]) == (0, 1, 256)
    resumed = copy.deepcopy(src)
    out2 = opened(resumed, subtask=1, parallelism=2)
    resumed.restore(state)
    drain(resumed)
    got = np.concatenate([out.all(src.out_dtype), out2.all(src.out_dtype)])
    assert np.array_equal(got, full)
    done = copy.deepcopy(src)
    opened(done, subtask=1, parallelism=2)
    done.restore(json_roundtrip(resumed.snapshot(4)))
    assert done.on_timer() is False


def test_parquet_source_refuses_what_does_not_fit(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"s": ["abc", "toolong"], "n": pa.array([1, None])}), path)
    with pytest.raises(ConfigError, match="bytes_widths"):
        ParquetSource(str(path))
    src = ParquetSource(str(path), columns=["s"], bytes_widths={"s": 4})
    opened(src)
    with pytest.raises(ConfigError, match="longer than its declared width"):
        src.on_timer()
    nulls = ParquetSource(str(path), columns=["n"])
    opened(nulls)
    with pytest.raises(ConfigError, match="nulls"):
        nulls.on_timer()


@pytest.mark.parametrize(
    "arrow_type", [pa.binary(), pa.string(), pa.large_binary(), pa.large_string(), pa.binary(3)]
)
def test_arrow_bytes_columns_become_zero_padded_fixed_width(arrow_type: pa.DataType) -> None:
    expected = [b"abc", b"xyz", b"", b"q"]
    if arrow_type == pa.binary(3):
        values: list[Any] = [v.ljust(3, b"\0") for v in expected]
    elif pa.types.is_binary(arrow_type) or pa.types.is_large_binary(arrow_type):
        values = expected
    else:
        values = [v.decode() for v in expected]
    dtype = np.dtype([("n", "<i2"), ("s", "S5")])
    table = pa.table({"n": np.arange(4, dtype=np.int16), "s": pa.array(values, arrow_type)})
    for start in range(4):
        got = arrow_to_batch(table.slice(start), dtype)
        assert got["s"].tolist() == expected[start:]
        assert got["n"].tolist() == list(range(start, 4))
        assert not byte_matrix(got, "s")[:, 3:].any()  # zeros, whatever np.empty left there
    assert len(arrow_to_batch(table.slice(4), dtype)) == 0
    same_width = pa.table({"n": np.zeros(2, np.int16), "s": pa.array([b"12345", b"abcde"])})
    assert arrow_to_batch(same_width, dtype)["s"].tolist() == [b"12345", b"abcde"]


# ---- CollectingSink ----


@pytest.fixture
def sink_name(request: pytest.FixtureRequest) -> Any:
    name = request.node.name
    CollectingSink.clear(name)
    yield name
    CollectingSink.clear(name)


def visible(name: str) -> list[int]:
    return sorted(CollectingSink.records(name, KV)["key"].tolist())


def test_collecting_sink_commits_on_notify_and_restore(sink_name: str) -> None:
    sink = CollectingSink(sink_name)
    opened(sink, subtask=1)
    sink.process(kv([1, 2], [0, 0]))
    sink.snapshot(1)
    sink.process(kv([3], [0]))
    assert visible(sink_name) == []
    sink.notify_checkpoint_complete(1)
    assert visible(sink_name) == [1, 2]
    sink.snapshot(2)  # aborted: its data waits for a later checkpoint
    sink.notify_checkpoint_aborted(2)
    sink.process(kv([4], [0]))
    state3 = json_roundtrip(sink.snapshot(3))
    assert sorted(state3["pending"]) == ["2", "3"]
    sink.process(kv([5], [0]))  # after checkpoint 3: lost with the failure
    assert visible(sink_name) == [1, 2]
    sink.close()  # the task fails before checkpoint 3's completion reaches it

    again = CollectingSink(sink_name)
    opened(again, subtask=1, attempt=1)
    assert CollectingSink.staged_records(sink_name) == 3
    again.restore(state3)
    assert visible(sink_name) == [1, 2, 3, 4]
    assert CollectingSink.staged_records(sink_name) == 0  # the failed attempt's record 5
    again.restore(state3)  # committing twice is a no-op
    again.notify_checkpoint_complete(3)
    again.process(kv([6], [0]))
    again.snapshot(4)
    again.notify_checkpoint_complete(4)
    assert visible(sink_name) == [1, 2, 3, 4, 6]
    assert list(CollectingSink.results(sink_name)) == [1]


def test_collecting_sink_commits_only_checkpoints_up_to_the_notified_one(sink_name: str) -> None:
    sink = CollectingSink(sink_name)
    opened(sink)
    for cid in (1, 2, 3):
        sink.process(kv([cid], [0]))
        sink.snapshot(cid)
    sink.notify_checkpoint_complete(2)
    assert visible(sink_name) == [1, 2]
    sink.notify_checkpoint_complete(2)
    assert visible(sink_name) == [1, 2]
    sink.notify_checkpoint_complete(3)
    assert visible(sink_name) == [1, 2, 3]


def test_collecting_sink_immediate_mode_and_clear(sink_name: str) -> None:
    sink = CollectingSink(sink_name, immediate=True)
    opened(sink)
    batch = kv([1], [0])
    sink.process(batch)
    batch["key"] = 9  # the sink kept a copy
    assert visible(sink_name) == [1]
    assert sink.snapshot(1).operator_state is None
    CollectingSink.clear(sink_name)
    assert visible(sink_name) == []
    assert CollectingSink.records(sink_name).dtype == np.dtype([])


# ---- ThrottledSink ----


def test_throttled_sink_paces_by_sleeping(sink_name: str) -> None:
    clock = FakeClock()
    inner = CollectingSink(sink_name, immediate=True)
    sink = ThrottledSink(100, inner, clock=clock.monotonic, sleep=clock.sleep)
    opened(sink)
    start = clock.now
    for i in range(10):
        sink.process(kv([i] * 10, [0] * 10))
    assert clock.now - start == pytest.approx(1.0)
    assert clock.sleeps == pytest.approx([0.1] * 10)
    assert len(visible(sink_name)) == 100
    # Time already spent elsewhere counts; idle time is not banked.
    clock.now += 0.05
    sink.process(kv([0] * 10, [0] * 10))
    assert clock.sleeps[-1] == pytest.approx(0.1)
    with pytest.raises(ConfigError):
        ThrottledSink(0)


def _pacing_context(uid: str) -> OperatorContext:
    """A subtask's context in a task that paces its operators (``pacing``)."""
    return OperatorContext(
        uid=uid,
        name=uid,
        subtask_index=0,
        parallelism=1,
        max_parallelism=128,
        attempt=0,
        output=RecordingOutput(),
        pacing=True,
    )


def test_a_pacing_task_waits_for_a_throttled_sink_only_past_the_slack() -> None:
    """In a pacing task the sink never sleeps; the task waits for it only once it is
    more than PACE_SLACK ahead of its pace, and over time it keeps its rate."""
    clock = FakeClock()
    sink = ThrottledSink(1000, clock=clock.monotonic, sleep=clock.sleep)
    sink.open(_pacing_context("s"))
    start = clock.now
    sink.process(kv([0] * 100, [0] * 100))  # owes 0.1 s: the task waits
    assert sink.ready_at() == pytest.approx(start + 0.1 - PACE_SLACK)
    taken = 0
    while clock.now - start < 10.0:  # the task's loop: a batch once it is ready
        clock.now = max(clock.now, sink.ready_at())
        sink.process(kv([0] * 1, [0] * 1))  # owes 1 ms, inside the slack
        taken += 1
    assert not clock.sleeps
    # Its rate over the 10 s: ahead by at most the slack's worth and the last batch.
    elapsed = clock.now - start
    assert 1000 * elapsed - 2 <= 100 + taken <= 1000 * (elapsed + PACE_SLACK) + 2
    fast = ThrottledSink(1e8, clock=clock.monotonic, sleep=clock.sleep)
    fast.open(_pacing_context("f"))
    fast.process(kv([0] * 6_500, [0] * 6_500))  # 65 us at its rate: no wait at all
    assert fast.ready_at() <= clock.now


def test_throttled_sink_passes_the_lifecycle_to_its_inner_sink(sink_name: str) -> None:
    clock = FakeClock()
    sink = ThrottledSink(1e6, CollectingSink(sink_name), clock=clock.monotonic, sleep=clock.sleep)
    opened(sink)
    sink.process(kv([1], [0]))
    state = sink.snapshot(1).operator_state
    assert state is not None and state["pending"]
    sink.notify_checkpoint_complete(1)
    assert visible(sink_name) == [1]


# ---- ParquetSink ----


def sink_kwargs(kind: str, directory: Path) -> tuple[str, dict[str, Any]]:
    if kind == "path":
        return str(directory), {}
    if kind == "file-uri":
        return f"file://{directory}", {}
    return str(directory), {"filesystem": pafs.LocalFileSystem()}


def checkpoint(sink: Operator, cid: int, directory: Path) -> Any:
    snap = sink.snapshot(cid)
    if snap.finalize is not None:
        assert snap.finalize(str(directory / "chk")) is None
    return json_roundtrip(snap)


def published(directory: Path) -> list[int]:
    if not list(directory.glob("*.parquet")):
        return []
    return sorted(pq.read_table(directory)["key"].to_pylist())


def staged(directory: Path) -> list[str]:
    return sorted(p.name for p in (directory / "_staging").glob("*"))


@pytest.mark.parametrize("kind", ["path", "file-uri", "arrow-fs"])
def test_parquet_sink_two_phase_commit(kind: str, tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    uri, kw = sink_kwargs(kind, out_dir)
    sink = ParquetSink(uri, row_group_rows=2, **kw)
    opened(sink, subtask=0)
    sink.process(kv([1, 2, 3], [0, 0, 0]))  # a full row group goes to disk at once
    assert len(staged(out_dir)) == 1
    checkpoint(sink, 1, out_dir)
    sink.process(kv([4], [0]))
    assert published(out_dir) == []
    sink.notify_checkpoint_complete(1)
    assert published(out_dir) == [1, 2, 3]
    state2 = checkpoint(sink, 2, out_dir)  # pending: the file holding 4
    sink.process(kv([5, 6, 7], [0, 0, 0]))  # in progress when the task fails
    sink.close()
    assert published(out_dir) == [1, 2, 3]
    assert len(staged(out_dir)) == 2

    again = ParquetSink(uri, row_group_rows=2, **kw)
    opened(again, subtask=0, attempt=1)
    again.restore(state2)
    assert published(out_dir) == [1, 2, 3, 4]
    assert staged(out_dir) == []  # the failed attempt's file is gone
    again.restore(state2)  # publishing twice is fine
    again.notify_checkpoint_complete(2)
    again.process(kv([5, 6], [0, 0]))
    checkpoint(again, 3, out_dir)
    again.notify_checkpoint_complete(3)
    assert published(out_dir) == [1, 2, 3, 4, 5, 6]
    names = sorted(p.name for p in out_dir.glob("*.parquet"))
    assert len(set(names)) == 3 and all(n.startswith("part-00000-") for n in names)
    assert pq.read_table(out_dir).schema.field("key").type == pa.int64()


def test_parquet_sink_publishes_checkpoints_up_to_the_notified_one(tmp_path: Path) -> None:
    sink = ParquetSink(str(tmp_path))
    opened(sink, subtask=2)
    sink.process(kv([1], [0]))
    checkpoint(sink, 1, tmp_path)
    sink.notify_checkpoint_aborted(1)  # its file stays pending for a later checkpoint
    sink.process(kv([2], [0]))
    checkpoint(sink, 2, tmp_path)
    sink.process(kv([3], [0]))
    state = checkpoint(sink, 3, tmp_path)
    assert sorted(state["pending"]) == ["1", "2", "3"]
    assert checkpoint(sink, 4, tmp_path)["pending"] == state["pending"]  # nothing new
    sink.notify_checkpoint_complete(2)
    assert published(tmp_path) == [1, 2]
    assert sorted(checkpoint(sink, 5, tmp_path)["pending"]) == ["3"]
    sink.notify_checkpoint_complete(5)
    assert published(tmp_path) == [1, 2, 3]
    assert checkpoint(sink, 6, tmp_path)["pending"] == {}


def test_parquet_sink_cleans_staging_when_nothing_was_restored(tmp_path: Path) -> None:
    first = ParquetSink(str(tmp_path), row_group_rows=1)
    opened(first, subtask=0)
    first.process(kv([1], [0]))
    other = ParquetSink(str(tmp_path), row_group_rows=1)
    opened(other, subtask=1)
    other.process(kv([2], [0]))
    first.close()
    assert len(staged(tmp_path)) == 2
    retry = ParquetSink(str(tmp_path), row_group_rows=1)
    opened(retry, subtask=0, attempt=1)  # no checkpoint completed: no restore
    retry.process(kv([3], [0]))
    left = staged(tmp_path)
    assert len(left) == 2 and any(n.startswith("part-00000-a0001") for n in left)
    assert any(n.startswith("part-00001-") for n in left)  # another subtask's: kept


def test_parquet_sink_rescaled_restore_gives_each_pending_file_one_publisher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """3 -> 2: every old subtask's pending file is published by exactly one new
    subtask (two publishers race on the rename), and every old staged file is gone."""
    states = []
    for j in range(3):
        old = ParquetSink(str(tmp_path), row_group_rows=1)
        opened(old, subtask=j, parallelism=3)
        old.process(kv([10 * j], [0]))
        states.append(checkpoint(old, 4, tmp_path))
        old.process(kv([10 * j + 1], [0]))  # in progress when the job fails
        old.close()
    publishers: dict[str, list[int]] = {}
    real_publish = ParquetSink._publish

    def recording_publish(self: ParquetSink, name: str) -> None:
        publishers.setdefault(name, []).append(self.ctx.subtask_index)
        real_publish(self, name)

    monkeypatch.setattr(ParquetSink, "_publish", recording_publish)
    for i in range(2):
        new = ParquetSink(str(tmp_path), row_group_rows=1)
        opened(new, subtask=i, parallelism=2, attempt=1)
        new.restore_rescaled(states)
    assert sorted(publishers) == sorted(n for st in states for n in st["pending"]["4"])
    assert all(len(who) == 1 for who in publishers.values()), publishers
    assert published(tmp_path) == [0, 10, 20]
    assert staged(tmp_path) == []


def test_parquet_sink_restore_names_a_lost_file(tmp_path: Path) -> None:
    sink = ParquetSink(str(tmp_path))
    opened(sink)
    sink.process(kv([1], [0]))
    state = checkpoint(sink, 1, tmp_path)
    for name in staged(tmp_path):
        os.unlink(tmp_path / "_staging" / name)
    again = ParquetSink(str(tmp_path))
    opened(again, attempt=1)
    with pytest.raises(StateFileNotFoundError, match="pending output file"):
        again.restore(state)


def test_generator_to_parquet_sink_to_parquet_source(tmp_path: Path) -> None:
    gen = GeneratorSource(3, 500, payload_bytes=20, batch_size=200, seed=5)
    records = run_source(gen)
    sink = ParquetSink(str(tmp_path), row_group_rows=400)
    opened(sink)
    for b in np.array_split(records, 4):
        sink.process(b)
    checkpoint(sink, 1, tmp_path)
    sink.notify_checkpoint_complete(1)
    src = ParquetSource(str(tmp_path), batch_size=333)
    assert src.out_dtype == records.dtype
    assert np.array_equal(run_source(src), records)
    assert copy.deepcopy(gen).out_dtype == gen.out_dtype


def test_parquet_sink_started_again_never_drops_a_file_of_an_earlier_run(tmp_path: Path) -> None:
    """A second run over the same directory, from scratch (attempt 0, checkpoint 1
    again), writes names of its own: publishing, idempotent by name, would otherwise
    take its file for an already published one and delete it."""
    for keys, mode in (([1, 2], "error"), ([3, 4], "append")):
        sink = ParquetSink(str(tmp_path), mode=mode)
        opened(sink, subtask=0)
        sink.process(kv(keys, [0, 0]))
        checkpoint(sink, 1, tmp_path)
        sink.notify_checkpoint_complete(1)
        sink.close()
    assert published(tmp_path) == [1, 2, 3, 4]
    assert staged(tmp_path) == []


def test_parquet_sink_refuses_another_runs_output_unless_told(tmp_path: Path) -> None:
    """A run that restored nothing meets committed output of another run: refused by
    default (before it writes anything), replaced with ``overwrite``; a restored
    run continues its own output."""
    first = ParquetSink(str(tmp_path))
    opened(first, subtask=0)
    first.process(kv([1, 2], [0, 0]))
    state = checkpoint(first, 1, tmp_path)
    first.notify_checkpoint_complete(1)
    again = ParquetSink(str(tmp_path))
    opened(again, subtask=0)
    with pytest.raises(ConfigError, match="committed output of another run"):
        again.process(kv([3], [0]))
    assert published(tmp_path) == [1, 2] and staged(tmp_path) == []
    resumed = ParquetSink(str(tmp_path))
    opened(resumed, subtask=0)
    resumed.restore(state)
    resumed.process(kv([3], [0]))
    checkpoint(resumed, 2, tmp_path)
    resumed.notify_checkpoint_complete(2)
    assert published(tmp_path) == [1, 2, 3]
    # Overwrite: the old subtask 0's parts belong to new subtask 0 of 2 (0 % 2).
    others = ParquetSink(str(tmp_path), mode="overwrite")
    opened(others, subtask=1, parallelism=2)
    others.process(kv([7], [0]))
    assert published(tmp_path) == [1, 2, 3]  # not its parts to delete
    over = ParquetSink(str(tmp_path), mode="overwrite")
    opened(over, subtask=0, parallelism=2)
    over.process(kv([8], [0]))
    checkpoint(over, 1, tmp_path)
    over.notify_checkpoint_complete(1)
    assert published(tmp_path) == [8]


def test_parquet_sink_takes_its_own_runs_output_for_its_own(tmp_path: Path) -> None:
    """Without checkpoints each subtask commits at its own end: a subtask whose first
    record comes after another subtask of the same run committed writes on (that
    output is its own run's, not another run's). A new run is still refused."""
    run = "5e1f" * 8
    fast, slow = ParquetSink(str(tmp_path)), ParquetSink(str(tmp_path))
    opened(fast, subtask=0, parallelism=2, job_run=run)
    opened(slow, subtask=1, parallelism=2, job_run=run)
    fast.process(kv([1, 2], [0, 0]))
    checkpoint(fast, FINAL_WITHOUT_CHECKPOINTS, tmp_path)
    fast.notify_checkpoint_complete(FINAL_WITHOUT_CHECKPOINTS)
    slow.process(kv([3], [0]))
    checkpoint(slow, FINAL_WITHOUT_CHECKPOINTS, tmp_path)
    slow.notify_checkpoint_complete(FINAL_WITHOUT_CHECKPOINTS)
    assert published(tmp_path) == [1, 2, 3]
    other = ParquetSink(str(tmp_path))
    opened(other, subtask=1, parallelism=2, job_run="0" * 32)
    with pytest.raises(ConfigError, match="committed output of another run"):
        other.process(kv([4], [0]))


def test_parquet_sink_takes_an_earlier_attempts_output_for_another_runs(
    tmp_path: Path,
) -> None:
    """Without checkpoints a restart writes the run's output again from the start:
    what a subtask of the failed attempt committed at its own end is refused as not
    this attempt's (``overwrite`` replaces it), never kept beside its second copy."""
    run = "5e1f" * 8
    first = ParquetSink(str(tmp_path))
    opened(first, subtask=0, parallelism=2, job_run=run)
    first.process(kv([1, 2], [0, 0]))
    checkpoint(first, FINAL_WITHOUT_CHECKPOINTS, tmp_path)
    first.notify_checkpoint_complete(FINAL_WITHOUT_CHECKPOINTS)
    again = ParquetSink(str(tmp_path))
    opened(again, subtask=0, parallelism=2, job_run=run, attempt=1)
    with pytest.raises(ConfigError, match="committed output of another run"):
        again.process(kv([1], [0]))
    over = ParquetSink(str(tmp_path), mode="overwrite")
    opened(over, subtask=0, parallelism=2, job_run=run, attempt=1)
    over.process(kv([1, 2], [0, 0]))
    checkpoint(over, FINAL_WITHOUT_CHECKPOINTS, tmp_path)
    over.notify_checkpoint_complete(FINAL_WITHOUT_CHECKPOINTS)
    assert published(tmp_path) == [1, 2]


def test_parquet_sink_refuses_to_publish_over_another_file_of_its_name(tmp_path: Path) -> None:
    """Publishing is idempotent by name (a cut-short move leaves both copies), but a
    different file under that name is another run's output: an error, never a skip."""
    sink = ParquetSink(str(tmp_path))
    opened(sink, subtask=0)
    sink.process(kv([1, 2, 3], [0, 0, 0]))
    state = checkpoint(sink, 1, tmp_path)
    (name,) = state["pending"]["1"]
    pq.write_table(pa.table({"key": [9]}), tmp_path / name)
    with pytest.raises(StateFileExistsError, match="another run"):
        sink.notify_checkpoint_complete(1)
    assert staged(tmp_path) == [name]  # kept


def test_every_operator_that_commits_on_notification_commits_on_restore(tmp_path: Path) -> None:
    """A subtask restored finished opens only the operators that commit on a
    checkpoint's notification: a user's own two-phase-commit sink is one of them
    without a flag, so its final checkpoint's pending transaction is not lost."""

    class UsersTwoPhaseSink(Operator):
        def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
            pass

    class Plain(Operator):
        pass

    assert UsersTwoPhaseSink().commits_on_restore
    assert not Plain().commits_on_restore
    assert ParquetSink(str(tmp_path)).commits_on_restore
    assert ThrottledSink(1000.0, ParquetSink(str(tmp_path))).commits_on_restore
    assert not ThrottledSink(1000.0).commits_on_restore
