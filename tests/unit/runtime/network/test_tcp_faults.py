"""The TCP transport's network-fault hook and heartbeats, on 127.0.0.1: a reset or a
stalled connection fails both ends, never a hang nor a silent gap; a quiet but
alive connection is not mistaken for a stalled one."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from spillover.errors import ConfigError
from spillover.runtime.network.buffers import BufferPool, NetworkBuffer
from spillover.runtime.network.errors import ChannelFailedError
from spillover.runtime.network.gate import InputGate
from spillover.runtime.network.partition import ResultPartition
from spillover.runtime.network.tcp import TcpReceiver, TcpSubpartition, connect_tcp
from spillover.runtime.network.tcp.faults import FaultCounter, NetworkFault
from support.threads import JOIN, eventually, transport_threads

SECRET = b"job-faults secret"
POLL = 0.02
LOOPBACK = "127.0.0.1"


@pytest.fixture(autouse=True)
def no_thread_survives() -> Iterator[None]:
    before = transport_threads()
    yield
    eventually(lambda: not transport_threads() - before, timeout=5.0)


def link(
    rcv: TcpReceiver, heartbeat: float | None = None, fault: FaultCounter | None = None
) -> tuple[ResultPartition, InputGate, TcpSubpartition]:
    part = ResultPartition(1, BufferPool(64, 64), "p")
    gate = InputGate(1, floating_buffers=0, buffers_per_channel=4, name="g")
    rcv.register(gate)
    sub = connect_tcp(
        part, 0, rcv.address, "g", 0, SECRET, poll_interval=POLL,
        heartbeat_interval=heartbeat, fault=fault,
    )  # fmt: skip
    return part, gate, sub


def received(gate: InputGate, why: str) -> list[bytes]:
    """Polls until the channel fails (``why`` in the message); what came before, in
    order."""
    got: list[bytes] = []
    with pytest.raises(ChannelFailedError) as failed:
        while True:
            item = gate.poll(JOIN)
            assert item is not None, f"no failure within {JOIN} s after {got}"
            got.append(bytes(item[1]))
            item[1].release()
    assert why in str(failed.value)
    return got


def test_a_fault_parses_and_strikes_once_on_its_worker_and_generation() -> None:
    fault = NetworkFault.parse("data:stall:after=3:worker=1")
    assert fault == NetworkFault("data", "stall", after=3, worker=1)
    assert fault.counter("data", 0, 0) is None and fault.counter("control", 1, 0) is None
    assert fault.counter("data", 1, 1) is None  # the restarted generation runs clean
    counter = fault.counter("data", 1, 0)
    assert counter is not None
    assert [counter.sent() for _ in range(5)] == [None, None, "stall", None, None]
    for bad in ("data", "data:cut", "disk:reset", "data:reset:after=0", "data:reset:x=1"):
        with pytest.raises(ConfigError):
            NetworkFault.parse(bad)


@pytest.mark.parametrize("action", ["reset", "stall"])
def test_a_broken_connection_fails_both_ends_after_what_it_delivered(action: str) -> None:
    counter = NetworkFault("data", action, after=4).counter("data", 0, 0)
    with TcpReceiver(SECRET, LOOPBACK, 0, poll_interval=POLL, silence_timeout=0.5) as rcv:
        part, gate, sub = link(rcv, heartbeat=0.05, fault=counter)
        sent: list[bytes] = []
        with pytest.raises(ChannelFailedError):
            for i in range(100):
                part.emit(0, NetworkBuffer.unpooled(bytes([i])), timeout=JOIN)
                sent.append(bytes([i]))
        assert counter is not None and counter.struck.is_set()
        # A reset is seen as the producer's end gone; a stall only as its silence.
        why = "closed the connection" if action == "reset" else "nothing heard for 0.5 s"
        got = received(gate, why)
        # Nothing is lost silently: what came is a prefix of what was sent, in order;
        # the rest fails the attempt, which restarts from its checkpoint.
        assert got == sent[: len(got)]
        assert len(sent) == 3 if action == "reset" else len(sent) >= 3
        sub.close(0)


def test_a_quiet_connection_with_heartbeats_stays_up_past_the_silence_timeout() -> None:
    with TcpReceiver(SECRET, LOOPBACK, 0, poll_interval=POLL, silence_timeout=1.0) as rcv:
        part, gate, sub = link(rcv, heartbeat=0.05)
        part.emit(0, NetworkBuffer.unpooled(b"a"), timeout=JOIN)
        item = gate.poll(JOIN)
        assert item is not None and bytes(item[1]) == b"a"
        item[1].release()
        assert gate.poll(2.0) is None  # twice the silence timeout, only heartbeats
        part.emit(0, NetworkBuffer.unpooled(b"b"), timeout=JOIN)
        part.finish()
        item = gate.poll(JOIN)
        assert item is not None and bytes(item[1]) == b"b"
        item[1].release()
        assert sub.close(JOIN)


def test_without_heartbeats_a_silence_timeout_fails_a_quiet_channel() -> None:
    """The timeout counts heartbeats: a producer that sends none looks hung."""
    with TcpReceiver(SECRET, LOOPBACK, 0, poll_interval=POLL, silence_timeout=0.3) as rcv:
        _, gate, sub = link(rcv)
        with pytest.raises(ChannelFailedError, match="nothing heard"):
            gate.poll(JOIN)
        eventually(lambda: sub.closed, timeout=JOIN)


def test_a_heartbeat_follows_a_write_in_place_one_interval_after_it() -> None:
    """A write in place does not wake the sender thread, yet the next heartbeat is
    due one interval after that write, not after the sender's wait began: a quiet
    channel stays up with an interval of more than half the silence timeout."""
    hb, silence = 0.6, 0.9  # a valid configuration: the interval below the timeout
    with TcpReceiver(SECRET, LOOPBACK, 0, poll_interval=POLL, silence_timeout=silence) as rcv:
        part, gate, sub = link(rcv, heartbeat=hb)
        eventually(lambda: sub.heartbeats_sent > 0)
        time.sleep(hb / 6)  # the sender waits for the next beat: the write comes after
        beats = sub.heartbeats_sent
        part.emit(0, NetworkBuffer.unpooled(b"a"), timeout=JOIN)
        assert sub.written_in_place == 1 and sub.heartbeats_sent == beats
        item = gate.poll(JOIN)
        assert item is not None and bytes(item[1]) == b"a"
        item[1].release()
        # A heartbeat went out within the silence timeout after the write (a late
        # one fails the channel: "nothing heard for 0.9 s"), and the channel stays up.
        assert gate.poll(silence) is None
        assert sub.heartbeats_sent > beats
        assert gate.poll(hb) is None
        part.finish()
        assert sub.close(JOIN)
