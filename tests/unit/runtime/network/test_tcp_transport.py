"""The TCP transport on 127.0.0.1: the channel properties of the in-memory tests,
the wire format, authentication, failures and a producer in another process."""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import spillover
from spillover import netio
from spillover.errors import ClosedError
from spillover.runtime.api import EdgeKind
from spillover.runtime.network.buffers import (
    BufferPool,
    NetworkBuffer,
    NetworkTimeoutError,
    OutputWaker,
    SignalWaker,
)
from spillover.runtime.network.errors import ChannelCancelledError, ChannelFailedError
from spillover.runtime.network.events import (
    BarrierKind,
    CheckpointBarrier,
    EndOfData,
    EndOfPartition,
    Event,
    deserialize,
    serialize,
)
from spillover.runtime.network.gate import InputGate
from spillover.runtime.network.partition import ResultPartition
from spillover.runtime.network.tcp import (
    HEADER,
    PROTOCOL_VERSION,
    HandshakeError,
    TcpReceiver,
    TcpSubpartition,
    TransportError,
    connect_tcp,
)
from spillover.runtime.network.writers import PartitionWriter
from spillover.storage.options import pure_selected
from support.threads import JOIN, Worker, eventually, transport_threads

SECRET = b"job-7f3a secret 01"
POLL = 0.05
LOOPBACK = "127.0.0.1"


def waiting(worker: Worker) -> None:
    time.sleep(0.1)
    assert worker.is_alive()


@pytest.fixture(autouse=True)
def no_thread_survives() -> Iterator[None]:
    """Every transport thread a test started ends once its ends are closed."""
    before = transport_threads()
    yield
    eventually(lambda: not transport_threads() - before, timeout=5.0)


@pytest.fixture
def receiver() -> Iterator[TcpReceiver]:
    rcv = TcpReceiver(SECRET, LOOPBACK, 0, poll_interval=POLL)
    try:
        yield rcv
    finally:
        rcv.close()


def data(payload: bytes) -> NetworkBuffer:
    return NetworkBuffer.unpooled(payload)


def tcp_link(
    rcv: TcpReceiver,
    subpartitions: int = 1,
    exclusive: int = 2,
    floating: int = 8,
    name: str = "g",
    segment_size: int = 64,
    signal: bool = False,
    waker: OutputWaker | None = None,
) -> tuple[ResultPartition, InputGate, list[TcpSubpartition]]:
    """``signal``: the partition's waker is a source's (a native signal), so its credit
    reader reads natively (``netio.read_credit``) and leaves other frames to Python;
    ``waker``: that waker, given."""
    part = ResultPartition(subpartitions, BufferPool(segment_size, 64), f"p-{name}")
    if signal or waker is not None:
        part.waker = waker if waker is not None else SignalWaker(netio.Wake())
    gate = InputGate(
        subpartitions, floating_buffers=floating, buffers_per_channel=exclusive, name=name
    )
    rcv.register(gate)
    subs = [
        connect_tcp(part, s, rcv.address, name, s, SECRET, poll_interval=POLL)
        for s in range(subpartitions)
    ]
    return part, gate, subs


@pytest.fixture
def native_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the credit readers' native reads (``netio.read_credit`` calls)."""
    calls = [0]
    real = netio.read_credit

    def counted(*args: Any) -> tuple[int, int, int, int]:
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(netio, "read_credit", counted)
    return calls


def reads_natively(calls: list[int], signal: bool) -> None:
    """A source's credit reader reads natively unless pure; any other never does
    (asserted again at a test's end, once its reader has read credit)."""
    if signal and not pure_selected():
        eventually(lambda: calls[0] > 0)
    else:
        assert calls[0] == 0


def drain(gate: InputGate, count: int) -> list[tuple[int, bytes | Event]]:
    """The next ``count`` buffers (waiting for them), released."""
    out: list[tuple[int, bytes | Event]] = []
    while len(out) < count:
        item = gate.poll(JOIN)
        assert item is not None, f"got only {out}"
        ch, buf = item
        out.append((ch, deserialize(buf) if buf.is_event else bytes(buf)))
        buf.release()
    return out


def finish_and_close(part: ResultPartition, subs: list[TcpSubpartition]) -> None:
    part.finish()
    for s in subs:
        assert s.close(JOIN)


# ---- order, loss, credit ----


def test_fifo_under_concurrent_producers_without_loss_or_duplication(
    receiver: TcpReceiver,
) -> None:
    producers, per_producer = 4, 400
    gates = [InputGate(producers, floating_buffers=2, name=f"g{j}") for j in range(2)]
    for g in gates:
        receiver.register(g)
    pools = [BufferPool(16, 3, f"pool{i}") for i in range(producers)]
    parts = [ResultPartition(2, pools[i], f"p{i}") for i in range(producers)]
    subs = [
        connect_tcp(parts[i], j, receiver.address, f"g{j}", i, SECRET, poll_interval=POLL)
        for i in range(producers)
        for j in range(2)
    ]

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
    assert all(s.close(JOIN) for s in subs)
    assert all(p.available == 3 for p in pools)  # every sent buffer was released
    assert sum(s.sent_buffers for s in subs) == producers * per_producer


def test_a_flowing_channel_is_written_by_the_producer_in_place(receiver: TcpReceiver) -> None:
    part, gate, (sub,) = tcp_link(receiver, exclusive=2, floating=0)
    for i in range(50):  # the consumer keeps up: nothing queues behind a write
        part.emit(0, data(b"%d" % i), timeout=JOIN)
        eventually(lambda: gate.channel(0).queued_buffers == 1)
        assert [p for _, p in drain(gate, 1)] == [b"%d" % i]
    assert sub.written_in_place == 50 and sub.handed_over == 0
    finish_and_close(part, [sub])
    assert sub.sent_buffers == 50


def test_an_idle_channel_writes_events_in_place_and_a_barrier_at_once(
    receiver: TcpReceiver,
) -> None:
    """A checkpoint barrier must not wait for the sender thread to be scheduled: on an
    idle channel the producer writes events itself, and they arrive in order with
    the data around them (events are not counted as data sent)."""
    part, gate, (sub,) = tcp_link(receiver, exclusive=2, floating=0)
    aligned = CheckpointBarrier(1, 0, BarrierKind.ALIGNED)
    unaligned = CheckpointBarrier(2, 0, BarrierKind.UNALIGNED)
    part.emit(0, data(b"a"), timeout=JOIN)
    eventually(lambda: gate.channel(0).queued_buffers == 1)
    part.broadcast_event(aligned)
    assert part.broadcast_event(unaligned, priority=True) == [[]]
    gate.block(0)  # only the priority path delivers
    assert drain(gate, 1) == [(0, unaligned)]
    gate.unblock(0)
    assert drain(gate, 2) == [(0, b"a"), (0, aligned)]
    assert sub.written_in_place == 3 and sub.handed_over == 0
    part.emit(0, data(b"b"), timeout=JOIN)
    assert drain(gate, 1) == [(0, b"b")]
    finish_and_close(part, [sub])
    assert sub.sent_buffers == 2 and sub.sent_bytes == 2


def test_what_the_socket_cannot_take_at_once_the_sender_finishes_in_order(
    receiver: TcpReceiver,
) -> None:
    size = 1 << 20
    part, gate, (sub,) = tcp_link(receiver, exclusive=4, floating=0, segment_size=size)
    sub._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # full at once
    rng = np.random.default_rng(7)
    payloads = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(6)]
    got: list[bytes | Event] = []
    barrier = CheckpointBarrier(1, 0, BarrierKind.ALIGNED)

    def consume() -> None:
        while len(got) < len(payloads) + 1:
            item = gate.poll(JOIN)
            assert item is not None
            _, buf = item
            got.append(deserialize(buf) if buf.is_event else bytes(buf))
            buf.release()

    consumer = Worker(consume)
    for i, p in enumerate(payloads):
        part.emit(0, data(p), timeout=JOIN)
        if i == 2:
            part.broadcast_event(barrier)  # in line, after a frame cut by the socket
    consumer.finish()
    assert got == [*payloads[:3], barrier, *payloads[3:]]
    assert sub.handed_over > 0  # some frames were finished by the sender thread
    finish_and_close(part, [sub])


def test_credit_stalls_the_producer_after_exactly_the_announced_credit(
    receiver: TcpReceiver,
) -> None:
    part, gate, (sub,) = tcp_link(receiver, exclusive=3, floating=8)
    assert part.credit(0) == 3  # the exclusive credits; floating ones stay local
    sent = 0
    with pytest.raises(NetworkTimeoutError):
        while True:
            part.emit(0, data(b"%d" % sent), timeout=0)
            sent += 1
    assert sent == 3 and part.credit(0) == 0
    eventually(lambda: gate.channel(0).queued_buffers == 3)
    ch, held = gate.poll(0) or (None, None)
    assert ch == 0 and held is not None and bytes(held) == b"0"
    with pytest.raises(NetworkTimeoutError):  # a buffer the consumer holds keeps its credit
        part.emit(0, data(b"x"), timeout=0.2)
    held.release()
    eventually(lambda: part.credit(0) == 1)
    part.emit(0, data(b"3"), timeout=0)
    with pytest.raises(NetworkTimeoutError):
        part.emit(0, data(b"x"), timeout=0.2)
    assert [p for _, p in drain(gate, 3)] == [b"1", b"2", b"3"]
    assert gate.channel(0).buffers_in_use == 0 and gate.floating_available == 8
    eventually(lambda: part.credit(0) == 3)
    assert sub.credit_granted == 3 + 4
    finish_and_close(part, [sub])


@pytest.mark.parametrize("kind", ["callback", "native signal", "pure signal"])
def test_credit_from_the_consumer_wakes_an_armed_producer(
    receiver: TcpReceiver, kind: str, native_reads: list[int]
) -> None:
    """A task with inputs is woken through a callback (its gate); a source through its
    mailbox's signal, which the credit reader posts natively without the lock (a
    pure twin's signal: in Python)."""
    woken = threading.Event()
    waker: OutputWaker
    if kind == "callback":
        waker = OutputWaker(woken.set)
        wait: Callable[[], bool] = lambda: woken.wait(JOIN)  # noqa: E731
    else:
        signal = netio.Wake() if kind == "native signal" else netio.PyWake()
        waker = SignalWaker(signal)
        wait = lambda: signal.wait(JOIN)  # noqa: E731
    part, gate, (sub,) = tcp_link(receiver, exclusive=1, floating=0, waker=waker)
    reads_natively(native_reads, kind == "native signal")
    for round_ in range(3):  # each armed wait is woken once, by the credit that ends it
        woken.clear()
        part.emit(0, data(b"a"), timeout=0)
        assert part.credit(0) == 0
        part.waker.arm()
        eventually(lambda: gate.channel(0).queued_buffers == 1)
        _, held = gate.poll(0) or (None, None)
        assert held is not None
        held.release()  # the CREDIT frame reaches the producer's reading thread
        assert wait() and part.credit(0) == 1
        assert part.waker.wakes == round_ + 1
    finish_and_close(part, [sub])
    reads_natively(native_reads, kind == "native signal")


@pytest.mark.parametrize("signal", [False, True], ids=["callback", "native signal"])
def test_a_debloated_size_reaches_the_producer_s_partition_and_its_writer(
    receiver: TcpReceiver,
    signal: bool,
    native_reads: list[int],
) -> None:
    part, gate, subs = tcp_link(receiver, subpartitions=2, segment_size=4096, signal=signal)
    reads_natively(native_reads, signal)
    out: list[list[bytes]] = [[], []]
    w = PartitionWriter(
        EdgeKind.REBALANCE,
        np.dtype("<i8"),
        2,
        0,
        4096,
        128,
        None,
        send=lambda sub, buf: out[sub].append(bytes(buf)),
        send_all=None,
        sizes=part,
    )
    hook = gate.channel(1).on_buffer_size
    assert hook is not None  # set by the handshake
    hook(120)  # a BUFFER_SIZE frame to the producer's reading thread
    eventually(lambda: part.buffer_sizes == [4096, 120])
    w.emit(np.arange(100, dtype="<i8"))  # to subpartition 0: one partial buffer, held
    w.emit(np.arange(100, dtype="<i8"))  # to subpartition 1: 1,200 B in 120 B buffers
    assert out[0] == [] and [len(b) for b in out[1]] == [120] * 10
    finish_and_close(part, subs)
    reads_natively(native_reads, signal)


def test_large_credits_are_announced_in_batches_but_never_withheld(
    receiver: TcpReceiver,
) -> None:
    part, gate, (sub,) = tcp_link(receiver, exclusive=8, floating=0)  # batches of 2
    for i in range(8):
        part.emit(0, data(bytes([i])), timeout=0)
    eventually(lambda: gate.channel(0).queued_buffers == 8)
    assert [p for _, p in drain(gate, 2)] == [b"\x00", b"\x01"]  # 6 still queued
    eventually(lambda: part.credit(0) == 2)
    _, held = gate.poll(0) or (0, None)
    assert held is not None
    held.release()  # 5 queued: held back, then announced once the connection idles
    eventually(lambda: part.credit(0) == 3)
    for i in range(8, 11):
        part.emit(0, data(bytes([i])), timeout=0)
    with pytest.raises(NetworkTimeoutError):
        part.emit(0, data(b"x"), timeout=0.1)
    assert [p for _, p in drain(gate, 8)] == [bytes([i]) for i in range(3, 11)]
    eventually(lambda: part.credit(0) == 8)
    finish_and_close(part, [sub])


@pytest.mark.parametrize("signal", [False, True], ids=["callback", "native signal"])
def test_a_blocked_emit_resumes_when_the_consumer_releases(
    receiver: TcpReceiver, signal: bool, native_reads: list[int]
) -> None:
    part, gate, subs = tcp_link(receiver, exclusive=1, floating=0, signal=signal)
    reads_natively(native_reads, signal)
    part.emit(0, data(b"a"))
    producer = Worker(lambda: part.emit(0, data(b"b"), timeout=JOIN))
    waiting(producer)
    assert [p for _, p in drain(gate, 1)] == [b"a"]
    producer.finish()
    assert part.backpressured_seconds > 0
    assert [p for _, p in drain(gate, 1)] == [b"b"]
    finish_and_close(part, subs)
    assert drain(gate, 1) == [(0, EndOfPartition())] and gate.finished
    reads_natively(native_reads, signal)


def test_events_need_no_credit_and_end_of_partition_comes_last(receiver: TcpReceiver) -> None:
    part, gate, subs = tcp_link(receiver, exclusive=1, floating=0)
    part.emit(0, data(b"a"))
    part.broadcast_event(CheckpointBarrier(1, 0))
    part.broadcast_event(EndOfData())
    part.finish()
    with pytest.raises(ClosedError):
        part.emit(0, data(b"b"))
    with pytest.raises(ClosedError):
        subs[0].add_event(NetworkBuffer.unpooled(serialize(EndOfData())), False)
    assert subs[0].close(JOIN)  # the stream completed and both ends closed
    assert drain(gate, 4) == [
        (0, b"a"),
        (0, CheckpointBarrier(1, 0)),
        (0, EndOfData()),
        (0, EndOfPartition()),
    ]
    assert gate.finished and gate.poll(None) is None


# ---- the priority path ----


class RawConsumer:
    """A consumer that speaks the wire protocol by hand and reads only when told,
    so the producer's socket fills up and its send queue holds data."""

    def __init__(self, recv_buffer: int = 1 << 16) -> None:
        self.listener = socket.create_server((LOOPBACK, 0))
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, recv_buffer)
        self.listener.settimeout(JOIN)
        self.address: tuple[str, int] = self.listener.getsockname()[:2]
        self.nonce = os.urandom(32)
        self.conn: socket.socket | None = None

    def accept(self, credit: int) -> tuple[tuple[int, ...], bytes]:
        conn, _ = self.listener.accept()
        conn.settimeout(JOIN)
        self.conn = conn
        challenge = struct.pack("<4sHH32s", b"SPLV", PROTOCOL_VERSION, 0, self.nonce)
        conn.sendall(HEADER.pack(6, 0, 0, 0xFFFFFFFF, len(challenge)) + challenge)
        ftype, _flags, _res, channel, length = HEADER.unpack(self.read(HEADER.size))
        hello = self.read(length)
        assert ftype == 6
        conn.sendall(HEADER.pack(5, 0, 0, channel, 4) + struct.pack("<I", credit))
        return (channel, *struct.unpack_from("<4sHHIIIHH", hello)), hello

    def read(self, n: int) -> bytes:
        assert self.conn is not None
        out = bytearray()
        while len(out) < n:
            chunk = self.conn.recv(n - len(out))
            assert chunk, "the producer closed the connection"
            out += chunk
        return bytes(out)

    def frames(self, count: int) -> list[tuple[int, int, bytes]]:
        out = []
        for _ in range(count):
            ftype, flags, res, channel, length = HEADER.unpack(self.read(HEADER.size))
            assert flags == res == 0
            out.append((ftype, channel, self.read(length)))
        return out

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.listener.close()


def test_wire_bytes_and_a_priority_event_overtaking_the_send_queue() -> None:
    peer = RawConsumer()
    n, size = 64, 256 << 10
    pool = BufferPool(size, n, "big")
    part = ResultPartition(1, pool, "prod")
    accepted = Worker(lambda: peer.accept(credit=n))
    sub = connect_tcp(part, 0, peer.address, "gate-x", 5, SECRET, poll_interval=POLL)
    (channel, magic, version, res, seg, subp, ch, plen, glen), hello = accepted.finish()
    assert (channel, magic, version, res, seg, subp, ch) == (
        5,
        b"SPLV",
        PROTOCOL_VERSION,
        0,
        size,
        0,
        5,
    )
    assert hello[24 : 24 + plen] == b"prod" and hello[24 + plen : 24 + plen + glen] == b"gate-x"
    body, mac = hello[:-32], hello[-32:]
    assert mac == hmac.new(SECRET, peer.nonce + body, hashlib.sha256).digest()
    assert len(hello) == 24 + plen + glen + 32
    try:
        emitted = []
        for i in range(n):
            seg_ = pool.request_segment(timeout=JOIN)
            seg_[:] = i
            emitted.append(pool.wrap(seg_))
            part.emit(0, emitted[-1], timeout=JOIN)
        # The consumer reads nothing: the socket fills and the sender stalls.
        last = -1
        while sub.backlog[0] != last:
            last = sub.backlog[0]
            time.sleep(0.2)
        assert 0 < last < n
        barrier = CheckpointBarrier(3, 99, BarrierKind.UNALIGNED)
        (overtaken,) = part.broadcast_event(barrier, priority=True)
        k = n - len(overtaken)
        assert len(overtaken) > 0 and all(
            a is b for a, b in zip(overtaken, emitted[k:], strict=True)
        )
        assert all(b.refs >= 2 for b in overtaken)  # retained for the caller, still queued
        for b in overtaken:
            b.release()
        part.finish()
        frames = peer.frames(n + 2)
        assert [f[0] for f in frames] == [1] * k + [3] + [1] * (n - k) + [4]
        assert {f[1] for f in frames} == {5}
        data_frames = [f[2] for f in frames if f[0] == 1]
        assert [d[0] for d in data_frames] == list(range(n))
        assert all(len(d) == size and d == bytes([d[0]]) * size for d in data_frames)
        assert deserialize(frames[k][2]) == barrier
        assert frames[-1][2] == serialize(EndOfPartition())
        eventually(lambda: pool.available == n)  # written buffers are released
    finally:
        peer.close()
        sub.close(JOIN)


@pytest.mark.parametrize("signal", [False, True], ids=["callback", "native signal"])
@pytest.mark.parametrize("size", [0, 4097])
def test_a_buffer_size_outside_the_segment_fails_the_producer_with_a_protocol_error(
    size: int, signal: bool
) -> None:
    peer = RawConsumer()
    part = ResultPartition(1, BufferPool(4096, 4), "prod")
    if signal:  # the native credit read leaves the frame to Python
        part.waker = SignalWaker(netio.Wake())
    accepted = Worker(lambda: peer.accept(credit=4))
    sub = connect_tcp(part, 0, peer.address, "gate-x", 5, SECRET, poll_interval=POLL)
    accepted.finish()
    try:
        assert peer.conn is not None
        peer.conn.sendall(HEADER.pack(8, 0, 0, 5, 4) + struct.pack("<I", size))
        frames = peer.frames(1)  # the producer tells why before it closes
        assert frames[0][0] == 7 and b"BUFFER_SIZE" in frames[0][2]
        with pytest.raises(ChannelFailedError, match="BUFFER_SIZE"):
            emit_until_it_raises(lambda: part.emit(0, data(b"x"), timeout=JOIN))
        assert part.buffer_sizes == [4096]
    finally:
        peer.close()
        sub.close(JOIN)


def emit_until_it_raises(call: Callable[[], object]) -> None:
    deadline = time.monotonic() + JOIN
    while time.monotonic() < deadline:
        call()
        time.sleep(0.01)


def test_priority_event_overtakes_on_the_consumer_what_was_already_sent(
    receiver: TcpReceiver,
) -> None:
    handed: list[tuple[int, Event, list[bytes]]] = []

    def persist(channel: int, event: Event, bufs: list[NetworkBuffer]) -> None:
        handed.append((channel, event, [bytes(b) for b in bufs]))
        for b in bufs:
            b.release()

    gate = InputGate(1, floating_buffers=0, buffers_per_channel=4, name="g")
    receiver.register(gate, on_overtaken=persist)
    part = ResultPartition(1, BufferPool(8, 8), "p")
    sub = connect_tcp(part, 0, receiver.address, "g", 0, SECRET, poll_interval=POLL)
    for i in range(4):
        part.emit(0, data(bytes([i])))
    eventually(lambda: gate.channel(0).queued_buffers == 4)  # all sent and received
    gate.block(0)  # a blocked channel still delivers priority events
    barrier = CheckpointBarrier(9, 1, BarrierKind.UNALIGNED)
    assert part.broadcast_event(barrier, priority=True) == [[]]  # nothing left to overtake
    assert drain(gate, 1) == [(0, barrier)]
    # Handed over before the barrier could be polled: a task that sees the barrier
    # finds what it overtook.
    assert handed == [(0, barrier, [b"\x00", b"\x01", b"\x02", b"\x03"])]
    gate.unblock(0)
    assert [p for _, p in drain(gate, 4)] == [bytes([i]) for i in range(4)]
    finish_and_close(part, [sub])


# ---- authentication and wiring ----


def test_wrong_secret_unknown_gate_and_second_connection_are_refused(
    receiver: TcpReceiver,
) -> None:
    gate = InputGate(2, name="in")
    receiver.register(gate)
    part = ResultPartition(2, BufferPool(8, 4), "p")
    with pytest.raises(HandshakeError, match="wrong job secret"):
        connect_tcp(part, 0, receiver.address, "in", 0, b"not the job secret")
    assert not gate.channel(0).connected and len(receiver.refused) == 1
    with pytest.raises(HandshakeError, match="no input gate 'nope'"):
        connect_tcp(part, 0, receiver.address, "nope", 0, SECRET)
    with pytest.raises(HandshakeError, match="no channel 2"):
        connect_tcp(part, 0, receiver.address, "in", 2, SECRET)
    sub = connect_tcp(part, 0, receiver.address, "in", 0, SECRET, poll_interval=POLL)
    assert gate.channel(0).connected
    other = ResultPartition(1, BufferPool(8, 4), "q")
    with pytest.raises(HandshakeError, match="already connected"):
        connect_tcp(other, 0, receiver.address, "in", 0, SECRET)
    # A stranger that sends garbage is dropped without touching any channel.
    with socket.create_connection(receiver.address, timeout=JOIN) as s:
        s.sendall(b"\x00" * 200)
    eventually(lambda: len(receiver.refused) == 5)
    part.emit(0, data(b"ok"))
    assert drain(gate, 1) == [(0, b"ok")]
    sub.close(JOIN)  # unfinished: cancels the channel
    with pytest.raises(ChannelCancelledError):
        eventually_raises(gate)


def eventually_raises(gate: InputGate) -> None:
    deadline = time.monotonic() + JOIN
    while time.monotonic() < deadline:
        item = gate.poll(0.05)
        if item is not None:
            item[1].release()
    raise AssertionError("the gate never failed")


# ---- failures ----


class Proxy:
    """Forwards one TCP connection on 127.0.0.1 and can cut it (RST both ways)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server((LOOPBACK, 0))
        self.listener.settimeout(JOIN)
        self.address: tuple[str, int] = self.listener.getsockname()[:2]
        self.socks: list[socket.socket] = []
        self.stop = False
        self.pumps: list[threading.Thread] = []
        self.acceptor = threading.Thread(target=self._accept, daemon=True)
        self.acceptor.start()

    def _accept(self) -> None:
        down, _ = self.listener.accept()
        up = socket.create_connection(self.target, timeout=JOIN)
        for s in (down, up):
            s.settimeout(0.05)
        self.socks = [down, up]
        for a, b in ((down, up), (up, down)):
            t = threading.Thread(target=self._pump, args=(a, b), daemon=True)
            t.start()
            self.pumps.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while not self.stop:
            try:
                chunk = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not chunk:
                return
            dst.sendall(chunk)

    def cut(self) -> None:
        self.acceptor.join(JOIN)
        self.stop = True
        for t in self.pumps:
            t.join(JOIN)
        for s in self.socks:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        self.listener.close()


def test_a_cut_connection_fails_both_sides_promptly(receiver: TcpReceiver) -> None:
    gate = InputGate(1, floating_buffers=0, buffers_per_channel=1, name="g")
    receiver.register(gate)
    proxy = Proxy(receiver.address)
    part = ResultPartition(1, BufferPool(8, 8), "p")
    sub = connect_tcp(part, 0, proxy.address, "g", 0, SECRET, poll_interval=POLL)
    gate.block(0)
    part.emit(0, data(b"a"))
    producer = Worker(lambda: part.emit(0, data(b"b")))  # no credit: waits, no deadline
    consumer = Worker(lambda: gate.poll(None))  # its only channel is blocked: waits
    waiting(producer)
    waiting(consumer)
    proxy.cut()
    # Neither side has a deadline: finishing at all (not "thread did not finish") means
    # the cut connection itself woke them.
    with pytest.raises(ChannelFailedError) as p_err:
        producer.finish(timeout=5)
    with pytest.raises(ChannelFailedError) as c_err:
        consumer.finish(timeout=5)
    assert isinstance(p_err.value.__cause__, TransportError)
    assert isinstance(c_err.value.__cause__, TransportError)
    assert "connection" in str(p_err.value) and "connection" in str(c_err.value)
    with pytest.raises(ChannelFailedError):
        part.emit(0, data(b"c"), timeout=0)
    assert not sub.close(JOIN)


@pytest.mark.parametrize("signal", [False, True], ids=["callback", "native signal"])
def test_cancelling_the_gate_wakes_the_remote_producer(
    receiver: TcpReceiver, signal: bool, native_reads: list[int]
) -> None:
    part, gate, (sub,) = tcp_link(receiver, exclusive=1, floating=0, signal=signal)
    reads_natively(native_reads, signal)
    part.emit(0, data(b"a"))
    producer = Worker(lambda: part.emit(0, data(b"b")))
    waiting(producer)
    gate.cancel()
    with pytest.raises(ChannelCancelledError):
        producer.finish(timeout=5)
    assert not sub.close(JOIN)
    reads_natively(native_reads, signal)


def test_cancelling_the_partition_reaches_the_remote_consumer(receiver: TcpReceiver) -> None:
    part, gate, (sub,) = tcp_link(receiver, exclusive=1, floating=0)
    part.emit(0, data(b"a"))
    assert drain(gate, 1) == [(0, b"a")]
    consumer = Worker(lambda: gate.poll(None))
    waiting(consumer)
    part.cancel()
    with pytest.raises(ChannelCancelledError, match="cancelled"):
        consumer.finish(timeout=5)
    assert not sub.close(JOIN)


@pytest.mark.parametrize("signal", [False, True], ids=["callback", "native signal"])
def test_a_consumer_that_finishes_its_channel_early_closes_the_producer(
    receiver: TcpReceiver,
    signal: bool,
    native_reads: list[int],
) -> None:
    part, gate, (sub,) = tcp_link(receiver, exclusive=1, floating=0, signal=signal)
    reads_natively(native_reads, signal)
    part.emit(0, data(b"a"))
    producer = Worker(lambda: part.emit(0, data(b"b")))
    waiting(producer)
    gate.channel_finished(0)
    with pytest.raises(ClosedError):
        producer.finish(timeout=5)
    assert not sub.close(JOIN)
    reads_natively(native_reads, signal)


def test_closing_the_receiver_cancels_open_channels(receiver: TcpReceiver) -> None:
    part, gate, (sub,) = tcp_link(receiver, exclusive=1, floating=0)
    part.emit(0, data(b"a"))
    producer = Worker(lambda: part.emit(0, data(b"b")))
    waiting(producer)
    receiver.close()
    with pytest.raises(ChannelCancelledError):
        producer.finish(timeout=5)
    with pytest.raises(ChannelCancelledError):
        gate.poll(0)
    assert receiver.connections == 0
    assert not sub.close(JOIN)


# ---- a real process boundary ----

PRODUCER = r"""
import struct, sys
import numpy as np
from spillover.runtime.network.buffers import BufferPool
from spillover.runtime.network.events import CheckpointBarrier
from spillover.runtime.network.partition import ResultPartition
from spillover.runtime.network.tcp import connect_tcp

host, port, n, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
pool = BufferPool(4096, 8, "remote")
part = ResultPartition(1, pool, "remote-producer")
sub = connect_tcp(part, 0, (host, port), "in", 0, sys.argv[5].encode(), poll_interval=0.05)
for i in range(n):
    seg = pool.request_segment(timeout=30)
    size = 8 + i % 4000
    seg[:size] = i % 251
    seg[:8] = np.frombuffer(struct.pack("<Q", i), np.uint8)
    part.emit(0, pool.wrap(seg[:size]), timeout=None if mode == "hang" else 30)
    if i == n // 2:
        part.broadcast_event(CheckpointBarrier(7, 0))
part.finish()
sys.exit(0 if sub.close(30) else 3)
"""


def spawn_producer(address: tuple[str, int], n: int, mode: str) -> subprocess.Popen[bytes]:
    src = str(Path(spillover.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": src}
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            PRODUCER,
            address[0],
            str(address[1]),
            str(n),
            mode,
            SECRET.decode(),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def stderr_of(proc: subprocess.Popen[bytes]) -> str:
    """What an exited process wrote to stderr (for assertion messages)."""
    return proc.stderr.read().decode(errors="replace") if proc.stderr is not None else ""


def reap(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait(JOIN)
    if proc.stderr is not None:
        proc.stderr.close()


def test_a_producer_in_another_process_feeds_a_gate_here(receiver: TcpReceiver) -> None:
    gate = InputGate(1, buffers_per_channel=4, name="in")
    receiver.register(gate)
    n = 3000
    proc = spawn_producer(receiver.address, n, "finish")
    try:
        got: list[int] = []
        events: list[Event] = []
        while not gate.finished:
            item = gate.poll(JOIN)
            assert item is not None, stderr_of(proc) if proc.poll() is not None else "stalled"
            _, buf = item
            if buf.is_event:
                events.append(deserialize(buf))
                if isinstance(events[-1], CheckpointBarrier):
                    assert len(got) == n // 2 + 1
            else:
                (seq,) = struct.unpack_from("<Q", buf)
                assert len(buf) == 8 + seq % 4000 and bytes(buf[8:]) == bytes([seq % 251]) * (
                    len(buf) - 8
                )
                got.append(seq)
            buf.release()
        assert got == list(range(n))
        assert events == [CheckpointBarrier(7, 0), EndOfPartition()]
        assert proc.wait(JOIN) == 0, stderr_of(proc)
    finally:
        reap(proc)


def test_killing_the_producer_process_fails_the_gate_promptly(receiver: TcpReceiver) -> None:
    gate = InputGate(1, floating_buffers=0, buffers_per_channel=2, name="in")
    receiver.register(gate)
    proc = spawn_producer(receiver.address, 100, "hang")
    try:
        eventually(lambda: gate.channel(0).queued_buffers == 2)  # then it waits for credit
        consumer = Worker(lambda: [gate.poll(None) for _ in range(3)])
        time.sleep(0.1)
        proc.kill()
        # The consumer has no deadline: it ends only because the connection closed.
        with pytest.raises(ChannelFailedError, match="closed the connection before EndOfPartition"):
            consumer.finish(timeout=5)
    finally:
        reap(proc)
