"""The consumer's end of remote channels: one :class:`TcpReceiver` per worker
accepts connections, authenticates each producer and pushes its frames into the
registered input gates' channels."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from spillover.errors import ClosedError, ConfigError
from spillover.runtime.network.buffers import (
    BufferPool,
    NetworkBuffer,
    NetworkTimeoutError,
    Segment,
)
from spillover.runtime.network.errors import ChannelCancelledError, ChannelFailedError
from spillover.runtime.network.events import EventFormatError, deserialize
from spillover.runtime.network.gate import InputChannel, InputGate
from spillover.runtime.network.partition import CreditListener
from spillover.runtime.network.tcp import auth
from spillover.runtime.network.tcp.protocol import (
    _CHALLENGE,
    _END_BYTES,
    _HELLO,
    _MAC_SIZE,
    _MAX_EVENT,
    _MAX_HELLO,
    _MAX_MESSAGE,
    _NO_CHANNEL,
    _U32,
    HEADER,
    MAGIC,
    PROTOCOL_VERSION,
    ErrorCode,
    FrameType,
    OvertakenHandler,
    ProtocolError,
    TransportError,
    _error_payload,
    _frame,
    _parse_error,
    _read_frame,
    _read_header,
    _read_into_ahead,
    _read_payload,
    _read_small_frame,
    _recv_with_lookahead,
    _remote_cause,
    _send_all,
    _send_now,
    _Stopped,
    _tune,
)
from spillover.storage import DataType
from spillover.storage.options import pure_selected


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
        self._nonblocking: socket.socket | None = None  # CREDIT out, event payloads in
        # CREDIT written with the interpreter lock kept (netio.send_now): the releasing
        # task thread does not hand the lock to another for a write that never waits.
        self._native_send = not pure_selected()
        self._announcing = False  # credit may be announced (open, before END)
        self._pending = 0  # credit returned and not announced yet
        self._batch = 1  # credits announced together while the consumer is busy
        self._ended = False
        self._closed = False
        self._heard = time.monotonic()  # when the last frame header came
        self.thread = threading.Thread(
            target=self._run, name=f"spillover-tcp-recv {peer}", daemon=True
        )

    # -- writing (any thread) --

    def _twin(self) -> socket.socket | None:
        """The non-blocking twin of the socket (a duplicate descriptor): CREDIT frames
        are written and event payloads read through it without the timed socket's
        poll. None once closed."""
        with self._send_lock:
            return None if self._closed else self._twin_locked()

    def _twin_locked(self) -> socket.socket:
        if self._nonblocking is None:
            self._nonblocking = socket.socket(fileno=os.dup(self.sock.fileno()))
            self._nonblocking.settimeout(0.0)
        return self._nonblocking

    def _send(self, ftype: FrameType, payload: bytes, timeout: float) -> None:
        with self._send_lock:
            self._send_locked(ftype, payload, timeout)

    def _send_locked(self, ftype: FrameType, payload: bytes, timeout: float) -> None:
        if self._closed:
            return
        views = _frame(ftype, self.channel_id, payload)
        if ftype in (FrameType.CREDIT, FrameType.BUFFER_SIZE):
            # 16 bytes the socket nearly always takes at once: one non-blocking write
            # (on a duplicate descriptor) spares the releasing thread the timed
            # socket's poll; whatever it does not take is written below.
            n = _send_now(self._twin_locked(), views, self._native_send)
            head = len(views[0])
            if n == head + len(views[1]):
                return
            views = [views[0][n:], views[1]] if n < head else [views[1][n - head :]]
        deadline = time.monotonic() + timeout
        _send_all(self.sock, views, lambda: time.monotonic() > deadline)

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

    def announce_buffer_size(self, size: int) -> None:
        """Tells the producer to cut this channel's data buffers at ``size`` bytes
        (buffer debloating, from the consuming thread). Never raises: a failed write
        cuts the connection and the receiving thread fails the channel."""
        if not self._announcing:
            return
        try:
            self._send(FrameType.BUFFER_SIZE, _U32.pack(size), self.receiver.io_timeout)
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
            if self._nonblocking is not None:
                self._nonblocking.close()
            self.sock.close()
        ch = self.channel
        if ch is not None and ch.credit_listener is self:
            ch.credit_listener = None
        if ch is not None and ch.on_buffer_size == self.announce_buffer_size:
            ch.on_buffer_size = None
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

        nonce = auth.new_nonce()
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
        if not auth.verify(rcv._secret, nonce, body, mac):
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
        # Only now: a BUFFER_SIZE frame before the initial CREDIT would break the
        # producer's handshake. The gate's debloater tells it its size next period.
        ch.on_buffer_size = self.announce_buffer_size
        self._heard = time.monotonic()
        return True

    def _idle(self) -> bool:
        """Called when a read waited ``poll_interval`` in vain: announces credit held
        back for batching (so a consumer that holds its buffers never starves),
        then tells whether to stop. A producer silent for longer than the receiver's
        ``silence_timeout`` (no frame, not even a heartbeat) fails the channel."""
        limit = self.receiver.silence_timeout
        if limit is not None and not self._ended and time.monotonic() - self._heard > limit:
            raise TransportError(
                f"{self.where}: nothing heard for {limit:g} s",
                hint="the producer hangs or the network path drops packets (heartbeat.timeout)",
            )
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
        # Natively, a frame's wait, header and small payload take the interpreter
        # lock once, and a data frame's payload with the next header once more;
        # the pure-Python twin (SPILLOVER_PURE=1) reads through the timed socket.
        native = not pure_selected()
        quick = None if native else self._twin()  # closed only by _close, after this loop
        frame = bytearray(HEADER.size + _MAX_MESSAGE + 2)  # a header and any small payload
        hdr = memoryview(frame)[: HEADER.size]
        stop, timeout = self._idle, self.receiver.poll_interval
        ahead = 0  # bytes of the next header read along with a data frame
        try:
            while True:
                inline: bytes | None = None
                if native:
                    whole = _read_frame(sock, frame, self.channel_id, stop, timeout, ahead)
                    head = None if whole is None else whole[:2]
                    inline = None if whole is None else whole[2]
                else:
                    head = _read_header(sock, hdr, self.channel_id, stop, ahead)
                self._heard = time.monotonic()
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
                if ftype == FrameType.HEARTBEAT:
                    if length:
                        raise ProtocolError(f"a HEARTBEAT frame of {length} bytes")
                elif ftype == FrameType.DATA:
                    if length > self.segment_size:
                        raise ProtocolError(
                            f"a data frame of {length} bytes",
                            detail=f"the announced segment size is {self.segment_size}",
                        )
                    seg = self._segment()
                    try:
                        if native:
                            ahead = _read_into_ahead(sock, seg.data[:length], hdr, stop, timeout)
                        else:
                            ahead = _recv_with_lookahead(sock, seg.data[:length], hdr, stop)
                    except BaseException:
                        pool.return_segment(seg)
                        raise
                    buf = pool.wrap_segment(seg, length)
                    try:
                        ch.push_data(buf, time.monotonic())  # never waits: sent with credit
                    except NetworkTimeoutError:
                        buf.release()
                        raise ProtocolError("a data frame beyond the announced credit") from None
                    except BaseException:
                        buf.release()
                        raise
                elif ftype in (FrameType.EVENT, FrameType.PRIORITY_EVENT):
                    payload = _payload(inline, sock, length, _MAX_EVENT, stop, "event", quick)
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
                    payload = _payload(inline, sock, length, _MAX_EVENT, stop, "END", quick)
                    if payload != _END_BYTES:
                        raise ProtocolError("an END frame that is not EndOfPartition")
                    self._announcing = False
                    self._ended = True
                    ch.push_end(NetworkBuffer.unpooled(payload, DataType.EVENT))
                elif ftype == FrameType.ERROR:
                    payload = _payload(inline, sock, length, _MAX_MESSAGE + 2, stop, "ERROR", quick)
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


def _payload(
    inline: bytes | None,
    sock: socket.socket,
    length: int,
    limit: int,
    stop: Callable[[], bool],
    what: str,
    quick: socket.socket | None,
) -> bytes:
    """A frame's payload: the one read with its header if it was, else read now
    (:func:`_read_payload` checks ``limit`` either way)."""
    if inline is None or length > limit:
        return _read_payload(sock, length, limit, stop, what, quick)
    return inline


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
    :class:`ChannelFailedError`), or, with ``silence_timeout``, when nothing came
    on the connection for that long before EndOfPartition (a hung producer or a
    dead path: producers send heartbeats while idle, see ``TcpSubpartition``).
    """

    def __init__(
        self,
        secret: bytes | str,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        poll_interval: float = 0.2,
        handshake_timeout: float = 30.0,
        io_timeout: float = 10.0,
        linger: float = 1.0,
        max_segment_size: int = 64 << 20,
        silence_timeout: float | None = None,
    ) -> None:
        self._secret = auth.job_key(secret)
        self.silence_timeout = silence_timeout
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

    def unregister(self, name: str) -> None:
        """Stops serving the gate registered under ``name`` (no-op if none is): a
        producer that connects to it later is refused; connections already bound to
        it keep feeding that gate alone until it is cancelled or finished (then they
        end), so none of their frames reaches a gate registered after it."""
        with self._lock:
            self._gates.pop(name, None)

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
