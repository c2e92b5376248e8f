"""The consumer's side: an :class:`InputGate` of :class:`InputChannel` s, each with
its queue and credit; ``InputGate.poll`` hands out buffers in arrival order with
priority events first."""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from spillover.errors import ClosedError, ConfigError
from spillover.runtime.network.buffers import NetworkBuffer, NetworkTimeoutError
from spillover.runtime.network.debloat import BufferDebloater
from spillover.runtime.network.errors import ChannelCancelledError
from spillover.runtime.network.errors import deadline as _deadline
from spillover.runtime.network.errors import failure as _failure
from spillover.runtime.network.partition import CreditListener
from spillover.storage import DataType

_DATA = DataType.DATA


class InputChannel:
    """The consumer's end of one channel, inside an :class:`InputGate`.

    Holds the channel's queue and credit. The channel may hold at most
    ``exclusive`` data buffers plus the floating ones it borrowed from its gate;
    a buffer counts from the moment it is enqueued until the consumer releases
    the handle ``poll`` gave out. Transports feed it with ``push_*`` (a local one
    from the producer's thread, a remote one from its receiving thread).
    """

    def __init__(self, gate: InputGate, index: int, exclusive: int) -> None:
        self.gate = gate
        self.index = index
        self.exclusive = exclusive
        self.connected = False
        self.credit_listener: CreditListener | None = None
        # An in-memory producer's hook, called when this channel's credit (or the
        # gate's floating credit) comes back: see OutputWaker.
        self.on_credit: Callable[[], None] | None = None
        # The transport's hook that tells the producer a debloated buffer size.
        self.on_buffer_size: Callable[[int], None] | None = None
        self._queue: deque[NetworkBuffer] = deque()  # data and events, FIFO
        self._priority: deque[NetworkBuffer] = deque()
        self._in_use = 0  # data buffers queued or handed out and not yet released
        self._floating = 0  # == max(0, _in_use - exclusive)
        self._blocked = False
        self._listed = False  # whether our index is in the gate's ready list
        self._ended = False  # EndOfPartition enqueued
        self._finished = False  # EndOfPartition delivered, or channel_finished()
        self._eop: NetworkBuffer | None = None
        self._cause: BaseException | None = None
        self.queued_buffers = 0
        self.queued_bytes = 0
        self.received_buffers = 0
        self.received_bytes = 0

    @property
    def where(self) -> str:
        return f"channel {self.index} of input gate {self.gate.name!r}"

    @property
    def blocked(self) -> bool:
        return self._blocked

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def buffers_in_use(self) -> int:
        """Data buffers queued or held by the consumer: the credit in use."""
        return self._in_use

    @property
    def credit(self) -> int:
        """Data buffers the channel would accept now (floating credit is shared)."""
        return max(0, self.exclusive - self._in_use) + self.gate._floating_free

    def _check_open_locked(self) -> None:
        if self._cause is not None:
            raise _failure(self.where, self._cause)
        if self._ended or self._finished:
            raise ClosedError(f"{self.where} is finished")

    def push_data(self, buffer: NetworkBuffer, deadline: float | None = None) -> float:
        """Enqueues a data buffer (taking over the reference), waiting for credit;
        returns the seconds waited. Raises :class:`NetworkTimeoutError` at
        ``deadline``, :class:`ChannelFailedError` if the channel fails meanwhile."""
        gate = self.gate
        waited = 0.0
        with gate._lock:
            self._check_open_locked()
            if self._in_use >= self.exclusive and gate._floating_free == 0:
                start = time.monotonic()
                try:
                    while self._in_use >= self.exclusive and gate._floating_free == 0:
                        remaining = None if deadline is None else deadline - time.monotonic()
                        if remaining is not None and remaining <= 0:
                            raise NetworkTimeoutError(
                                f"{self.where}: no credit before the deadline",
                                detail=f"{self._in_use} buffers in use",
                                hint="the consumer is slow, blocked or not polling",
                            )
                        gate._credit_waiters += 1
                        try:
                            gate._credit.wait(remaining)
                        finally:
                            gate._credit_waiters -= 1
                        self._check_open_locked()
                finally:
                    waited = time.monotonic() - start
            self._in_use += 1
            if self._in_use > self.exclusive + self._floating:
                self._floating += 1
                gate._floating_free -= 1
            self._queue.append(buffer)
            self.queued_buffers += 1
            self.queued_bytes += len(buffer)
            gate._list_locked(self)
        return waited

    def push_event(
        self,
        buffer: NetworkBuffer,
        priority: bool = False,
        on_overtaken: Callable[[list[NetworkBuffer]], None] | None = None,
    ) -> list[NetworkBuffer]:
        """Enqueues an event (no credit needed); see :meth:`Subpartition.add_event`.

        A priority event returns the data buffers it overtook (retained), or hands
        them to ``on_overtaken`` (then returns ``[]``), which runs before the event
        can be polled: whatever it records is there when the consumer sees the event.
        """
        gate = self.gate
        with gate._lock:
            self._check_open_locked()
            if not priority:
                self._queue.append(buffer)
                gate._list_locked(self)
                return []
            overtaken = [b.retain() for b in self._queue if b.data_type == _DATA]
            if on_overtaken is not None:
                on_overtaken(overtaken)
                overtaken = []
            self._priority.append(buffer)
            gate._prio.append(self.index)
            gate._available.notify_all()
            return overtaken

    def push_end(self, buffer: NetworkBuffer) -> None:
        """Enqueues EndOfPartition; any later push raises :class:`ClosedError`."""
        gate = self.gate
        with gate._lock:
            self._check_open_locked()
            self._queue.append(buffer)
            self._eop = buffer
            self._ended = True
            gate._list_locked(self)
            if self._blocked:  # the consumer may unblock it now (has_ended)
                gate._woken = True
                gate._available.notify_all()

    def fail(self, cause: BaseException) -> None:
        """Fails the channel and its gate: producer and consumer raise from now on."""
        gate = self.gate
        with gate._lock:
            if self._cause is None:
                self._cause = cause
            if gate._failure is None:
                gate._failure = (self.index, cause)
            dropped = self._drop_locked()
            gate._available.notify_all()
        for b in dropped:
            b.release()

    def _drop_locked(self) -> list[NetworkBuffer]:
        """Empties the queues, giving back their credit; the caller releases the result."""
        dropped = [*self._priority, *self._queue]
        self._priority.clear()
        self._queue.clear()
        self._eop = None
        data = sum(1 for b in dropped if b.data_type == _DATA)
        self.queued_buffers = self.queued_bytes = 0
        if data:
            self._return_credit_locked(data)
        else:
            self.gate._credit.notify_all()  # wakes producers to see the new state
        return dropped

    def _return_credit_locked(self, n: int) -> int:
        """Gives back ``n`` buffers' credit; returns the floating credits freed."""
        self._in_use -= n
        excess = self._floating - max(0, self._in_use - self.exclusive)
        if excess > 0:
            self._floating -= excess
            self.gate._floating_free += excess
        if self.gate._credit_waiters:  # (a notify with none waiting still costs)
            self.gate._credit.notify_all()
        return max(0, excess)

    def _handle_released(self, queued: NetworkBuffer, _handle: NetworkBuffer) -> None:
        with self.gate._lock:
            freed = self._return_credit_locked(1)
        queued.release()
        listener = self.credit_listener
        if listener is not None:
            listener.credit_returned(self)
        if freed:  # floating credit: any channel's producer may go on now
            for ch in self.gate._channels:
                if ch.on_credit is not None:
                    ch.on_credit()
        elif self.on_credit is not None:
            self.on_credit()

    def __repr__(self) -> str:
        state = "finished" if self._finished else "blocked" if self._blocked else "open"
        return f"InputChannel({self.where}, {state}, {self.queued_buffers} queued)"


class InputGate:
    """The consumer side of one logical input: ``num_channels`` input channels.

    Each channel has ``buffers_per_channel`` exclusive credits; ``floating_buffers``
    more are shared by all channels. Consumed from one task thread with
    :meth:`poll`; other threads may call :meth:`wake`, :meth:`cancel` and release
    buffers. Blocking a channel (barrier alignment) stops its delivery: its queue
    fills to its credit and its producer stalls, while other channels flow.
    """

    def __init__(
        self,
        num_channels: int,
        floating_buffers: int = 8,
        name: str = "gate",
        buffers_per_channel: int = 2,
    ) -> None:
        if num_channels < 1 or floating_buffers < 0 or buffers_per_channel < 1:
            raise ConfigError(
                f"input gate {name!r}: bad size",
                detail=f"num_channels={num_channels}, floating_buffers={floating_buffers}, "
                f"buffers_per_channel={buffers_per_channel}",
                hint="every channel needs at least one exclusive buffer, or a blocked "
                "channel could starve the others",
            )
        self.name = name
        self.floating_buffers = floating_buffers
        self._lock = threading.Lock()
        self._available = threading.Condition(self._lock)  # consumer waits here
        self._credit = threading.Condition(self._lock)  # producers wait here
        # How many wait on each condition: a buffer's arrival or its credit's return
        # notifies only when someone waits (both happen once per buffer).
        self._credit_waiters = 0
        self._consumer_waits = 0
        self._channels = [InputChannel(self, i, buffers_per_channel) for i in range(num_channels)]
        self._floating_free = floating_buffers
        self._ready: deque[int] = deque()  # channels with queued buffers, round robin
        self._prio: deque[int] = deque()  # one entry per queued priority buffer
        self._woken = False
        self._failure: tuple[int | None, BaseException] | None = None
        self._num_finished = 0
        self.debloater: BufferDebloater | None = None  # set by wiring when debloating

    @property
    def num_channels(self) -> int:
        return len(self._channels)

    @property
    def channels(self) -> Sequence[InputChannel]:
        return tuple(self._channels)

    def channel(self, index: int) -> InputChannel:
        return self._channels[index]

    @property
    def floating_available(self) -> int:
        """Floating credits no channel holds now."""
        return self._floating_free

    @property
    def finished(self) -> bool:
        """Every channel delivered its EndOfPartition (or was marked finished)."""
        return self._num_finished == len(self._channels)

    @property
    def queued_bytes(self) -> int:
        """Bytes of data queued on all channels, not yet polled."""
        return sum(c.queued_bytes for c in self._channels)

    def _list_locked(self, ch: InputChannel) -> None:
        if not ch._listed and not ch._blocked:
            ch._listed = True
            self._ready.append(ch.index)
            if self._consumer_waits:
                self._available.notify_all()

    def _raise_if_failed_locked(self) -> None:
        if self._failure is not None:
            index, cause = self._failure
            where = f"input gate {self.name!r}"
            raise _failure(where if index is None else f"channel {index} of {where}", cause)

    def _ready_locked(self, priority_only: bool = False) -> bool:
        """Whether poll would return a buffer now; drops stale ready entries."""
        prio, ready, channels = self._prio, self._ready, self._channels
        while prio:
            if channels[prio[0]]._priority:
                return True
            prio.popleft()
        if priority_only:
            return False
        while ready:
            ch = channels[ready[0]]
            if ch._queue and not ch._blocked and not ch._finished:
                return True
            ready.popleft()
            ch._listed = False
        return False

    def _take_locked(
        self, priority_only: bool = False
    ) -> tuple[InputChannel, NetworkBuffer] | None:
        if not self._ready_locked(priority_only):
            return None
        if self._prio:
            ch = self._channels[self._prio.popleft()]
            return ch, ch._priority.popleft()
        ch = self._channels[self._ready.popleft()]
        buf = ch._queue.popleft()
        if ch._queue:
            self._ready.append(ch.index)
        else:
            ch._listed = False
        if buf.data_type == _DATA:
            n = len(buf)
            ch.queued_buffers -= 1
            ch.queued_bytes -= n
            ch.received_buffers += 1
            ch.received_bytes += n
        elif buf is ch._eop:
            ch._eop = None
            ch._finished = True
            self._num_finished += 1
        return ch, buf

    def poll(
        self, timeout: float | None = None, priority_only: bool = False
    ) -> tuple[int, NetworkBuffer] | None:
        """The next ``(channel index, buffer)``, waiting at most ``timeout`` seconds
        (None: until one comes, the gate finishes or :meth:`wake` is called).

        Priority buffers of any channel, blocked or not, come first, then data and
        events of unblocked channels in round robin, FIFO per channel. Returns None
        on timeout, after a wake-up, or at once when the gate is finished. The
        caller owns the returned buffer and must release it; releasing a data
        buffer returns the channel's credit. Raises :class:`ChannelFailedError`
        once a channel or the gate failed. With ``priority_only`` only priority
        buffers are returned (a task whose output is backpressured still takes
        its unaligned barriers).
        """
        deadline = _deadline(timeout)
        with self._lock:
            while True:
                self._raise_if_failed_locked()
                taken = self._take_locked(priority_only)
                if taken is not None:
                    break
                if not self._wait_locked(deadline):
                    return None
        ch, buf = taken
        if buf.data_type == _DATA:
            buf = buf.derive(functools.partial(ch._handle_released, buf))
        return ch.index, buf

    def wait_available(self, timeout: float | None = None) -> bool:
        """Waits until :meth:`poll` would return a buffer (True), or until ``timeout``,
        a wake-up or the end of the gate (False). Raises like :meth:`poll`."""
        deadline = _deadline(timeout)
        with self._lock:
            while True:
                self._raise_if_failed_locked()
                if self._ready_locked():
                    return True
                if not self._wait_locked(deadline):
                    return False

    def _wait_locked(self, deadline: float | None) -> bool:
        """One wait for news; False when the caller should return empty-handed."""
        if self._woken:
            self._woken = False
            return False
        if self._num_finished == len(self._channels):
            return False
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return False
        self._consumer_waits += 1
        try:
            self._available.wait(remaining)
        finally:
            self._consumer_waits -= 1
        return True

    def wake(self) -> None:
        """Makes the current (or next) waiting :meth:`poll`/:meth:`wait_available`
        return empty-handed, e.g. because the task's mailbox has mail."""
        with self._lock:
            self._woken = True
            self._available.notify_all()

    def block(self, channel: int) -> None:
        """Stops delivering the channel's data and non-priority events (alignment)."""
        with self._lock:
            self._channels[channel]._blocked = True

    def unblock(self, channel: int) -> None:
        with self._lock:
            ch = self._channels[channel]
            ch._blocked = False
            if ch._queue:
                self._list_locked(ch)
                self._available.notify_all()

    def unblock_all(self) -> None:
        with self._lock:
            for ch in self._channels:
                ch._blocked = False
                if ch._queue:
                    self._list_locked(ch)
            self._available.notify_all()

    def overtake(
        self, channel: int, match: Callable[[NetworkBuffer], bool]
    ) -> list[NetworkBuffer] | None:
        """Takes the first queued event of ``channel`` that ``match`` accepts out of the
        queue, as if it had come on the priority path, and returns the data buffers
        queued ahead of it (retained: the caller releases them; they stay queued and
        are still delivered). None when no such event is queued.

        An aligned-with-timeout checkpoint that switches to unaligned uses it: the
        barrier overtakes the data in front of it, which the checkpoint persists."""
        with self._lock:
            ch = self._channels[channel]
            for i, buf in enumerate(ch._queue):
                if buf.data_type != _DATA and buf is not ch._eop and match(buf):
                    ahead = [b.retain() for b in list(ch._queue)[:i] if b.data_type == _DATA]
                    del ch._queue[i]
                    if not ch._queue and ch._listed:
                        self._ready.remove(ch.index)
                        ch._listed = False
                    return ahead
        return None

    def is_blocked(self, channel: int) -> bool:
        return self._channels[channel]._blocked

    def has_ended(self, channel: int) -> bool:
        """Whether the channel's EndOfPartition is queued (or delivered): what is
        queued on it is all that is left. Its arrival on a blocked channel wakes a
        waiting :meth:`poll`."""
        ch = self._channels[channel]
        return ch._ended or ch._finished

    def channel_finished(self, channel: int) -> None:
        """Marks a channel finished; idempotent. ``poll`` does so itself when it hands
        out the channel's EndOfPartition. Buffers still queued are released and the
        channel's producer gets :class:`ClosedError` from now on."""
        with self._lock:
            ch = self._channels[channel]
            if ch._finished:
                return
            ch._finished = True
            self._num_finished += 1
            dropped = ch._drop_locked()
            self._available.notify_all()
        for b in dropped:
            b.release()

    def fail(self, cause: BaseException) -> None:
        """Fails every channel: the consumer and every producer blocked on this gate
        raise :class:`ChannelFailedError`; queued buffers are released."""
        with self._lock:
            if self._failure is None:
                self._failure = (None, cause)
        for ch in self._channels:
            ch.fail(cause)

    def cancel(self) -> None:
        """:meth:`fail` with :class:`ChannelCancelledError`."""
        self.fail(ChannelCancelledError(f"input gate {self.name!r} was cancelled"))

    def __repr__(self) -> str:
        return f"InputGate({self.name!r}, {len(self._channels)} channels)"
