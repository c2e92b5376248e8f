"""The heap sum state's ``add`` (what ``KeyedCount``/``KeyedSum`` call per buffer)
against a pure-Python dict of the same work and the machine's limit for the keys.

Run: ``PYTHONPATH=src .venv/bin/python -m pytest bench/bench_sum_state.py --benchmark-only -q``

Two shapes, batches of 1,000 int64 keys (about one 128 KiB buffer of the bench job):

- ``steady``: every key already in the state (10,000 keys, the bench job's, and
  1,000,000), the job's steady state;
- ``growing``: every key new (random 40-bit keys), 200 batches from an empty state.

``memcpy`` is one copy of the batches' keys (the least any add does with them);
``python`` a dict ``counts[k] = counts.get(k, 0) + 1`` per key and the touched keys'
totals, the reference. Time per key is in each benchmark's ``extra_info``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from spillover.keygroups import KeyGroupRange
from spillover.runtime.api import StateDescriptor
from spillover.runtime.state import HeapKeyedStateBackend, HeapSumState

BATCH = 1_000
BATCHES = 200


def _state(keys: np.ndarray | None = None) -> HeapSumState:
    s = HeapKeyedStateBackend(128, KeyGroupRange(0, 127)).state(StateDescriptor("s", "sum"))
    assert isinstance(s, HeapSumState)
    if keys is not None:
        s.add(keys)
        s.items()  # merged into the main run, as after a checkpoint
    return s


def _batches(universe: np.ndarray, seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [universe[rng.integers(0, universe.size, BATCH)] for _ in range(BATCHES)]


def _add_all(state: HeapSumState, batches: list[np.ndarray]) -> None:
    for b in batches:
        state.add(b)


def _python(counts: dict[int, int], batches: list[list[int]]) -> None:
    for b in batches:
        touched = {}
        for k in b:
            touched[k] = counts[k] = counts.get(k, 0) + 1
        list(touched.items())


def _rate(benchmark: Any) -> None:
    keys = BATCH * BATCHES
    benchmark.extra_info["ns_per_key"] = benchmark.stats.stats.median / keys * 1e9


@pytest.mark.parametrize("n_keys", [10_000, 1_000_000])
def test_steady(benchmark: Any, n_keys: int) -> None:
    universe = np.random.default_rng(0).integers(0, 1 << 40, n_keys)
    state, batches = _state(universe), _batches(universe)
    benchmark.pedantic(_add_all, args=(state, batches), rounds=5, warmup_rounds=1)
    _rate(benchmark)


@pytest.mark.parametrize("n_keys", [10_000, 1_000_000])
def test_steady_python(benchmark: Any, n_keys: int) -> None:
    universe = np.random.default_rng(0).integers(0, 1 << 40, n_keys)
    counts = dict.fromkeys(universe.tolist(), 0)
    batches = [b.tolist() for b in _batches(universe)]
    benchmark.pedantic(_python, args=(counts, batches), rounds=3, warmup_rounds=0)
    _rate(benchmark)


def test_growing(benchmark: Any) -> None:
    rng = np.random.default_rng(2)
    batches = [rng.integers(0, 1 << 40, BATCH) for _ in range(BATCHES)]
    benchmark.pedantic(lambda: _add_all(_state(), batches), rounds=5, warmup_rounds=1)
    _rate(benchmark)


def test_memcpy(benchmark: Any) -> None:
    src = np.random.default_rng(0).integers(0, 1 << 40, BATCH * BATCHES)
    dst = np.empty_like(src)
    benchmark.pedantic(np.copyto, args=(dst, src), rounds=5, warmup_rounds=1)
    _rate(benchmark)
