"""The pieces that let a TCP channel's credit reader wake a waiting source without
the interpreter lock (``netio.Wake``, ``netio.Credit``, ``netio.read_credit``) and
their pure-Python twins: a wake-up is never lost and never given twice, credit is
never taken twice, and every CREDIT frame of a stream is granted however the
stream is cut, up to the first frame of another kind, which is left to parse."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from spillover import netio
from spillover.runtime.network.tcp.protocol import HEADER, FrameType
from support.threads import JOIN, eventually

CHANNEL = 7
WAKES: list[Callable[[], netio.WakeCell]] = [netio.Wake, netio.PyWake]
CREDITS: list[Callable[[int], netio.CreditCell]] = [netio.Credit, netio.PyCredit]


def credit_frame(n: int, channel: int = CHANNEL) -> bytes:
    return HEADER.pack(FrameType.CREDIT, 0, 0, channel, 4) + n.to_bytes(4, "little")


@pytest.mark.parametrize("make", WAKES, ids=["native", "pure"])
def test_a_post_is_kept_until_one_wait_takes_it(make: Callable[[], netio.WakeCell]) -> None:
    w = make()
    assert not w.wait(0)
    w.post()
    w.post()  # not counted: one wait takes both
    assert w.wait(0)
    assert not w.wait(0.01)


@pytest.mark.parametrize("make", WAKES, ids=["native", "pure"])
def test_a_wait_ends_when_another_thread_posts(make: Callable[[], netio.WakeCell]) -> None:
    w = make()
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(w.wait(JOIN)))
    t.start()
    time.sleep(0.05)
    w.post()
    t.join(JOIN)
    assert got == [True]


class WakeModel(RuleBasedStateMachine):
    """Both wakes against a model: ``set`` (posted, not taken), ``armed``, wakes."""

    def __init__(self) -> None:
        super().__init__()
        self.wakes = [make() for make in WAKES]
        self.set = self.armed = False
        self.count = 0

    @rule()
    def post(self) -> None:
        for w in self.wakes:
            w.post()
        self.set = True

    @rule()
    def arm(self) -> None:
        for w in self.wakes:
            w.arm()
        self.armed = True

    @rule()
    def disarm(self) -> None:
        for w in self.wakes:
            w.disarm()
        self.armed = False

    @rule()
    def notify(self) -> None:
        assert [w.notify_armed() for w in self.wakes] == [self.armed] * len(self.wakes)
        if self.armed:
            self.armed, self.set = False, True
            self.count += 1

    @precondition(lambda self: not self.set)  # a wait with nothing posted: kept short
    @rule()
    def wait_for_nothing(self) -> None:
        assert [w.wait(0) for w in self.wakes] == [False] * len(self.wakes)

    @precondition(lambda self: self.set)
    @rule()
    def wait(self) -> None:
        assert [w.wait(JOIN) for w in self.wakes] == [True] * len(self.wakes)
        self.set = False

    @invariant()
    def counted(self) -> None:
        assert [w.wakes for w in self.wakes] == [self.count] * len(self.wakes)


TestWakeModel = WakeModel.TestCase
TestWakeModel.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


@pytest.mark.parametrize("make", CREDITS, ids=["native", "pure"])
def test_credit_is_taken_once_per_grant_across_threads(
    make: Callable[[int], netio.CreditCell],
) -> None:
    cell = make(3)
    taken: list[int] = []
    done = threading.Event()

    def take() -> None:
        n = 0
        while not done.is_set():
            n += cell.take()
        n += cell.take()
        taken.append(n)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for _ in range(997):
        cell.add(1)
    eventually(lambda: cell.value == 0)
    done.set()
    for t in threads:
        t.join(JOIN)
    assert sum(taken) == 1000 and cell.value == 0 and cell.granted == 1000
    assert not cell.take()


def read_all(
    writes: list[bytes], buf_size: int = 256, timeout: float = 0.0
) -> tuple[netio.Credit, netio.Wake, netio.Wake, bytes, list[int]]:
    """Runs ``read_credit`` over a socket fed ``writes`` one by one, then closed;
    returns the cells, what was left to parse, and the statuses."""
    a, b = socket.socketpair()
    cell, credit_wake, out = netio.Credit(0), netio.Wake(), netio.Wake()
    out.arm()
    buf = bytearray(buf_size)
    start = end = 0
    statuses: list[int] = []
    left = b""
    try:
        for chunk in writes:
            a.sendall(chunk)
            status, start, end, err = netio.read_credit(
                b.fileno(), buf, start, end, FrameType.CREDIT, CHANNEL,
                cell, credit_wake, out, timeout,
            )  # fmt: skip
            statuses.append(status)
            assert err == 0
            if status == netio.FRAME:
                break
        for _ in range(100):  # a zero timeout reads once: what one write left, next
            if statuses and statuses[-1] == netio.FRAME:
                break
            status, start, end, err = netio.read_credit(
                b.fileno(), buf, start, end, FrameType.CREDIT, CHANNEL,
                cell, credit_wake, out, timeout,
            )  # fmt: skip
            statuses.append(status)
        if statuses[-1] == netio.FRAME:
            left = bytes(buf[start:end])
    finally:
        a.close()
        b.close()
    return cell, credit_wake, out, left, statuses


@settings(max_examples=60, deadline=None)
@given(
    grants=st.lists(st.integers(0, 2**31), min_size=0, max_size=20),
    cuts=st.lists(st.integers(1, 40), min_size=0, max_size=30),
    other=st.sampled_from([FrameType.BUFFER_SIZE, FrameType.ERROR, FrameType.DATA]),
    wrong_channel=st.booleans(),
)
def test_every_credit_frame_is_granted_up_to_another_frame_however_the_stream_is_cut(
    grants: list[int], cuts: list[int], other: FrameType, wrong_channel: bool
) -> None:
    tail = (
        credit_frame(9, CHANNEL + 1)
        if wrong_channel
        else HEADER.pack(other, 0, 0, CHANNEL, 4) + b"\x01\x02\x03\x04"
    )
    stream = b"".join(credit_frame(n) for n in grants) + tail
    writes, at = [], 0
    for c in cuts:
        if at >= len(stream):
            break
        writes.append(stream[at : at + c])
        at += c
    writes.append(stream[at:])
    cell, credit_wake, out, left, statuses = read_all([w for w in writes if w])
    assert statuses[-1] == netio.FRAME
    assert all(s in (netio.TIMEOUT, netio.FRAME) for s in statuses)
    assert cell.value == cell.granted == sum(grants)
    assert left == tail[: len(left)] and len(left) >= HEADER.size  # the other frame's header on
    assert credit_wake.wait(0) == any(grants)
    assert out.wakes == int(any(grants))  # armed once: woken once


def test_the_read_ends_at_eof_and_returns_while_credit_keeps_coming() -> None:
    a, b = socket.socketpair()
    cell, credit_wake, out = netio.Credit(0), netio.Wake(), netio.Wake()
    buf = bytearray(256)
    stop, fed = threading.Event(), threading.Event()

    def feed() -> None:
        while not stop.is_set():
            a.sendall(credit_frame(1))
            fed.set()
            time.sleep(0.001)

    t = threading.Thread(target=feed)
    t.start()
    try:
        assert fed.wait(JOIN)  # credit is there before the read begins
        started = time.monotonic()
        status, start, end, _ = netio.read_credit(
            b.fileno(), buf, 0, 0, FrameType.CREDIT, CHANNEL, cell, credit_wake, out, 0.1
        )
        assert status == netio.TIMEOUT and time.monotonic() - started < JOIN
        assert cell.granted > 0 and out.wakes == 0  # never armed: never woken
    finally:
        stop.set()
        t.join(JOIN)
    a.close()
    status, start, end, _ = netio.read_credit(
        b.fileno(), buf, start, end, FrameType.CREDIT, CHANNEL, cell, credit_wake, out, JOIN
    )
    b.close()
    assert status == netio.EOF and start == end == 0


def test_a_bad_buffer_or_a_missing_cell_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="holding"):
        netio.read_credit(
            0, bytearray(256), 10, 5, FrameType.CREDIT, CHANNEL,
            netio.Credit(), netio.Wake(), None, 0,
        )  # fmt: skip
    cells: list[tuple[Any, Any]] = [(None, netio.Wake()), (netio.Credit(), None)]
    for cell, wake in cells:
        with pytest.raises(TypeError):
            netio.read_credit(
                0, bytearray(256), 0, 0, FrameType.CREDIT, CHANNEL, cell, wake, None, 0
            )


def test_a_zero_timeout_reads_once_even_while_credit_keeps_coming() -> None:
    a, b = socket.socketpair()
    cell, credit_wake = netio.Credit(0), netio.Wake()
    try:
        a.sendall(credit_frame(2) + credit_frame(3)[:5])
        status, start, end, _ = netio.read_credit(
            b.fileno(), bytearray(256), 0, 0, FrameType.CREDIT, CHANNEL,
            cell, credit_wake, None, 0,
        )  # fmt: skip
        assert (status, start, end, cell.granted) == (netio.TIMEOUT, 0, 5, 2)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("make", WAKES, ids=["native", "pure"])
@pytest.mark.parametrize("timeout", [0.0, -1.0, float("nan"), 0.0001])
def test_a_short_or_odd_timeout_never_hangs(
    make: Callable[[], netio.WakeCell], timeout: float
) -> None:
    w = make()
    assert not w.wait(timeout)
    w.post()
    assert w.wait(float("inf"))  # no limit: ends at the post
