"""Event time: watermarks from sources, their combination in a task, keyed
event-time timers, and the tumbling event-time window count built on them
(docs/runtime.md, "Event time")."""

from __future__ import annotations

from spillover.runtime.eventtime.strategy import (
    SourceWatermarks,
    WatermarkingOutput,
    WatermarkStrategy,
)
from spillover.runtime.eventtime.timers import KeyedTimerService
from spillover.runtime.eventtime.valve import StatusWatermarkValve
from spillover.runtime.eventtime.windows import TumblingWindowCount

__all__ = [
    "KeyedTimerService",
    "SourceWatermarks",
    "StatusWatermarkValve",
    "TumblingWindowCount",
    "WatermarkStrategy",
    "WatermarkingOutput",
]
