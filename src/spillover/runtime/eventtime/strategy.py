"""How sources generate watermarks: a :class:`WatermarkStrategy` names the event
timestamp field and the out-of-orderness to allow, and :class:`SourceWatermarks`
applies it to one source subtask's batches."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from spillover.errors import ConfigError
from spillover.runtime.api import Batch, Operator, Output
from spillover.runtime.network.events import (
    MAX_WATERMARK,
    MIN_WATERMARK,
    Watermark,
    WatermarkStatus,
)

SourceEvents = list[Watermark | WatermarkStatus]


@dataclass(frozen=True)
class WatermarkStrategy:
    """Bounded out-of-orderness watermarks (Flink's
    ``WatermarkStrategy.forBoundedOutOfOrderness``), given to ``env.from_source``.

    ``timestamp_field`` is an int64 field of the source's records, in
    milliseconds. After each batch a source subtask emits ``max timestamp seen -
    max_delay_ms - 1`` when that advanced, per split when the source reads splits
    (the minimum over the splits it still reads, a split it has not seen a record
    of holding it at the start of time), so a record at most ``max_delay_ms``
    behind the newest one of its split is never late. ``idleness_ms``: a subtask
    that emitted no record for that long (wall-clock time) goes idle, and does not
    hold the watermark back downstream until it emits again; a subtask that owns
    no split is idle at once.
    """

    timestamp_field: str
    max_delay_ms: int = 0
    idleness_ms: int | None = None

    def __post_init__(self) -> None:
        if self.max_delay_ms < 0:
            raise ConfigError(f"max_delay_ms must be >= 0, got {self.max_delay_ms}")
        if self.idleness_ms is not None and self.idleness_ms <= 0:
            raise ConfigError(f"the idleness timeout must be > 0 ms, got {self.idleness_ms}")

    @staticmethod
    def bounded_out_of_orderness(field: str, max_delay_ms: int) -> WatermarkStrategy:
        """Watermarks ``max_delay_ms`` behind the newest timestamp of ``field``."""
        return WatermarkStrategy(field, max_delay_ms)

    @staticmethod
    def monotonous_timestamps(field: str) -> WatermarkStrategy:
        """Timestamps that never go back (per split): no delay."""
        return WatermarkStrategy(field, 0)

    def with_idleness(self, idleness_ms: int) -> WatermarkStrategy:
        """The same strategy, going idle after ``idleness_ms`` without records."""
        return replace(self, idleness_ms=idleness_ms)

    def check(self, dtype: Any, source: Operator) -> None:
        """Refuses a strategy the source's records cannot serve."""
        dt = np.dtype(dtype)
        names = dt.names or ()
        if self.timestamp_field not in names:
            raise ConfigError(
                f"no timestamp field {self.timestamp_field!r} in {dt}",
                hint="name an int64 field of the source's records (milliseconds)",
            )
        if dt[self.timestamp_field] != np.dtype("<i8"):
            raise ConfigError(f"timestamp field {self.timestamp_field!r} must be int64")
        split = source.split_field
        if split is not None and (split not in names or dt[split].kind not in "iu"):
            raise ConfigError(f"{type(source).__name__}'s split field {split!r} is no integer")


class SourceWatermarks:
    """The watermarks of one source subtask under a :class:`WatermarkStrategy`.

    :meth:`observe` sees every batch the source emits (a few numpy calls per batch);
    :meth:`poll`, after each turn of the source, says what to emit: a watermark
    when it advanced, and the idle or active status when it changes. Nothing here
    is checkpointed: a restored source starts again at the start of time, and a
    record of a split is never more than ``max_delay_ms`` behind that split's
    newest, so no record becomes late by a restore.
    """

    def __init__(
        self,
        strategy: WatermarkStrategy,
        source: Operator,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.strategy = strategy
        self.source = source
        self.clock = clock
        self._split_ids: npt.NDArray[np.int64] = np.empty(0, dtype=np.int64)  # sorted
        self._split_max: npt.NDArray[np.int64] = np.empty(0, dtype=np.int64)
        self._max = MIN_WATERMARK  # without splits
        self._last_record = clock()
        self.watermark = MIN_WATERMARK  # the last one emitted
        self.idle = False

    def observe(self, batch: Batch) -> None:
        """Takes note of the timestamps of ``batch`` (vectorised)."""
        if not len(batch):
            return
        self._last_record = self.clock()
        ts = np.asarray(batch[self.strategy.timestamp_field], dtype=np.int64)
        split = self.source.split_field
        if split is None:
            self._max = max(self._max, int(ts.max()))
            return
        ids = np.asarray(batch[split], dtype=np.int64)
        uniq, inverse = np.unique(ids, return_inverse=True)
        maxes = np.full(uniq.size, MIN_WATERMARK, dtype=np.int64)
        np.maximum.at(maxes, inverse, ts)
        pos = np.searchsorted(self._split_ids, uniq)
        known = np.zeros(uniq.size, dtype=np.bool_)
        if self._split_ids.size:
            known = self._split_ids[np.minimum(pos, self._split_ids.size - 1)] == uniq
        if known.any():
            at = pos[known]
            self._split_max[at] = np.maximum(self._split_max[at], maxes[known])
        if not known.all():
            new = ~known
            ids_all = np.concatenate([self._split_ids, uniq[new]])
            max_all = np.concatenate([self._split_max, maxes[new]])
            order = np.argsort(ids_all, kind="stable")
            self._split_ids, self._split_max = ids_all[order], max_all[order]

    def _current(self) -> int | None:
        """The watermark the records seen allow; None when the subtask reads no split."""
        delay = self.strategy.max_delay_ms + 1
        if self.source.split_field is None:
            return self._max - delay if self._max > MIN_WATERMARK + delay else MIN_WATERMARK
        splits = self.source.active_splits()
        if splits is None:
            splits = self._split_ids
        if not len(splits):
            return None
        splits = np.asarray(splits, dtype=np.int64)
        pos = np.searchsorted(self._split_ids, splits)
        seen = pos < self._split_ids.size
        seen[seen] = self._split_ids[pos[seen]] == splits[seen]
        if not seen.all():
            return MIN_WATERMARK  # a split without records holds everything back
        low = int(self._split_max[pos].min())
        return low - delay if low > MIN_WATERMARK + delay else MIN_WATERMARK

    def poll(self) -> SourceEvents:
        """What the subtask emits now: a status change, then an advanced watermark."""
        current = self._current()
        timeout = self.strategy.idleness_ms
        idle = current is None or (
            timeout is not None and (self.clock() - self._last_record) * 1000 >= timeout
        )
        out: SourceEvents = []
        if idle != self.idle:
            self.idle = idle
            out.append(WatermarkStatus(idle))
        if not idle and current is not None and current > self.watermark:
            self.watermark = current
            out.append(Watermark(current))
        return out

    def end(self) -> SourceEvents:
        """The end of input with a drain: active again if idle, then MAX_WATERMARK."""
        out: SourceEvents = []
        if self.idle:
            self.idle = False
            out.append(WatermarkStatus(False))
        if self.watermark < MAX_WATERMARK:
            self.watermark = MAX_WATERMARK
            out.append(Watermark(MAX_WATERMARK))
        return out


class WatermarkingOutput:
    """A source's output that shows every batch to its :class:`SourceWatermarks`."""

    def __init__(self, inner: Output, watermarks: SourceWatermarks) -> None:
        self.inner = inner
        self.watermarks = watermarks

    def emit(self, batch: Batch) -> None:
        self.watermarks.observe(batch)
        self.inner.emit(batch)

    def emit_watermark(self, timestamp_ms: int) -> None:
        self.inner.emit_watermark(timestamp_ms)
