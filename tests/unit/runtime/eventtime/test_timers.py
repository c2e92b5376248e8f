"""Event-time timers: a keyed state of (key, timestamp) pairs, fired in timestamp
order, snapshotted and redistributed by key group like every keyed state."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from spillover.keygroups import key_group_range_for_operator
from spillover.runtime.eventtime.timers import KeyedTimerService
from spillover.runtime.state import HeapKeyedStateBackend, HeapTimerState

MAX_P = 128


def backend(p: int = 1, i: int = 0) -> HeapKeyedStateBackend:
    return HeapKeyedStateBackend(MAX_P, key_group_range_for_operator(MAX_P, p, i))


def i64(xs: list[int]) -> np.ndarray:
    return np.asarray(xs, dtype=np.int64)


PAIRS = st.lists(st.tuples(st.integers(0, 30), st.integers(-5, 60)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(st.lists(PAIRS, max_size=5), st.lists(st.integers(-10, 70), max_size=6))
def test_timers_fire_once_in_timestamp_order(
    batches: list[list[tuple[int, int]]], wms: list[int]
) -> None:
    service = KeyedTimerService(backend(), "op.timers")
    pending: set[tuple[int, int]] = set()  # the model: (key, time) registered, not fired
    current = -(2**63)

    def advance(wm: int) -> None:
        nonlocal current
        fired: list[tuple[int, int]] = []
        service.advance(wm, lambda k, t: fired.extend(zip(k.tolist(), t.tolist(), strict=True)))
        due = sorted((p for p in pending if p[1] <= wm), key=lambda p: (p[1], p[0]))
        if wm <= current:
            due = []
        current = max(current, wm)
        assert fired == due  # timestamp order, ties by key, each pair once
        pending.difference_update(due)

    for batch, wm in zip(batches, [*sorted(wms), *([None] * len(batches))], strict=False):
        if batch:
            service.register(i64([k for k, _ in batch]), i64([t for _, t in batch]))
            pending.update(batch)
        if wm is not None:
            advance(wm)
    advance(2**63 - 1)
    assert service.pending() == 0 and not pending


def test_a_watermark_fires_only_what_it_passed_and_never_goes_back() -> None:
    service = KeyedTimerService(backend(), "t")
    service.register(i64([1, 2, 3, 1]), i64([10, 5, 10, 10]))
    got: list[tuple[list[int], list[int]]] = []
    service.advance(9, lambda k, t: got.append((k.tolist(), t.tolist())))
    assert got == [([2], [5])]
    service.advance(8, lambda k, t: got.append((k.tolist(), t.tolist())))  # no step back
    assert service.current_watermark == 9
    service.delete(i64([3]), i64([10]))
    service.advance(10, lambda k, t: got.append((k.tolist(), t.tolist())))
    assert got[1:] == [([1], [10])]


def test_timers_registered_while_firing_at_or_before_the_watermark_fire_too() -> None:
    service = KeyedTimerService(backend(), "t")
    service.register(i64([7]), i64([1]))
    fired: list[int] = []

    def fire(keys: np.ndarray, times: np.ndarray) -> None:
        fired.extend(times.tolist())
        if times[0] < 3:
            service.register(keys, times + 1)

    service.advance(5, fire)
    assert fired == [1, 2, 3]


def test_an_operator_without_timers_adds_no_state() -> None:
    b = backend()
    service = KeyedTimerService(b, "t")
    service.advance(100, lambda k, t: None)
    assert b.state_names() == []


def test_timers_restore_by_key_group_at_another_parallelism(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    keys = rng.integers(0, 10_000, 3000).astype(np.int64)
    times = rng.integers(0, 1000, 3000).astype(np.int64)
    handles = []
    for i in range(2):
        b = backend(2, i)
        mine = b.key_group_range
        from spillover.keygroups import key_groups

        kg = key_groups(keys, MAX_P)
        sel = (kg >= mine.start) & (kg <= mine.end)
        KeyedTimerService(b, "w.timers").register(keys[sel], times[sel])
        handles.append(b.snapshot()(str(tmp_path / f"old{i}")))
    fired: list[tuple[int, int]] = []
    for i in range(3):
        b = backend(3, i)
        b.restore(handles)
        service = KeyedTimerService(b, "w.timers")
        state = b.state_names()
        assert state == ["w.timers"]
        service.advance(
            2**63 - 1, lambda k, t: fired.extend(zip(k.tolist(), t.tolist(), strict=True))
        )
    assert sorted(fired) == sorted(set(zip(keys.tolist(), times.tolist(), strict=True)))


def test_timer_state_queries() -> None:
    b = backend()
    service = KeyedTimerService(b, "t")
    service.register(i64([4, 4, 9]), i64([30, 20, 50]))
    from spillover.runtime.api import StateDescriptor

    state = b.state(StateDescriptor("t", "timers", np.int64))
    assert isinstance(state, HeapTimerState)
    earliest, present = state.get(i64([4, 9, 1]))
    assert earliest.tolist()[:2] == [20, 50] and present.tolist() == [True, True, False]
    keys, values = state.items()
    assert keys.tolist() == [4, 4, 9] and values.tolist() == [20, 30, 50]
    state.clear(i64([4]))
    assert len(state) == 1
