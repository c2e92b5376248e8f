"""Source watermarks (per split, idleness, end of input) and the tumbling window
count, driven directly without a runtime."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from spillover.errors import ConfigError
from spillover.keygroups import KeyGroupRange
from spillover.runtime.api import Batch, Operator, OperatorContext
from spillover.runtime.connectors.generator import GeneratedEventTime, GeneratorSource
from spillover.runtime.eventtime import (
    KeyedTimerService,
    SourceWatermarks,
    TumblingWindowCount,
    WatermarkStrategy,
)
from spillover.runtime.network.events import MAX_WATERMARK, Watermark, WatermarkStatus
from spillover.runtime.state import HeapKeyedStateBackend

REC = np.dtype([("partition", "<i4"), ("key", "<i8"), ("ts", "<i8")])


class Splits(Operator):
    """A source whose splits the test sets."""

    is_source = True
    split_field = "partition"
    out_dtype = REC

    def __init__(self, splits: list[int]) -> None:
        self.splits = np.asarray(splits, dtype=np.int64)

    def active_splits(self) -> np.ndarray:
        return self.splits


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def batch(rows: list[tuple[int, int, int]]) -> Batch:
    return np.array(rows, dtype=REC)


def test_watermarks_follow_the_slowest_split_minus_the_delay() -> None:
    source = Splits([0, 1])
    gen = SourceWatermarks(WatermarkStrategy.bounded_out_of_orderness("ts", 10), source)
    gen.observe(batch([(0, 1, 100), (0, 1, 90)]))
    assert gen.poll() == []  # split 1 has shown nothing yet
    gen.observe(batch([(1, 1, 50)]))
    assert gen.poll() == [Watermark(39)]  # min(100, 50) - 10 - 1
    gen.observe(batch([(1, 1, 45)]))
    assert gen.poll() == []  # only when it advances
    source.splits = np.array([0])  # split 1 ended
    assert gen.poll() == [Watermark(89)]
    assert gen.end() == [Watermark(MAX_WATERMARK)]


def test_a_subtask_without_splits_is_idle_and_one_without_records_goes_idle() -> None:
    assert SourceWatermarks(WatermarkStrategy("ts"), Splits([])).poll() == [WatermarkStatus(True)]
    clock = Clock()
    source = Splits([3])
    gen = SourceWatermarks(WatermarkStrategy("ts").with_idleness(500), source, clock)
    gen.observe(batch([(3, 1, 10)]))
    assert gen.poll() == [Watermark(9)]
    clock.now = 0.4
    assert gen.poll() == []
    clock.now = 0.6
    assert gen.poll() == [WatermarkStatus(True)]
    gen.observe(batch([(3, 1, 20)]))
    assert gen.poll() == [WatermarkStatus(False), Watermark(19)]
    clock.now = 5.0
    assert gen.poll() == [WatermarkStatus(True)]
    assert gen.end() == [WatermarkStatus(False), Watermark(MAX_WATERMARK)]


def test_strategies_are_checked_against_the_records() -> None:
    with pytest.raises(ConfigError, match="no timestamp field"):
        WatermarkStrategy("nope").check(REC, Splits([]))
    with pytest.raises(ConfigError, match="int64"):
        WatermarkStrategy("partition").check(REC, Splits([]))
    with pytest.raises(ConfigError):
        WatermarkStrategy("ts", -1)
    with pytest.raises(ConfigError):
        WatermarkStrategy("ts").with_idleness(0)


def test_generated_event_time_is_deterministic_bounded_and_optional() -> None:
    plain = GeneratorSource(partitions=2, payload_bytes=4)
    assert plain.out_dtype.names == ("partition", "seq", "key", "payload")
    et = GeneratedEventTime(step_ms=5, max_disorder_ms=40)
    a = GeneratorSource(partitions=2, payload_bytes=4, seed=1, event_time=et)
    assert a.out_dtype.names == ("partition", "seq", "key", "payload", "ts")
    seq = np.arange(10_000)
    ts = a.timestamps_of(np.zeros_like(seq), seq)
    assert np.array_equal(ts, a.timestamps_of(np.zeros_like(seq), seq))
    assert (ts >= seq * 5).all() and (ts <= seq * 5 + 40).all()
    # Never more than max_disorder_ms behind any earlier record of the partition.
    assert (ts >= np.maximum.accumulate(ts) - 40).all()
    assert not np.array_equal(np.diff(ts) >= 0, np.ones(len(ts) - 1, bool)), "some disorder"


# ---- the window operator ----

OUT = np.dtype([("key", "<i8"), ("window_end", "<i8"), ("count", "<i8")])


class Recording:
    def __init__(self) -> None:
        self.batches: list[Batch] = []
        self.watermarks: list[int] = []

    def emit(self, b: Batch) -> None:
        self.batches.append(b)

    def emit_watermark(self, ts: int) -> None:
        self.watermarks.append(ts)

    def rows(self) -> list[tuple[int, int, int]]:
        return [tuple(map(int, r)) for b in self.batches for r in b.tolist()]


def window(size: int = 10) -> tuple[TumblingWindowCount, Recording, HeapKeyedStateBackend]:
    keyed = HeapKeyedStateBackend(128, KeyGroupRange(0, 127))
    out = Recording()
    op = TumblingWindowCount("key", "ts", size)
    op.open(
        OperatorContext(
            uid="w",
            name="w",
            subtask_index=0,
            parallelism=1,
            max_parallelism=128,
            attempt=0,
            output=out,
            keyed=keyed,
            timers=KeyedTimerService(keyed, "w.timers"),
        )
    )
    return op, out, keyed


def test_windows_fire_when_the_watermark_passes_their_end_in_timestamp_order() -> None:
    op, out, _ = window()
    op.process(batch([(0, 1, 3), (0, 2, 4), (0, 1, 15), (0, 1, 9), (0, 2, 25)]))
    op.process_watermark(8)
    assert out.rows() == [] and out.watermarks == [8]
    op.process_watermark(9)  # window [0, 10) ends: its last instant is 9
    assert out.rows() == [(1, 10, 2), (2, 10, 1)]
    op.process(batch([(0, 2, 12)]))
    op.process_watermark(MAX_WATERMARK)
    assert out.rows()[2:] == [(1, 20, 1), (2, 20, 1), (2, 30, 1)]
    assert out.watermarks == [8, 9, MAX_WATERMARK]


def test_late_records_are_dropped_and_counted() -> None:
    op, out, _ = window()
    op.process(batch([(0, 1, 3)]))
    op.process_watermark(12)
    op.process(batch([(0, 1, 5), (0, 3, 9), (0, 1, 13), (0, 1, 10)]))  # two late
    assert op.ctx.metrics["late_records_dropped"] == 2
    op.process_watermark(19)
    assert out.rows() == [(1, 10, 1), (1, 20, 2)]


def test_window_state_and_timers_survive_a_snapshot(tmp_path: Any) -> None:
    op, out, keyed = window()
    op.process(batch([(0, 1, 3), (0, 5, 14), (0, 5, 15)]))
    handle = keyed.snapshot()(str(tmp_path))
    op2, out2, keyed2 = window()
    keyed2.restore([handle])
    op2.process(batch([(0, 5, 11)]))
    op2.process_watermark(MAX_WATERMARK)
    assert out2.rows() == [(1, 10, 1), (5, 20, 3)]
    assert out.rows() == []
