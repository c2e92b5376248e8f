"""The control connection's framing: whatever way the bytes arrive (many messages
in one read, one message over many reads, a long message), each ``recv`` returns
the next message whole and in order, and a peer that closes ends it."""

from __future__ import annotations

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
