"""Socket reads that let the interpreter lock go once (``csrc/sockio.c``).

A Python socket with a timeout polls before every read, letting the lock go and
taking it back, then reads and takes it back again; on a worker whose task threads
are busy each take waits behind them. These calls wait and transfer in one native
call, and read what the socket already holds without letting the lock go at all:
the TCP transport's receiving thread takes a frame (header and small payload)
with at most one take, a data frame's payload with the next header likewise, and
a producer's credit-reading thread its CREDIT frames.
``SPILLOVER_PURE=1`` selects the plain-socket twin where a caller offers one
(``runtime/network/tcp/protocol.py``)."""

from __future__ import annotations

from typing import Final

from spillover._native import _storage

__all__ = ["DONE", "EOF", "ERROR", "TIMEOUT", "read_frame", "read_into", "recv"]

DONE: Final = _storage.SOCK_DONE
TIMEOUT: Final = _storage.SOCK_TIMEOUT
EOF: Final = _storage.SOCK_EOF
ERROR: Final = _storage.SOCK_ERROR


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
