"""The producer's side: a :class:`ResultPartition` with one subpartition per
consumer subtask, behind the :class:`Subpartition` interface that transports
implement (in memory: :class:`~spillover.runtime.network.local.LocalChannel`; over
TCP: :class:`~spillover.runtime.network.tcp.TcpSubpartition`), and the
:class:`CreditListener` a transport registers to hear of returned credit."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

from spillover.errors import ClosedError, ConfigError
from spillover.runtime.network.buffers import BufferPool, NetworkBuffer, OutputWaker
from spillover.runtime.network.errors import (
    ChannelCancelledError,
    NetworkError,
)
from spillover.runtime.network.errors import deadline as _deadline
from spillover.runtime.network.errors import failure as _failure
from spillover.runtime.network.events import EndOfPartition, Event, to_buffer
from spillover.storage import DataType

if TYPE_CHECKING:
    from spillover.runtime.network.gate import InputChannel

_DATA = DataType.DATA


class CreditListener(ABC):
    """Told when a consumer frees credit on an input channel (a remote transport
    announces it to the producer). Called from the releasing thread, no lock held."""

    @abstractmethod
    def credit_returned(self, channel: InputChannel) -> None: ...


class Subpartition(ABC):
    """The producer's end of one channel: carries one subpartition's buffers to one
    input channel. :class:`ResultPartition` calls it from the producer's thread.

    A transport calls :attr:`partition`'s ``credit_returned`` when its consumer
    grants credit, and ``announce_buffer_size`` when it debloats, from any thread
    with no lock held. When the partition's waker has a native ``signal`` (a
    source's), the TCP transport may notify that signal itself instead, without
    the interpreter lock (``netio.read_credit``): ``credit_returned`` must do no
    more than wake the waker."""

    partition: ResultPartition | None = None
    index = 0  # which subpartition of :attr:`partition` (set by ``connect``)
    # Its ``add_event`` may let the interpreter lock go (a socket write): a priority
    # broadcast reaches every other subpartition first (``broadcast_event``).
    lets_lock_go: ClassVar[bool] = False
    announced_size: int | None = None  # the consumer's last BUFFER_SIZE (TCP)

    @abstractmethod
    def add_data(self, buffer: NetworkBuffer, deadline: float | None) -> float:
        """Enqueues a data buffer once the consumer has credit for it, waiting until
        ``deadline`` (``time.monotonic()``; None: no limit). Takes over the caller's
        reference on success. Returns the seconds spent waiting for credit."""

    @abstractmethod
    def add_event(self, buffer: NetworkBuffer, priority: bool) -> list[NetworkBuffer]:
        """Enqueues an event buffer without credit, taking over the caller's reference.
        With ``priority`` it goes ahead of every queued buffer and the data buffers
        it overtook are returned, each retained once for the caller."""

    @abstractmethod
    def finish(self, buffer: NetworkBuffer) -> None:
        """Enqueues the EndOfPartition buffer; nothing may follow."""

    @abstractmethod
    def fail(self, cause: BaseException) -> None:
        """Fails the channel: waiters on both ends raise, queued buffers are released."""

    @property
    @abstractmethod
    def credit(self) -> int:
        """Data buffers that can be added now without waiting (a snapshot)."""

    @property
    @abstractmethod
    def backlog(self) -> tuple[int, int]:
        """``(buffers, bytes)`` of data enqueued and not yet taken by the consumer."""


class ResultPartition:
    """The producer side of one output: ``num_subpartitions`` subpartitions, one per
    consumer subtask, filled from buffers of ``pool``.

    Used from the producer's thread; :meth:`cancel` and :meth:`fail` may come from
    any thread and wake a producer blocked for credit or for a pool segment.
    ``backpressured_seconds`` adds up the time spent waiting for credit.
    """

    def __init__(
        self,
        num_subpartitions: int,
        pool: BufferPool,
        name: str = "partition",
        buffer_size: int | None = None,
    ) -> None:
        if num_subpartitions < 1:
            raise ConfigError(f"result partition {name!r} needs at least one subpartition")
        self.name = name
        self.pool = pool
        self._subs: list[Subpartition | None] = [None] * num_subpartitions
        self._lock = threading.Lock()
        self._emitted_buffers = [0] * num_subpartitions
        self._emitted_bytes = [0] * num_subpartitions
        self._finished = False
        self._cause: BaseException | None = None
        self.backpressured_seconds = 0.0
        self.waker: OutputWaker | None = None  # told when a consumer grants credit
        # Where each subpartition's buffers are cut: ``buffer_size`` (debloating's
        # initial size; default the segment size), then what its consumer announced
        # (buffer debloating); the writer follows ``sizes_version``.
        start = pool.segment_size if buffer_size is None else self._cut_size(buffer_size)
        self.buffer_sizes = [start] * num_subpartitions
        self.sizes_version = 0

    @property
    def num_subpartitions(self) -> int:
        return len(self._subs)

    @property
    def finished(self) -> bool:
        return self._finished

    def connect(self, subpartition: int, target: Subpartition) -> None:
        """Sets the transport of one subpartition (once)."""
        if self._subs[subpartition] is not None:
            raise NetworkError(f"subpartition {subpartition} of {self.name!r} is connected")
        self._subs[subpartition] = target
        target.index = subpartition
        target.partition = self
        if target.announced_size is not None:  # told before it was connected
            self.announce_buffer_size(subpartition, target.announced_size)

    def _cut_size(self, size: int) -> int:
        """``size`` as a buffer may be cut: 1 byte to the segment size."""
        return max(1, min(int(size), self.pool.segment_size))

    def announce_buffer_size(self, subpartition: int, size: int) -> None:
        """A consumer's debloated buffer size for one subpartition (any thread):
        its writer cuts buffers at it from its next batch, never above the segment."""
        size = self._cut_size(size)
        if self.buffer_sizes[subpartition] != size:
            self.buffer_sizes[subpartition] = size
            self.sizes_version += 1

    def credit_returned(self) -> None:
        """A consumer granted credit: wakes the producer if it waits for it."""
        waker = self.waker
        if waker is not None:
            waker()

    def _sub(self, index: int) -> Subpartition:
        if self._cause is not None:
            raise _failure(f"result partition {self.name!r}", self._cause)
        if self._finished:
            raise ClosedError(f"result partition {self.name!r} is finished")
        sub = self._subs[index]
        if sub is None:
            raise NetworkError(f"subpartition {index} of {self.name!r} is not connected")
        return sub

    def _count(self, index: int, nbytes: int, waited: float) -> None:
        with self._lock:
            self._emitted_buffers[index] += 1
            self._emitted_bytes[index] += nbytes
            self.backpressured_seconds += waited

    def emit(self, subpartition: int, buffer: NetworkBuffer, timeout: float | None = None) -> None:
        """Enqueues ``buffer`` into one subpartition, blocking until its consumer has
        credit (at most ``timeout`` seconds, then :class:`NetworkTimeoutError`).

        Takes over the caller's reference; if it raises, the caller keeps it. Event
        buffers need no credit.
        """
        sub = self._sub(subpartition)
        if buffer.data_type != _DATA:
            sub.add_event(buffer, False)
            return
        nbytes = len(buffer)
        waited = sub.add_data(buffer, _deadline(timeout))
        self._count(subpartition, nbytes, waited)

    def broadcast(self, buffer: NetworkBuffer, timeout: float | None = None) -> None:
        """Enqueues the same ``buffer`` (no copy, one reference each) into every
        subpartition in turn, waiting for each one's credit.

        Takes over the caller's reference. If it raises, the caller keeps its
        reference but the subpartitions before the failing one already got the
        buffer, so a timed-out broadcast must not simply be retried.
        """
        subs = [self._sub(i) for i in range(len(self._subs))]
        deadline = _deadline(timeout)
        nbytes = len(buffer)
        for i, sub in enumerate(subs):
            buffer.retain()
            try:
                if buffer.data_type == _DATA:
                    self._count(i, nbytes, sub.add_data(buffer, deadline))
                else:
                    sub.add_event(buffer, False)
            except BaseException:
                buffer.release()
                raise
        buffer.release()

    def broadcast_event(self, event: Event, priority: bool = False) -> list[list[NetworkBuffer]]:
        """Sends ``event`` (serialized once) to every subpartition; never waits.

        With ``priority`` the event goes ahead of the data buffers queued in each
        subpartition; the result holds, per subpartition, the data buffers it
        overtook, in order, each retained for the caller, who must release every
        one (after persisting them). Without ``priority`` the lists are empty.
        """
        subs = [self._sub(i) for i in range(len(self._subs))]
        order = list(range(len(subs)))
        if priority:
            # The subpartitions in this process first: a socket's write lets the
            # interpreter lock go, and taking it back behind the worker's busy
            # threads took milliseconds, which a barrier to an in-memory channel
            # after it waited too. The remote ones follow microseconds later.
            order.sort(key=lambda i: subs[i].lets_lock_go)
        buf = to_buffer(event)
        overtaken: list[list[NetworkBuffer]] = [[] for _ in subs]
        try:
            for i in order:
                buf.retain()
                try:
                    overtaken[i] = subs[i].add_event(buf, priority)
                except BaseException:
                    buf.release()
                    raise
        except BaseException:
            for bufs in overtaken:
                for b in bufs:
                    b.release()
            raise
        finally:
            buf.release()
        return overtaken

    def finish(self) -> None:
        """Sends EndOfPartition on every subpartition; later emits raise
        :class:`ClosedError`. Idempotent."""
        if self._finished:
            return
        subs = [self._sub(i) for i in range(len(self._subs))]
        buf = to_buffer(EndOfPartition())
        try:
            for sub in subs:
                buf.retain()
                try:
                    sub.finish(buf)
                except BaseException:
                    buf.release()
                    raise
        finally:
            buf.release()
        self._finished = True

    def fail(self, cause: BaseException) -> None:
        """Fails every subpartition and closes the pool: blocked producers and the
        consumers raise :class:`ChannelFailedError`; queued buffers are released."""
        with self._lock:
            if self._cause is None:
                self._cause = cause
        for sub in self._subs:
            if sub is not None:
                sub.fail(cause)
        self.pool.close()

    def cancel(self) -> None:
        """:meth:`fail` with :class:`ChannelCancelledError`."""
        self.fail(ChannelCancelledError(f"result partition {self.name!r} was cancelled"))

    def credit(self, subpartition: int) -> int:
        """Data buffers ``emit`` would take now without waiting (a snapshot)."""
        return self._sub(subpartition).credit

    def backlog(self, subpartition: int) -> tuple[int, int]:
        """``(buffers, bytes)`` of data queued in the subpartition, not yet consumed."""
        sub = self._subs[subpartition]
        return (0, 0) if sub is None else sub.backlog

    def emitted(self, subpartition: int) -> tuple[int, int]:
        """``(buffers, bytes)`` of data emitted into the subpartition so far."""
        return self._emitted_buffers[subpartition], self._emitted_bytes[subpartition]

    def __repr__(self) -> str:
        return f"ResultPartition({self.name!r}, {len(self._subs)} subpartitions)"
