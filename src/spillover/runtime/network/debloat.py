"""Buffer debloating: an input gate sizes its producers' buffers to what it takes.

Every ``period`` the gate's consumer (the task thread) measures the bytes per second
it took, smoothed, and announces ``rate * target / buffers`` bytes, between
``min_size`` and the segment size, to the producer of every channel (a local
channel sets it on the producer's partition, a TCP one sends a BUFFER_SIZE frame):
the ``buffers`` the gate surely holds then carry about ``target`` seconds of its
input. Those are its channels' exclusive buffers, and its floating ones only when
every channel is local: a TCP channel is given exclusive credit only, so counting
floating buffers would leave each remote channel a fraction of the target. The
producer's writer cuts its buffers at the announced size from its next batch. A
size is announced only when it differs from the last by more than ``threshold`` (a
fraction) or reaches a bound.
Measured where the data is consumed, as Flink does (FLIP-183): while full-size
buffers drain, the consumer's rate is what it takes, not what it is sent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Debloat:
    """Buffer debloating of one input gate (``taskmanager.network.memory.buffer-debloat.*``)."""

    target_s: float
    period_s: float
    min_size: int
    threshold: float = 0.25
    initial_size: int | None = None  # None: the segment size (``max_size``)
    clock: Callable[[], float] = field(default=time.monotonic, compare=False)


class BufferDebloater:
    """Measures what one gate consumes and announces buffer sizes to its channels'
    producers (:class:`Debloat`). Fed by the consuming thread with :meth:`consumed`.

    ``buffers`` is what the gate surely holds: its channels' exclusive buffers, and
    its floating ones only when no channel is remote (``wiring.gate_debloater``). A
    channel not yet told the current size (connected after it was announced) is
    told at the end of the next period."""

    def __init__(
        self, settings: Debloat, channels: Sequence[Any], max_size: int, buffers: int
    ) -> None:
        self.settings = settings
        self.channels = channels  # each with ``on_buffer_size`` (None: not connected)
        self.max_size = max_size
        self.buffers = max(1, buffers)
        # What the producers cut at until told otherwise (they start there too:
        # wiring.debloat_start_size).
        initial = max_size if settings.initial_size is None else settings.initial_size
        self.size = max(1, min(initial, max_size))
        self._told = [self.size] * len(channels)  # what each channel's producer was told
        self._clock = settings.clock
        self._bytes = 0
        self._since: float | None = None  # measuring from the first buffer taken
        self._rate: float | None = None  # smoothed bytes/s

    def consumed(self, nbytes: int) -> None:
        """The consumer took a data buffer of ``nbytes``."""
        now = self._clock()
        if self._since is None:
            self._since = now  # not the time before the job ran
            return
        self._bytes += nbytes
        elapsed = now - self._since
        st = self.settings
        if elapsed < st.period_s:
            return
        rate = self._bytes / elapsed
        self._bytes, self._since = 0, now
        self._rate = rate if self._rate is None else 0.5 * (self._rate + rate)
        want = int(self._rate * st.target_s / self.buffers)
        size = min(self.max_size, max(st.min_size, want))
        bound = size in (st.min_size, self.max_size)
        if size != self.size and (bound or abs(size - self.size) > st.threshold * self.size):
            self.size = size
        for i, ch in enumerate(self.channels):
            tell = ch.on_buffer_size
            if tell is not None and self._told[i] != self.size:
                self._told[i] = self.size
                tell(self.size)
