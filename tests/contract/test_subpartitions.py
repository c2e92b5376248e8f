"""One subpartition contract, every channel implementation: what a producer's
result partition and a consumer's input gate promise (docs/network.md) holds the
same in memory (``LocalChannel``) and over TCP on loopback (``TcpSubpartition``).

No test sleeps to synchronise: a thread's outcome is asserted once it ended, and
every wait is bounded (``JOIN``) only so that a hang fails instead of stalling.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spillover.errors import ClosedError
from spillover.runtime.network.buffers import NetworkBuffer, NetworkTimeoutError
from spillover.runtime.network.errors import ChannelCancelledError
from spillover.runtime.network.events import (
    BarrierKind,
    CancelCheckpointMarker,
    CheckpointBarrier,
    EndOfData,
    EndOfPartition,
    Event,
    Watermark,
    WatermarkStatus,
)
from support.channels import SEGMENT, Link, Links, item
from support.threads import JOIN, Worker, eventually

CONTRACT = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture
def engine() -> str:
    """Channels do not go through the storage engine: run each test once."""
    return "native"


def data(payload: bytes) -> NetworkBuffer:
    return NetworkBuffer.unpooled(payload)


def consume_to_the_end(link: Link) -> dict[int, list[bytes | Event]]:
    """Everything each channel delivers until the gate finished, released."""
    got: dict[int, list[bytes | Event]] = {i: [] for i in range(link.gate.num_channels)}
    while not link.gate.finished:
        polled = link.gate.poll(JOIN)
        assert polled is not None, f"nothing came; so far {got}"
        ch, buf = polled
        got[ch].append(item(buf))
        buf.release()
    return got


def next_item(link: Link) -> tuple[int, bytes | Event]:
    polled = link.gate.poll(JOIN)
    assert polled is not None, "nothing came"
    ch, buf = polled
    try:
        return ch, item(buf)
    finally:
        buf.release()


in_line_events = st.one_of(
    st.builds(Watermark, st.integers(0, 2**62)),
    st.builds(WatermarkStatus, st.booleans()),
    st.builds(CheckpointBarrier, st.integers(0, 10**6), st.integers(0, 10**12)),
    st.builds(CancelCheckpointMarker, st.integers(0, 10**6)),
    st.builds(EndOfData, st.booleans()),
)
to_a_channel = st.tuples(st.integers(0, 1), st.binary(min_size=1, max_size=SEGMENT))


@CONTRACT
@given(
    ops=st.lists(st.one_of(to_a_channel, in_line_events), max_size=60),
    exclusive=st.integers(1, 4),
)
def test_buffers_arrive_exactly_once_in_order_with_events_in_their_place(
    links: Links, ops: list[tuple[int, bytes] | Event], exclusive: int
) -> None:
    """Data to either channel and in-line events to both, sent while the consumer
    polls: each channel gets its data once, in order, each event where it was sent
    among the data, and EndOfPartition last."""
    link = links(subpartitions=2, exclusive=exclusive)
    part = link.partition

    def produce() -> None:
        for op in ops:
            if isinstance(op, tuple):
                part.emit(op[0], data(op[1]), timeout=JOIN)
            else:
                part.broadcast_event(op)
        part.finish()

    producer = Worker(produce)
    got = consume_to_the_end(link)
    producer.finish()
    expected: dict[int, list[bytes | Event]] = {0: [], 1: []}
    for op in ops:
        for ch in (0, 1):
            if not isinstance(op, tuple):
                expected[ch].append(op)
            elif op[0] == ch:
                expected[ch].append(op[1])
    assert got == {ch: [*expected[ch], EndOfPartition()] for ch in (0, 1)}
    assert link.close()  # over TCP: the whole stream was written and read


@pytest.mark.parametrize("what", ["data", "in-line event", "priority event"])
def test_after_end_of_partition_nothing(links: Links, what: str) -> None:
    link = links()
    part, gate = link.partition, link.gate
    part.emit(0, data(b"last"))
    part.finish()
    part.finish()  # idempotent: one EndOfPartition
    with pytest.raises(ClosedError):
        if what == "data":
            part.emit(0, data(b"late"), timeout=0)
        else:
            part.broadcast_event(
                CheckpointBarrier(1, 0, BarrierKind.UNALIGNED), priority=what == "priority event"
            )
    assert consume_to_the_end(link) == {0: [b"last", EndOfPartition()]}
    assert gate.finished and gate.poll(0) is None
    assert link.close()


@CONTRACT
@given(queued=st.integers(0, 4), polled=st.integers(0, 4))
def test_a_priority_event_overtakes_queued_data_and_hands_back_what_it_overtook(
    links: Links, queued: int, polled: int
) -> None:
    """``queued`` buffers sent, ``polled`` of them taken by the consumer, then an
    unaligned barrier: the consumer gets the barrier first (its channel blocked for
    alignment or not), the buffers it overtook are handed back exactly, in order
    (on the producer's side or, over TCP, those already received on the consumer's),
    and they still arrive after it."""
    polled = min(polled, queued)
    link = links(exclusive=4)
    part, gate = link.partition, link.gate
    payloads = [bytes([i]) * (i + 1) for i in range(queued)]
    for p in payloads:
        part.emit(0, data(p), timeout=0)  # within credit: never waits
    for p in payloads[:polled]:
        assert next_item(link) == (0, p)
    gate.block(0)  # a blocked channel still delivers priority events
    barrier = CheckpointBarrier(7, 1, BarrierKind.UNALIGNED)
    [returned] = part.broadcast_event(barrier, priority=True)
    assert next_item(link) == (0, barrier)
    producer_side = [bytes(b) for b in returned]
    for b in returned:
        b.release()
    assert link.consumer_overtaken.get(0, []) + producer_side == payloads[polled:]
    gate.unblock(0)
    part.finish()
    assert consume_to_the_end(link) == {0: [*payloads[polled:], EndOfPartition()]}
    assert link.close()


@CONTRACT
@given(exclusive=st.integers(1, 4))
def test_a_producer_without_credit_stalls_and_returned_credit_lets_it_go_on(
    links: Links, exclusive: int
) -> None:
    link = links(exclusive=exclusive)
    part, gate = link.partition, link.gate
    assert part.credit(0) == exclusive
    for i in range(exclusive):
        part.emit(0, data(bytes([i])), timeout=0)
    with pytest.raises(NetworkTimeoutError):  # no credit: nothing beyond it goes out
        part.emit(0, data(b"over"), timeout=0)
    assert part.credit(0) == 0 and part.emitted(0) == (exclusive, exclusive)
    eventually(lambda: gate.channel(0).queued_buffers == exclusive)
    polled = gate.poll(JOIN)
    assert polled is not None and bytes(polled[1]) == b"\x00"
    with pytest.raises(NetworkTimeoutError):  # a buffer the consumer holds keeps its credit
        part.emit(0, data(b"over"), timeout=0)
    producer = Worker(lambda: part.emit(0, data(b"next"), timeout=JOIN))
    polled[1].release()  # one credit back: exactly one more buffer goes
    producer.finish()
    with pytest.raises(NetworkTimeoutError):
        part.emit(0, data(b"over"), timeout=0)
    part.finish()
    rest = [bytes([i]) for i in range(1, exclusive)]
    assert consume_to_the_end(link) == {0: [*rest, b"next", EndOfPartition()]}
    assert link.close()


@pytest.mark.parametrize("cancelled", ["partition", "gate"])
def test_cancel_wakes_a_producer_blocked_for_credit(links: Links, cancelled: str) -> None:
    link = links(exclusive=1)
    part, gate = link.partition, link.gate
    part.emit(0, data(b"a"), timeout=0)
    with pytest.raises(NetworkTimeoutError):
        part.emit(0, data(b"b"), timeout=0)
    producer = Worker(lambda: part.emit(0, data(b"b"), timeout=JOIN))
    (part if cancelled == "partition" else gate).cancel()
    with pytest.raises(ChannelCancelledError):
        producer.finish()
    with pytest.raises(ChannelCancelledError):
        part.emit(0, data(b"c"), timeout=JOIN)
    assert not link.close()  # the stream never completed


@pytest.mark.parametrize("cancelled", ["partition", "gate"])
def test_cancel_wakes_a_consumer_waiting_for_data(links: Links, cancelled: str) -> None:
    link = links()
    part, gate = link.partition, link.gate
    part.emit(0, data(b"a"), timeout=0)
    assert next_item(link) == (0, b"a")
    consumer = Worker(lambda: gate.poll(None))
    (part if cancelled == "partition" else gate).cancel()
    with pytest.raises(ChannelCancelledError):
        consumer.finish()
    with pytest.raises(ChannelCancelledError):
        gate.poll(JOIN)
    assert not link.close()


@pytest.mark.parametrize("what", ["data", "in-line event", "end of partition"])
def test_what_arrives_wakes_a_consumer_waiting_for_it(links: Links, what: str) -> None:
    """A consumer blocked in ``poll(None)`` on an unblocked channel gets what arrives:
    a buffer's arrival wakes it (the gate notifies only when a consumer waits)."""
    link = links()
    part, gate = link.partition, link.gate
    consumer = Worker(lambda: gate.poll(None))
    eventually(lambda: gate._consumer_waits == 1)  # blocked in its wait, not before it
    expected: bytes | Event
    if what == "data":
        expected = b"a"
        part.emit(0, data(b"a"), timeout=JOIN)
    elif what == "in-line event":
        expected = Watermark(5)
        part.broadcast_event(expected)
    else:
        expected = EndOfPartition()
        part.finish()
    polled = consumer.finish()
    assert polled is not None
    ch, buf = polled
    assert (ch, item(buf)) == (0, expected)
    buf.release()
    part.finish()
    assert consume_to_the_end(link) == {0: [] if what == "end of partition" else [EndOfPartition()]}
    assert link.close()
