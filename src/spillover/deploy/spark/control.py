"""The control connection between the job master (driver) and its workers.

One TCP connection per worker, opened by the worker. The master's endpoint binds
to the driver's address and admits only peers that prove they hold the job's
secret: it sends a 32-byte nonce and expects ``HMAC-SHA256(secret, nonce +
b"spillover-control/1")`` back within the handshake timeout, then answers
``OK``. After that both sides exchange messages: a 4-byte little-endian length,
then one pickled message (``messages.py``; docs/spark.md lists them). Pickles
are read only from authenticated peers.

Either side closing the connection ends the worker: the master treats it as a
lost worker, the worker cancels its subtasks and exits. A running worker sends
its metrics every half second; the master counts a worker silent for
``heartbeat.timeout`` as lost (:meth:`ControlConnection.watch`). The network-fault
hook (``runtime/network/tcp/faults.py``) resets or stalls a worker's connection.
"""

from __future__ import annotations

import contextlib
import pickle
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from spillover.errors import ConfigError
from spillover.runtime.network.tcp import auth
from spillover.runtime.network.tcp.faults import FaultCounter

__all__ = ["ControlConnection", "ControlError", "ControlServer", "ControlSilence", "connect"]

_TAG = b"spillover-control/1"
_LEN = struct.Struct("<I")
_MAX_MESSAGE = 1 << 30
_OK = b"OK"
_SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)  # a dead peer: EPIPE, never SIGPIPE
# One read takes this much if it is there: a small message (a trigger, an
# acknowledgement) arrives with its length in one read.
_READ_AHEAD = 1 << 16


class ControlError(ConnectionError):
    """The control connection failed, was refused or closed."""


class ControlSilence(ControlError):
    """Nothing came for the connection's watch timeout, between two messages: the
    connection is intact and may be read again, if the silence is expected."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes of a handshake (a timeout breaks the connection)."""
    parts: list[bytes] = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ControlError("the peer closed the control connection")
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


class ControlConnection:
    """Framed pickled messages over an authenticated socket; ``send`` from any thread,
    ``recv`` from one.

    ``recv`` reads ahead into a buffer: a message and its length prefix usually
    come in one read, so the reading thread lets the interpreter lock go once per
    message, not twice (each time taking it back behind the busy task threads).
    """

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self._send_lock = threading.Lock()
        self.closed = False
        self._gone = threading.Event()  # closed
        self.fault: FaultCounter | None = None  # the network-fault hook, counting sends
        self._stalled = False
        self._buf = bytearray()  # read, not yet taken (the reading thread's)
        self._watch: float | None = None

    def watch(self, timeout: float | None) -> None:
        """From now on :meth:`recv` raises :class:`ControlSilence` when no message came
        for ``timeout`` seconds (None: it waits as long as it takes), and a send that
        cannot go on for as long fails.

        The socket stays blocking and the kernel keeps the time (``SO_RCVTIMEO``,
        ``SO_SNDTIMEO``): a Python socket timeout polls before every read, so each
        message would let the interpreter lock go twice and take it back twice."""
        self._watch = timeout
        seconds = timeout or 0.0  # 0: no limit
        whole = int(seconds)
        micros = round((seconds - whole) * 1e6) or int(0 < seconds < 1e-6)
        tv = struct.pack("ll", whole, micros)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)

    def _strike(self) -> None:
        """The network-fault hook: a reset cuts the connection now; a stall leaves it
        open and silent, both ways, until it is closed."""
        assert self.fault is not None
        action = self.fault.sent()
        if action == "reset":
            with contextlib.suppress(OSError):
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close()
        elif action == "stall":
            self._stalled = True
        if self._stalled:
            self._gone.wait()
        if action is not None or self._stalled:
            raise ControlError(f"control connection to {self.peer}: {action} (network fault)")

    def send(self, message: Any) -> None:
        if self.fault is not None:
            self._strike()
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            if self.closed:
                raise ControlError(f"control connection to {self.peer} is closed")
            try:
                self.sock.sendall(_LEN.pack(len(data)) + data, _SEND_FLAGS)
            except (BlockingIOError, TimeoutError) as e:  # SO_SNDTIMEO: EAGAIN
                raise ControlError(
                    f"control connection to {self.peer}: a send made no progress for "
                    f"{self._watch or 0:g} s (heartbeat.timeout): the peer does not read"
                ) from e
            except OSError as e:
                raise ControlError(f"control connection to {self.peer}: {e}") from e

    def _take(self, n: int, first: bool = False) -> bytes:
        """``n`` bytes, read ahead where more came; with ``first``, a timeout before
        any byte came is a :class:`ControlSilence` (inside a message it breaks)."""
        buf = self._buf
        while len(buf) < n:
            try:
                chunk = self.sock.recv(max(min(n - len(buf), 1 << 20), _READ_AHEAD))
            except (TimeoutError, BlockingIOError):  # SO_RCVTIMEO: EAGAIN
                if first and not buf:
                    raise ControlSilence(f"nothing heard for {self._watch or 0:g} s") from None
                raise TimeoutError(
                    f"a control message cut off for {self._watch or 0:g} s"
                ) from None
            if not chunk:
                raise ControlError("the peer closed the control connection")
            buf += chunk
        data = bytes(buf[:n])
        del buf[:n]
        return data

    def recv(self) -> Any:
        """The next message; raises :class:`ControlError` once the peer closed, or on a
        message that does not unpickle to a tuple."""
        try:
            (n,) = _LEN.unpack(self._take(_LEN.size, first=True))
            if n > _MAX_MESSAGE:
                raise ControlError(f"a control message of {n} bytes from {self.peer}")
            data = self._take(n)
            if self._stalled:  # what comes is never read
                self._gone.wait()
                raise ControlError(f"control connection to {self.peer}: stalled (network fault)")
        except ControlSilence as e:
            raise ControlSilence(
                f"nothing heard from {self.peer} for {self._watch or 0:g} s "
                "(heartbeat.timeout): the peer hangs or the network path drops packets"
            ) from e
        except OSError as e:
            raise ControlError(f"control connection to {self.peer}: {e}") from e
        try:
            message = pickle.loads(data)
        except Exception as e:  # UnpicklingError, but also whatever a class's reduce raises
            raise ControlError(
                f"an unreadable control message from {self.peer}: {type(e).__name__}: {e}"
            ) from e
        return message  # the protocol's side checks it is one of its messages

    def close(self) -> None:
        self._gone.set()
        with self._send_lock:
            self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def connect(address: tuple[str, int], secret: bytes, timeout: float = 30.0) -> ControlConnection:
    """A worker's connection to the master's endpoint, authenticated."""
    host, port = address
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        raise ControlError(f"cannot reach the job master at {host}:{port}: {e}") from e
    try:
        nonce = _recv_exact(sock, auth.NONCE_BYTES)
        sock.sendall(auth.sign(secret, nonce, _TAG), _SEND_FLAGS)
        if _recv_exact(sock, len(_OK)) != _OK:
            raise ControlError(f"the job master at {host}:{port} refused this worker")
    except (OSError, ControlError) as e:
        sock.close()
        raise ControlError(f"handshake with the job master at {host}:{port} failed: {e}") from e
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return ControlConnection(sock, f"{host}:{port}")


class ControlServer:
    """The master's endpoint: accepts workers that hold ``secret`` and hands each
    authenticated connection to ``on_connect`` (on a thread of its own)."""

    def __init__(
        self,
        secret: bytes,
        on_connect: Callable[[ControlConnection], None],
        host: str = "127.0.0.1",
        port: int = 0,
        handshake_timeout: float = 30.0,
    ) -> None:
        self._secret = auth.job_key(secret)
        self._on_connect = on_connect
        self.handshake_timeout = handshake_timeout
        self.refused: list[str] = []
        self._closing = False
        try:
            self._listener = socket.create_server((host, port), backlog=256)
        except OSError as e:
            raise ConfigError(
                f"cannot bind the job master's control endpoint to {host}:{port}",
                detail=str(e),
                hint="set spark.driver.host (or --driver-host) to an address of this machine",
            ) from e
        self._listener.settimeout(0.2)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._thread = threading.Thread(
            target=self._accept_loop, name=f"spillover-control {self.address}", daemon=True
        )
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                sock, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._closing:
                    return
                time.sleep(0.05)  # e.g. out of descriptors: connects wait in the backlog
                continue
            threading.Thread(
                target=self._admit, args=(sock, f"{addr[0]}:{addr[1]}"), daemon=True
            ).start()

    def _admit(self, sock: socket.socket, peer: str) -> None:
        try:
            sock.settimeout(self.handshake_timeout)
            nonce = auth.new_nonce()
            sock.sendall(nonce, _SEND_FLAGS)
            answer = _recv_exact(sock, auth.MAC_BYTES)
            if not auth.verify(self._secret, nonce, _TAG, answer):
                self.refused.append(f"{peer}: wrong secret")
                sock.close()
                return
            sock.sendall(_OK, _SEND_FLAGS)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, ControlError) as e:
            self.refused.append(f"{peer}: {e}")
            sock.close()
            return
        self._on_connect(ControlConnection(sock, peer))

    def close(self) -> None:
        self._closing = True
        # Wakes an accept() at once (Linux): closing alone waits for its timeout.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(timeout=5)
