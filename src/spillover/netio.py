"""Socket reads that let the interpreter lock go once, and writes that never let it
go (``csrc/sockio.c``).

A Python socket with a timeout polls before every read, letting the lock go and
taking it back, then reads and takes it back again; on a worker whose task threads
are busy each take waits behind them. These calls wait and transfer in one native
call, and read what the socket already holds without letting the lock go at all:
the TCP transport's receiving thread takes a frame (header and small payload)
with at most one take, a data frame's payload with the next header likewise, and
a producer's credit-reading thread its CREDIT frames.
A producer's credit reader runs natively between reads too (:func:`read_credit`):
it grants credit (:class:`Credit`) and wakes the waiting producer (:class:`Wake`)
without taking the lock at all.
``SPILLOVER_PURE=1`` selects the plain-socket twin where a caller offers one
(``runtime/network/tcp/protocol.py``), and :class:`PyWake`, :class:`PyCredit`."""

from __future__ import annotations

import threading
from typing import Final, TypeAlias

from spillover._native import _storage

__all__ = [
    "DONE",
    "EOF",
    "ERROR",
    "FRAME",
    "TIMEOUT",
    "Credit",
    "CreditCell",
    "PyCredit",
    "PyWake",
    "Wake",
    "WakeCell",
    "read_credit",
    "read_frame",
    "read_into",
    "recv",
    "send_now",
]

DONE: Final = _storage.SOCK_DONE
TIMEOUT: Final = _storage.SOCK_TIMEOUT
EOF: Final = _storage.SOCK_EOF
ERROR: Final = _storage.SOCK_ERROR
FRAME: Final = _storage.SOCK_FRAME


read_frame = _storage.sock_read_frame
"""``read_frame(fd, buf, got, header, length_at, whole_type_skip, timeout)``: the
next frame's ``header`` bytes (its type in the first, its payload's length a
little-endian u32 at ``length_at``) into ``buf`` (``got`` bytes are there already)
and, unless its type is ``whole_type_skip`` or it does not fit ``buf``, its
payload after it; each wait at most ``timeout`` s. ``(status, got, errno)``."""

read_into = _storage.sock_read_into
"""``read_into(fd, dst, got, ahead, timeout)``: fills ``dst`` (``got`` bytes are there
already), each read running on into ``ahead``; each wait at most ``timeout`` s.
``(status, got, ahead_got, errno)``."""

recv = _storage.sock_recv
"""``recv(fd, buf, start, timeout)``: what the socket holds, into ``buf[start:]``,
waiting at most ``timeout`` s when nothing is there yet. ``(status, n, errno)``,
``n`` > 0 with ``DONE``."""

read_credit = _storage.sock_read_credit
"""``read_credit(fd, buf, start, end, credit_type, channel, credit, credit_wake,
output_wake, timeout)``: the consumer's CREDIT frames of ``channel`` read and their
credit granted to ``credit`` (a :class:`Credit`), ``credit_wake`` posted and
``output_wake`` (a :class:`Wake` or None) notified as each read brings some, the
lock let go the whole time; returns after ``timeout`` s, or at once when a frame
of another type is next (``FRAME``), at EOF or on an error.
``(status, start, end, errno)``: ``buf[start:end]`` is still to parse."""

send_now = _storage.sock_send_now
"""``send_now(fd, head, body)``: ``head`` then ``body`` in one non-blocking
``sendmsg`` with the lock kept (it never waits; a frame above 256 KiB lets it go
for the copy); the bytes the socket took, 0 when it is full; ``OSError`` on any
other failure."""

Wake = _storage.Wake
Credit = _storage.Credit


class PyWake:
    """:class:`Wake` in Python (``SPILLOVER_PURE=1``)."""

    __slots__ = ("_armed", "_cond", "_set", "_wakes")

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._set = self._armed = False
        self._wakes = 0

    def post(self) -> None:
        with self._cond:
            self._set = True
            self._cond.notify()

    def arm(self) -> None:
        self._armed = True

    def disarm(self) -> None:
        self._armed = False

    def notify_armed(self) -> bool:
        with self._cond:
            if not self._armed:
                return False
            self._armed = False
            self._set = True
            self._wakes += 1
            self._cond.notify()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is not None and not timeout > 0:  # 0, negative or NaN: no wait
            timeout = 0.0
        elif timeout is not None and timeout >= 1e9:  # as the native one: no limit
            timeout = None
        with self._cond:
            if not self._set:
                self._cond.wait(timeout)
            got, self._set = self._set, False
        return got

    @property
    def wakes(self) -> int:
        return self._wakes


class PyCredit:
    """:class:`Credit` in Python (``SPILLOVER_PURE=1``)."""

    __slots__ = ("_granted", "_lock", "_value")

    def __init__(self, initial: int = 0) -> None:
        self._lock = threading.Lock()
        self._value = self._granted = initial

    def add(self, delta: int) -> None:
        with self._lock:
            self._value += delta
            self._granted += delta

    def take(self) -> bool:
        with self._lock:
            if self._value <= 0:
                return False
            self._value -= 1
            return True

    @property
    def value(self) -> int:
        return self._value

    @property
    def granted(self) -> int:
        return self._granted


WakeCell: TypeAlias = "Wake | PyWake"
"""A wake-up, native or its pure twin."""
CreditCell: TypeAlias = "Credit | PyCredit"
"""A credit cell, native or its pure twin."""
