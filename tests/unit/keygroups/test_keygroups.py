"""Key groups: bit-compatibility with Flink (golden files from the JVM) and range arithmetic."""

from __future__ import annotations

import csv
import gzip
import itertools
import struct
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillover.errors import ConfigError
from spillover.keygroups import (
    KeyGroupRange,
    add_key_sum_rows,
    add_key_sums,
    assign_to_key_group,
    compute_default_max_parallelism,
    compute_key_group_for_key_hash,
    java_hash_code,
    key_group_range_for_operator,
    key_group_table,
    key_groups,
    key_groups_from_hashes,
    key_groups_packed,
    key_sums_index,
    murmur_hash,
    operator_index_for_key_group,
)
from spillover.records import FieldKey, key_groups_of, write_records

GOLDEN = Path(__file__).parents[2] / "golden" / "keygroups"
MAX_PARALLELISMS = (128, 1000, 32768)


class Golden:
    """One golden file: keys (as written), Java hash codes, murmur hashes, key groups."""

    def __init__(self, name: str) -> None:
        with gzip.open(GOLDEN / f"{name}.csv.gz", "rt", newline="") as f:
            reader = csv.reader(f)
            header = next(reader)
            rows = list(reader)
        assert header[:3] == ["key", "hash", "murmur"]
        assert header[3:] == [f"kg{p}" for p in MAX_PARALLELISMS]
        self.raw = [r[0] for r in rows]
        self.hashes = np.array([int(r[1]) for r in rows], dtype=np.int32)
        self.murmur = np.array([int(r[2]) for r in rows], dtype=np.int64)
        self.kgs = {
            p: np.array([int(r[3 + i]) for r in rows]) for i, p in enumerate(MAX_PARALLELISMS)
        }

    def blobs(self) -> list[bytes]:
        return [bytes.fromhex(k) for k in self.raw]

    def packed(self) -> tuple[bytes, np.ndarray]:
        blobs = self.blobs()
        offsets = np.zeros(len(blobs) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in blobs], out=offsets[1:])
        return b"".join(blobs), offsets


@cache
def golden(name: str) -> Golden:
    return Golden(name)


def test_flink_check_values() -> None:
    # Values of Flink's MathUtils.murmurHash and KeyGroupRangeAssignment at max parallelism 128.
    assert [murmur_hash(h) for h in (0, 42, -1)] == [593689054, 1134849565, 1982413648]
    assert [assign_to_key_group(k, 128) for k in (0, 42, -1)] == [94, 29, 80]
    assert list(key_groups(np.array([0, 42, -1], dtype=np.int32), 128)) == [94, 29, 80]


# Java hash codes whose murmur mix ends at Integer.MIN_VALUE (Flink maps it to 0), at
# MIN_VALUE + 1 (negated: 2^31 - 1) and at 2^31 - 1 (kept), found by inverting the mix.
MURMUR_EDGES = {-2089875627: 0, 1814469223: 2**31 - 1, 994512208: 2**31 - 1}


def test_murmur_edges_of_the_sign_native_as_in_python() -> None:
    codes = np.array(list(MURMUR_EDGES), dtype=np.int32)
    assert [murmur_hash(int(c)) for c in codes] == list(MURMUR_EDGES.values())
    framed = write_records([struct.pack("<i", int(c)) for c in codes], 4096)[0]
    for p in (1, 7, 128, 32768):
        expected = [m % p for m in MURMUR_EDGES.values()]
        assert key_groups(codes, p).tolist() == expected
        assert key_groups_from_hashes(codes, p).tolist() == expected
        assert key_groups_of(framed, p, FieldKey(0, "int32")).tolist() == expected
        assert [assign_to_key_group(int(c), p, "int32") for c in codes] == expected


@pytest.mark.parametrize("name", ["int32", "int64", "str", "bytes", "utf8_malformed"])
def test_golden_files_are_complete(name: str) -> None:
    g = golden(name)
    assert len(g.raw) >= (10_000 if name in ("int32", "int64", "str") else 5_000)
    assert (g.murmur >= 0).all()
    for p in MAX_PARALLELISMS:
        assert (g.kgs[p] == g.murmur % p).all()


@pytest.mark.parametrize("name", ["int32", "int64", "str", "utf8_malformed"])
def test_murmur_matches_golden(name: str) -> None:
    g = golden(name)
    assert [murmur_hash(h) for h in g.hashes.tolist()] == g.murmur.tolist()
    for p in MAX_PARALLELISMS:
        assert (key_groups_from_hashes(g.hashes, p) == g.kgs[p]).all()


@pytest.mark.parametrize("name", ["int32", "int64"])
def test_integer_keys_scalar_and_native_match_golden(name: str) -> None:
    g = golden(name)
    keys = [int(k) for k in g.raw]
    assert [java_hash_code(k, name) for k in keys] == g.hashes.tolist()  # type: ignore[arg-type]
    arr = np.array(keys, dtype=name)
    for p in MAX_PARALLELISMS:
        assert (key_groups(arr, p) == g.kgs[p]).all()
    sample = keys[:: len(keys) // 500]
    for p in MAX_PARALLELISMS:
        expected = g.kgs[p][:: len(keys) // 500].tolist()
        assert [assign_to_key_group(k, p, name) for k in sample] == expected  # type: ignore[arg-type]


def test_str_keys_scalar_and_native_match_golden() -> None:
    g = golden("str")
    strings = [b.decode("utf-8") for b in g.blobs()]
    assert any(any(ord(c) > 0xFFFF for c in s) for s in strings)  # non-BMP is covered
    assert "" in strings
    assert [java_hash_code(s) for s in strings] == g.hashes.tolist()
    data, offsets = g.packed()
    for p in MAX_PARALLELISMS:
        assert (key_groups_packed(data, offsets, p, "str") == g.kgs[p]).all()
        assert [assign_to_key_group(s, p) for s in strings[:300]] == g.kgs[p][:300].tolist()


def test_malformed_utf8_decodes_like_java() -> None:
    g = golden("utf8_malformed")
    data, offsets = g.packed()
    for p in MAX_PARALLELISMS:
        assert (key_groups_packed(data, offsets, p, "str") == g.kgs[p]).all()


def test_bytes_keys_match_java_arrays_hashcode() -> None:
    g = golden("bytes")
    assert [java_hash_code(b) for b in g.blobs()] == g.hashes.tolist()
    data, offsets = g.packed()
    for p in MAX_PARALLELISMS:
        assert (key_groups_packed(data, offsets, p, "bytes") == g.kgs[p]).all()


def test_record_key_fields_match_golden() -> None:
    """The filter's key extraction (int64 field, length-prefixed str field) agrees with the JVM."""
    g64 = golden("int64")
    recs = [b"\x01\x02\x03" + struct.pack("<q", int(k)) + b"tail" for k in g64.raw]
    (buf,) = write_records(recs, buffer_size=1 << 24)
    assert (key_groups_of(buf, 1000, FieldKey(3, "int64")) == g64.kgs[1000]).all()
    gs = golden("str")
    recs = [b"xy" + struct.pack("<I", len(b)) + b + b"!" for b in gs.blobs()]
    (buf,) = write_records(recs, buffer_size=1 << 24)
    assert (key_groups_of(buf, 32768, FieldKey(2, "str")) == gs.kgs[32768]).all()


# ---- native versus the Python reference on random keys ----

MAXP = st.integers(1, 32768)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=200), MAXP)
def test_native_int32_equals_scalar(keys: list[int], maxp: int) -> None:
    native = key_groups(np.array(keys, dtype=np.int32), maxp)
    assert native.tolist() == [assign_to_key_group(k, maxp, "int32") for k in keys]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=200), MAXP)
def test_native_int64_equals_scalar(keys: list[int], maxp: int) -> None:
    native = key_groups(np.array(keys, dtype=np.int64), maxp)
    assert native.tolist() == [assign_to_key_group(k, maxp, "int64") for k in keys]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(max_size=30), max_size=60), MAXP)
def test_native_str_equals_scalar(keys: list[str], maxp: int) -> None:
    blobs = [k.encode("utf-8") for k in keys]
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in blobs])]).astype(np.int64)
    native = key_groups_packed(b"".join(blobs), offsets, maxp, "str")
    assert native.tolist() == [assign_to_key_group(k, maxp) for k in keys]


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=40))
def test_valid_utf8_prefix_of_malformed_input_is_never_lost(blob: bytes) -> None:
    """Where Python and Java agree (no encoded surrogates), decoding matches errors='replace'."""
    if b"\xed" in blob:
        return
    text = blob.decode("utf-8", "replace")
    offsets = np.array([0, len(blob)], dtype=np.int64)
    assert key_groups_packed(blob, offsets, 32768, "str")[0] == assign_to_key_group(text, 32768)


def test_python_int_keys_pick_int32_or_int64() -> None:
    assert java_hash_code(-1) == -1  # Integer.hashCode
    assert java_hash_code(-1, "int64") == 0  # Long.hashCode
    assert java_hash_code(2**31) == java_hash_code(2**31, "int64") == -(2**31)
    assert java_hash_code(np.int64(-1)) == 0
    assert java_hash_code(np.int32(-1)) == -1
    with pytest.raises(ValueError):
        java_hash_code(2**31, "int32")
    with pytest.raises(ValueError):
        java_hash_code(2**63)
    with pytest.raises(TypeError):
        java_hash_code(True)
    with pytest.raises(TypeError):
        java_hash_code(1.5)


# ---- ranges and operator assignment ----


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_ranges_partition_all_key_groups(data: st.DataObject) -> None:
    maxp = data.draw(MAXP)
    p = data.draw(st.integers(1, min(maxp, 512)))
    ranges = [key_group_range_for_operator(maxp, p, i) for i in range(p)]
    assert ranges[0].start == 0 and ranges[-1].end == maxp - 1
    for a, b in itertools.pairwise(ranges):
        assert b.start == a.end + 1
    assert all(len(r) >= 1 for r in ranges)
    assert sum(len(r) for r in ranges) == maxp
    table = key_group_table(maxp, ranges)
    kgs = data.draw(st.lists(st.integers(0, maxp - 1), min_size=1, max_size=50))
    for kg in kgs:
        i = operator_index_for_key_group(maxp, p, kg)
        assert kg in ranges[i]
        assert table[kg] == i


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 32768))
def test_default_max_parallelism(p: int) -> None:
    m = compute_default_max_parallelism(p)
    assert m & (m - 1) == 0 and 128 <= m <= 32768
    if 128 < m < 32768:
        assert m // 2 < p + p // 2 <= m
    if m == 32768:
        assert p + p // 2 > 16384


def test_default_max_parallelism_flink_values() -> None:
    assert [compute_default_max_parallelism(p) for p in (1, 85, 86, 100, 1000, 30000)] == [
        128,
        128,
        256,
        256,
        2048,
        32768,
    ]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 50), st.integers(-1, 50), st.integers(0, 50), st.integers(-1, 50))
def test_range_intersection_is_set_intersection(a: int, b: int, c: int, d: int) -> None:
    r, s = KeyGroupRange(a, b), KeyGroupRange(c, d)
    both = r.intersection(s)
    assert set(both) == set(r) & set(s)
    assert len(both) == len(set(both))
    assert all(k in r for k in r) and -1 not in r and (b + 1) not in r
    if not len(both):
        assert both == KeyGroupRange.empty()


@pytest.mark.parametrize(
    "call",
    [
        lambda: compute_key_group_for_key_hash(0, 0),
        lambda: compute_key_group_for_key_hash(0, 32769),
        lambda: key_group_range_for_operator(128, 129, 0),
        lambda: key_group_range_for_operator(128, 4, 4),
        lambda: operator_index_for_key_group(128, 4, 128),
        lambda: compute_default_max_parallelism(0),
        lambda: KeyGroupRange(-1, 3),
        lambda: key_group_table(8, [KeyGroupRange(0, 3), KeyGroupRange(3, 5)]),
        lambda: key_group_table(8, [KeyGroupRange(0, 8)]),
    ],
)
def test_bad_bounds_raise_config_error(call: object) -> None:
    with pytest.raises(ConfigError):
        call()  # type: ignore[operator]


def test_bad_hash_or_key_array() -> None:
    with pytest.raises(ValueError):
        compute_key_group_for_key_hash(2**31, 128)
    with pytest.raises(TypeError):
        key_groups(np.array([1.0]), 128)
    with pytest.raises(ValueError):
        key_groups_packed(b"abc", np.array([0, 4]), 128)


# ---- add_key_sums ----


def _empty_run() -> tuple[np.ndarray, np.ndarray]:
    return np.empty(0, np.int64), np.empty(0, np.int64)


@settings(max_examples=100, deadline=None)
@given(
    keys=st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=50),
    maxp=st.sampled_from(MAX_PARALLELISMS),
    start=st.floats(0, 1),
    length=st.floats(0, 1),
)
def test_add_key_sums_checks_key_groups_as_key_groups_does(
    keys: list[int], maxp: int, start: float, length: float
) -> None:
    """A batch passes the check exactly when ``key_groups`` puts every key in the
    range; then the keys are counted, else nothing is returned or changed."""
    lo = int(start * (maxp - 1))
    rng = KeyGroupRange(lo, lo + int(length * (maxp - 1 - lo)))
    k = np.array(keys, dtype=np.int64)
    main = (np.unique(k[: len(k) // 2]), np.zeros(np.unique(k[: len(k) // 2]).size, np.int64))
    got = add_key_sums(k, None, main, _empty_run(), maxp, rng)
    kg = key_groups(k, maxp)
    if ((kg < rng.start) | (kg > rng.end)).any():
        assert got is None
        assert not main[1].any()
        return
    assert got is not None
    uniq, totals, new = got
    want, counts = np.unique(k, return_counts=True)
    assert uniq.tolist() == want.tolist() and totals.tolist() == counts.tolist()
    assert uniq[new].tolist() == sorted(set(keys) - set(main[0].tolist()))


@settings(max_examples=150, deadline=None)
@given(
    main_keys=st.sets(st.integers(-(1 << 63), (1 << 63) - 1), max_size=60),
    delta_keys=st.sets(st.integers(-300, 300), max_size=30),
    batch=st.lists(st.integers(-300, 300) | st.integers(-(1 << 63), (1 << 63) - 1), max_size=80),
    index_main=st.booleans(),
    index_delta=st.booleans(),
    counted=st.booleans(),
)
def test_add_key_sums_by_hash_index_adds_as_by_search(
    main_keys: set[int],
    delta_keys: set[int],
    batch: list[int],
    index_main: bool,
    index_delta: bool,
    counted: bool,
) -> None:
    """Runs searched through their hash indexes, keys in first-seen order, end with the
    sums a binary search gives, return the same total per key, and list the same keys
    as new, ascending by where they stand in the output."""
    mk = np.array(sorted(main_keys), dtype=np.int64)
    dk = np.array(sorted(delta_keys - main_keys), dtype=np.int64)
    k = np.array(batch, dtype=np.int64)
    values = None if counted else np.arange(1, len(batch) + 1, dtype=np.int64) * 7
    runs = [
        ((mk, np.arange(mk.size, dtype=np.int64)), (dk, -np.arange(dk.size, dtype=np.int64)))
        for _ in range(2)
    ]
    indexes = (
        key_sums_index(mk) if index_main else None,
        key_sums_index(dk) if index_delta else None,
    )
    hashed = add_key_sums(k, values, *runs[0], indexes=indexes, ascending=False)
    searched = add_key_sums(k, values, *runs[1])
    assert hashed is not None and searched is not None
    assert hashed[0].tolist() == list(dict.fromkeys(batch))
    assert searched[0].tolist() == sorted(set(batch))
    assert dict(zip(hashed[0].tolist(), hashed[1].tolist(), strict=True)) == dict(
        zip(searched[0].tolist(), searched[1].tolist(), strict=True)
    )
    assert hashed[2].tolist() == sorted(hashed[2].tolist())
    assert sorted(hashed[0][hashed[2]].tolist()) == searched[0][searched[2]].tolist()
    for a, b in zip(runs[0], runs[1], strict=True):
        assert a[1].tolist() == b[1].tolist()


@settings(max_examples=100, deadline=None)
@given(
    main_keys=st.sets(st.integers(-300, 300), max_size=40),
    batch=st.lists(st.integers(-300, 300) | st.integers(-(1 << 63), (1 << 63) - 1), max_size=80),
    indexed=st.booleans(),
    counted=st.booleans(),
)
def test_add_key_sum_rows_are_add_key_sums_side_by_side(
    main_keys: set[int], batch: list[int], indexed: bool, counted: bool
) -> None:
    """The rows variant returns each distinct key beside its new sum, in the order and
    with the new keys of :func:`add_key_sums`, and leaves the runs as it does: a
    record batch of ``(key, sum)`` without a copy."""
    mk = np.array(sorted(main_keys), dtype=np.int64)
    k = np.array(batch, dtype=np.int64)
    values = None if counted else np.arange(1, len(batch) + 1, dtype=np.int64) * -3
    runs = [((mk, np.arange(mk.size, dtype=np.int64) * 5), _empty_run()) for _ in range(2)]
    index = (key_sums_index(mk) if indexed else None, None)
    cols = add_key_sums(k, values, *runs[0], indexes=index, ascending=False)
    rows = add_key_sum_rows(k, values, *runs[1], indexes=index, ascending=False)
    assert cols is not None and rows is not None
    assert rows[0].shape == (cols[0].size, 2) and rows[0].flags.c_contiguous
    assert rows[0][:, 0].tolist() == cols[0].tolist()
    assert rows[0][:, 1].tolist() == cols[1].tolist()
    assert rows[1].tolist() == cols[2].tolist()
    assert runs[0][0][1].tolist() == runs[1][0][1].tolist()
    batch_of = rows[0].view([("key", "<i8"), ("count", "<i8")]).reshape(-1)
    assert batch_of["key"].tolist() == cols[0].tolist()


def test_a_hash_index_must_be_the_one_built_for_its_run() -> None:
    keys = np.arange(40, dtype=np.int64)
    index = key_sums_index(keys)
    assert index.dtype == np.uint32 and index.size >= 60 and index.size & (index.size - 1) == 0
    assert sorted(index[index > 0].tolist()) == list(range(1, 41))
    run = (keys, np.zeros(40, np.int64))
    for wrong in (index[:-1], index.astype(np.int64), key_sums_index(keys[:8])):
        with pytest.raises(ValueError, match="index"):
            add_key_sums(keys, None, run, _empty_run(), indexes=(wrong, None))  # type: ignore[arg-type]
    # An index of other keys with a table of the same size is the caller's error; one of
    # a longer run that shares its first keys still finds them (slots past the run are
    # skipped, never read through).
    short = (keys[:33].copy(), np.zeros(33, np.int64))
    got = add_key_sums(keys[:33], None, short, _empty_run(), indexes=(index, None))
    assert got is not None and short[1].tolist() == [1] * 33


def test_add_key_sums_refuses_runs_it_cannot_add_into() -> None:
    keys = np.arange(4, dtype=np.int64)
    frozen = np.zeros(4, np.int64)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        add_key_sums(keys, None, (keys, frozen), _empty_run())
    with pytest.raises(ValueError, match="contiguous"):
        add_key_sums(keys, None, (np.arange(8)[::2], np.zeros(4, np.int64)), _empty_run())
    with pytest.raises(TypeError, match="int64"):
        add_key_sums(keys.astype(np.int32), None, _empty_run(), _empty_run())
    with pytest.raises(ValueError, match="values"):
        add_key_sums(keys, keys[:3], _empty_run(), _empty_run())
