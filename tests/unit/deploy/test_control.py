"""The control connection's framing: whatever way the bytes arrive (many messages
in one read, one message over many reads, a long message), each ``recv`` returns
the next message whole and in order, and a peer that closes ends it."""

from __future__ import annotations

import contextlib
import pickle
import socket
import threading
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillover.deploy.spark import control
from spillover.deploy.spark.control import ControlConnection, ControlError, ControlSilence


@pytest.fixture
def pair() -> Iterator[tuple[ControlConnection, ControlConnection]]:
    a, b = socket.socketpair()
    ca, cb = ControlConnection(a, "a"), ControlConnection(b, "b")
    yield ca, cb
    ca.close()
    cb.close()


messages = st.lists(
    st.one_of(st.integers(), st.binary(max_size=300), st.tuples(st.text(max_size=20))),
    min_size=1,
    max_size=40,
)


@settings(max_examples=80, deadline=None)
@given(messages, st.sampled_from([1, 5, 7, 1 << 16]))
def test_messages_sent_back_to_back_come_whole_and_in_order(
    sent: list[object], read_ahead: int
) -> None:
    """Whatever the read-ahead, a read that takes part of the next message's length
    prefix or body keeps it for the next ``recv``."""
    a, b = socket.socketpair()
    ca, cb = ControlConnection(a, "a"), ControlConnection(b, "b")
    saved = control._READ_AHEAD
    control._READ_AHEAD = read_ahead
    try:
        for m in sent:  # all queued before the first read: many in one read
            ca.send(m)
        assert [cb.recv() for _ in sent] == sent
    finally:
        control._READ_AHEAD = saved
        ca.close()
        cb.close()


def test_a_long_message_between_short_ones(
    pair: tuple[ControlConnection, ControlConnection],
) -> None:
    ca, cb = pair
    long = bytes(range(256)) * 4096  # 1 MiB: more than one read ahead
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.extend(cb.recv() for _ in range(3)))
    reader.start()
    for m in ("before", long, "after"):
        ca.send(m)
    reader.join(10)
    assert got == ["before", long, "after"]


def test_a_message_split_across_writes(
    pair: tuple[ControlConnection, ControlConnection], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without read-ahead each read asks only for what the message still needs: a
    length prefix and a body written in pieces come whole, however the kernel
    delivers them (the property above covers reads that take part of the next)."""
    monkeypatch.setattr(control, "_READ_AHEAD", 1)
    ca, cb = pair
    data = pickle.dumps(("split", 7))
    framed = len(data).to_bytes(4, "little") + data
    ca.send("whole")
    for part in (framed[:3], framed[3:9], framed[9:]):  # the length prefix split too
        ca.sock.sendall(part)
    assert [cb.recv(), cb.recv()] == ["whole", ("split", 7)]


def test_silence_then_the_next_message(pair: tuple[ControlConnection, ControlConnection]) -> None:
    ca, cb = pair
    cb.watch(0.05)
    with pytest.raises(ControlSilence):
        cb.recv()
    ca.send("late")
    assert cb.recv() == "late"


def test_a_closed_peer_ends_the_connection(
    pair: tuple[ControlConnection, ControlConnection],
) -> None:
    ca, cb = pair
    ca.send("last")
    ca.close()
    assert cb.recv() == "last"
    with pytest.raises(ControlError):
        cb.recv()


def test_a_watched_message_cut_off_breaks_the_connection(
    pair: tuple[ControlConnection, ControlConnection],
) -> None:
    ca, cb = pair
    cb.watch(0.05)
    ca.sock.sendall((100).to_bytes(4, "little") + b"only part")
    with pytest.raises(ControlError) as e:
        cb.recv()
    assert not isinstance(e.value, ControlSilence)


def test_a_watched_send_to_a_peer_that_never_reads_fails(
    pair: tuple[ControlConnection, ControlConnection],
) -> None:
    ca, _ = pair
    ca.watch(0.05)
    with pytest.raises(ControlError, match=r"made no progress .* the peer does not read"):
        for _ in range(1000):  # the socket buffers fill: the send gives up, no hang
            ca.send(b"x" * (1 << 20))


@contextlib.contextmanager
def pairs(n: int) -> Iterator[list[tuple[ControlConnection, ControlConnection]]]:
    made = [socket.socketpair() for _ in range(n)]
    conns = [
        (ControlConnection(a, f"a{i}"), ControlConnection(b, f"b{i}"))
        for i, (a, b) in enumerate(made)
    ]
    try:
        yield conns
    finally:
        for ca, cb in conns:
            ca.close()
            cb.close()


def test_messages_sent_together_come_to_each_peer_whole_and_in_order() -> None:
    """One write for every worker of a trigger: each peer reads its own messages, as
    if each had been sent alone, long ones included."""
    long = bytes(range(256)) * 4096
    with pairs(3) as conns:
        batches = [(conns[0][0], ["t", 1]), (conns[1][0], [long]), (conns[2][0], [("x", 2)])]
        got: list[list[object]] = [[], [], []]
        readers = [
            threading.Thread(
                target=lambda i=i, k=k: got[i].extend(conns[i][1].recv() for _ in range(k))
            )
            for i, k in enumerate((2, 1, 1))
        ]
        for r in readers:
            r.start()
        assert control.send_together(batches) == [None, None, None]
        for r in readers:
            r.join(10)
        assert got == [["t", 1], [long], [("x", 2)]]


def test_a_failed_peer_in_a_send_together_fails_alone() -> None:
    with pairs(3) as conns:
        conns[1][1].close()  # the peer is gone: a reset or a broken pipe
        conns[2][0].close()  # closed on this side: refused before any write
        errors = control.send_together([(ca, ["m"]) for ca, _ in conns])
        assert errors[0] is None and conns[0][1].recv() == "m"
        assert isinstance(errors[1], ControlError) and isinstance(errors[2], ControlError)
        assert "closed" in str(errors[2])


def test_a_watched_send_together_to_a_peer_that_never_reads_fails() -> None:
    with pairs(2) as conns:
        for ca, _ in conns:
            ca.watch(0.05)
        errors = control.send_together(
            [(conns[0][0], [b"x" * (1 << 20)] * 64), (conns[1][0], ["small"])]
        )
        assert isinstance(errors[0], ControlError)
        assert "made no progress" in str(errors[0]) and "does not read" in str(errors[0])
        assert errors[1] is None and conns[1][1].recv() == "small"
