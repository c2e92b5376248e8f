"""TCP transport: a subpartition of one worker feeds an input channel of another.

The producer's end is a :class:`TcpSubpartition` (a :class:`Subpartition`, attached
with :func:`connect_tcp`); the consumer's end is a :class:`TcpReceiver`, one per
worker, which serves the input gates registered with it. One TCP connection
carries one channel; docs/network.md ("TCP transport") has the wire format.

Semantics are those of :class:`~spillover.runtime.network.channels.LocalChannel`: FIFO
data, credit-based flow control, events without credit, a priority path,
EndOfPartition last, failures reaching both ends. Two differences:

- Credit: a remote channel announces only its exclusive credits
  (``buffers_per_channel``), never the gate's floating ones, so the receiving
  thread never has to wait in ``push_data`` (floating credit is shared with other
  channels and could be gone by the time the buffer arrives).
- Priority events split the overtaken data in two. ``add_event(priority=True)``
  returns the data buffers still in the producer's send queue (the producer
  persists them as output state; they follow the event on the wire). Data the
  sender thread already handed to the socket reaches the consumer ahead of the
  event; what of it the consumer has not polled yet is overtaken there, and the
  receiver hands those buffers to the gate's ``on_overtaken`` handler (the
  consumer persists them as input state of that channel).

Buffers travel without copies in Python: ``socket.sendmsg`` of the buffers'
memoryviews on the producer, ``recv_into`` pooled segments on the consumer.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import hashlib
import hmac
import os
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from spillover.errors import ClosedError, ConfigError
from spillover.runtime.network.buffers import (
    BufferPool,
    NetworkBuffer,
    NetworkTimeoutError,
    Segment,
)
from spillover.runtime.network.channels import (
    ChannelCancelledError,
    ChannelFailedError,
    CreditListener,
    InputChannel,
    InputGate,
    NetworkError,
    ResultPartition,
    Subpartition,
)
from spillover.runtime.network.events import (
    EndOfPartition,
    Event,
    EventFormatError,
    deserialize,
    serialize,
)
from spillover.storage import DataType

__all__ = [
    "HEADER",
    "MAGIC",
    "PROTOCOL_VERSION",
    "ErrorCode",
    "FrameType",
    "HandshakeError",
    "OvertakenHandler",
    "ProtocolError",
    "RemoteError",
    "TcpReceiver",
    "TcpSubpartition",
    "TransportError",
    "connect_tcp",
]

PROTOCOL_VERSION = 1
MAGIC = b"SPLV"
HEADER = struct.Struct("<BBHII")  # type, flags (0), reserved (0), channel, payload length


class FrameType(enum.IntEnum):
    DATA = 1  # producer -> consumer: one data buffer
    EVENT = 2  # producer -> consumer: one serialized event, in line
    PRIORITY_EVENT = 3  # producer -> consumer: one serialized event, priority path
    END = 4  # producer -> consumer: EndOfPartition, the last frame
    CREDIT = 5  # consumer -> producer: u32 more data frames may be sent
    HELLO = 6  # both: the consumer's challenge, then the producer's identity and MAC
    ERROR = 7  # both: u16 code + UTF-8 message; the sender closes afterwards


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
_MAC_SIZE = 32  # HMAC-SHA256
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


def _secret_bytes(secret: bytes | str) -> bytes:
    key = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not key:
        raise ConfigError("the job secret of a TCP transport must not be empty")
    return key


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
    ftype, flags, reserved, chan, length = HEADER.unpack(view)
    if flags or reserved:
        raise ProtocolError(f"frame header with flags {flags} and reserved {reserved}")
    if channel != _NO_CHANNEL and chan != channel:
        raise ProtocolError(f"frame for channel {chan} on the connection of channel {channel}")
    return ftype, length


def _read_payload(
    sock: socket.socket, length: int, limit: int, stop: Callable[[], bool], what: str
) -> bytes:
    if length > limit:
        raise ProtocolError(f"{what} frame of {length} bytes", detail=f"at most {limit}")
    payload = bytearray(length)
    if _recv_into(sock, memoryview(payload), stop) < length:
        raise TransportError(f"the connection closed inside a {what} frame")
    return bytes(payload)


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


# ---- producer side ----------------------------------------------------------------


class TcpSubpartition(Subpartition):
    """The producer's end of one remote channel; made by :func:`connect_tcp`.

    Threads: the producer thread calls ``add_*``/``finish`` (``fail``, ``close``
    from any thread); a sender thread writes queued buffers to the socket in
    vectored batches; a reader thread takes the consumer's CREDIT and ERROR frames.
    ``add_data`` waits until the consumer has announced credit for one more buffer,
    so the send queue never holds more data than the consumer can take.

    Ownership: a queued buffer belongs to the subpartition; the sender releases it
    once written (or ``fail`` releases it unsent). Buffers returned by a priority
    ``add_event`` are retained for the caller and still sent after the event.

    Lifecycle: after ``finish`` the sender writes the rest and EndOfPartition,
    half-closes the socket and the reader waits for the consumer to close; then
    both threads are gone and the socket is closed. ``close`` waits for that (or
    cancels an unfinished channel). ``fail``, an ERROR frame or a broken connection
    fail the channel: waiters raise :class:`ChannelFailedError` (or
    :class:`ChannelCancelledError`), queued buffers are released, and a local
    failure is reported to the consumer in an ERROR frame.
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        channel: int,
        where: str,
        segment_size: int,
        initial_credit: int,
        poll_interval: float = 0.2,
        linger: float = 1.0,
        end_timeout: float = 60.0,
    ) -> None:
        self.where = where
        self.channel_id = channel
        self.segment_size = segment_size
        self.poll_interval = poll_interval
        self.linger = linger
        self.end_timeout = end_timeout
        self._sock = sock
        self._lock = threading.Lock()
        self._credit_cv = threading.Condition(self._lock)  # the producer waits here
        self._work_cv = threading.Condition(self._lock)  # the sender waits here
        self._queue: deque[NetworkBuffer] = deque()
        self._prio: deque[NetworkBuffer] = deque()
        self._end: NetworkBuffer | None = None
        self._credit = initial_credit
        self._queued_buffers = 0
        self._queued_bytes = 0
        self._finished = False
        self._cause: BaseException | None = None
        self._tell_peer = False
        self._end_written_at: float | None = None
        self._stopping = False
        self._running = 2
        self._done = threading.Event()
        self.credit_granted = initial_credit
        self.sent_buffers = 0
        self.sent_bytes = 0
        self._threads = [
            threading.Thread(target=self._send_loop, name=f"spillover-tcp-send {where}"),
            threading.Thread(target=self._read_loop, name=f"spillover-tcp-credit {where}"),
        ]
        for t in self._threads:
            t.daemon = True

    def _start(self) -> None:
        for t in self._threads:
            t.start()

    # -- the Subpartition interface (producer thread) --

    def _check_open_locked(self) -> None:
        if self._cause is not None:
            raise _failure(self.where, self._cause)
        if self._finished:
            raise ClosedError(f"{self.where} is finished")

    def add_data(self, buffer: NetworkBuffer, deadline: float | None) -> float:
        if len(buffer) > self.segment_size:
            raise ConfigError(
                f"{self.where}: a buffer of {len(buffer)} bytes exceeds the announced "
                f"segment size of {self.segment_size}"
            )
        waited = 0.0
        with self._lock:
            self._check_open_locked()
            if self._credit <= 0:
                start = time.monotonic()
                try:
                    while self._credit <= 0:
                        remaining = None if deadline is None else deadline - time.monotonic()
                        if remaining is not None and remaining <= 0:
                            raise NetworkTimeoutError(
                                f"{self.where}: no credit before the deadline",
                                hint="the consumer is slow, blocked or not polling",
                            )
                        self._credit_cv.wait(remaining)
                        self._check_open_locked()
                finally:
                    waited = time.monotonic() - start
            self._credit -= 1
            self._queue.append(buffer)
            self._queued_buffers += 1
            self._queued_bytes += len(buffer)
            self._work_cv.notify()
        return waited

    def add_event(self, buffer: NetworkBuffer, priority: bool) -> list[NetworkBuffer]:
        if len(buffer) > _MAX_EVENT:
            raise ConfigError(f"{self.where}: an event of {len(buffer)} bytes is too large")
        with self._lock:
            self._check_open_locked()
            self._work_cv.notify()
            if not priority:
                self._queue.append(buffer)
                return []
            self._prio.append(buffer)
            return [b.retain() for b in self._queue if b.data_type == _DATA]

    def finish(self, buffer: NetworkBuffer) -> None:
        if bytes(buffer) != _END_BYTES:
            raise ValueError(f"{self.where}: finish() takes an EndOfPartition buffer")
        with self._lock:
            self._check_open_locked()
            self._queue.append(buffer)
            self._end = buffer
            self._finished = True
            self._work_cv.notify()

    def fail(self, cause: BaseException) -> None:
        self._fail(cause, tell_peer=True)

    @property
    def credit(self) -> int:
        return self._credit

    @property
    def backlog(self) -> tuple[int, int]:
        """``(buffers, bytes)`` of data in the send queue (not yet handed to the
        socket); buffers in flight or queued at the consumer are not counted."""
        return self._queued_buffers, self._queued_bytes

    @property
    def closed(self) -> bool:
        """Both threads are gone and the socket is closed."""
        return self._done.is_set()

    def close(self, timeout: float | None = 10.0) -> bool:
        """Waits until everything queued and EndOfPartition were written and the
        consumer closed, then returns True. An unfinished channel is failed first
        (:class:`ChannelCancelledError`, reported to the consumer). If ``timeout``
        passes, the connection is cut. Returns False unless the stream completed."""
        with self._lock:
            unfinished = not self._finished and self._cause is None
        if unfinished:
            self.fail(ChannelCancelledError(f"{self.where} was closed before it finished"))
        if not self._done.wait(timeout):
            with self._lock:
                self._stopping = True
                self._work_cv.notify_all()
                self._credit_cv.notify_all()
            self._shutdown()
            self._done.wait(self.linger + 4 * self.poll_interval)
        return self._end_written_at is not None and self._cause is None

    # -- failure --

    def _fail(self, cause: BaseException, tell_peer: bool) -> None:
        with self._lock:
            if self._cause is not None or self._end_written_at is not None:
                return
            self._cause = cause
            self._tell_peer = tell_peer
            dropped = [*self._prio, *self._queue]
            self._prio.clear()
            self._queue.clear()
            self._queued_buffers = self._queued_bytes = 0
            self._credit_cv.notify_all()
            self._work_cv.notify_all()
        for b in dropped:
            b.release()
        if not tell_peer:
            self._shutdown()

    def _shutdown(self, how: int = socket.SHUT_RDWR) -> None:
        """Wakes both threads; never closes the descriptor (the last thread does)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(how)

    def _exit(self) -> None:
        with self._lock:
            self._running -= 1
            last = self._running == 0
        if last:
            self._sock.close()
            self._done.set()

    # -- sender thread --

    def _take_batch_locked(self) -> list[tuple[FrameType, NetworkBuffer]]:
        batch: list[tuple[FrameType, NetworkBuffer]] = []
        while self._prio and len(batch) < _BATCH_FRAMES:
            batch.append((FrameType.PRIORITY_EVENT, self._prio.popleft()))
        nbytes = 0
        while self._queue and len(batch) < _BATCH_FRAMES and nbytes < _BATCH_BYTES:
            buf = self._queue.popleft()
            if buf.data_type == _DATA:
                n = len(buf)
                nbytes += n
                self._queued_buffers -= 1
                self._queued_bytes -= n
                batch.append((FrameType.DATA, buf))
            else:
                batch.append((FrameType.END if buf is self._end else FrameType.EVENT, buf))
        return batch

    def _abort_send(self) -> bool:
        return self._stopping or self._cause is not None

    def _send_loop(self) -> None:
        at_boundary = True
        try:
            while True:
                with self._lock:
                    while not (
                        self._prio or self._queue or self._cause is not None or self._stopping
                    ):
                        self._work_cv.wait()
                    if self._cause is not None or self._stopping:
                        break
                    batch = self._take_batch_locked()
                views: list[memoryview] = []
                for ftype, buf in batch:
                    views.append(memoryview(HEADER.pack(ftype, 0, 0, self.channel_id, len(buf))))
                    views.append(buf.data)
                at_boundary = False
                try:
                    _send_all(self._sock, views, self._abort_send)
                finally:
                    for _, buf in batch:
                        buf.release()
                at_boundary = True
                data = [len(b) for t, b in batch if t == FrameType.DATA]
                self.sent_buffers += len(data)
                self.sent_bytes += sum(data)
                if batch[-1][0] == FrameType.END:
                    with self._lock:
                        self._end_written_at = time.monotonic()
                    self._shutdown(socket.SHUT_WR)
                    return
        except _Stopped:
            pass
        except OSError as e:
            at_boundary = False
            self._fail(
                TransportError(f"{self.where}: sending failed", detail=f"{type(e).__name__}: {e}"),
                tell_peer=False,
            )
        finally:
            if self._end_written_at is None:
                self._goodbye(at_boundary)
            self._exit()

    def _goodbye(self, at_boundary: bool) -> None:
        """Reports a local failure to the consumer (if the stream is intact), then
        cuts the connection."""
        cause = self._cause
        if self._tell_peer and cause is not None and at_boundary:
            code = ErrorCode.CANCELLED
            if isinstance(cause, ProtocolError):
                code = ErrorCode.PROTOCOL
            elif not isinstance(cause, ChannelCancelledError):
                code = ErrorCode.FAILED
            message = f"{self.where}: {type(cause).__name__}: {cause}"
            deadline = time.monotonic() + self.linger
            with contextlib.suppress(OSError, _Stopped):
                _send_all(
                    self._sock,
                    _frame(FrameType.ERROR, self.channel_id, _error_payload(code, message)),
                    lambda: time.monotonic() > deadline,
                )
        self._shutdown()

    # -- reader thread --

    def _stop_reading(self) -> bool:
        end = self._end_written_at
        return self._stopping or (end is not None and time.monotonic() - end > self.end_timeout)

    def _read_loop(self) -> None:
        hdr = memoryview(bytearray(HEADER.size))
        sock, stop = self._sock, self._stop_reading
        try:
            while True:
                head = _read_header(sock, hdr, self.channel_id, stop)
                if head is None:
                    if self._end_written_at is None:
                        self._fail(
                            TransportError(f"{self.where}: the consumer closed the connection"),
                            tell_peer=False,
                        )
                    return
                ftype, length = head
                if ftype == FrameType.CREDIT:
                    if length != _U32.size:
                        raise ProtocolError(f"a CREDIT frame of {length} bytes")
                    (delta,) = _U32.unpack(_read_payload(sock, length, 4, stop, "CREDIT"))
                    with self._lock:
                        self._credit += delta
                        self.credit_granted += delta
                        self._credit_cv.notify_all()
                elif ftype == FrameType.ERROR:
                    payload = _read_payload(sock, length, _MAX_MESSAGE + 2, stop, "ERROR")
                    if len(payload) < 2:
                        raise ProtocolError("an ERROR frame without a code")
                    code, message = _parse_error(payload)
                    self._fail(_remote_cause(code, message, "the consumer"), tell_peer=False)
                    return
                else:
                    raise ProtocolError(f"unexpected frame type {ftype} from the consumer")
        except _Stopped:
            pass
        except ProtocolError as e:
            self._fail(e, tell_peer=True)
        except OSError as e:
            self._fail(
                TransportError(
                    f"{self.where}: connection broken", detail=f"{type(e).__name__}: {e}"
                ),
                tell_peer=False,
            )
        finally:
            self._exit()

    def __repr__(self) -> str:
        state = "failed" if self._cause else "finished" if self._finished else "open"
        return f"TcpSubpartition({self.where}, {state}, credit {self._credit})"


def connect_tcp(
    partition: ResultPartition,
    subpartition: int,
    address: tuple[str, int],
    gate: str,
    channel: int,
    secret: bytes | str,
    *,
    timeout: float = 10.0,
    poll_interval: float = 0.2,
) -> TcpSubpartition:
    """Links ``partition``'s subpartition to channel ``channel`` of the input gate
    named ``gate`` at a :class:`TcpReceiver`'s ``address``, like
    :func:`~spillover.runtime.network.channels.connect` does in memory.

    Connects, answers the receiver's challenge with an HMAC of ``secret`` and
    waits (at most ``timeout`` seconds) for the initial credit, which is the
    acceptance. Raises :class:`HandshakeError` when refused or unanswered.
    """
    key = _secret_bytes(secret)
    host, port = address
    where = (
        f"subpartition {subpartition} of result partition {partition.name!r} "
        f"(to channel {channel} of input gate {gate!r} at {host}:{port})"
    )
    pname, gname = partition.name.encode(), gate.encode()
    if len(pname) > _MAX_NAME or len(gname) > _MAX_NAME:
        raise ConfigError(f"{where}: names are limited to {_MAX_NAME} bytes")
    if not 0 <= subpartition < partition.num_subpartitions or not 0 <= channel < _NO_CHANNEL:
        raise ConfigError(f"{where}: no such subpartition or channel")
    try:
        partition.credit(subpartition)
    except ChannelFailedError:
        raise
    except NetworkError:
        pass  # not connected yet: as it should be
    else:
        raise NetworkError(f"subpartition {subpartition} of {partition.name!r} is connected")
    segment_size = partition.pool.segment_size
    deadline = time.monotonic() + timeout

    def late() -> bool:
        return time.monotonic() > deadline

    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        raise HandshakeError(f"{where}: cannot connect", detail=str(e)) from e
    try:
        _tune(sock, min(poll_interval, timeout))
        ftype, _, payload = _read_small_frame(sock, _MAX_MESSAGE + 2, late)
        if ftype == FrameType.ERROR and len(payload) >= 2:
            raise HandshakeError(f"{where}: refused", detail=_parse_error(payload)[1])
        if ftype != FrameType.HELLO or len(payload) != _CHALLENGE.size:
            raise HandshakeError(f"{where}: the peer is not a spillover TCP receiver")
        magic, version, _, nonce = _CHALLENGE.unpack(payload)
        if magic != MAGIC:
            raise HandshakeError(f"{where}: the peer is not a spillover TCP receiver")
        if version != PROTOCOL_VERSION:
            raise HandshakeError(
                f"{where}: the receiver speaks protocol version {version}",
                detail=f"this producer speaks version {PROTOCOL_VERSION}",
                hint="every worker of a job must run the same spillover version",
            )
        body = (
            _HELLO.pack(
                MAGIC,
                PROTOCOL_VERSION,
                0,
                segment_size,
                subpartition,
                channel,
                len(pname),
                len(gname),
            )
            + pname
            + gname
        )
        mac = hmac.new(key, nonce + body, hashlib.sha256).digest()
        _send_all(sock, _frame(FrameType.HELLO, channel, body + mac), late)
        ftype, chan, payload = _read_small_frame(sock, _MAX_MESSAGE + 2, late)
        if ftype == FrameType.ERROR and len(payload) >= 2:
            raise HandshakeError(
                f"{where}: refused",
                detail=_parse_error(payload)[1],
                hint="every worker of a job must use the job's secret and wiring",
            )
        if ftype != FrameType.CREDIT or len(payload) != _U32.size or chan != channel:
            raise HandshakeError(f"{where}: unexpected answer to the handshake (type {ftype})")
        (initial,) = _U32.unpack(payload)
        sock.settimeout(poll_interval)
    except _Stopped:
        sock.close()
        raise HandshakeError(f"{where}: no answer within {timeout} s") from None
    except HandshakeError:
        sock.close()
        raise
    except OSError as e:
        sock.close()
        raise HandshakeError(f"{where}: handshake failed", detail=f"{type(e).__name__}: {e}") from e
    sub = TcpSubpartition(
        sock,
        channel=channel,
        where=where,
        segment_size=segment_size,
        initial_credit=initial,
        poll_interval=poll_interval,
    )
    sub._start()
    try:
        partition.connect(subpartition, sub)
    except BaseException:
        sub.close(0)
        raise
    return sub


# ---- consumer side ----------------------------------------------------------------


@dataclass
class _Registered:
    gate: InputGate
    on_overtaken: OvertakenHandler | None


class _Inbound(CreditListener):
    """One accepted connection: handshake, then the receiving loop for one channel.

    Its thread reads frames and pushes them into the channel; it is also the
    channel's credit listener, whose calls (from the releasing threads) write
    CREDIT frames under ``_send_lock``. The thread closes the socket on exit,
    under the same lock, so no write can hit a reused descriptor.
    """

    def __init__(self, receiver: TcpReceiver, sock: socket.socket, peer: str) -> None:
        self.receiver = receiver
        self.sock = sock
        self.peer = peer
        self.where = f"connection from {peer}"
        self.channel: InputChannel | None = None
        self.channel_id = _NO_CHANNEL
        self.on_overtaken: OvertakenHandler | None = None
        self.pool: BufferPool | None = None
        self.segment_size = 0
        self._send_lock = threading.Lock()
        self._announcing = False  # credit may be announced (open, before END)
        self._pending = 0  # credit returned and not announced yet
        self._batch = 1  # credits announced together while the consumer is busy
        self._ended = False
        self._closed = False
        self.thread = threading.Thread(
            target=self._run, name=f"spillover-tcp-recv {peer}", daemon=True
        )

    # -- writing (any thread) --

    def _send(self, ftype: FrameType, payload: bytes, timeout: float) -> None:
        with self._send_lock:
            self._send_locked(ftype, payload, timeout)

    def _send_locked(self, ftype: FrameType, payload: bytes, timeout: float) -> None:
        if self._closed:
            return
        deadline = time.monotonic() + timeout
        _send_all(
            self.sock, _frame(ftype, self.channel_id, payload), lambda: time.monotonic() > deadline
        )

    def _tell(self, code: ErrorCode, message: str) -> None:
        with contextlib.suppress(OSError, _Stopped):
            self._send(FrameType.ERROR, _error_payload(code, message), self.receiver.linger)

    def credit_returned(self, channel: InputChannel) -> None:
        """Announces the credit the consumer returned by releasing a buffer: at once
        when the channel has fewer than ``_batch`` buffers queued (the consumer may
        run dry), else once ``_batch`` credits are pending (the consumer is busy
        with the queue meanwhile, and fewer CREDIT frames cost it less). Never
        raises: a failed write cuts the connection and the receiving thread fails
        the channel."""
        if not self._announcing:
            return
        try:
            with self._send_lock:
                self._pending += 1
                if self._pending < self._batch and channel.queued_buffers >= self._batch:
                    return
                n, self._pending = self._pending, 0
                self._send_locked(FrameType.CREDIT, _U32.pack(n), self.receiver.io_timeout)
        except (OSError, _Stopped):
            self._cut()

    def _cut(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _close(self) -> None:
        with self._send_lock:
            self._announcing = False
            self._closed = True
            self._cut()
            self.sock.close()
        ch = self.channel
        if ch is not None and ch.credit_listener is self:
            ch.credit_listener = None
        if self.pool is not None:
            self.pool.close()

    # -- the thread --

    def _run(self) -> None:
        try:
            if self._handshake():
                self._serve()
        finally:
            self._close()
            self.receiver._forget(self)

    def _refuse(self, reason: str) -> bool:
        self.receiver._refused(f"{self.where}: {reason}")
        self._tell(ErrorCode.REFUSED, reason)
        return False

    def _handshake(self) -> bool:
        rcv = self.receiver
        deadline = time.monotonic() + rcv.handshake_timeout

        def late() -> bool:
            return rcv._closing or time.monotonic() > deadline

        nonce = os.urandom(32)
        try:
            challenge = _CHALLENGE.pack(MAGIC, PROTOCOL_VERSION, 0, nonce)
            _send_all(self.sock, _frame(FrameType.HELLO, _NO_CHANNEL, challenge), late)
            ftype, chan, payload = _read_small_frame(self.sock, _MAX_HELLO, late)
        except _Stopped:
            rcv._refused(f"{self.where}: no hello within {rcv.handshake_timeout} s")
            return False
        except OSError as e:
            rcv._refused(f"{self.where}: handshake failed: {type(e).__name__}: {e}")
            return False
        if ftype != FrameType.HELLO or len(payload) < _HELLO.size + _MAC_SIZE:
            return self._refuse(f"expected a HELLO frame, got type {ftype}")
        magic, version, _, segment_size, sub, channel, plen, glen = _HELLO.unpack_from(payload)
        if magic != MAGIC:
            return self._refuse("not a spillover producer")
        if version != PROTOCOL_VERSION:
            return self._refuse(
                f"protocol version {version} is not supported (this receiver speaks "
                f"{PROTOCOL_VERSION})"
            )
        if len(payload) != _HELLO.size + plen + glen + _MAC_SIZE or chan != channel:
            return self._refuse("malformed HELLO frame")
        body, mac = payload[:-_MAC_SIZE], payload[-_MAC_SIZE:]
        expected = hmac.new(rcv._secret, nonce + body, hashlib.sha256).digest()
        if not hmac.compare_digest(mac, expected):
            return self._refuse("authentication failed: wrong job secret")
        pname = payload[_HELLO.size : _HELLO.size + plen].decode("utf-8", "replace")
        gname = payload[_HELLO.size + plen : _HELLO.size + plen + glen].decode("utf-8", "replace")
        producer = f"subpartition {sub} of result partition {pname!r}"
        if not 0 < segment_size <= rcv.max_segment_size:
            return self._refuse(f"segment size {segment_size} is not in 1..{rcv.max_segment_size}")
        with rcv._lock:
            reg = rcv._gates.get(gname)
            if reg is None:
                refusal = f"no input gate {gname!r} here"
            elif channel >= reg.gate.num_channels:
                refusal = f"input gate {gname!r} has no channel {channel}"
            elif reg.gate.channel(channel).connected:
                refusal = f"{reg.gate.channel(channel).where} is already connected"
            else:
                refusal = ""
                reg.gate.channel(channel).connected = True
        if refusal or reg is None:
            return self._refuse(refusal)
        ch = reg.gate.channel(channel)
        self.where = f"{ch.where} (from {producer} at {self.peer})"
        self.channel, self.channel_id = ch, channel
        self.on_overtaken = reg.on_overtaken
        self.segment_size = segment_size
        self.pool = BufferPool(segment_size, 2 * ch.exclusive + 1, f"tcp {ch.where}")
        self.sock.settimeout(rcv.poll_interval)
        self._batch = max(1, ch.exclusive // 4)
        ch.credit_listener = self
        self._announcing = True
        try:  # the initial credit is the acceptance
            self._send(
                FrameType.CREDIT, _U32.pack(ch.exclusive - ch.buffers_in_use), rcv.io_timeout
            )
        except (OSError, _Stopped) as e:
            ch.fail(TransportError(f"{self.where}: handshake failed", detail=str(e)))
            return False
        return True

    def _idle(self) -> bool:
        """Called when a read waited ``poll_interval`` in vain: announces credit held
        back for batching (so a consumer that holds its buffers never starves),
        then tells whether to stop."""
        if self._pending and self._announcing:
            try:
                with self._send_lock:
                    n, self._pending = self._pending, 0
                    if n:
                        self._send_locked(FrameType.CREDIT, _U32.pack(n), self.receiver.io_timeout)
            except (OSError, _Stopped):
                self._cut()
        return self._should_stop()

    def _should_stop(self) -> bool:
        if self.receiver._closing:
            return True
        ch = self.channel
        assert ch is not None
        return not self._ended and (ch.finished or _channel_failure(ch) is not None)

    def _segment(self) -> Segment:
        pool = self.pool
        assert pool is not None
        while True:
            try:
                return pool.request_segment(timeout=self.receiver.poll_interval)
            except NetworkTimeoutError:
                if self._should_stop():
                    raise _Stopped from None

    def _serve(self) -> None:
        ch, pool, sock = self.channel, self.pool, self.sock
        assert ch is not None and pool is not None
        hdr = memoryview(bytearray(HEADER.size))
        stop = self._idle
        ahead = 0  # bytes of the next header read along with a data frame
        try:
            while True:
                head = _read_header(sock, hdr, self.channel_id, stop, ahead)
                ahead = 0
                if head is None:
                    if not self._ended:
                        raise TransportError(
                            "the producer closed the connection before EndOfPartition"
                        )
                    return
                ftype, length = head
                if self._ended:
                    raise ProtocolError(f"a frame of type {ftype} after EndOfPartition")
                if ftype == FrameType.DATA:
                    if length > self.segment_size:
                        raise ProtocolError(
                            f"a data frame of {length} bytes",
                            detail=f"the announced segment size is {self.segment_size}",
                        )
                    seg = self._segment()
                    try:
                        ahead = _recv_with_lookahead(sock, seg.data[:length], hdr, stop)
                    except BaseException:
                        pool.return_segment(seg)
                        raise
                    buf = pool.wrap(seg[:length])
                    try:
                        ch.push_data(buf, time.monotonic())  # never waits: sent with credit
                    except NetworkTimeoutError:
                        buf.release()
                        raise ProtocolError("a data frame beyond the announced credit") from None
                    except BaseException:
                        buf.release()
                        raise
                elif ftype in (FrameType.EVENT, FrameType.PRIORITY_EVENT):
                    payload = _read_payload(sock, length, _MAX_EVENT, stop, "event")
                    ev = NetworkBuffer.unpooled(payload, DataType.EVENT)
                    if ftype == FrameType.EVENT:
                        ch.push_event(ev, False)
                        continue
                    try:
                        event = deserialize(payload)
                    except EventFormatError as e:
                        raise ProtocolError(
                            "a priority event that does not parse", detail=str(e)
                        ) from e
                    handler = self.on_overtaken
                    if handler is not None:
                        ch.push_event(ev, True, functools.partial(handler, ch.index, event))
                    else:
                        for b in ch.push_event(ev, True):
                            b.release()
                elif ftype == FrameType.END:
                    payload = _read_payload(sock, length, _MAX_EVENT, stop, "END")
                    if payload != _END_BYTES:
                        raise ProtocolError("an END frame that is not EndOfPartition")
                    self._announcing = False
                    self._ended = True
                    ch.push_end(NetworkBuffer.unpooled(payload, DataType.EVENT))
                elif ftype == FrameType.ERROR:
                    payload = _read_payload(sock, length, _MAX_MESSAGE + 2, stop, "ERROR")
                    if len(payload) < 2:
                        raise ProtocolError("an ERROR frame without a code")
                    code, message = _parse_error(payload)
                    ch.fail(_remote_cause(code, message, "the producer"))
                    return
                else:
                    raise ProtocolError(f"unexpected frame type {ftype} from the producer")
        except (_Stopped, ChannelFailedError, ClosedError):
            self._stopped()
        except ProtocolError as e:
            self._tell(ErrorCode.PROTOCOL, str(e))
            ch.fail(ProtocolError(f"{self.where}: {e}"))
        except OSError as e:
            ch.fail(
                TransportError(f"{self.where}: connection lost", detail=f"{type(e).__name__}: {e}")
            )
        except BaseException as e:  # e.g. an on_overtaken handler raised
            self._tell(ErrorCode.FAILED, f"{type(e).__name__}: {e}")
            ch.fail(e)

    def _stopped(self) -> None:
        """The consumer side ended the channel: say why to the producer."""
        ch = self.channel
        assert ch is not None
        if self._ended:
            return
        cause = _channel_failure(ch)
        if cause is not None:
            code = (
                ErrorCode.CANCELLED
                if isinstance(cause, ChannelCancelledError)
                else ErrorCode.FAILED
            )
            self._tell(code, f"{ch.where} failed: {type(cause).__name__}: {cause}")
        elif ch.finished:
            self._tell(ErrorCode.CLOSED, f"{ch.where} was finished by its consumer")
        else:  # the receiver is closing
            ch.fail(ChannelCancelledError(f"{self.where}: the TCP receiver was closed"))
            self._tell(ErrorCode.CANCELLED, f"the TCP receiver serving {ch.where} was closed")


def _channel_failure(ch: InputChannel) -> BaseException | None:
    # InputChannel exposes no failure state yet; this is the one place that reads it.
    return ch._cause


class TcpReceiver:
    """The consumer side of the TCP transport for one worker: a listening socket
    that serves the input gates registered with it.

    Threads: an accept thread (polling its socket every ``poll_interval``), and a
    receiving thread per connection that authenticates the producer (challenge and
    HMAC-SHA256 of the job ``secret``), then reads its frames into buffers of a
    pool of its own (``2 * buffers_per_channel + 1`` segments of the producer's
    segment size) and pushes them into the input channel. Releasing a polled
    buffer returns the channel's credit and the channel's credit listener (set
    here) announces it to the producer.

    Lifecycle: :meth:`register` gates before producers connect; :meth:`close`
    stops accepting and ends every connection: channels that have not received
    EndOfPartition fail with :class:`ChannelCancelledError` and their producers
    are told. A connection also ends when its channel fails or is finished on the
    consumer side (the producer gets an ERROR frame within ``poll_interval``) and
    when the producer fails or disconnects (the channel fails with
    :class:`ChannelFailedError`).
    """

    def __init__(
        self,
        secret: bytes | str,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        poll_interval: float = 0.2,
        handshake_timeout: float = 10.0,
        io_timeout: float = 10.0,
        linger: float = 1.0,
        max_segment_size: int = 64 << 20,
    ) -> None:
        self._secret = _secret_bytes(secret)
        self.poll_interval = poll_interval
        self.handshake_timeout = handshake_timeout
        self.io_timeout = io_timeout
        self.linger = linger
        self.max_segment_size = max_segment_size
        self._lock = threading.Lock()
        self._gates: dict[str, _Registered] = {}
        self._conns: set[_Inbound] = set()
        self._closing = False
        self.refused: list[str] = []
        self._listener = socket.create_server((host, port), backlog=128)
        self._listener.settimeout(poll_interval)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"spillover-tcp-accept {self.address}", daemon=True
        )
        self._accept_thread.start()

    def register(
        self,
        gate: InputGate,
        name: str | None = None,
        on_overtaken: OvertakenHandler | None = None,
    ) -> None:
        """Serves ``gate`` under ``name`` (default ``gate.name``). ``on_overtaken``
        receives, per priority event, the data buffers it overtook in the channel's
        queue; without it they are released (they stay queued and are delivered)."""
        key = gate.name if name is None else name
        with self._lock:
            if key in self._gates:
                raise ConfigError(f"TCP receiver {self.address}: gate {key!r} is registered")
            self._gates[key] = _Registered(gate, on_overtaken)

    @property
    def connections(self) -> int:
        """Connections being served now (handshake included)."""
        return len(self._conns)

    def _refused(self, reason: str) -> None:
        with self._lock:
            self.refused.append(reason)

    def _forget(self, conn: _Inbound) -> None:
        with self._lock:
            self._conns.discard(conn)

    def _accept_loop(self) -> None:
        try:
            while not self._closing:
                try:
                    sock, addr = self._listener.accept()
                except TimeoutError:
                    continue
                except OSError:
                    if self._closing:
                        break
                    time.sleep(self.poll_interval)  # e.g. out of descriptors
                    continue
                try:
                    _tune(sock, self.poll_interval)
                except OSError:
                    sock.close()
                    continue
                conn = _Inbound(self, sock, f"{addr[0]}:{addr[1]}")
                with self._lock:
                    if self._closing:
                        sock.close()
                        break
                    self._conns.add(conn)
                conn.thread.start()
        finally:
            self._listener.close()

    def close(self, timeout: float = 10.0) -> None:
        """Stops accepting, ends every connection (see the class) and joins the
        threads, cutting connections still open after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._closing = True
            conns = list(self._conns)
        self._accept_thread.join(timeout)
        for c in conns:
            c.thread.join(max(0.0, deadline - time.monotonic()))
        for c in conns:
            if c.thread.is_alive():
                c._cut()
                c.thread.join(self.linger + 4 * self.poll_interval)

    def __enter__(self) -> TcpReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TcpReceiver({self.address[0]}:{self.address[1]}, {len(self._conns)} connections)"
