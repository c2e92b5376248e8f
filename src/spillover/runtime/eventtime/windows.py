"""The keyed tumbling event-time window count, on keyed state and event-time timers."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from spillover.errors import ConfigError
from spillover.runtime.api import Batch, Operator, OperatorContext, StateDescriptor
from spillover.runtime.state.heap import HeapListState

_ROW = np.dtype([("window_end", "<i8"), ("count", "<i8")])

I64 = npt.NDArray[np.int64]


def _group_counts(keys: I64, ends: I64, counts: I64) -> tuple[I64, I64, I64]:
    """Sums ``counts`` per distinct ``(key, end)``, sorted by key, then end."""
    order = np.lexsort((ends, keys))
    k, e, c = keys[order], ends[order], counts[order]
    first = np.ones(k.size, dtype=np.bool_)
    first[1:] = (k[1:] != k[:-1]) | (e[1:] != e[:-1])
    starts = np.flatnonzero(first)
    return k[starts], e[starts], np.add.reduceat(c, starts) if c.size else c


class TumblingWindowCount(Operator):
    """Counts records per key in tumbling event-time windows of ``size_ms``
    (``stream.key_by(k).window_count(size_ms, timestamp_field=...)``).

    A record with timestamp ``t`` falls in the window ``[end - size_ms, end)`` with
    ``end = (t // size_ms + 1) * size_ms``. When the watermark reaches ``end - 1``
    (an event-time timer per key and window) the operator emits
    ``(key, window_end, count)`` and forgets the window; results come in timestamp
    order. A record whose window already fired (``end - 1 <= watermark``) is late:
    it is dropped and counted in the metric ``late_records_dropped`` (Flink's
    default, no allowed lateness). The counts are keyed state (list state of
    ``(window_end, count)`` per key, one row per open window), so they and the
    timers are checkpointed and rescaled by key group.
    """

    def __init__(self, key_field: str, timestamp_field: str, size_ms: int) -> None:
        if size_ms < 1:
            raise ConfigError(f"a window needs size_ms >= 1, got {size_ms}")
        self.key_field = key_field
        self.timestamp_field = timestamp_field
        self.size_ms = size_ms
        self.out_dtype = np.dtype([(key_field, "<i8"), ("window_end", "<i8"), ("count", "<i8")])

    def open(self, ctx: OperatorContext) -> None:
        super().open(ctx)
        if ctx.keyed is None or ctx.timers is None:
            raise ConfigError(
                "window_count needs keyed state and timers",
                hint="put key_by(field) before window_count",
            )
        state = ctx.keyed.state(StateDescriptor(f"{ctx.uid}.windows", "list", _ROW))
        assert isinstance(state, HeapListState)
        self.windows = state
        self.timers = ctx.timers
        ctx.metrics.setdefault("late_records_dropped", 0)

    def _rows(self, keys: I64) -> tuple[I64, npt.NDArray[Any]]:
        """The open windows of ``keys`` (distinct): one key per row, and the rows."""
        values, offsets = self.windows.get_lists(keys)
        return np.repeat(keys, np.diff(offsets)), values

    def _replace(self, keys: I64, row_keys: I64, rows: npt.NDArray[Any]) -> None:
        """The open windows of ``keys`` become ``rows``."""
        self.windows.clear(keys)
        if row_keys.size:
            self.windows.put(row_keys, rows)

    def process(self, batch: Batch, input_index: int = 0) -> None:
        if not len(batch):
            return
        keys = np.asarray(batch[self.key_field], dtype=np.int64)
        ends = (np.asarray(batch[self.timestamp_field], dtype=np.int64) // self.size_ms + 1) * (
            self.size_ms
        )
        late = ends - 1 <= self.timers.current_watermark
        if late.any():
            self.ctx.metrics["late_records_dropped"] += int(late.sum())
            keys, ends = keys[~late], ends[~late]
            if not keys.size:
                return
        k, e, c = _group_counts(keys, ends, np.ones(keys.size, dtype=np.int64))
        touched = np.unique(k)
        old_keys, old = self._rows(touched)
        k2, e2, c2 = _group_counts(
            np.concatenate([old_keys, k]),
            np.concatenate([old["window_end"], e]),
            np.concatenate([old["count"], c]),
        )
        rows = np.empty(k2.size, dtype=_ROW)
        rows["window_end"], rows["count"] = e2, c2
        self._replace(touched, k2, rows)
        self.timers.register(k, e - 1)

    def on_event_time(self, keys: I64, times: I64) -> None:
        # Every timer at or before the watermark fires in this one call, so the due
        # windows of these keys are exactly those that end by the watermark.
        touched = np.unique(keys)
        row_keys, rows = self._rows(touched)
        due = rows["window_end"] - 1 <= self.timers.current_watermark
        if not due.any():
            return
        self._replace(touched, row_keys[~due], rows[~due])
        fired_keys, fired = row_keys[due], rows[due]
        order = np.lexsort((fired_keys, fired["window_end"]))  # timestamp order
        out = np.empty(order.size, dtype=self.out_dtype)
        out[self.key_field] = fired_keys[order]
        out["window_end"] = fired["window_end"][order]
        out["count"] = fired["count"][order]
        self.ctx.output.emit(out)
