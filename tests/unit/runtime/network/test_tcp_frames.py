"""Whole frames read over a real TCP connection on 127.0.0.1 by the receiving
thread's native reads (``_read_frame``, ``_read_into_ahead``: the wait and the read
in one call) and by their pure-Python twin (``_read_header``, ``_read_payload``,
``_recv_with_lookahead``): the same frames, in order, however the stream is cut,
never a byte of the next frame too many; a close or reset inside a frame fails the
connection; a wait with nothing to read asks ``stop`` and goes on."""

from __future__ import annotations

import contextlib
import itertools
import socket
import struct
import time
from collections.abc import Callable, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillover import netio
from spillover.runtime.network.tcp.protocol import (
    _MAX_MESSAGE,
    HEADER,
    FrameType,
    TransportError,
    _read_frame,
    _read_header,
    _read_into_ahead,
    _read_payload,
    _recv_with_lookahead,
    _tune,
)
from support.threads import JOIN, Worker

POLL = 0.02
LOOPBACK = "127.0.0.1"
CHANNEL = 3
Frame = tuple[int, bytes]


def never() -> bool:
    return False


@contextlib.contextmanager
def connected() -> Iterator[tuple[socket.socket, socket.socket]]:
    with socket.create_server((LOOPBACK, 0)) as listener:
        writer = socket.create_connection(listener.getsockname()[:2], timeout=JOIN)
        sock, _ = listener.accept()
    _tune(sock, POLL)  # as the receiver's accept loop
    try:
        yield writer, sock
    finally:
        sock.close()
        writer.close()


def encode(frames: list[Frame]) -> bytes:
    return b"".join(HEADER.pack(t, 0, 0, CHANNEL, len(p)) + p for t, p in frames)


def read_all(
    sock: socket.socket, n: int, native: bool, stop: Callable[[], bool], wait: float = POLL
) -> list[Frame]:
    """``n`` frames as the receiving loop reads them, data frames with look-ahead;
    ``wait``: how long a read waits for bytes before it asks ``stop``."""
    frame = bytearray(HEADER.size + _MAX_MESSAGE + 2)
    hdr = memoryview(frame)[: HEADER.size]
    out: list[Frame] = []
    ahead = 0
    for _ in range(n):
        if native:
            whole = _read_frame(sock, frame, CHANNEL, stop, wait, ahead)
            assert whole is not None
            ftype, length, payload = whole
        else:
            head = _read_header(sock, hdr, CHANNEL, stop, ahead)
            assert head is not None
            (ftype, length), payload = head, None
        ahead = 0
        if ftype == FrameType.DATA:
            data = memoryview(bytearray(length))
            if native:
                ahead = _read_into_ahead(sock, data, hdr, stop, wait)
            else:
                ahead = _recv_with_lookahead(sock, data, hdr, stop)
            payload = bytes(data)
        elif payload is None:
            payload = _read_payload(sock, length, _MAX_MESSAGE + 2, stop, "event")
        out.append((ftype, payload))
    assert ahead == 0  # nothing of a frame that was never sent
    return out


frames_st = st.lists(
    st.one_of(
        st.tuples(
            st.sampled_from([FrameType.DATA, FrameType.PRIORITY_EVENT, FrameType.HEARTBEAT]),
            st.binary(max_size=300),
        ).map(lambda f: (f[0], b"" if f[0] == FrameType.HEARTBEAT else f[1])),
        # A data frame many reads long: the look-ahead comes with its last read.
        st.integers(min_value=64 << 10, max_value=200 << 10).map(
            lambda n: (FrameType.DATA, bytes(range(256)) * (n // 256) + bytes(n % 256))
        ),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=40, deadline=None)
@given(frames=frames_st, cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=8))
@pytest.mark.parametrize("native", [True, False], ids=["native", "pure"])
def test_frames_written_in_any_pieces_come_back_whole_and_in_order(
    native: bool, frames: list[Frame], cuts: list[int]
) -> None:
    stream = encode(frames)
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    with connected() as (writer, sock):
        reader = Worker(lambda: read_all(sock, len(frames), native, never))
        for a, b in itertools.pairwise(bounds):
            writer.sendall(stream[a:b])
            time.sleep(0.001)  # separate segments, not a test of timing
        assert reader.finish() == frames


@pytest.mark.parametrize("native", [True, False], ids=["native", "pure"])
@pytest.mark.parametrize("cut", [4, HEADER.size + 3], ids=["in-header", "in-payload"])
def test_a_close_inside_a_frame_fails_the_connection(native: bool, cut: int) -> None:
    stream = encode([(FrameType.PRIORITY_EVENT, bytes(10))])
    with connected() as (writer, sock):
        writer.sendall(stream[:cut])
        writer.shutdown(socket.SHUT_WR)
        with pytest.raises(TransportError, match="closed inside a frame"):
            read_all(sock, 1, native, never)


def test_a_close_between_frames_is_the_end_of_the_stream() -> None:
    with connected() as (writer, sock):
        writer.shutdown(socket.SHUT_WR)
        assert _read_frame(sock, bytearray(64), CHANNEL, never, POLL) is None


def test_a_reset_is_a_lost_connection() -> None:
    with connected() as (writer, sock):
        writer.sendall(encode([(FrameType.DATA, bytes(5))])[:8])
        writer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()
        with pytest.raises(ConnectionResetError):
            read_all(sock, 1, True, never)


@pytest.mark.parametrize("native", [True, False], ids=["native", "pure"])
def test_a_frame_still_arriving_never_counts_as_silence(native: bool) -> None:
    """A frame whose bytes keep coming, each well within the wait, takes longer in all
    than the wait: a read asks ``stop`` (the receiver's silence check) only after a
    silence as long as the wait, as each read's wait starts again once bytes came.
    The writer's own gaps bound the asks, so a machine that stalls the writer allows
    as many asks as it made silences, never a flake."""
    asked: list[float] = []

    def stop() -> bool:
        asked.append(time.monotonic())
        return False

    wait = 0.5
    frames = [(FrameType.PRIORITY_EVENT, b"barrier" * 12), (FrameType.DATA, bytes(range(200)))]
    stream = encode(frames)
    sent: list[float] = []
    with connected() as (writer, sock):
        _tune(sock, wait)  # the pure reads wait as long as the socket's timeout
        sent.append(time.monotonic())
        reader = Worker(lambda: read_all(sock, 2, native, stop, wait))
        for i in range(0, len(stream), 8):  # about 2 s in all, 8 bytes every 50 ms
            writer.sendall(stream[i : i + 8])
            sent.append(time.monotonic())
            time.sleep(wait / 10)
        assert reader.finish() == frames
    silences = sum(1 for a, b in itertools.pairwise(sent) if b - a >= 0.8 * wait)
    assert len(sent) * wait / 10 > 2 * wait  # the frames took longer in all than the wait
    assert len(asked) <= silences


def test_a_wait_in_vain_asks_stop_and_goes_on_where_it_was() -> None:
    asked: list[float] = []

    def stop() -> bool:
        asked.append(time.monotonic())
        return len(asked) > 1000  # a read that never ends fails, not hangs

    frame = (FrameType.PRIORITY_EVENT, b"barrier")
    stream = encode([frame])
    with connected() as (writer, sock):
        writer.sendall(stream[:5])
        reader = Worker(lambda: read_all(sock, 1, True, stop))
        while len(asked) < 2:
            time.sleep(POLL)
        writer.sendall(stream[5:])
        assert reader.finish() == [frame]


@settings(max_examples=30, deadline=None)
@given(
    data=st.binary(min_size=1, max_size=20_000),
    cuts=st.lists(st.integers(min_value=0, max_value=20_000), max_size=6),
    cap=st.integers(min_value=1, max_value=4096),
)
def test_recv_reads_what_is_there_and_the_stream_comes_back_exact(
    data: bytes, cuts: list[int], cap: int
) -> None:
    """``netio.recv`` (the credit-reading thread's read): every byte once, in order,
    never more than the buffer's room, whatever pieces the writer sends."""
    edges = sorted({0, len(data), *(c for c in cuts if c < len(data))})
    got = bytearray()
    with connected() as (writer, sock):
        buf = bytearray(cap + 1)
        for a, b in itertools.pairwise(edges):
            writer.sendall(data[a:b])
            while len(got) < b:
                status, n, err = netio.recv(sock.fileno(), buf, 1, JOIN)
                assert (status, err) == (netio.DONE, 0) and 0 < n <= cap
                got += buf[1 : 1 + n]
        assert bytes(got) == data
        status, n, _ = netio.recv(sock.fileno(), buf, 0, 0.0)  # nothing there: no wait
        assert (status, n) == (netio.TIMEOUT, 0)
        writer.shutdown(socket.SHUT_WR)
        status, n, _ = netio.recv(sock.fileno(), buf, 0, JOIN)
        assert (status, n) == (netio.EOF, 0)


@pytest.mark.parametrize("native", [True, False], ids=["native", "pure"])
@pytest.mark.parametrize("wait", [POLL, 0.0], ids=["wait", "no-wait"])
def test_a_segment_larger_than_one_read_with_the_lock_kept_comes_back_whole(
    native: bool, wait: float
) -> None:
    """A data frame of a large segment, there in the socket before it is read: the
    native read keeps the interpreter lock for its first 256 KiB only and reads the
    rest with it let go; the same bytes, the next frames' headers not one byte
    early, as the pure-Python twin reads them."""
    big = bytes(range(251)) * (5 << 12)  # about 1 MiB, not a multiple of anything round
    frames = [
        (FrameType.DATA, big),
        (FrameType.HEARTBEAT, b""),
        (FrameType.DATA, big[:300_000]),
        (FrameType.PRIORITY_EVENT, b"barrier"),
    ]
    stream = encode(frames)
    with connected() as (writer, sock):
        sender = Worker(lambda: writer.sendall(stream))
        with contextlib.suppress(AssertionError):  # as much as the socket takes
            sender.finish(0.2)
        got = read_all(sock, len(frames), native, never, wait)
        sender.finish()
    assert got == frames
