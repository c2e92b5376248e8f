"""Buffer debloating: an edge's buffers shrink to what its consumers take in the
target time, grow back when they take more, and the record streams stay exact."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from spillover.config import Config
from spillover.records import RecordReader
from spillover.runtime.api import EdgeKind
from spillover.runtime.network.writers import Debloat, PartitionWriter, _Debloater
from spillover.runtime.wiring import edge_debloat

DTYPE = np.dtype([("key", "<i8"), ("payload", "S20")])  # 32 framed bytes a record
SEGMENT = 4096


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def settings_(clock: Clock, *, target: float = 1.0, buffers: int = 4) -> Debloat:
    return Debloat(
        target_s=target, period_s=0.2, min_size=64, buffers_in_flight=buffers, clock=clock
    )


def feed(d: _Debloater, clock: Clock, rate: float, seconds: float) -> list[int]:
    """``rate`` bytes/s in steps of 50 ms; the sizes it proposed."""
    sizes = []
    for _ in range(round(seconds / 0.05)):
        clock.now += 0.05
        size = d.account(int(rate * 0.05), 1)
        if size is not None:
            sizes.append(size)
    return sizes


def test_a_slow_consumer_shrinks_the_buffers_to_its_target_and_a_fast_one_restores_them() -> None:
    clock = Clock()
    d = _Debloater(settings_(clock, target=1.0, buffers=4), SEGMENT)
    assert d.size == SEGMENT  # full size until a rate is known
    feed(d, clock, rate=4000.0, seconds=3.0)  # 4 buffers x 1,000 B = one second's bytes
    assert abs(d.size - 1000) <= 0.25 * 1000
    feed(d, clock, rate=10.0, seconds=3.0)
    assert d.size == 64  # the minimum
    feed(d, clock, rate=1e9, seconds=1.0)
    assert d.size == SEGMENT  # never above the segment size


def test_small_changes_do_not_resize() -> None:
    clock = Clock()
    d = _Debloater(settings_(clock), SEGMENT)
    feed(d, clock, rate=8000.0, seconds=3.0)
    settled = d.size
    assert feed(d, clock, rate=8000.0 * 1.1, seconds=3.0) == []  # within 25 %
    assert d.size == settled


def test_a_broadcast_edge_counts_every_byte_per_channel_a_spread_one_a_share() -> None:
    clock = Clock()
    spread, whole = _Debloater(settings_(clock), SEGMENT), _Debloater(settings_(clock), SEGMENT)
    for _ in range(40):
        clock.now += 0.05
        spread.account(400, 4)  # 100 B/step each of 4 channels: 2,000 B/s
        whole.account(400, 1)  # 400 B/step on every channel: 8,000 B/s
    assert whole.size > 3 * spread.size


def test_the_network_settings_give_each_channel_its_window_and_pool_share() -> None:
    net = Config.from_dict(
        {
            "taskmanager.network.memory.buffers-per-partition": 16,
            "taskmanager.network.memory.buffer-debloat.enabled": True,
        }
    ).network
    d = edge_debloat(net, 4)
    assert d is not None and d.buffers_in_flight == 2 + 4
    assert d.target_s == 1.0 and d.period_s == 0.2 and d.min_size == 256
    assert edge_debloat(Config.from_dict({}).network, 4) is None  # off by default


def writer(kind: EdgeKind, n: int, clock: Clock, out: list[list[Any]]) -> PartitionWriter:
    return PartitionWriter(
        kind,
        DTYPE,
        n,
        0,
        SEGMENT,
        128,
        "key",
        send=lambda sub, buf: out[sub].append(bytes(buf)),
        send_all=lambda buf: [o.append(bytes(buf)) for o in out],
        debloat=Debloat(target_s=0.1, period_s=0.2, min_size=64, buffers_in_flight=4, clock=clock),
    )


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from([EdgeKind.KEY_BY, EdgeKind.REBALANCE, EdgeKind.BROADCAST]),
    n=st.integers(1, 3),
    steps=st.lists(st.tuples(st.integers(1, 300), st.floats(0.0, 0.5)), min_size=1, max_size=30),
)
def test_resizing_keeps_every_channel_s_records_exact_and_in_order(
    kind: EdgeKind, n: int, steps: list[tuple[int, float]]
) -> None:
    clock = Clock()
    out: list[list[Any]] = [[] for _ in range(n)]
    w = writer(kind, n, clock, out)
    sent, key = [], 0
    for count, pause in steps:
        clock.now += pause  # long pauses: a slow consumer; short ones: a fast one
        batch = np.zeros(count, DTYPE)
        batch["key"] = np.arange(key, key + count)
        batch["payload"] = [b"p%d" % k for k in range(key, key + count)]
        key += count
        sent.append(batch)
        w.emit(batch)
        assert w.buffer_size <= SEGMENT
    w.flush()
    assert all(len(b) <= SEGMENT for o in out for b in o)
    want = np.concatenate(sent)
    got = []
    for o in out:
        reader = RecordReader()
        rows = [bytes(r) for buf in o for rb in reader.feed(buf) for r in rb]
        got.append(np.frombuffer(b"".join(rows), DTYPE))
    if kind is EdgeKind.BROADCAST:
        assert all(np.array_equal(g, want) for g in got)
    else:  # every record once, each channel's in emit order
        merged = np.concatenate(got)
        assert sorted(merged["key"].tolist()) == want["key"].tolist()
        assert all((np.diff(g["key"]) > 0).all() for g in got)
        assert np.array_equal(np.sort(merged, order="key"), want)


def test_a_slow_edge_cuts_small_buffers() -> None:
    clock = Clock()
    out: list[list[Any]] = [[]]
    w = writer(EdgeKind.REBALANCE, 1, clock, out)
    for _ in range(20):  # 10 records (320 B) every 0.1 s: 3,200 B/s
        clock.now += 0.1
        w.emit(np.zeros(10, DTYPE))
    # 0.1 s of 3,200 B/s over 4 buffers: 80 B, within the threshold
    assert w.resized >= 1 and 64 <= w.buffer_size <= 100
    before = len(out[0])
    w.emit(np.zeros(100, DTYPE))  # 3,200 B in buffers of the new size
    assert all(len(b) <= w.buffer_size for b in out[0][before:])
    assert len(out[0]) - before >= 3200 // 100
