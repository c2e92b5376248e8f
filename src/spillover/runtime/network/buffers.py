"""Network buffers and the pools that budget them.

A :class:`NetworkBuffer` is one buffer in flight: a read-only, reference-counted
window over bytes produced elsewhere (a pool segment, a ``KeyGroupDemux`` output,
a serialized event). It never copies. When its last reference is released it runs
its recycler, which for pooled buffers gives a permit back to the
:class:`BufferPool` of the producer that created it: that is how a slow consumer
ends up stalling its producers.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Self

import numpy as np
import numpy.typing as npt

from spillover import netio
from spillover.errors import ClosedError, ConfigError, SpilloverError
from spillover.storage import DataType, OnRelease, Storer

__all__ = [
    "BufferPool",
    "BufferReleasedError",
    "NetworkBuffer",
    "NetworkTimeoutError",
    "OutputWaker",
    "PoolClosedError",
    "Recycler",
    "Segment",
    "SignalWaker",
    "append_zero_copy",
]

Segment = npt.NDArray[np.uint8]
Recycler = Callable[["NetworkBuffer"], None]


class NetworkTimeoutError(SpilloverError, TimeoutError):
    """A wait for a pool permit or for a consumer's credit ran out of time."""


class BufferReleasedError(SpilloverError, RuntimeError):
    """A buffer was retained or released after its last reference was released."""


class PoolClosedError(ClosedError):
    """A buffer pool was asked for a permit after ``close()``."""


def _as_bytes_array(data: Any) -> Segment:
    """A 1-D ``uint8`` view of any contiguous buffer, without copying."""
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise BufferError("a network buffer needs contiguous memory")
        return data.reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


class NetworkBuffer(np.ndarray[tuple[int], np.dtype[np.uint8]]):
    """One buffer in flight: a read-only 1-D ``uint8`` array with a reference count.

    It exports the buffer protocol (``Storer.append(channel, buf, buf.data_type)``,
    ``RecordReader.feed(buf)`` and ``bytes(buf)`` read its memory in place) and
    ``len(buf)`` is its size in bytes. ``data`` is a read-only memoryview of exactly
    the valid bytes.

    Ownership: whoever holds a reference calls :meth:`release` exactly once when
    done; :meth:`retain` adds a reference for another holder (another queue, a
    checkpoint writer). The memory stays valid only while a reference is held: a
    pooled segment is reused once the count drops to zero, so views taken from a
    buffer (slices, record batches) must not outlive the holder's reference.
    Slices and arithmetic give plain arrays that hold no reference. Buffers compare
    and hash by identity; compare contents with ``bytes(a) == bytes(b)``.
    """

    __slots__ = ("_lock", "_recycler", "_refs", "data_type")

    _lock: threading.Lock | None
    _recycler: Recycler | None
    _refs: int
    data_type: DataType

    @classmethod
    def _make(cls, array: Segment, data_type: DataType, recycler: Recycler | None) -> NetworkBuffer:
        buf = np.ndarray.view(array, cls)
        buf.flags.writeable = False
        buf.data_type = data_type if data_type.__class__ is DataType else DataType(data_type)
        buf._refs = 1
        buf._lock = threading.Lock()
        buf._recycler = recycler
        return buf

    @classmethod
    def unpooled(cls, data: Any, data_type: DataType = DataType.DATA) -> NetworkBuffer:
        """A buffer over ``data`` (any contiguous buffer) that holds no pool permit.

        Events travel in such buffers, so that they never wait for memory.
        """
        return cls._make(_as_bytes_array(data), data_type, None)

    def derive(self, recycler: Recycler) -> NetworkBuffer:
        """A new buffer over the same memory with its own count and ``recycler``.

        It does not retain ``self``: the recycler usually releases a reference the
        caller took for it. Channels hand such handles to consumers so that each
        consumer's release returns that consumer's credit.
        """
        return NetworkBuffer._make(self, self.data_type, recycler)

    def __array_finalize__(self, obj: Any) -> None:
        # Views made by numpy itself (copies, reshapes) hold no reference.
        self._lock = None
        self._recycler = None
        self._refs = 0
        self.data_type = DataType.DATA

    @property
    def is_event(self) -> bool:
        return self.data_type == DataType.EVENT

    @property
    def refs(self) -> int:
        """The current reference count (0 once recycled)."""
        return self._refs

    def retain(self) -> Self:
        """Adds one reference and returns ``self``."""
        lock = self._lock
        if lock is None:
            raise BufferReleasedError("retain() on a buffer that holds no reference")
        with lock:
            if self._refs <= 0:
                raise BufferReleasedError("retain() after the last release", detail=repr(self))
            self._refs += 1
        return self

    def release(self) -> None:
        """Drops one reference; the last one runs the recycler (once)."""
        lock = self._lock
        if lock is None:
            raise BufferReleasedError("release() on a buffer that holds no reference")
        with lock:
            if self._refs <= 0:
                raise BufferReleasedError("buffer released twice", detail=repr(self))
            self._refs -= 1
            if self._refs:
                return
            recycler, self._recycler = self._recycler, None
        if recycler is not None:
            recycler(self)

    def __getitem__(self, key: Any) -> Any:
        return np.ndarray.view(self, np.ndarray)[key]

    def __array_wrap__(self, array: Any, context: Any = None, return_scalar: bool = False) -> Any:
        out = np.ndarray.view(array, np.ndarray)
        return out[()] if return_scalar else out

    def __eq__(self, other: object) -> bool:
        return self is other

    def __ne__(self, other: object) -> bool:
        return self is not other

    def __hash__(self) -> int:  # type: ignore[override]
        return id(self)

    def __bool__(self) -> bool:
        return True

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("a NetworkBuffer cannot be pickled; send bytes(buf) instead")

    def __repr__(self) -> str:
        return f"NetworkBuffer({self.data_type.name}, {len(self)} bytes, refs={self._refs})"

    __str__ = __repr__

    if TYPE_CHECKING:
        # ndarray exports its buffer natively; this only tells type checkers so.
        def __buffer__(self, flags: int, /) -> memoryview: ...


class OutputWaker:
    """Wakes a producer that waits for its output to move (a consumer's credit or a
    pool permit came back), instead of polling: at most once per :meth:`arm`.

    The producer arms it *before* it checks for credit and waits only if the check
    fails; credit returned after the arming wakes it, so no wake is lost between the
    check and the wait. Called from any thread, no lock held. ``signal`` is None
    here; see :class:`SignalWaker`.
    """

    __slots__ = ("_armed", "_wake", "_wakes")

    def __init__(self, wake: Callable[[], None]) -> None:
        self._armed = False
        self._wake = wake
        self._wakes = 0

    @property
    def signal(self) -> netio.WakeCell | None:
        return None

    @property
    def wakes(self) -> int:
        """Wakes given."""
        return self._wakes

    def arm(self) -> None:
        self._armed = True

    def disarm(self) -> None:
        self._armed = False

    def __call__(self) -> None:
        if self._armed:
            self._armed = False
            self._wakes += 1
            self._wake()


class SignalWaker(OutputWaker):
    """An :class:`OutputWaker` whose flag and wake are a :class:`~spillover.netio.Wake`
    (``signal``) that the producer waits on: a TCP channel's credit reader notifies
    it natively, without taking the interpreter lock (``netio.read_credit``)."""

    __slots__ = ("_cell",)

    def __init__(self, signal: netio.WakeCell) -> None:
        super().__init__(signal.post)
        self._cell = signal

    @property
    def signal(self) -> netio.WakeCell:
        return self._cell

    @property
    def wakes(self) -> int:
        return self._cell.wakes

    def arm(self) -> None:
        self._cell.arm()

    def disarm(self) -> None:
        self._cell.disarm()

    def __call__(self) -> None:
        self._cell.notify_armed()


class BufferPool:
    """A budget of ``num_segments`` buffers of ``segment_size`` bytes for one producer.

    Each :class:`NetworkBuffer` made by :meth:`wrap` holds one permit until its last
    release. When all permits are out, :meth:`request_segment` and :meth:`wrap` block:
    this is where a backpressured producer stalls. Segments are allocated on first
    use and reused. Thread-safe; buffers may be released from any thread.
    """

    def __init__(self, segment_size: int, num_segments: int, name: str = "pool") -> None:
        if segment_size < 1 or num_segments < 1:
            raise ConfigError(
                f"buffer pool {name!r} needs a positive segment size and count",
                detail=f"segment_size={segment_size}, num_segments={num_segments}",
            )
        self.segment_size = segment_size
        self.num_segments = num_segments
        self.name = name
        self._cond = threading.Condition(threading.Lock())
        self._permits = num_segments
        self._waiters = 0  # threads waiting in _acquire
        self._free: list[Segment] = []
        self._allocated = 0
        # Segments handed out by request_segment and not yet wrapped or returned.
        self._outstanding: dict[int, Segment] = {}
        self._ours: dict[int, Segment] = {}  # every segment ever allocated, by id
        self._closed = False
        self.waited_seconds = 0.0
        self.waker: OutputWaker | None = None  # told when a permit comes back

    @property
    def available(self) -> int:
        """Permits free now."""
        return self._permits

    @property
    def in_use(self) -> int:
        """Permits held by requested segments and live buffers."""
        return self.num_segments - self._permits

    @property
    def segments_allocated(self) -> int:
        """Segments allocated so far (at most ``num_segments``; they are reused)."""
        return self._allocated

    @property
    def closed(self) -> bool:
        return self._closed

    def _acquire(self, timeout: float | None) -> None:
        # Called with the lock held.
        if self._closed:
            raise PoolClosedError(f"buffer pool {self.name!r} is closed")
        if self._permits > 0:
            self._permits -= 1
            return
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        try:
            while self._permits == 0:
                if self._closed:
                    raise PoolClosedError(f"buffer pool {self.name!r} was closed while waiting")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise NetworkTimeoutError(
                        f"buffer pool {self.name!r}: no segment free after {timeout} s",
                        detail=f"all {self.num_segments} segments in use",
                        hint="consumers are slow or a buffer is never released",
                    )
                self._waiters += 1
                try:
                    self._cond.wait(remaining)
                finally:
                    self._waiters -= 1
            self._permits -= 1
        finally:
            self.waited_seconds += time.monotonic() - start

    def request_segment(self, timeout: float | None = None) -> Segment:
        """A writable ``uint8`` array of ``segment_size`` bytes, holding one permit.

        Blocks while every permit is in use, at most ``timeout`` seconds (None:
        until one comes back). Hand the filled segment (or a prefix slice of it) to
        :meth:`wrap`, which moves the permit into the buffer, or give it back with
        :meth:`return_segment`. Do not write to it after wrapping.
        """
        with self._cond:
            self._acquire(timeout)
            if self._free:
                seg = self._free.pop()
            else:
                seg = np.empty(self.segment_size, dtype=np.uint8)
                self._allocated += 1
                self._ours[id(seg)] = seg
            self._outstanding[id(seg)] = seg
            return seg

    def return_segment(self, segment: Segment) -> None:
        """Gives back a requested segment that was not wrapped."""
        with self._cond:
            if self._outstanding.pop(id(segment), None) is not segment:
                raise ValueError(f"buffer pool {self.name!r}: segment was not requested here")
            self._recycle_locked(segment)

    def wrap(
        self, data: Any, data_type: DataType = DataType.DATA, timeout: float | None = None
    ) -> NetworkBuffer:
        """A :class:`NetworkBuffer` over ``data``, zero-copy, holding one permit.

        ``data`` is a segment from :meth:`request_segment` (or a slice of one, for
        the valid prefix: its permit moves to the buffer, no wait) or any other
        contiguous buffer of at most ``segment_size`` bytes, e.g. an output of
        ``KeyGroupDemux`` (a new permit is taken, blocking as in
        :meth:`request_segment`). The caller must not modify ``data`` afterwards.
        """
        array = _as_bytes_array(data)
        if len(array) > self.segment_size:
            raise ConfigError(
                f"buffer pool {self.name!r}: a buffer of {len(array)} bytes exceeds the "
                f"segment size of {self.segment_size}",
                hint="producers must cut buffers at taskmanager.memory.segment-size",
            )
        with self._cond:
            seg = self._segment_of_locked(data)
            if seg is None:
                self._acquire(timeout)
        recycle = functools.partial(self._recycle, seg)
        return NetworkBuffer._make(array, data_type, recycle)

    def wrap_segment(
        self, segment: Segment, length: int, data_type: DataType = DataType.DATA
    ) -> NetworkBuffer:
        """A :class:`NetworkBuffer` over the first ``length`` bytes of ``segment``, one
        that :meth:`request_segment` handed out: its permit moves to the buffer.
        :meth:`wrap` of a slice does the same, but first finds the segment behind
        the slice; a caller that holds the segment itself (a receiving thread, per
        frame) names it."""
        if not 0 <= length <= self.segment_size:
            raise ConfigError(
                f"buffer pool {self.name!r}: a buffer of {length} bytes does not fit a "
                f"segment of {self.segment_size}"
            )
        with self._cond:
            if self._outstanding.pop(id(segment), None) is not segment:
                raise ValueError(
                    f"buffer pool {self.name!r}: segment wrapped twice, already returned "
                    "or not requested here"
                )
        return NetworkBuffer._make(
            segment[:length], data_type, functools.partial(self._recycle, segment)
        )

    def _segment_of_locked(self, data: Any) -> Segment | None:
        """The outstanding segment ``data`` is a view of (now claimed), or None if foreign."""
        owner = data
        while isinstance(owner, np.ndarray):
            if self._ours.get(id(owner)) is owner:
                seg = self._outstanding.pop(id(owner), None)
                if seg is None:
                    raise ValueError(
                        f"buffer pool {self.name!r}: segment wrapped twice or already returned"
                    )
                return seg
            owner = owner.base
        return None

    def _recycle(self, segment: Segment | None, _buffer: NetworkBuffer) -> None:
        with self._cond:
            self._recycle_locked(segment)
        waker = self.waker
        if waker is not None:
            waker()

    def _recycle_locked(self, segment: Segment | None) -> None:
        if segment is not None:
            self._free.append(segment)
        self._permits += 1
        if self._waiters:  # (once per buffer: a notify with none waiting still costs)
            self._cond.notify()

    def close(self) -> None:
        """Wakes every waiter with :class:`PoolClosedError` and refuses new requests.

        Buffers still out stay valid and are recycled normally when released.
        """
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __repr__(self) -> str:
        return (
            f"BufferPool({self.name!r}, {self.segment_size} B x {self.num_segments}, "
            f"in use {self.in_use})"
        )


class _ReleaseOnce:
    """One reference of a buffer, released by whichever comes first: the storer
    letting go of its view, or the append that failed. Thread-safe (``list.pop``)."""

    __slots__ = ("_held",)

    def __init__(self, buffer: NetworkBuffer) -> None:
        self._held = [buffer]

    def __call__(self) -> None:
        try:
            buffer = self._held.pop()
        except IndexError:
            return
        buffer.release()


def append_zero_copy(storer: Storer, channel: int, buffer: NetworkBuffer) -> None:
    """Appends ``buffer`` to ``storer`` without a copy, taking over one of the caller's
    references: it is released exactly once, when the storer is done with it
    (written, or copied in non-blocking mode) or at once when ``append`` fails (a
    failed append keeps nothing of the buffer).

    The :class:`~spillover.storage.OnRelease` wrapper also releases when it is
    freed, which after a failure may be now or whenever the exception's traceback
    goes; both paths go through one :class:`_ReleaseOnce`, so the buffer never
    loses a reference someone else holds (an input queue's: recycled while still
    queued, it would be released twice when the queue is dropped).
    """
    once = _ReleaseOnce(buffer)
    try:
        storer.append(channel, OnRelease(buffer, once))
    except BaseException:
        once()
        raise
