"""``netio.send_now``: the producer's in-place write and a consumer's CREDIT frame,
one non-blocking ``sendmsg`` that keeps the interpreter lock. It never waits,
reports exactly the bytes the socket took (the caller sends the rest later, so a
wrong count would cut or repeat a frame), and fails as ``socket.sendmsg`` does,
over TCP as over a socket pair."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillover import netio
from spillover.storage.options import pure_selected

pytestmark = pytest.mark.skipif(pure_selected(), reason="the native write's own contract")

Pair = tuple[socket.socket, socket.socket]


def _unix_pair() -> Pair:
    return socket.socketpair()


def _tcp_pair() -> Pair:
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    return a, b


@pytest.fixture(params=[_unix_pair, _tcp_pair], ids=["socketpair", "tcp"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    """The writing end stays blocking, as the transport's socket is: only the call's
    own flag keeps it from waiting."""
    make: Callable[[], Pair] = request.param
    a, b = make()
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


def _within(seconds: float, fn: Callable[[], object]) -> object:
    """``fn()`` on a thread, failing the test if it has not returned in time."""
    result: list[object] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "send_now waited"
    if errors:
        raise errors[0]
    return result[0]


@settings(max_examples=30, deadline=None)
@given(
    frames=st.lists(
        st.tuples(st.integers(0, 40), st.integers(0, 300_000), st.integers(0, 2**32 - 1)),
        min_size=1,
        max_size=8,
    ),
    small_buffers=st.booleans(),
    tcp=st.booleans(),
)
def test_the_bytes_it_reports_are_the_bytes_that_arrive(
    frames: list[tuple[int, int, int]], small_buffers: bool, tcp: bool
) -> None:
    """However full the socket gets (frames up to 300 KB, small socket buffers),
    what it says it sent arrives, in order, and sending the rest later (as the
    sender thread does) makes the stream whole."""
    a, b = _tcp_pair() if tcp else _unix_pair()
    try:
        if small_buffers:
            a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
            b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        b.setblocking(False)
        sent = []
        for head_len, body_len, seed in frames:
            rng = random.Random(seed)
            sent.append((rng.randbytes(head_len), rng.randbytes(body_len)))
        received = bytearray()
        for head, body in sent:
            n = _within(10, lambda h=head, b_=body: netio.send_now(a.fileno(), h, b_))
            assert isinstance(n, int) and 0 <= n <= len(head) + len(body)
            rest = (head + body)[n:]
            received += _drain(b)
            while rest:  # what the socket did not take: written once there is room
                taken = netio.send_now(a.fileno(), rest, b"")
                rest = rest[taken:]
                received += _drain(b)
        expected = b"".join(h + x for h, x in sent)
        deadline = time.monotonic() + 30
        while len(received) < len(expected) and time.monotonic() < deadline:
            received += _drain(b)  # the last bytes sent may still be on their way
        assert bytes(received) == expected
    finally:
        a.close()
        b.close()


def test_a_full_socket_takes_part_then_nothing_and_never_waits(pair: Pair) -> None:
    a, b = pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    big = b"y" * (1 << 20)  # far more than both ends hold: a part is taken
    n = _within(5, lambda: netio.send_now(a.fileno(), b"h" * 12, big))
    assert isinstance(n, int) and 0 < n < 12 + len(big)
    chunk = b"x" * 65536
    for _ in range(10_000):  # the socket fills long before this
        n = _within(5, lambda: netio.send_now(a.fileno(), b"h" * 12, chunk))
        assert isinstance(n, int) and 0 <= n <= 12 + len(chunk)
        if n == 0:
            break
    else:
        pytest.fail("the socket never filled")
    assert netio.send_now(a.fileno(), b"header", chunk) == 0


def test_empty_buffers_send_nothing(pair: Pair) -> None:
    a, b = pair
    assert netio.send_now(a.fileno(), b"", b"") == 0
    assert netio.send_now(a.fileno(), b"", memoryview(b"abc")) == 3
    got = b""
    deadline = time.monotonic() + 30
    while not got and time.monotonic() < deadline:
        got += _drain(b)
    assert got == b"abc"


def test_a_closed_peer_raises_as_sendmsg_does(pair: Pair) -> None:
    a, b = pair
    b.close()
    deadline = time.monotonic() + 30
    with pytest.raises((BrokenPipeError, ConnectionResetError)):
        while time.monotonic() < deadline:  # TCP may take a write before it knows
            netio.send_now(a.fileno(), b"head", b"body")
            time.sleep(0.001)
    with pytest.raises(OSError):  # a closed descriptor
        netio.send_now(-1, b"head", b"")


def test_a_broken_pipe_is_an_error_not_a_signal() -> None:
    """With SIGPIPE at its default (a process that is not Python's would die of it),
    a write to a closed peer still raises."""
    code = (
        "import signal, socket\n"
        "from spillover import netio\n"
        "signal.signal(signal.SIGPIPE, signal.SIG_DFL)\n"
        "a, b = socket.socketpair()\n"
        "b.close()\n"
        "try:\n"
        "    netio.send_now(a.fileno(), b'head', b'body')\n"
        "except BrokenPipeError:\n"
        "    print('raised')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, (out.returncode, out.stderr)
    assert out.stdout.strip() == "raised"
