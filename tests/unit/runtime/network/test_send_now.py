"""``netio.send_now``: the producer's in-place write and a consumer's CREDIT frame,
one non-blocking ``sendmsg`` that keeps the interpreter lock. It never waits,
reports exactly the bytes the socket took (the caller sends the rest later, so a
wrong count would cut or repeat a frame), and fails as ``socket.sendmsg`` does."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillover import netio
from spillover.storage.options import pure_selected

pytestmark = pytest.mark.skipif(pure_selected(), reason="the native write's own contract")


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    yield a, b
    a.close()
    b.close()


def _drain(sock: socket.socket) -> bytes:
    out = bytearray()
    while True:
        try:
            chunk = sock.recv(1 << 20)
        except BlockingIOError:
            return bytes(out)
        if not chunk:
            return bytes(out)
        out += chunk


@settings(max_examples=60, deadline=None)
@given(
    frames=st.lists(
        st.tuples(st.binary(max_size=40), st.binary(max_size=200_000)), min_size=1, max_size=12
    ),
    sndbuf=st.sampled_from([4096, 65536, 1 << 20]),
)
def test_the_bytes_it_reports_are_the_bytes_that_arrive(
    frames: list[tuple[bytes, bytes]], sndbuf: int
) -> None:
    """However full the socket gets, what it says it sent arrives, in order, and
    sending the rest later (as the sender thread does) makes the stream whole."""
    a, b = socket.socketpair()
    try:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        b.setblocking(False)
        expected = b"".join(h + body for h, body in frames)
        received = bytearray()
        for head, body in frames:
            n = netio.send_now(a.fileno(), head, body)
            assert 0 <= n <= len(head) + len(body)
            rest = (head + body)[n:]
            received += _drain(b)
            while rest:  # what the socket did not take: written once there is room
                taken = netio.send_now(a.fileno(), rest, b"")
                rest = rest[taken:]
                received += _drain(b)
        received += _drain(b)
        assert bytes(received) == expected
    finally:
        a.close()
        b.close()


def test_a_full_socket_takes_nothing_and_does_not_wait(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, _ = pair
    chunk = b"x" * 65536
    while netio.send_now(a.fileno(), chunk, b"") == len(chunk):
        pass  # until the socket is full
    assert netio.send_now(a.fileno(), b"header", chunk) == 0


def test_empty_buffers_send_nothing(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    assert netio.send_now(a.fileno(), b"", b"") == 0
    assert netio.send_now(a.fileno(), b"", memoryview(b"abc")) == 3
    assert _drain(b) == b"abc"


def test_a_closed_peer_raises_as_sendmsg_does(pair: tuple[socket.socket, socket.socket]) -> None:
    """A broken pipe is an ``OSError`` of the right kind, never a SIGPIPE."""
    a, b = pair
    b.close()
    with pytest.raises(BrokenPipeError):
        netio.send_now(a.fileno(), b"head", b"body")
    with pytest.raises(OSError):  # a closed descriptor
        netio.send_now(-1, b"head", b"")
