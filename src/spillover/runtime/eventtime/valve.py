"""Combining the watermarks of a task's input channels (Flink's StatusWatermarkValve)."""

from __future__ import annotations

from spillover.runtime.network.events import MIN_WATERMARK, Watermark, WatermarkStatus

ValveOutput = list[Watermark | WatermarkStatus]


class StatusWatermarkValve:
    """The watermark of a task: the minimum over its input channels, of every input.

    Each channel keeps the highest watermark it delivered. The task's watermark is
    the minimum over the channels that hold it back: active (not idle), not ended,
    and aligned; it is emitted only when it advances, so it never goes back. A
    channel that goes idle stops holding it back; when it becomes active again it
    holds it back only once its own watermark caught up (it is "aligned" again).
    When every channel is idle the task flushes the highest watermark of all and
    goes idle itself (emits an idle status), and active again with the first
    active channel. A channel whose data ended with a drain (EndOfData, drain) no
    longer holds anything back; one that stopped without draining keeps holding
    back at its last watermark (the job resumes it from a savepoint).

    Each ``on_*`` method returns what the task emits, in order.
    """

    def __init__(self, num_channels: int) -> None:
        self._wm = [MIN_WATERMARK] * num_channels
        self._idle = [False] * num_channels
        self._aligned = [True] * num_channels
        self._ended = [False] * num_channels
        self.watermark = MIN_WATERMARK  # the last one emitted
        self.idle = False  # the status last emitted

    def channel_watermark(self, channel: int) -> int:
        return self._wm[channel]

    def _live(self) -> list[int]:
        return [c for c, e in enumerate(self._ended) if not e]

    def _active(self) -> list[int]:
        return [c for c in self._live() if not self._idle[c]]

    def _advance_to_min(self) -> ValveOutput:
        holding = [self._wm[c] for c in self._active() if self._aligned[c]]
        if holding and min(holding) > self.watermark:
            self.watermark = min(holding)
            return [Watermark(self.watermark)]
        return []

    def _flush_max(self) -> ValveOutput:
        live = self._live()
        top = max((self._wm[c] for c in live), default=MIN_WATERMARK)
        if top > self.watermark:
            self.watermark = top
            return [Watermark(top)]
        return []

    def on_watermark(self, channel: int, timestamp: int) -> ValveOutput:
        """Channel ``channel`` delivered watermark ``timestamp``."""
        if self._ended[channel] or self._idle[channel]:
            return []  # an idle channel's watermarks do not count (Flink's rule)
        if timestamp <= self._wm[channel]:
            return []
        self._wm[channel] = timestamp
        if not self._aligned[channel] and timestamp >= self.watermark:
            self._aligned[channel] = True
        return self._advance_to_min()

    def on_status(self, channel: int, idle: bool) -> ValveOutput:
        """Channel ``channel`` went idle (``idle``) or active again."""
        if self._ended[channel] or self._idle[channel] == idle:
            return []
        self._idle[channel] = idle
        if not idle:
            self._aligned[channel] = self._wm[channel] >= self.watermark
            if self.idle:
                self.idle = False
                return [WatermarkStatus(False)]
            return []
        self._aligned[channel] = False
        if not self._active():
            out = self._flush_max() if self._wm[channel] == self.watermark else []
            if not self.idle:
                self.idle = True
                out.append(WatermarkStatus(True))
            return out
        return self._advance_to_min() if self._wm[channel] == self.watermark else []

    def on_end(self, channel: int) -> ValveOutput:
        """Channel ``channel``'s data ended with a drain: it holds nothing back."""
        if self._ended[channel]:
            return []
        was_idle = self._idle[channel]
        self._ended[channel] = True
        self._idle[channel] = False
        if not self._live():
            return []  # the task's own end of input takes it to the end of time
        if not self._active():
            out = [] if was_idle else self._flush_max()
            if not self.idle:
                self.idle = True
                out.append(WatermarkStatus(True))
            return out
        return self._advance_to_min()
