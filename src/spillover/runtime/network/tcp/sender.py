"""The producer's end of a remote channel: :class:`TcpSubpartition`, attached to a
result partition with :func:`connect_tcp`."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections import deque

from spillover import netio
from spillover.errors import ClosedError, ConfigError
from spillover.runtime.network.buffers import NetworkBuffer, NetworkTimeoutError
from spillover.runtime.network.errors import (
    ChannelCancelledError,
    ChannelFailedError,
    NetworkError,
)
from spillover.runtime.network.partition import ResultPartition, Subpartition
from spillover.runtime.network.tcp import auth
from spillover.runtime.network.tcp.faults import FaultCounter
from spillover.runtime.network.tcp.protocol import (
    _BATCH_BYTES,
    _BATCH_FRAMES,
    _CHALLENGE,
    _DATA,
    _END_BYTES,
    _HELLO,
    _MAX_EVENT,
    _MAX_MESSAGE,
    _MAX_NAME,
    _NO_CHANNEL,
    _U32,
    HEADER,
    MAGIC,
    PROTOCOL_VERSION,
    ErrorCode,
    FrameType,
    HandshakeError,
    ProtocolError,
    TransportError,
    _error_payload,
    _failure,
    _frame,
    _parse_error,
    _read_small_frame,
    _remote_cause,
    _send_all,
    _send_now,
    _Stopped,
    _tune,
)
from spillover.storage.options import pure_selected

_NO_LINGER = struct.pack("ii", 1, 0)


class TcpSubpartition(Subpartition):
    """The producer's end of one remote channel; made by :func:`connect_tcp`.

    Threads: the producer thread calls ``add_*``/``finish`` (``fail``, ``close``
    from any thread); a sender thread writes queued buffers to the socket in
    vectored batches; a reader thread takes the consumer's CREDIT and ERROR frames.
    A data buffer that finds nothing queued and the socket idle is written by the
    producer itself, without waiting (a non-blocking write): the common case of a
    flowing channel costs no hand-off to the sender thread. So is a priority event
    whenever no frame is being written (data may be queued: it follows the event),
    and any other event that finds nothing queued: a checkpoint barrier leaves at
    once instead of waiting for the sender thread to be scheduled, which on a busy
    interpreter took milliseconds. What such a write leaves unwritten (the socket
    was full) goes to the sender thread, ahead of everything queued after it.
    ``add_data`` waits until the consumer has announced credit for one more buffer,
    so the send queue never holds more data than the consumer can take.

    Heartbeats: with ``heartbeat_interval`` set, the sender thread writes a
    HEARTBEAT frame whenever nothing was written for that long (an idle or
    backpressured channel), so that the consumer can tell a hung producer or a
    dead path from a quiet one (``TcpReceiver``'s ``silence_timeout``). ``fault``
    is the test hook of :mod:`~spillover.runtime.network.tcp.faults`: counted per
    data buffer, it resets the connection or stalls it (nothing more is written,
    heartbeats included) when it strikes.

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

    lets_lock_go = True  # the producer writes an event to the socket itself

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
        heartbeat_interval: float | None = None,
        fault: FaultCounter | None = None,
    ) -> None:
        self.where = where
        self.heartbeat_interval = heartbeat_interval
        self._fault = fault
        self._stalled = False  # the fault hook stalled the connection: nothing is written
        self._last_sent = time.monotonic()
        self.channel_id = channel
        self.segment_size = segment_size
        self.poll_interval = poll_interval
        self.linger = linger
        self.end_timeout = end_timeout
        self._sock = sock
        self._lock = threading.Lock()
        # Credit is a lock-free cell the reader grants to (natively, without the
        # interpreter lock: netio.read_credit) and the producer takes from; a producer
        # out of credit in add_data waits on _credit_wake.
        pure = pure_selected()
        self._cell: netio.CreditCell = (
            netio.PyCredit(initial_credit) if pure else netio.Credit(initial_credit)
        )
        self._credit_wake: netio.WakeCell = netio.PyWake() if pure else netio.Wake()
        self._work_cv = threading.Condition(self._lock)  # the sender waits here
        self._queue: deque[NetworkBuffer] = deque()
        # The producer writes in place while nothing is queued and the sender thread
        # does not write (``_sending``); meanwhile ``_writing`` is set. The rest of a
        # frame it could not write waits in ``_partial`` for the sender thread, which
        # writes it before anything else; ``_mid_frame`` says the stream is cut
        # inside a frame until then (no ERROR frame may follow).
        self._writing = False
        self._sending = False
        self._mid_frame = False
        self._write_waiters = 0  # threads waiting for the producer's write to end
        self._partial: tuple[list[memoryview], NetworkBuffer, FrameType] | None = None
        self._nonblocking = socket.socket(fileno=os.dup(sock.fileno()))
        self._nonblocking.settimeout(0.0)
        # The producer's in-place write keeps the interpreter lock (netio.send_now):
        # on a busy worker, letting it go around a write that never waits hands it
        # to another task thread, and the producer waits to take it back.
        self._native_send = not pure
        self._prio: deque[NetworkBuffer] = deque()
        self._end: NetworkBuffer | None = None
        self._queued_buffers = 0
        self._queued_bytes = 0
        self._finished = False
        self._cause: BaseException | None = None
        self._tell_peer = False
        self._end_written_at: float | None = None
        self._stopping = False
        self._running = 2
        self._done = threading.Event()
        self.sent_buffers = 0
        self.sent_bytes = 0
        self.written_in_place = 0  # data buffers and events the producer wrote whole itself
        self.handed_over = 0  # frames the producer began and the sender finished
        self.heartbeats_sent = 0
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
        if self._fault is not None:
            self._strike(self._fault.sent())
        if self._cause is not None or self._finished:  # no credit taken from a closed one
            with self._lock:
                self._check_open_locked()
        waited = 0.0 if self._cell.take() else self._wait_for_credit(deadline)
        with self._lock:
            self._check_open_locked()
            direct = not (
                self._stalled or self._sending or self._queue or self._prio or self._partial
            )
            if direct:
                self._writing = True
            else:
                self._queue.append(buffer)
                self._queued_buffers += 1
                self._queued_bytes += len(buffer)
                self._work_cv.notify()
        if direct:
            self._write_now(buffer)
        return waited

    def _wait_for_credit(self, deadline: float | None) -> float:
        """Waits until one buffer's credit is taken; returns the seconds waited."""
        start = time.monotonic()
        try:
            while True:
                with self._lock:
                    self._check_open_locked()
                if self._cell.take():
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise NetworkTimeoutError(
                        f"{self.where}: no credit before the deadline",
                        hint="the consumer is slow, blocked or not polling",
                    )
                # A grant, a failure and close post the wake; the poll is a safety net.
                wait = (
                    self.poll_interval if remaining is None else min(remaining, self.poll_interval)
                )
                self._credit_wake.wait(wait)
        finally:
            waited = time.monotonic() - start
        return waited

    def _write_now(self, buffer: NetworkBuffer, ftype: FrameType = FrameType.DATA) -> None:
        """On the producer thread, ``_writing`` set: writes what the socket takes now
        and leaves the rest of the frame to the sender thread."""
        views = [memoryview(HEADER.pack(ftype, 0, 0, self.channel_id, len(buffer)))]
        views.append(buffer.data)
        size = len(views[0]) + len(views[1])
        try:
            n = _send_now(self._nonblocking, views, self._native_send)
        except OSError as e:
            with self._lock:
                self._writing = False
                self._work_cv.notify_all()
            buffer.release()
            self._fail(
                TransportError(f"{self.where}: sending failed", detail=f"{type(e).__name__}: {e}"),
                tell_peer=False,  # maybe in the middle of a frame: no ERROR frame
            )
            return
        with self._lock:
            self._writing = False
            self._last_sent = time.monotonic()
            if n == size:
                if ftype == FrameType.DATA:
                    self.sent_buffers += 1
                    self.sent_bytes += len(buffer)
                self.written_in_place += 1
                done = True
            else:
                head = len(views[0])
                views = [views[0][n:], views[1]] if n < head else [views[1][n - head :]]
                self._partial = (views, buffer, ftype)
                self._mid_frame = n > 0
                self.handed_over += 1
                done = False
            # Wake the sender only for work it can now do (what is queued, the rest
            # of this frame) or a thread that waits for this write to end: a direct
            # write is made while the sender idles, and a wake for nothing is a
            # hand-off of the interpreter lock per buffer.
            if not done or self._queue or self._prio or self._write_waiters:
                self._work_cv.notify_all()
        if done:
            buffer.release()

    def add_event(self, buffer: NetworkBuffer, priority: bool) -> list[NetworkBuffer]:
        if len(buffer) > _MAX_EVENT:
            raise ConfigError(f"{self.where}: an event of {len(buffer)} bytes is too large")
        with self._lock:
            self._check_open_locked()
            idle = not (
                self._stalled or self._sending or self._writing or self._partial or self._prio
            )
            if idle and (priority or not self._queue):
                self._writing = True  # written below, ahead of what is queued
                overtaken = [b.retain() for b in self._queue if b.data_type == _DATA]
            else:
                self._work_cv.notify()
                if not priority:
                    self._queue.append(buffer)
                    return []
                self._prio.append(buffer)
                return [b.retain() for b in self._queue if b.data_type == _DATA]
        self._write_now(buffer, FrameType.PRIORITY_EVENT if priority else FrameType.EVENT)
        return overtaken if priority else []

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
        return self._cell.value

    @property
    def credit_granted(self) -> int:
        """All credit the consumer granted, the initial included."""
        return self._cell.granted

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
            self._credit_wake.post()
            self._shutdown()
            self._done.wait(self.linger + 4 * self.poll_interval)
        return self._end_written_at is not None and self._cause is None

    # -- failure --

    def _strike(self, action: str | None) -> None:
        """The fault hook's action, if it struck on this frame."""
        if action == "reset":
            # Linger 0: closing the socket resets the connection instead of ending it.
            with contextlib.suppress(OSError):
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _NO_LINGER)
            self._fail(TransportError(f"{self.where}: connection reset (network fault)"), False)
        elif action == "stall":
            with self._lock:
                self._stalled = True

    def _fail(self, cause: BaseException, tell_peer: bool) -> None:
        with self._lock:
            if self._cause is not None or self._end_written_at is not None:
                return
            self._cause = cause
            self._tell_peer = tell_peer
            dropped = [*self._prio, *self._queue]
            if self._partial is not None:
                dropped.append(self._partial[1])
                self._partial = None
            self._prio.clear()
            self._queue.clear()
            self._queued_buffers = self._queued_bytes = 0
            self._work_cv.notify_all()
        self._credit_wake.post()
        for b in dropped:
            b.release()
        if not tell_peer:
            self._shutdown()

    def _shutdown(self, how: int = socket.SHUT_RDWR) -> None:
        """Wakes both threads; never closes the descriptor (the last thread does)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(how)

    def _wait_for_write_locked(self) -> None:
        """Waits (lock held) for the producer's write in place to end."""
        self._write_waiters += 1
        try:
            self._work_cv.wait(self.poll_interval)
        finally:
            self._write_waiters -= 1

    def _exit(self) -> None:
        with self._lock:
            self._running -= 1
            last = self._running == 0
            while last and self._writing:  # a non-blocking write: never long
                self._wait_for_write_locked()
            partial, self._partial = (self._partial, None) if last else (None, self._partial)
        if partial is not None:
            partial[1].release()
        if last:
            self._nonblocking.close()
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

    def _has_work_locked(self) -> bool:
        return not self._stalled and (
            self._partial is not None or (not self._writing and bool(self._prio or self._queue))
        )

    def _beat_due_locked(self) -> bool:
        hb = self.heartbeat_interval
        return (
            hb is not None
            and not self._stalled
            and not self._writing
            and time.monotonic() - self._last_sent >= hb
        )

    def _beat_wait_locked(self) -> float | None:
        """How long the idle sender waits: until a heartbeat is due, counted from the
        last write (``_last_sent``, which writes in place set too: they do not wake
        the sender, so a fixed wait begun before one would let the beat slip to
        almost two intervals after it); a whole interval when the beat is overdue
        but held back (stalled, or a write in place under way), never a spin."""
        hb = self.heartbeat_interval
        if hb is None:
            return None
        left = self._last_sent + hb - time.monotonic()
        return left if left > 0 else hb

    def _send_loop(self) -> None:
        at_boundary = True
        try:
            while True:
                with self._lock:
                    beat = False
                    while not (self._has_work_locked() or self._abort_send()):
                        if self._beat_due_locked():
                            beat = True
                            break
                        self._work_cv.wait(self._beat_wait_locked())
                    if self._cause is not None or self._stopping:
                        break
                    partial, self._partial = (None, None) if beat else (self._partial, None)
                    batch: list[tuple[FrameType, NetworkBuffer]] = []
                    if not beat and partial is None:
                        batch = self._take_batch_locked()
                    self._sending = True
                views: list[memoryview] = []
                if beat:
                    views = _frame(FrameType.HEARTBEAT, self.channel_id, b"")
                elif partial is not None:  # the rest of the producer's frame, first
                    views, last, ftype = partial
                    batch = [(ftype, last)]
                else:
                    for ftype, buf in batch:
                        head = HEADER.pack(ftype, 0, 0, self.channel_id, len(buf))
                        views.append(memoryview(head))
                        views.append(buf.data)
                at_boundary = False
                data = [len(b) for t, b in batch if t == FrameType.DATA]
                sent = False
                try:
                    _send_all(self._sock, views, self._abort_send)
                    sent = True
                finally:
                    for _, buf in batch:
                        buf.release()
                    with self._lock:
                        self._sending = False
                        # In the same step as _sending: once it is clear the producer
                        # may write a frame in place and mark the stream cut itself.
                        if sent:
                            self._last_sent = time.monotonic()
                            self.heartbeats_sent += int(beat)
                            self._mid_frame = False
                            self.sent_buffers += len(data)
                            self.sent_bytes += sum(data)
                        self._work_cv.notify_all()
                at_boundary = True
                if batch and batch[-1][0] == FrameType.END:
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
        with self._lock:
            while self._writing:  # the producer's non-blocking write: never long
                self._wait_for_write_locked()
            at_boundary = at_boundary and not self._mid_frame
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
        # Frames are read as they come, several per recv when several wait: the
        # consumer's CREDIT frames are small and frequent, and their credit is
        # added up and given to the producer once per read.
        buf = bytearray(2 * (HEADER.size + _MAX_MESSAGE + 2))  # a whole frame always fits
        view = memoryview(buf)
        start = end = 0
        sock, stop = self._sock, self._stop_reading
        # Natively a read of what is there keeps the interpreter lock and a wait lets
        # it go once; the pure-Python twin reads through the timed socket (a poll,
        # then the read: two takes of the lock per wake).
        fd = -1 if pure_selected() else sock.fileno()
        try:
            while True:
                # Natively, while the credit's producer waits on a signal the native
                # reader can post (a source's mailbox) and the next frame is CREDIT,
                # the reader grants credit without the lock at all until another kind
                # of frame comes (then parsed below), or a poll interval passed.
                if fd >= 0:
                    native = self._native_cells(buf, start, end)
                    if native is not None:
                        status, start, end, err = netio.read_credit(
                            fd, buf, start, end, FrameType.CREDIT, self.channel_id, *native,
                            self.poll_interval,
                        )  # fmt: skip
                        n = 0 if status == netio.EOF else -1  # -1: a frame to parse is in
                    else:
                        status, n, err = netio.recv(fd, buf, end, self.poll_interval)
                    if status == netio.TIMEOUT:
                        if stop():
                            raise _Stopped
                        continue
                    if status == netio.ERROR:
                        raise OSError(err, os.strerror(err))
                else:
                    try:
                        n = sock.recv_into(view[end:])
                    except TimeoutError:
                        if stop():
                            raise _Stopped from None
                        continue
                if n == 0:
                    if start != end:
                        raise TransportError(f"{self.where}: the connection closed inside a frame")
                    if self._end_written_at is None:
                        self._fail(
                            TransportError(f"{self.where}: the consumer closed the connection"),
                            tell_peer=False,
                        )
                    return
                end += max(n, 0)
                delta = 0
                while end - start >= HEADER.size:
                    ftype, length = self._consumer_frame(*HEADER.unpack_from(buf, start))
                    if end - start < HEADER.size + length:
                        break  # the rest of it comes with the next read
                    at = start + HEADER.size
                    start = at + length
                    if ftype == FrameType.CREDIT:
                        delta += _U32.unpack_from(buf, at)[0]
                        continue
                    if ftype == FrameType.BUFFER_SIZE:
                        self._resize(_U32.unpack_from(buf, at)[0])
                        continue
                    payload = bytes(buf[at:start])
                    if len(payload) < 2:
                        raise ProtocolError("an ERROR frame without a code")
                    self._grant(delta)
                    code, message = _parse_error(payload)
                    self._fail(_remote_cause(code, message, "the consumer"), tell_peer=False)
                    return
                self._grant(delta)
                if start:  # the start of a frame moves to the front: it fits whole
                    buf[: end - start] = buf[start:end]
                    start, end = 0, end - start
        except _Stopped:
            pass
        except ProtocolError as e:
            self._fail(e, tell_peer=True)
        except TransportError as e:
            self._fail(e, tell_peer=False)
        except OSError as e:
            self._fail(
                TransportError(
                    f"{self.where}: connection broken", detail=f"{type(e).__name__}: {e}"
                ),
                tell_peer=False,
            )
        finally:
            self._exit()

    def _native_cells(
        self, buf: bytearray, start: int, end: int
    ) -> tuple[netio.Credit, netio.Wake, netio.Wake] | None:
        """The credit, its wake and the task's signal for the native credit read (see
        ``_read_loop``), or None to read in Python: a producer whose waker has no
        native signal (a task with inputs waits on its gate), or the start of a frame
        of another type in the buffer."""
        if start != end and buf[start] != FrameType.CREDIT:
            return None
        part = self.partition
        signal = part.waker.signal if part is not None and part.waker is not None else None
        cell, wake = self._cell, self._credit_wake
        if (
            isinstance(signal, netio.Wake)
            and isinstance(cell, netio.Credit)
            and isinstance(wake, netio.Wake)
        ):
            return cell, wake, signal
        return None

    def _consumer_frame(
        self, ftype: int, flags: int, reserved: int, chan: int, length: int
    ) -> tuple[int, int]:
        """``(type, length)`` of a frame header from the consumer, checked."""
        if flags or reserved:
            raise ProtocolError(f"frame header with flags {flags} and reserved {reserved}")
        if chan != self.channel_id:
            raise ProtocolError(f"frame for channel {chan} on the connection of {self.channel_id}")
        if ftype in (FrameType.CREDIT, FrameType.BUFFER_SIZE):
            if length != _U32.size:
                raise ProtocolError(f"a {FrameType(ftype).name} frame of {length} bytes")
        elif ftype == FrameType.ERROR:
            if length > _MAX_MESSAGE + 2:
                raise ProtocolError(
                    f"ERROR frame of {length} bytes", detail=f"at most {_MAX_MESSAGE + 2}"
                )
        else:
            raise ProtocolError(f"unexpected frame type {ftype} from the consumer")
        return ftype, length

    def _resize(self, size: int) -> None:
        """The consumer's debloated buffer size for this subpartition."""
        if not 0 < size <= self.segment_size:
            raise ProtocolError(
                f"a BUFFER_SIZE of {size} bytes", detail=f"the segment size is {self.segment_size}"
            )
        self.announced_size = size  # applied by ``connect`` if it comes first
        part = self.partition
        if part is not None:
            part.announce_buffer_size(self.index, size)

    def _grant(self, delta: int) -> None:
        """The consumer's credit: the producer may send ``delta`` more buffers."""
        if not delta:
            return
        self._cell.add(delta)
        self._credit_wake.post()
        if self.partition is not None:
            self.partition.credit_returned()

    def __repr__(self) -> str:
        state = "failed" if self._cause else "finished" if self._finished else "open"
        return f"TcpSubpartition({self.where}, {state}, credit {self._cell.value})"


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
    heartbeat_interval: float | None = None,
    fault: FaultCounter | None = None,
) -> TcpSubpartition:
    """Links ``partition``'s subpartition to channel ``channel`` of the input gate
    named ``gate`` at a :class:`TcpReceiver`'s ``address``, like
    :func:`~spillover.runtime.network.local.connect` does in memory.

    Connects, answers the receiver's challenge with an HMAC of ``secret`` and
    waits (at most ``timeout`` seconds) for the initial credit, which is the
    acceptance. Raises :class:`HandshakeError` when refused or unanswered.
    ``heartbeat_interval`` and ``fault``: see :class:`TcpSubpartition`.
    """
    key = auth.job_key(secret)
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
        mac = auth.sign(key, nonce, body)
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
        heartbeat_interval=heartbeat_interval,
        fault=fault,
    )
    sub._start()
    try:
        partition.connect(subpartition, sub)
    except BaseException:
        sub.close(0)
        raise
    return sub
