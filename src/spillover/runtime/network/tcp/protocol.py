"""The TCP transport's wire protocol: frame header, frame types, error codes, the
handshake's messages, and the socket loops both ends share (docs/network.md, "TCP
transport"). Names with a leading underscore belong to the ``tcp`` package, not to
its users."""

from __future__ import annotations

import enum
import os
import socket
import struct
from collections.abc import Callable

from spillover import netio
from spillover.errors import ClosedError
from spillover.runtime.network.buffers import NetworkBuffer
from spillover.runtime.network.errors import (
    ChannelCancelledError,
    ChannelFailedError,
    NetworkError,
)
from spillover.runtime.network.events import EndOfPartition, Event, serialize
from spillover.runtime.network.tcp.auth import MAC_BYTES
from spillover.storage import DataType

PROTOCOL_VERSION = 3  # 2: BUFFER_SIZE frames; 3: HEARTBEAT frames
MAGIC = b"SPLV"
HEADER = struct.Struct("<BBHII")  # type, flags (0), reserved (0), channel, payload length
_LENGTH_AT = 8  # the payload length's offset in HEADER


class FrameType(enum.IntEnum):
    DATA = 1  # producer -> consumer: one data buffer
    EVENT = 2  # producer -> consumer: one serialized event, in line
    PRIORITY_EVENT = 3  # producer -> consumer: one serialized event, priority path
    END = 4  # producer -> consumer: EndOfPartition, the last frame
    CREDIT = 5  # consumer -> producer: u32 more data frames may be sent
    HELLO = 6  # both: the consumer's challenge, then the producer's identity and MAC
    ERROR = 7  # both: u16 code + UTF-8 message; the sender closes afterwards
    BUFFER_SIZE = 8  # consumer -> producer: u32 bytes to cut data buffers at (debloating)
    HEARTBEAT = 9  # producer -> consumer: no payload; the connection is alive though idle


class ErrorCode(enum.IntEnum):
    REFUSED = 1  # handshake refused: secret, unknown gate or channel, version
    PROTOCOL = 2  # the peer broke the protocol
    FAILED = 3  # the sender's partition or gate failed
    CANCELLED = 4  # the sender's partition or gate was cancelled (or its receiver closed)
    CLOSED = 5  # the consumer finished the channel before EndOfPartition


_CHALLENGE = struct.Struct("<4sHH32s")  # magic, version, reserved, nonce
_HELLO = struct.Struct("<4sHHIIIHH")  # magic, version, reserved, segment size,
# subpartition, channel, partition name length, gate name length; names and MAC follow
_U32 = struct.Struct("<I")
_U16 = struct.Struct("<H")
_MAC_SIZE = MAC_BYTES
_NO_CHANNEL = 0xFFFFFFFF
_MAX_NAME = 1024
_MAX_HELLO = _HELLO.size + 2 * _MAX_NAME + _MAC_SIZE
_MAX_EVENT = 256
_MAX_MESSAGE = 4096
_BATCH_FRAMES = 64  # frames per sendmsg (two iovecs each, far below IOV_MAX)
_BATCH_BYTES = 1 << 20
_SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)
_END_BYTES = serialize(EndOfPartition())
_DATA = DataType.DATA

OvertakenHandler = Callable[[int, Event, list[NetworkBuffer]], None]
"""``(channel index, priority event, overtaken data buffers)``, called by a receiving
thread just before the event can be polled (under the gate's lock: it must only
record them, quickly); the handler owns the buffers (each retained for it) and
releases every one, after persisting it."""


class TransportError(NetworkError, ConnectionError):
    """A channel's TCP connection broke or could not be set up."""


class HandshakeError(TransportError):
    """A receiver refused a connection (wrong secret, unknown gate or channel, channel
    already connected, other protocol version) or did not answer in time."""


class ProtocolError(TransportError):
    """Bytes on a channel's connection do not follow the wire protocol."""


class RemoteError(TransportError):
    """The other end of a connection reported a failure in an ERROR frame."""


class _Stopped(Exception):
    """An I/O wait gave up because its owner is stopping."""


def _failure(where: str, cause: BaseException) -> Exception:
    """A fresh error for one waiter, like the in-memory channels raise."""
    if isinstance(cause, ChannelCancelledError):
        return ChannelCancelledError(f"{where} was cancelled", detail=str(cause))
    if isinstance(cause, ClosedError):
        return ClosedError(f"{where} is closed", detail=str(cause))
    err = ChannelFailedError(f"{where} failed", detail=f"{type(cause).__name__}: {cause}")
    err.__cause__ = cause
    return err


def _tune(sock: socket.socket, poll_interval: float) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.settimeout(poll_interval)


def _recv_into(sock: socket.socket, view: memoryview, stop: Callable[[], bool]) -> int:
    """Fills ``view`` from the socket; returns the bytes read (fewer only at EOF).
    Socket timeouts are polls: ``stop()`` true then raises :class:`_Stopped`."""
    got, size = 0, len(view)
    while got < size:
        try:
            n = sock.recv_into(view[got:], size - got)
        except TimeoutError:
            if stop():
                raise _Stopped from None
            continue
        if n == 0:
            break
        got += n
    return got


def _send_all(sock: socket.socket, views: list[memoryview], stop: Callable[[], bool]) -> None:
    """Writes every view with vectored ``sendmsg`` calls, resuming after partial
    writes; a timeout with ``stop()`` true raises :class:`_Stopped`."""
    i = 0
    while True:
        while i < len(views) and not len(views[i]):
            i += 1
        if i == len(views):
            return
        try:
            n = sock.sendmsg(views[i : i + 2 * _BATCH_FRAMES], (), _SEND_FLAGS)
        except TimeoutError:
            if stop():
                raise _Stopped from None
            continue
        while n:
            v = views[i]
            if n >= len(v):
                n -= len(v)
                i += 1
            else:
                views[i] = v[n:]
                n = 0


def _send_now(sock: socket.socket, views: list[memoryview], native: bool) -> int:
    """One write of a frame's two views that never waits, on a non-blocking socket:
    the bytes the socket took (0 when it is full). Native (``netio.send_now``) it
    keeps the interpreter lock; the pure twin is ``socket.sendmsg``. Any other
    failure raises ``OSError``."""
    if native:
        return netio.send_now(sock.fileno(), views[0], views[1])
    try:
        return sock.sendmsg(views, (), _SEND_FLAGS)
    except (BlockingIOError, InterruptedError):
        return 0


def _frame(ftype: FrameType, channel: int, payload: bytes) -> list[memoryview]:
    return [memoryview(HEADER.pack(ftype, 0, 0, channel, len(payload))), memoryview(payload)]


def _error_payload(code: ErrorCode, message: str) -> bytes:
    return _U16.pack(code) + message.encode("utf-8", "replace")[:_MAX_MESSAGE]


def _parse_error(payload: bytes) -> tuple[int, str]:
    return _U16.unpack_from(payload)[0], payload[2:].decode("utf-8", "replace")


def _recv_with_lookahead(
    sock: socket.socket, view: memoryview, ahead: memoryview, stop: Callable[[], bool]
) -> int:
    """Fills ``view`` like :func:`_recv_into`, letting each read run on into ``ahead``
    (the next frame's header), so a stream of frames costs one read each. Returns
    how many bytes of ``ahead`` were filled; raises at EOF before ``view`` is full."""
    got, size = 0, len(view)
    while got < size:
        try:
            n = sock.recvmsg_into([view[got:], ahead])[0]
        except TimeoutError:
            if stop():
                raise _Stopped from None
            continue
        if n == 0:
            raise TransportError("the connection closed inside a data frame")
        got += n
    return got - size


def _read_header(
    sock: socket.socket,
    view: memoryview,
    channel: int,
    stop: Callable[[], bool],
    ahead: int = 0,
) -> tuple[int, int] | None:
    """The next ``(type, length)``, of which ``ahead`` bytes are already in ``view``;
    None at EOF on a frame boundary."""
    got = ahead + _recv_into(sock, view[ahead:], stop)
    if got == 0:
        return None
    if got < HEADER.size:
        raise TransportError("the connection closed inside a frame header")
    return _parse_header(view, channel)


def _parse_header(buf: bytearray | memoryview, channel: int) -> tuple[int, int]:
    """``(type, length)`` of the header at the start of ``buf``, checked: no flags, and
    the connection's own channel (unless ``channel`` is ``_NO_CHANNEL``)."""
    ftype, flags, reserved, chan, length = HEADER.unpack_from(buf)
    if flags or reserved:
        raise ProtocolError(f"frame header with flags {flags} and reserved {reserved}")
    if channel != _NO_CHANNEL and chan != channel:
        raise ProtocolError(f"frame for channel {chan} on the connection of channel {channel}")
    return ftype, length


def _read_payload(
    sock: socket.socket,
    length: int,
    limit: int,
    stop: Callable[[], bool],
    what: str,
    quick: socket.socket | None = None,
) -> bytes:
    """A frame's payload after its header. ``quick``, a non-blocking twin of ``sock``,
    reads first what is there: a small frame left with its header and is there
    whole, and a read of a socket with a timeout polls before it reads, letting the
    interpreter lock go twice (and taking it back twice behind busy threads) where
    one non-blocking read lets it go once."""
    if length > limit:
        raise ProtocolError(f"{what} frame of {length} bytes", detail=f"at most {limit}")
    payload = bytearray(length)
    view, got = memoryview(payload), 0
    if quick is not None and length:
        try:
            got = quick.recv_into(view, length)
        except (BlockingIOError, InterruptedError):
            got = 0  # nothing yet: the timed read waits (a closed peer reads 0 there too)
    if got < length and _recv_into(sock, view[got:], stop) < length - got:
        raise TransportError(f"the connection closed inside a frame ({what})")
    return bytes(payload)


def _read_frame(
    sock: socket.socket,
    buf: bytearray,
    channel: int,
    stop: Callable[[], bool],
    timeout: float,
    ahead: int = 0,
) -> tuple[int, int, bytes | None] | None:
    """The next ``(type, length, payload)`` in one native call (``netio.read_frame``):
    the wait, the header and a small frame's payload with one take of the
    interpreter lock, where :func:`_read_header` and :func:`_read_payload` take it
    three or four times. ``buf`` holds ``ahead`` bytes of the header already; the
    payload is None for a data frame and for a frame larger than ``buf`` (read it
    apart). None at EOF on a frame boundary."""
    fd, got = sock.fileno(), ahead
    while True:
        status, got, err = netio.read_frame(
            fd, buf, got, HEADER.size, _LENGTH_AT, FrameType.DATA, timeout
        )
        if status == netio.DONE:
            break
        if status == netio.TIMEOUT:
            if stop():
                raise _Stopped
        elif status == netio.EOF:
            if got == 0:
                return None
            if got < HEADER.size:
                raise TransportError("the connection closed inside a frame header")
            raise TransportError("the connection closed inside a frame")
        else:
            raise OSError(err, os.strerror(err))
    ftype, length = _parse_header(buf, channel)
    if ftype == FrameType.DATA or length > len(buf) - HEADER.size:
        return ftype, length, None
    return ftype, length, bytes(memoryview(buf)[HEADER.size : HEADER.size + length])


def _read_into_ahead(
    sock: socket.socket,
    view: memoryview,
    ahead: memoryview,
    stop: Callable[[], bool],
    timeout: float,
) -> int:
    """:func:`_recv_with_lookahead` in native calls (``netio.read_into``): one take
    of the interpreter lock per read, not two (a timed socket's poll, then its
    read)."""
    fd, got = sock.fileno(), 0
    while True:
        status, got, extra, err = netio.read_into(fd, view, got, ahead, timeout)
        if status == netio.DONE:
            return extra
        if status == netio.TIMEOUT:
            if stop():
                raise _Stopped
        elif status == netio.EOF:
            raise TransportError("the connection closed inside a data frame")
        else:
            raise OSError(err, os.strerror(err))


def _read_small_frame(
    sock: socket.socket, limit: int, stop: Callable[[], bool]
) -> tuple[int, int, bytes]:
    """One whole frame of at most ``limit`` payload bytes (handshake only)."""
    hdr = bytearray(HEADER.size)
    got = _recv_into(sock, memoryview(hdr), stop)
    if got < HEADER.size:
        raise TransportError("the connection closed during the handshake")
    ftype, flags, reserved, chan, length = HEADER.unpack(hdr)
    if flags or reserved:
        raise ProtocolError(f"frame header with flags {flags} and reserved {reserved}")
    return ftype, chan, _read_payload(sock, length, limit, stop, "handshake")


def _remote_cause(code: int, message: str, peer: str) -> BaseException:
    if code == ErrorCode.CANCELLED:
        return ChannelCancelledError(f"{peer} was cancelled", detail=message)
    if code == ErrorCode.CLOSED:
        return ClosedError(f"{peer} finished the channel", detail=message)
    return RemoteError(f"{peer} reported a failure (code {code})", detail=message)
