"""A frame's payload read after its header over a real TCP connection on 127.0.0.1,
through the receiving thread's non-blocking twin of the socket and then the timed
read: it comes back whole however it arrives, a close or reset inside it fails the
connection, and the read never runs past its frame."""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import socket
import struct
import termios
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillover.runtime.network.tcp.protocol import (
    ProtocolError,
    TransportError,
    _read_payload,
    _tune,
)
from support.threads import JOIN, Worker, eventually

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

POLL = 0.02  # the timed socket's poll interval, as a receiver's
LOOPBACK = "127.0.0.1"
LIMIT = 1 << 16


class TimedSocket(socket.socket):
    """The receiving thread's socket (reads time out after :data:`POLL`), counting
    the reads made through it rather than through its twin."""

    reads = 0

    def recv_into(self, buffer: WriteableBuffer, nbytes: int = 0, flags: int = 0) -> int:
        self.reads += 1
        return super().recv_into(buffer, nbytes, flags)


class Polls:
    """The read's ``stop`` callback: counts the timed read's polls, each one a wait
    with nothing to read, and stops the read only after :data:`JOIN` seconds, so a
    read that never ends fails its test rather than outliving it."""

    def __init__(self) -> None:
        self.count = 0
        self._deadline = time.monotonic() + JOIN

    def __call__(self) -> bool:
        self.count += 1
        return time.monotonic() > self._deadline

    def blocked(self) -> None:
        """Waits until the read has taken what was there and waits for more."""
        eventually(lambda: self.count > 0)


@dataclass(frozen=True)
class Connection:
    """A connected pair: the producer's end and the receiving end set up as the
    receiving thread sets up its own (timed socket and non-blocking twin)."""

    writer: socket.socket
    sock: TimedSocket
    quick: socket.socket

    def pending(self) -> int:
        """The bytes that arrived at the receiving end and wait to be read."""
        out = fcntl.ioctl(self.sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
        return int(struct.unpack("i", out)[0])

    def send(self, data: bytes) -> None:
        """Writes ``data`` while nothing reads, and waits until all of it arrived."""
        before = self.pending()
        self.writer.sendall(data)
        eventually(lambda: self.pending() == before + len(data))

    def reset(self) -> None:
        """Closes the producer's end with a reset (no linger) instead of a FIN."""
        self.writer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.close()

    def read(self, length: int, polls: Polls, limit: int = LIMIT) -> bytes:
        return _read_payload(self.sock, length, limit, polls, "event", self.quick)

    def rest(self) -> bytes:
        """What the payload read left behind, up to the producer's close."""
        self.writer.shutdown(socket.SHUT_WR)
        self.sock.settimeout(JOIN)
        out = bytearray()
        while chunk := self.sock.recv(1 << 16):
            out += chunk
        return bytes(out)


@contextlib.contextmanager
def connected() -> Iterator[Connection]:
    with socket.create_server((LOOPBACK, 0)) as listener:
        writer = socket.create_connection(listener.getsockname()[:2], timeout=JOIN)
        accepted, _ = listener.accept()
    sock = TimedSocket(fileno=accepted.detach())
    _tune(sock, POLL)  # as the receiver's accept loop
    quick = socket.socket(fileno=os.dup(sock.fileno()))  # as the receiver's twin
    quick.settimeout(0.0)
    try:
        yield Connection(writer, sock, quick)
    finally:
        for s in (quick, sock, writer):
            s.close()


@pytest.fixture
def conn() -> Iterator[Connection]:
    with connected() as c:
        yield c


PAYLOAD = bytes(range(10))


def test_a_payload_already_there_is_read_by_the_twin_alone(conn: Connection) -> None:
    conn.send(PAYLOAD)
    polls = Polls()
    assert conn.read(len(PAYLOAD), polls) == PAYLOAD
    assert conn.sock.reads == 0 and polls.count == 0


def test_a_payload_in_two_parts_waits_for_the_rest(conn: Connection) -> None:
    conn.send(PAYLOAD[:4])
    polls = Polls()
    reader = Worker(lambda: conn.read(len(PAYLOAD), polls))
    polls.blocked()
    assert conn.pending() == 0  # the twin took the first part
    conn.writer.sendall(PAYLOAD[4:])
    assert reader.finish() == PAYLOAD


@pytest.mark.parametrize("first", [PAYLOAD[:4], b""], ids=["part", "nothing"])
@pytest.mark.parametrize("while_blocked", [False, True], ids=["then-read", "while-blocked"])
def test_a_close_inside_a_payload_fails_naming_the_frame(
    conn: Connection, first: bytes, while_blocked: bool
) -> None:
    conn.send(first)
    polls = Polls()
    if not while_blocked:
        conn.writer.shutdown(socket.SHUT_WR)
    reader = Worker(lambda: conn.read(len(PAYLOAD), polls))
    if while_blocked:
        polls.blocked()
        conn.writer.shutdown(socket.SHUT_WR)
    with pytest.raises(TransportError, match=r"closed inside a frame \(event\)"):
        reader.finish()


@pytest.mark.parametrize("first", [PAYLOAD[:4], b""], ids=["part", "nothing"])
@pytest.mark.parametrize("while_blocked", [False, True], ids=["then-read", "while-blocked"])
def test_a_reset_inside_a_payload_is_a_lost_connection(
    conn: Connection, first: bytes, while_blocked: bool
) -> None:
    """The receiving thread turns an ``OSError`` other than a protocol error into a
    lost connection; a reset is a ``ConnectionResetError``, not a clean close."""
    conn.send(first)
    polls = Polls()
    if not while_blocked:
        conn.reset()
    reader = Worker(lambda: conn.read(len(PAYLOAD), polls))
    if while_blocked:
        polls.blocked()
        conn.reset()
    with pytest.raises(ConnectionResetError):
        reader.finish()


def test_a_payload_over_the_limit_is_refused_before_any_read(conn: Connection) -> None:
    conn.send(PAYLOAD)
    with pytest.raises(ProtocolError, match="event frame of 11 bytes") as refused:
        conn.read(11, Polls(), limit=10)
    assert refused.value.detail == "at most 10"
    assert conn.sock.reads == 0 and conn.rest() == PAYLOAD


def test_an_empty_payload_reads_nothing_and_does_not_wait(conn: Connection) -> None:
    polls = Polls()
    assert conn.read(0, polls) == b""
    conn.send(PAYLOAD)
    assert conn.read(0, polls) == b""
    assert polls.count == 0 and conn.sock.reads == 0 and conn.rest() == PAYLOAD


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(min_size=1, max_size=4096),
    trailer=st.binary(max_size=64),
    cuts=st.lists(st.integers(min_value=0, max_value=4160), max_size=6),
    early=st.booleans(),
)
def test_a_payload_written_in_any_pieces_comes_back_whole(
    data: bytes, trailer: bytes, cuts: list[int], early: bool
) -> None:
    """The payload, then the next frame's first bytes, cut at random points into
    separate writes, each one read before the next is written; with ``early``, the
    first is there before the read starts (for the twin), else it waits for it."""
    stream = data + trailer
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    pieces = [stream[a:b] for a, b in itertools.pairwise(bounds)]
    with connected() as conn:
        if early:
            conn.send(pieces.pop(0))
        reader = Worker(lambda: conn.read(len(data), Polls()))
        for piece in pieces:
            eventually(lambda: conn.pending() == 0 or not reader.is_alive())
            conn.writer.sendall(piece)
        assert reader.finish() == data
        assert conn.rest() == trailer
