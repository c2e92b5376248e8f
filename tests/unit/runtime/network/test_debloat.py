"""Buffer debloating: a gate announces buffer sizes that hold about the target time
of what it takes, its producers' writers cut at them, and record streams stay exact."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillover.benchmark.spec import BenchSpec, build_job
from spillover.config import Config
from spillover.records import RecordReader
from spillover.runtime.api import EdgeKind
from spillover.runtime.failures import FailureInjector
from spillover.runtime.network.buffers import BufferPool
from spillover.runtime.network.debloat import BufferDebloater, Debloat
from spillover.runtime.network.gate import InputGate
from spillover.runtime.network.local import LocalChannel, connect
from spillover.runtime.network.partition import ResultPartition
from spillover.runtime.network.writers import PartitionWriter
from spillover.runtime.wiring import build_tasks, debloat_start_size, gate_debloater

DTYPE = np.dtype([("key", "<i8"), ("payload", "S20")])  # 32 framed bytes a record
SEGMENT = 4096


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Channel:
    """An input channel's debloating hook: records what it was told."""

    def __init__(self) -> None:
        self.told: list[int] = []
        self.on_buffer_size = self.told.append
        self.credit_listener: object = None  # a TCP channel has one


def debloater(clock: Clock, channels: list[Any], buffers: int = 4) -> BufferDebloater:
    settings_ = Debloat(target_s=1.0, period_s=0.2, min_size=64, clock=clock)
    return BufferDebloater(settings_, channels, SEGMENT, buffers)  # exclusive only


def consume(d: BufferDebloater, clock: Clock, rate: float, seconds: float) -> None:
    """``rate`` bytes/s taken in steps of 50 ms."""
    for _ in range(round(seconds / 0.05)):
        clock.now += 0.05
        d.consumed(int(rate * 0.05))


def test_a_slow_consumer_announces_its_target_and_a_fast_one_the_segment_size() -> None:
    clock, chans = Clock(), [Channel(), Channel()]
    d = debloater(clock, chans, buffers=4)
    assert d.size == SEGMENT  # full size until a rate is known
    consume(d, clock, rate=4000.0, seconds=3.0)  # 4 buffers x 1,000 B = one second's bytes
    assert abs(d.size - 1000) <= 0.25 * 1000
    assert chans[0].told == chans[1].told and chans[0].told[-1] == d.size  # every channel
    consume(d, clock, rate=10.0, seconds=3.0)
    assert d.size == 64  # the minimum
    consume(d, clock, rate=1e9, seconds=1.0)
    assert d.size == SEGMENT and chans[0].told[-1] == SEGMENT  # never above the segment


def test_small_changes_are_not_announced() -> None:
    clock, chan = Clock(), Channel()
    d = debloater(clock, [chan])
    consume(d, clock, rate=8000.0, seconds=3.0)
    told = len(chan.told)
    consume(d, clock, rate=8000.0 * 1.1, seconds=3.0)  # within 25 %
    assert len(chan.told) == told


def test_floating_buffers_count_only_when_no_channel_is_remote() -> None:
    net = Config.from_dict({"taskmanager.network.memory.buffer-debloat.enabled": True}).network
    local = gate_debloater(net, InputGate(2, floating_buffers=8))
    remote = gate_debloater(net, InputGate(2, floating_buffers=8), remote=True)
    assert local is not None and remote is not None
    assert (local.buffers, remote.buffers) == (2 * 2 + 8, 2 * 2)


def test_a_channel_connected_later_is_told_the_current_size() -> None:
    clock, early, late = Clock(), Channel(), Channel()
    late.on_buffer_size = None  # type: ignore[assignment]  # not connected yet
    d = debloater(clock, [early, late])
    consume(d, clock, rate=4000.0, seconds=3.0)
    assert early.told and late.told == []
    late.on_buffer_size = late.told.append  # its handshake ended
    consume(d, clock, rate=4000.0, seconds=0.3)
    assert late.told == [d.size] and early.told[-1] == d.size


def test_the_time_before_the_first_buffer_is_not_measured() -> None:
    clock, chan = Clock(), Channel()
    d = debloater(clock, [chan])
    clock.now += 30.0  # the job starting, a restore
    consume(d, clock, rate=1e9, seconds=1.0)
    assert chan.told == [] and d.size == SEGMENT  # never shrunk by the wait


def test_a_size_told_before_the_subpartition_is_connected_is_applied_then() -> None:
    part = ResultPartition(2, BufferPool(SEGMENT, 8), "p")
    gate = InputGate(1)
    link = connect(part, 0, gate, 0)
    assert link.index == 0
    early = LocalChannel(InputGate(1).channel(0))
    early.announced_size = 700  # a BUFFER_SIZE frame that came before ``connect``
    part.connect(1, early)
    assert early.index == 1 and part.buffer_sizes == [SEGMENT, 700]


def test_a_gate_counts_its_channels_exclusive_and_floating_buffers() -> None:
    net = Config.from_dict({"taskmanager.network.memory.floating-buffers-per-gate": 8}).network
    d = gate_debloater(net, InputGate(4, floating_buffers=8))
    assert d is not None and d.buffers == 4 * 2 + 8  # on by default
    assert d.settings.target_s == 0.5 and d.settings.period_s == 0.2
    assert d.settings.min_size == 256 and d.max_size == 256 * 1024  # the defaults
    off = Config.from_dict({"taskmanager.network.memory.buffer-debloat.enabled": False})
    assert gate_debloater(off.network, InputGate(4)) is None


def test_a_local_channel_tells_its_producer_s_partition() -> None:
    part = ResultPartition(2, BufferPool(SEGMENT, 8), "p")
    gates = [InputGate(1, name=f"g{i}") for i in range(2)]
    for sub, gate in enumerate(gates):
        connect(part, sub, gate, 0)
    version = part.sizes_version
    hook = gates[1].channel(0).on_buffer_size
    assert hook is not None
    hook(1000)
    assert part.buffer_sizes == [SEGMENT, 1000] and part.sizes_version > version
    hook(10 * SEGMENT)  # never above the segment size
    assert part.buffer_sizes == [SEGMENT, SEGMENT]


class Sizes:
    """What a ResultPartition offers its writer: announced sizes and their version."""

    def __init__(self, n: int) -> None:
        self.buffer_sizes = [SEGMENT] * n
        self.sizes_version = 0


def writer(kind: EdgeKind, n: int, sizes: Sizes, out: list[list[bytes]]) -> PartitionWriter:
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
        sizes=sizes,
    )


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from([EdgeKind.KEY_BY, EdgeKind.REBALANCE, EdgeKind.BROADCAST]),
    n=st.integers(1, 3),
    steps=st.lists(
        st.tuples(st.integers(1, 300), st.integers(0, 2), st.sampled_from([64, 100, 700, SEGMENT])),
        min_size=1,
        max_size=30,
    ),
)
def test_resizing_keeps_every_channel_s_records_exact_and_in_order(
    kind: EdgeKind, n: int, steps: list[tuple[int, int, int]]
) -> None:
    sizes, out = Sizes(n), [[] for _ in range(n)]
    w = writer(kind, n, sizes, out)
    sent, key = [], 0
    for count, sub, size in steps:
        sizes.buffer_sizes[sub % n] = size  # a consumer announced a size
        sizes.sizes_version += 1
        batch = np.zeros(count, DTYPE)
        batch["key"] = np.arange(key, key + count)
        batch["payload"] = [b"p%d" % k for k in range(key, key + count)]
        key += count
        sent.append(batch)
        w.emit(batch)
        cut = min(sizes.buffer_sizes) if kind is not EdgeKind.REBALANCE else SEGMENT
        assert w.buffer_size <= cut
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
        assert all((np.diff(g["key"]) > 0).all() for g in got)
        assert np.array_equal(np.sort(merged, order="key"), want)


def test_a_writer_cuts_at_the_announced_size_from_its_next_batch() -> None:
    sizes, out = Sizes(2), [[], []]
    w = writer(EdgeKind.REBALANCE, 2, sizes, out)
    sizes.buffer_sizes[1], sizes.sizes_version = 100, 1
    w.emit(np.zeros(100, DTYPE))  # 3,200 B to subpartition 0: full segments
    w.emit(np.zeros(100, DTYPE))  # 3,200 B to subpartition 1: 100 B buffers
    assert w.resized == 1 and w.buffer_size == 100
    # Whole records: three 32-byte frames a buffer, the 100th record left for a flush.
    assert out[0] == [] and len(out[1]) == 33 and all(len(b) == 96 for b in out[1])


def test_producers_start_at_the_initial_size_and_a_fast_consumer_grows_it() -> None:
    """A job starts (or restarts) with buffers of the initial size on every streaming
    edge, so a slow consumer's gate fills with small buffers, not full segments it
    would hold for tens of seconds; a fast consumer's first measurement grows them
    to the segment size (that both sides assume the same size: the test below)."""
    net = Config.from_dict(
        {
            "taskmanager.memory.segment-size": "64 kb",
            "taskmanager.network.memory.buffer-debloat.initial-size": "8 kb",
        }
    ).network
    assert debloat_start_size(net) == 8 * 1024
    part = ResultPartition(2, BufferPool(net.segment_size, 8), "p", debloat_start_size(net))
    out: list[list[bytes]] = [[], []]
    w = PartitionWriter(
        EdgeKind.REBALANCE,
        DTYPE,
        2,
        0,
        net.segment_size,
        128,
        "key",
        send=lambda sub, buf: out[sub].append(bytes(buf)),
        send_all=lambda buf: None,
        sizes=part,
    )
    assert w.buffer_size == 8 * 1024  # before any consumer said a word
    w.emit(np.zeros(2048, DTYPE))  # 32 KiB to each subpartition
    assert out[0] and all(len(b) <= 8 * 1024 for b in out[0] + out[1])
    clock, chan = Clock(), Channel()
    d = BufferDebloater(
        Debloat(target_s=0.5, period_s=0.2, min_size=256, clock=clock, initial_size=8 * 1024),
        [chan],
        net.segment_size,
        10,
    )
    consume(d, clock, rate=1e9, seconds=0.3)
    assert chan.told == [net.segment_size]  # a fast consumer: full segments again


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({}, 32 * 1024),  # the defaults: 32 KiB until measured, segments of 256 KiB
        ({"taskmanager.memory.segment-size": "16 kb"}, 16 * 1024),  # never above it
        ({"taskmanager.memory.min-segment-size": "64 kb"}, 64 * 1024),  # never below it
        ({"taskmanager.network.memory.buffer-debloat.enabled": False}, None),
    ],
)
def test_every_writer_of_a_job_starts_where_its_consumers_gates_assume(
    options: dict[str, Any], expected: int | None
) -> None:
    """Producers and consumers agree on the initial size without a word between them
    (the consumer may be in another process): a job's every streaming writer starts
    at the size every input gate's debloater assumes, or at the segment size with
    debloating off."""
    cfg = Config.from_dict(options)
    graph = build_job(BenchSpec(executor="local"), "initial").build()
    tasks = build_tasks(
        graph,
        cfg,
        attempt=0,
        restore=None,
        storage=None,
        failures=FailureInjector(),
        on_done=lambda task, error: None,
        flush_interval=0.005,
    )
    writers = {w.buffer_size for t in tasks.values() for w in t.output.writers}
    gates = [t.gate.debloater for t in tasks.values() if t.has_input]
    assert len(gates) == 4 and writers  # two counts, two sinks; sources and counts write
    if expected is None:
        assert writers == {cfg.network.segment_size} and gates == [None, None, None, None]
    else:
        assert writers == {expected} == {d.size for d in gates if d is not None}
