"""The generator's native fill against the numpy formula it stands for."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillover.records.generated import fill_generated, letter_pattern

U64 = np.uint64


def splitmix64(z: np.ndarray) -> np.ndarray:
    z = z + U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> U64(30))) * U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> U64(27))) * U64(0x94D049BB133111EB)
    return z ^ (z >> U64(31))


def dtype(payload: int, extra: bool) -> np.dtype[Any]:
    fields = [("partition", "<i4"), ("seq", "<i8"), ("key", "<i8"), ("payload", f"S{payload}")]
    return np.dtype(fields + ([("ts", "<i8")] if extra else []))


blocks = st.lists(
    st.tuples(st.integers(0, 2**31 - 1), st.integers(0, 2**62), st.integers(0, 40)), max_size=6
)


@settings(max_examples=150, deadline=None)
@given(
    blocks=blocks,
    seed_mix=st.integers(0, 2**64 - 1),
    keys=st.integers(0, 2**64 - 1),
    payload=st.integers(1, 300),
    extra=st.booleans(),
)
def test_fill_is_the_numpy_formula(
    blocks: list[tuple[int, int, int]], seed_mix: int, keys: int, payload: int, extra: bool
) -> None:
    """Every record gets its block's partition, consecutive seqs, the key
    ``splitmix64(seq + partition * golden + seed_mix) % keys`` (``keys`` 0: untouched)
    and the letters from ``'A' + seq % 26``; fields it does not own keep their bytes."""
    parts, starts, counts = (np.array([b[i] for b in blocks], np.int64) for i in range(3))
    total = int(counts.sum())
    out = np.zeros(total, dtype(payload, extra))
    if extra:
        out["ts"] = -7
    out["key"] = -3
    fill_generated(out, parts, starts, counts, seed_mix, keys, letter_pattern(payload))
    part = np.repeat(parts, counts)
    seq = np.array([s + i for s, c in zip(starts, counts, strict=True) for i in range(c)], np.int64)
    assert out["partition"].tolist() == part.tolist()
    assert out["seq"].tolist() == seq.tolist()
    if keys:
        h = splitmix64(seq.astype(U64) + part.astype(U64) * U64(0x9E3779B97F4A7C15) + U64(seed_mix))
        assert out["key"].tolist() == (h % U64(keys)).astype(np.int64).tolist()
    else:
        assert (out["key"] == -3).all()
    letters = [bytes((65 + (s % 26 + j) % 26) for j in range(payload)) for s in seq.tolist()]
    assert out["payload"].tolist() == letters
    if extra:
        assert (out["ts"] == -7).all()


def test_fill_refuses_what_it_cannot_fill() -> None:
    one = np.ones(1, np.int64)
    with pytest.raises(ValueError, match="records to generate"):
        fill_generated(np.zeros(1, [("seq", "<i8")]), one, one, one, 0, 5, letter_pattern(4))
    with pytest.raises(ValueError, match="hold 2 records"):
        fill_generated(np.zeros(1, dtype(4, False)), one, one, one * 2, 0, 5, letter_pattern(4))
    with pytest.raises(ValueError, match="pattern"):
        fill_generated(np.zeros(1, dtype(4, False)), one, one, one, 0, 5, letter_pattern(2))
    with pytest.raises(ValueError, match=">= 0"):
        fill_generated(np.zeros(0, dtype(4, False)), one, one, -one, 0, 5, letter_pattern(4))
