"""Network buffers, pools, events and credit-based channels (in-memory transport)."""

from __future__ import annotations

import functools
import pickle
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillover import DataType, open_retriever, open_storage
from spillover.errors import ClosedError, ConfigError, FormatError
from spillover.runtime.api import EdgeKind
from spillover.runtime.network.buffers import (
    BufferPool,
    BufferReleasedError,
    NetworkBuffer,
    NetworkTimeoutError,
    OutputWaker,
    PoolClosedError,
)
from spillover.runtime.network.errors import (
    ChannelCancelledError,
    ChannelFailedError,
    NetworkError,
)
from spillover.runtime.network.events import (
    MAX_WATERMARK,
    BarrierKind,
    CancelCheckpointMarker,
    CheckpointBarrier,
    EndOfData,
    EndOfPartition,
    Event,
    EventFormatError,
    LoopProbe,
    UnsupportedEventVersionError,
    Watermark,
    WatermarkStatus,
    deserialize,
    is_priority,
    serialize,
)
from spillover.runtime.network.gate import InputGate
from spillover.runtime.network.local import connect, wire
from spillover.runtime.network.partition import ResultPartition, Subpartition
from support.threads import JOIN, Worker, eventually


def waiting(worker: Worker) -> None:
    """Gives a thread that should now be blocked a moment, then checks it still is."""
    time.sleep(0.05)
    assert worker.is_alive()


def data(payload: bytes) -> NetworkBuffer:
    return NetworkBuffer.unpooled(payload)


def link(
    subpartitions: int = 1, channels: int = 1, floating: int = 8, exclusive: int = 2
) -> tuple[ResultPartition, InputGate]:
    part = ResultPartition(subpartitions, BufferPool(64, 64), "p")
    gate = InputGate(channels, floating_buffers=floating, buffers_per_channel=exclusive)
    for s in range(subpartitions):
        connect(part, s, gate, s)
    return part, gate


def drain(gate: InputGate) -> list[tuple[int, bytes | Event]]:
    """Everything deliverable now, released, as (channel, bytes or event)."""
    out: list[tuple[int, bytes | Event]] = []
    while (item := gate.poll(0)) is not None:
        ch, buf = item
        out.append((ch, deserialize(buf) if buf.is_event else bytes(buf)))
        buf.release()
    return out


# ---- buffers and pools ----


def test_buffer_is_a_zero_copy_read_only_view_with_a_reference_count() -> None:
    recycled: list[NetworkBuffer] = []
    array = np.arange(10, dtype=np.uint8)
    buf = NetworkBuffer.unpooled(array[2:7]).derive(recycled.append)
    assert len(buf) == 5 and bytes(buf) == bytes(range(2, 7))
    assert np.shares_memory(buf, array)
    assert buf.data.readonly and memoryview(buf).readonly
    assert bytes(buf.data) == bytes(buf)
    with pytest.raises(ValueError):
        buf[0] = 1
    assert type(buf[1:3]) is np.ndarray and type(buf + 1) is np.ndarray
    assert buf.retain() is buf and buf.refs == 2
    buf.release()
    assert not recycled
    buf.release()
    assert recycled == [buf] and buf.refs == 0
    with pytest.raises(BufferReleasedError):
        buf.release()
    with pytest.raises(BufferReleasedError):
        buf.retain()
    assert recycled == [buf]
    with pytest.raises(TypeError):
        pickle.dumps(buf)


def test_buffer_goes_straight_into_a_storer(tmp_path: Path) -> None:
    pool = BufferPool(32, 2)
    seg = pool.request_segment()
    seg[:5] = np.frombuffer(b"hello", np.uint8)
    buf = pool.wrap(seg[:5])
    ev = NetworkBuffer.unpooled(serialize(EndOfData()), DataType.EVENT)
    storage = open_storage(tmp_path)
    storer = storage.create_storer(0, kind="output")
    storer.append(3, buf, buf.data_type)
    storer.append(3, ev, ev.data_type)
    handle = storer.close()
    buf.release()
    got = [(b.channel_id, b.data_type, bytes(b)) for b in open_retriever(handle)]
    assert got == [(3, DataType.DATA, b"hello"), (3, DataType.EVENT, serialize(EndOfData()))]


def test_pool_budget_blocks_and_wakes_and_reuses_segments() -> None:
    pool = BufferPool(16, 2, "budget")
    a = pool.wrap(pool.request_segment())
    seg_b = pool.request_segment()
    assert pool.available == 0 and pool.in_use == 2
    with pytest.raises(NetworkTimeoutError):
        pool.request_segment(timeout=0)
    with pytest.raises(NetworkTimeoutError):
        pool.wrap(b"foreign", timeout=0.01)
    waiter = Worker(pool.request_segment)
    waiting(waiter)
    a.release()
    got = waiter.finish()
    assert pool.available == 0
    pool.return_segment(seg_b)
    pool.return_segment(got)
    assert pool.available == 2
    assert pool.segments_allocated == 2
    again = pool.request_segment()
    assert again is got or again is seg_b
    pool.return_segment(again)


def test_pool_permits_for_own_segments_and_foreign_arrays() -> None:
    pool = BufferPool(8, 3)
    seg = pool.request_segment()
    buf = pool.wrap(seg[:3])  # the segment's permit moves into the buffer
    assert pool.in_use == 1 and np.shares_memory(buf, seg) and len(buf) == 3
    with pytest.raises(ValueError):
        pool.wrap(seg[:3])  # the same segment twice
    foreign = np.zeros(8, dtype=np.uint8)
    fbuf = pool.wrap(foreign, DataType.EVENT)
    assert pool.in_use == 2 and fbuf.is_event and np.shares_memory(fbuf, foreign)
    with pytest.raises(ConfigError):
        pool.wrap(np.zeros(9, dtype=np.uint8))
    buf.release()
    fbuf.release()
    assert pool.available == 3
    assert pool.request_segment() is seg


def test_pool_wraps_a_segment_it_handed_out_by_name() -> None:
    pool = BufferPool(8, 2)
    seg = pool.request_segment()
    seg[:5] = np.frombuffer(b"hello", dtype=np.uint8)
    buf = pool.wrap_segment(seg, 5)  # the segment's permit moves into the buffer
    assert pool.in_use == 1 and bytes(buf) == b"hello" and np.shares_memory(buf, seg)
    with pytest.raises(ValueError):
        pool.wrap_segment(seg, 5)  # the same segment twice
    with pytest.raises(ValueError):
        pool.wrap_segment(np.zeros(8, dtype=np.uint8), 1)  # not one of the pool's
    other = pool.request_segment()
    with pytest.raises(ConfigError):
        pool.wrap_segment(other, 9)
    pool.return_segment(other)
    buf.release()
    assert pool.available == 2
    assert pool.request_segment() in (seg, other)


def test_pool_close_wakes_waiters() -> None:
    pool = BufferPool(4, 1)
    held = pool.wrap(pool.request_segment())
    waiter = Worker(lambda: pool.request_segment(timeout=JOIN))
    waiting(waiter)
    pool.close()
    with pytest.raises(PoolClosedError):
        waiter.finish()
    held.release()  # buffers out at close still recycle
    assert pool.available == 1
    with pytest.raises(PoolClosedError):
        pool.request_segment()


# ---- events ----

INT64 = st.integers(-(2**63), 2**63 - 1)
IDS = st.integers(0, 2**63 - 1)
BARRIERS = st.one_of(
    st.builds(
        CheckpointBarrier, IDS, INT64, st.sampled_from([BarrierKind.ALIGNED, BarrierKind.UNALIGNED])
    ),
    st.builds(
        CheckpointBarrier,
        IDS,
        INT64,
        st.just(BarrierKind.ALIGNED_WITH_TIMEOUT),
        st.integers(0, 2**63 - 1),
    ),
)
EVENTS = st.one_of(
    BARRIERS,
    st.builds(CancelCheckpointMarker, IDS),
    st.builds(EndOfData, st.booleans()),
    st.just(EndOfPartition()),
    st.builds(Watermark, INT64),
    st.builds(WatermarkStatus, st.booleans()),
    st.builds(LoopProbe, IDS),
)


@settings(max_examples=300, deadline=None)
@given(EVENTS)
def test_events_round_trip(event: Event) -> None:
    wire_bytes = serialize(event)
    assert deserialize(wire_bytes) == event
    assert deserialize(NetworkBuffer.unpooled(wire_bytes, DataType.EVENT)) == event
    assert deserialize(bytearray(wire_bytes)) == event


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40))
def test_any_bytes_decode_to_an_event_or_raise_a_format_error(raw: bytes) -> None:
    try:
        event = deserialize(raw)
    except EventFormatError:
        return
    assert serialize(event) == raw


def test_event_wire_layout() -> None:
    barrier = CheckpointBarrier(7, -2, BarrierKind.ALIGNED_WITH_TIMEOUT, 500)
    assert serialize(barrier) == bytes([1, 1, 2]) + struct.pack("<qqq", 7, -2, 500)
    assert serialize(CancelCheckpointMarker(9)) == bytes([1, 2]) + struct.pack("<q", 9)
    assert serialize(EndOfData(drain=False)) == bytes([1, 3, 0])
    assert serialize(EndOfPartition()) == bytes([1, 4])
    assert serialize(Watermark(-5)) == bytes([1, 5]) + struct.pack("<q", -5)
    assert serialize(Watermark(MAX_WATERMARK)) == bytes([1, 5]) + struct.pack("<q", 2**63 - 1)
    assert serialize(WatermarkStatus(idle=True)) == bytes([1, 6, 1])
    assert serialize(LoopProbe(3)) == bytes([1, 7]) + struct.pack("<q", 3)


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        (b"", EventFormatError),
        (bytes([1]), EventFormatError),
        (bytes([2, 4]), UnsupportedEventVersionError),
        (bytes([1, 0]), EventFormatError),
        (bytes([1, 99]), EventFormatError),
        (bytes([1, 4, 0]), EventFormatError),  # trailing byte
        (bytes([1, 2, 0]), EventFormatError),  # truncated
        (bytes([1, 1, 9]) + bytes(24), EventFormatError),  # unknown barrier kind
        (bytes([1, 1, 0]) + struct.pack("<qqq", 1, 0, 5), EventFormatError),  # timeout, aligned
        (bytes([1, 2]) + struct.pack("<q", -1), EventFormatError),  # negative id
        (bytes([1, 3, 2]), EventFormatError),  # drain flag
        (bytes([1, 5]) + bytes(7), EventFormatError),  # truncated watermark
        (bytes([1, 6, 2]), EventFormatError),  # idle flag
    ],
)
def test_bad_event_bytes_raise_format_errors(raw: bytes, error: type[Exception]) -> None:
    with pytest.raises(error) as info:
        deserialize(raw)
    assert isinstance(info.value, FormatError) and isinstance(info.value, ValueError)


def test_only_unaligned_barriers_take_the_priority_path() -> None:
    assert is_priority(CheckpointBarrier(1, 0, BarrierKind.UNALIGNED))
    assert not is_priority(CheckpointBarrier(1, 0, BarrierKind.ALIGNED))
    timed = CheckpointBarrier(1, 0, BarrierKind.ALIGNED_WITH_TIMEOUT, 10)
    assert not is_priority(timed) and is_priority(timed.as_unaligned())
    assert not is_priority(CancelCheckpointMarker(1)) and not is_priority(EndOfPartition())
    # Watermarks travel in line: a barrier may overtake them like data.
    assert not is_priority(Watermark(5)) and not is_priority(WatermarkStatus(True))
    with pytest.raises(ValueError):
        CheckpointBarrier(1, 0, BarrierKind.UNALIGNED, 10)


# ---- channels: order, credit, blocking ----


def test_fifo_per_channel_under_concurrency_without_loss_or_duplication() -> None:
    producers, per_producer = 4, 400
    gates = [InputGate(producers, floating_buffers=2, name=f"g{j}") for j in range(2)]
    pools = [BufferPool(16, 3, f"pool{i}") for i in range(producers)]
    parts = [ResultPartition(2, pools[i], f"p{i}") for i in range(producers)]
    wire(parts, gates, EdgeKind.REBALANCE)

    def produce(i: int) -> None:
        for seq in range(per_producer):
            seg = parts[i].pool.request_segment(timeout=JOIN)
            seg[:8] = np.frombuffer(struct.pack("<II", i, seq), np.uint8)
            parts[i].emit(seq % 2, parts[i].pool.wrap(seg[:8]), timeout=JOIN)
        parts[i].finish()

    def consume(gate: InputGate) -> dict[int, list[tuple[int, int]]]:
        seen: dict[int, list[tuple[int, int]]] = {c: [] for c in range(producers)}
        while not gate.finished:
            item = gate.poll(JOIN)
            assert item is not None
            ch, buf = item
            if not buf.is_event:
                seen[ch].append(struct.unpack("<II", buf))
            buf.release()
        return seen

    consumers = [Worker(functools.partial(consume, g)) for g in gates]
    workers = [Worker(functools.partial(produce, i)) for i in range(producers)]
    for w in workers:
        w.finish()
    for j, c in enumerate(consumers):
        seen = c.finish()
        for i in range(producers):
            assert seen[i] == [(i, s) for s in range(j, per_producer, 2)]
    assert all(p.available == 3 for p in pools)


def test_credit_stalls_the_producer_after_exclusive_plus_floating_buffers() -> None:
    part, gate = link(exclusive=2, floating=8)
    sent = 0
    with pytest.raises(NetworkTimeoutError):
        while True:
            part.emit(0, data(b"%d" % sent), timeout=0)
            sent += 1
    assert sent == 10 and part.backlog(0) == (10, 10) and part.credit(0) == 0
    ch, held = gate.poll(0) or (None, None)
    assert ch == 0 and held is not None and bytes(held) == b"0"
    with pytest.raises(NetworkTimeoutError):  # a buffer the consumer holds keeps its credit
        part.emit(0, data(b"x"), timeout=0)
    held.release()
    part.emit(0, data(b"10"), timeout=0)
    with pytest.raises(NetworkTimeoutError):
        part.emit(0, data(b"x"), timeout=0)
    assert [p for _, p in drain(gate)] == [b"%d" % i for i in range(1, 11)]
    assert gate.channel(0).buffers_in_use == 0 and gate.floating_available == 8


def test_a_blocked_emit_resumes_when_the_consumer_releases() -> None:
    part, gate = link(exclusive=1, floating=0)
    part.emit(0, data(b"a"))
    producer = Worker(lambda: part.emit(0, data(b"b")))
    waiting(producer)
    _, buf = gate.poll(0) or (0, None)
    assert buf is not None
    buf.release()
    producer.finish()
    assert part.backpressured_seconds > 0
    assert part.emitted(0) == (2, 2)
    assert [p for _, p in drain(gate)] == [b"b"]


def test_floating_credit_is_shared_and_returned() -> None:
    part, gate = link(subpartitions=2, channels=2, exclusive=2, floating=3)

    def fill(sub: int) -> int:
        n = 0
        try:
            while True:
                part.emit(sub, data(b"x"), timeout=0)
                n += 1
        except NetworkTimeoutError:
            return n

    assert fill(0) == 5  # its 2 exclusive and all 3 floating
    assert fill(1) == 2  # only its exclusive ones remain
    gate.block(1)
    _, buf = gate.poll(0) or (0, None)
    assert buf is not None
    buf.release()  # channel 0 gives a floating credit back to the gate
    assert gate.floating_available == 1
    assert fill(1) == 1
    gate.unblock(1)
    assert len(drain(gate)) == 7
    assert gate.floating_available == 3


def counting_waker() -> tuple[OutputWaker, list[int]]:
    woken: list[int] = []
    return OutputWaker(lambda: woken.append(1)), woken


def test_returned_credit_wakes_an_armed_producer_once() -> None:
    part, gate = link(exclusive=1, floating=0)
    waker, woken = counting_waker()
    part.waker = waker
    part.emit(0, data(b"a"))
    assert part.credit(0) == 0
    waker.arm()  # what a backpressured task does before it looks at the credit
    _, buf = gate.poll(0) or (0, None)
    assert buf is not None and woken == []  # polled, but the consumer holds it
    buf.release()
    assert woken == [1] and part.credit(0) == 1
    part.emit(0, data(b"b"))
    _, buf = gate.poll(0) or (0, None)
    assert buf is not None
    buf.release()  # not armed: a producer that does not wait is not disturbed
    assert woken == [1] and waker.wakes == 1


def test_freed_floating_credit_wakes_the_producers_of_other_channels() -> None:
    parts = [ResultPartition(1, BufferPool(64, 64), f"p{i}") for i in range(2)]
    gate = InputGate(2, floating_buffers=1, buffers_per_channel=1)
    for i, p in enumerate(parts):
        connect(p, 0, gate, i)
    wakers = [counting_waker() for _ in parts]
    for p, (w, _) in zip(parts, wakers, strict=True):
        p.waker = w
        w.arm()
    parts[0].emit(0, data(b"a"))
    parts[0].emit(0, data(b"b"))  # borrows the gate's one floating credit
    parts[1].emit(0, data(b"c"))
    assert parts[1].credit(0) == 0
    gate.block(1)
    _, buf = gate.poll(0) or (0, None)
    assert buf is not None
    buf.release()  # channel 0 gives the floating credit back: channel 1 may use it
    assert parts[1].credit(0) == 1 and wakers[1][1] == [1]


def test_a_returned_pool_permit_wakes_an_armed_producer() -> None:
    pool = BufferPool(8, 1)
    waker, woken = counting_waker()
    pool.waker = waker
    buf = pool.wrap(pool.request_segment())
    assert pool.available == 0
    waker.arm()
    buf.release()
    assert pool.available == 1 and woken == [1]


def test_blocked_channel_stalls_its_producer_while_others_flow() -> None:
    part, gate = link(subpartitions=2, channels=2, exclusive=2, floating=0)
    sent = [0, 0]

    def produce(sub: int) -> None:
        for i in range(30):
            part.emit(sub, data(bytes([sub, i])), timeout=JOIN)
            sent[sub] += 1

    gate.block(0)
    producers = [Worker(functools.partial(produce, s)) for s in range(2)]
    got: list[tuple[int, bytes]] = []
    while len(got) < 30:
        item = gate.poll(JOIN)
        assert item is not None
        got.append((item[0], bytes(item[1])))
        item[1].release()
    producers[1].finish()
    assert got == [(1, bytes([1, i])) for i in range(30)]
    eventually(lambda: gate.channel(0).queued_buffers == 2)
    waiting(producers[0])
    assert sent[0] == 2 and gate.is_blocked(0)
    assert gate.poll(0) is None
    gate.unblock_all()
    rest: list[tuple[int, bytes]] = []
    while len(rest) < 30:
        item = gate.poll(JOIN)
        assert item is not None
        rest.append((item[0], bytes(item[1])))
        item[1].release()
    producers[0].finish()
    assert rest == [(0, bytes([0, i])) for i in range(30)]


def test_round_robin_between_channels_with_data() -> None:
    part, gate = link(subpartitions=3, channels=3)
    for sub, n in ((0, 3), (1, 1), (2, 2)):
        for i in range(n):
            part.emit(sub, data(bytes([sub, i])))
    assert [ch for ch, _ in drain(gate)] == [0, 1, 2, 0, 2, 0]


def test_blocking_a_channel_that_has_data_hides_it_until_unblocked() -> None:
    part, gate = link(subpartitions=2, channels=2)
    part.emit(0, data(b"a"))
    part.emit(1, data(b"b"))
    gate.block(0)
    assert drain(gate) == [(1, b"b")]
    part.emit(1, data(b"c"))
    gate.unblock(0)
    assert sorted(drain(gate)) == [(0, b"a"), (1, b"c")]


# ---- events on channels ----


def test_priority_event_overtakes_queued_buffers_and_returns_them() -> None:
    pool = BufferPool(8, 8)
    part = ResultPartition(2, pool, "p")
    gate = InputGate(2, floating_buffers=0, buffers_per_channel=3)
    connect(part, 0, gate, 0)
    connect(part, 1, gate, 1)
    emitted = [pool.wrap(bytes([i])) for i in range(4)]
    for buf in emitted[:3]:
        part.emit(0, buf)
    first = gate.poll(0)
    assert first is not None and first[1] is not emitted[0] and bytes(first[1]) == b"\x00"
    first[1].release()
    part.emit(0, emitted[3])
    part.emit(1, pool.wrap(b"\x09"))
    part.broadcast_event(EndOfData())  # a non-priority event stays in line
    gate.block(0)  # a blocked channel still delivers priority events
    barrier = CheckpointBarrier(5, 123, BarrierKind.UNALIGNED)
    assert part.credit(0) == 0
    overtaken = part.broadcast_event(barrier, priority=True)  # no credit needed
    assert [len(o) for o in overtaken] == [3, 1]
    assert all(a is b for a, b in zip(overtaken[0], emitted[1:], strict=True))
    assert [bytes(b) for b in overtaken[1]] == [b"\x09"]
    for bufs in overtaken:
        for b in bufs:
            b.release()
    gate.unblock(0)
    got = drain(gate)
    assert sorted(got[:2], key=lambda x: x[0]) == [(0, barrier), (1, barrier)]
    assert sorted(got[2:], key=lambda x: x[0]) == [
        (0, b"\x01"),
        (0, b"\x02"),
        (0, b"\x03"),
        (0, EndOfData()),
        (1, b"\x09"),
        (1, EndOfData()),
    ]
    assert pool.available == 8


class RemoteLike(Subpartition):
    """A subpartition whose event writes let the interpreter lock go, like a socket's:
    records what the in-memory channel beside it held when its event came."""

    lets_lock_go = True

    def __init__(self, beside: InputGate, queued: list[NetworkBuffer]) -> None:
        self.beside, self.queued, self.seen_beside = beside, queued, []

    def add_data(self, buffer: NetworkBuffer, deadline: float | None) -> float:
        self.queued.append(buffer)
        return 0.0

    def add_event(self, buffer: NetworkBuffer, priority: bool) -> list[NetworkBuffer]:
        self.seen_beside = drain(self.beside)
        buffer.release()
        return [b.retain() for b in self.queued] if priority else []

    def finish(self, buffer: NetworkBuffer) -> None:
        buffer.release()

    def fail(self, cause: BaseException) -> None:
        pass

    @property
    def credit(self) -> int:
        return 1

    @property
    def backlog(self) -> tuple[int, int]:
        return len(self.queued), sum(len(b) for b in self.queued)


def test_a_priority_event_reaches_in_memory_channels_before_remote_ones() -> None:
    pool = BufferPool(8, 4)
    part = ResultPartition(2, pool, "p")
    gate = InputGate(1, floating_buffers=0, buffers_per_channel=2)
    remote = RemoteLike(gate, [])
    part.connect(0, remote)  # the remote one comes first by index
    connect(part, 1, gate, 0)
    part.emit(0, pool.wrap(b"r"))
    part.emit(1, pool.wrap(b"l"))
    barrier = CheckpointBarrier(3, 0, BarrierKind.UNALIGNED)
    overtaken = part.broadcast_event(barrier, priority=True)
    assert remote.seen_beside == [(0, barrier), (0, b"l")]  # it was there already
    assert [[bytes(b) for b in o] for o in overtaken] == [[b"r"], [b"l"]]  # by index
    for bufs in overtaken:
        for b in bufs:
            b.release()
    part.broadcast_event(EndOfData())  # in line: by index, the remote one first
    assert remote.seen_beside == []
    assert drain(gate) == [(0, EndOfData())]
    for b in remote.queued:
        b.release()
    assert pool.available == 4


def test_events_need_no_credit_and_end_of_partition_comes_last() -> None:
    part, gate = link(exclusive=1, floating=0)
    part.emit(0, data(b"a"))
    part.broadcast_event(CheckpointBarrier(1, 0))
    part.finish()
    part.finish()  # idempotent
    with pytest.raises(ClosedError):
        part.emit(0, data(b"b"))
    assert not gate.finished
    assert drain(gate) == [(0, b"a"), (0, CheckpointBarrier(1, 0)), (0, EndOfPartition())]
    assert gate.finished and gate.channel(0).finished
    gate.channel_finished(0)  # idempotent
    assert gate.poll(None) is None  # a finished gate never waits


def test_broadcast_does_not_copy_and_recycles_after_every_release() -> None:
    pool = BufferPool(32, 4)
    part = ResultPartition(3, pool, "bcast")
    gates = [InputGate(1, name=f"g{j}") for j in range(3)]
    wire([part], gates, "all_to_all")
    seg = pool.request_segment()
    seg[:4] = np.frombuffer(b"data", np.uint8)
    part.broadcast(pool.wrap(seg[:4]))
    assert [part.backlog(j) for j in range(3)] == [(1, 4)] * 3
    handles = []
    for g in gates:
        item = g.poll(0)
        assert item is not None
        handles.append(item[1])
    assert all(np.shares_memory(h, seg) and bytes(h) == b"data" for h in handles)
    for h in handles:
        assert pool.in_use == 1
        h.release()
    assert pool.in_use == 0 and pool.request_segment() is seg


# ---- cancellation, failure, wake-ups ----


def test_cancel_wakes_blocked_producers_and_consumers() -> None:
    part, gate = link(exclusive=1, floating=0)
    part.emit(0, data(b"a"))
    producer = Worker(lambda: part.emit(0, data(b"b")))
    other = InputGate(1, name="idle")
    consumer = Worker(lambda: other.poll(None))
    held = [part.pool.request_segment() for _ in range(part.pool.available)]
    pool_waiter = Worker(lambda: part.pool.request_segment())
    waiting(producer)
    waiting(pool_waiter)
    waiting(consumer)
    part.cancel()
    with pytest.raises(ChannelCancelledError):
        producer.finish()
    with pytest.raises(PoolClosedError):
        pool_waiter.finish()
    with pytest.raises(ChannelCancelledError):
        gate.poll(0)
    other.cancel()
    with pytest.raises(ChannelCancelledError):
        consumer.finish()
    with pytest.raises(ChannelCancelledError):
        part.emit(0, data(b"c"))
    assert len(held) == 64


def test_gate_failure_reaches_its_producers_with_the_cause() -> None:
    part, gate = link(exclusive=1, floating=0)
    part.emit(0, data(b"a"))
    producer = Worker(lambda: part.emit(0, data(b"b")))
    waiting(producer)
    boom = OSError("disk gone")
    gate.fail(boom)
    with pytest.raises(ChannelFailedError) as info:
        producer.finish()
    assert info.value.__cause__ is boom and not isinstance(info.value, ChannelCancelledError)
    with pytest.raises(ChannelFailedError):
        gate.wait_available(0)


def test_wake_interrupts_a_waiting_consumer() -> None:
    _, gate = link()
    consumer = Worker(lambda: gate.poll(None))
    waiting(consumer)
    gate.wake()
    assert consumer.finish() is None
    gate.wake()  # a wake-up before the wait is not lost
    assert gate.wait_available(JOIN) is False


def test_wait_available_sees_data_and_ignores_blocked_channels() -> None:
    part, gate = link()
    gate.block(0)
    part.emit(0, data(b"a"))
    assert gate.wait_available(0) is False
    waiter = Worker(lambda: gate.wait_available(JOIN))
    waiting(waiter)
    gate.unblock(0)
    assert waiter.finish() is True


# ---- wiring ----


def test_wire_patterns_and_misuse() -> None:
    pools = [BufferPool(8, 2) for _ in range(2)]
    parts = [ResultPartition(1, pools[i], f"f{i}") for i in range(2)]
    gates = [InputGate(1) for _ in range(2)]
    wire(parts, gates, "forward")
    parts[1].emit(0, data(b"z"))
    assert drain(gates[1]) == [(0, b"z")] and drain(gates[0]) == []
    with pytest.raises(NetworkError):
        connect(parts[0], 0, InputGate(1), 0)  # subpartition taken
    with pytest.raises(NetworkError):
        connect(ResultPartition(1, pools[0]), 0, gates[0], 0)  # channel taken
    with pytest.raises(ConfigError):
        wire(parts, [InputGate(1)], "forward")
    with pytest.raises(ConfigError):
        wire(parts, [InputGate(1)], "all_to_all")
    with pytest.raises(ConfigError):
        wire(parts, gates, "sideways")
    with pytest.raises(NetworkError):
        ResultPartition(2, pools[0]).emit(1, data(b"x"))  # not connected
    with pytest.raises(ConfigError):
        InputGate(2, buffers_per_channel=0)
