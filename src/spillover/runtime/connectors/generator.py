"""A deterministic, replayable, rescalable source of generated records."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from spillover.errors import ConfigError
from spillover.records.generated import fill_generated, fill_layout, letter_pattern
from spillover.runtime.api import Batch, Operator, OperatorContext, OperatorSnapshot

_U64 = np.uint64
_PACE_INTERVAL = 0.01  # rate-limited sources emit at most ~1/_PACE_INTERVAL batches a second
_MASK64 = (1 << 64) - 1
_HOLD_POLL_S = 0.005  # an exhausted source holding its end sleeps this long per call


def _splitmix64(z: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """The splitmix64 finalizer, vectorised (uint64 arithmetic wraps)."""
    z = z + _U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


@dataclass(frozen=True)
class GeneratedEventTime:
    """Event timestamps for :class:`GeneratorSource` records, in a field ``field``
    (int64, milliseconds): record ``seq`` of a partition is stamped
    ``seq * step_ms + max_disorder_ms - jitter``, the jitter in
    ``0 .. max_disorder_ms`` a seeded hash of ``(partition, seq)``. Timestamps
    therefore go back by at most ``max_disorder_ms`` within a partition: with
    watermarks that allow that much delay no record is ever late."""

    step_ms: int = 1
    max_disorder_ms: int = 0
    field: str = "ts"

    def __post_init__(self) -> None:
        if self.step_ms < 0 or self.max_disorder_ms < 0:
            raise ConfigError(
                f"event time needs step_ms >= 0 and max_disorder_ms >= 0, got "
                f"{self.step_ms} and {self.max_disorder_ms}"
            )


class GeneratorSource(Operator):
    """Generates records ``(partition, seq, key, payload)``; see :meth:`dtype`.

    ``partitions`` logical partitions are spread over the subtasks (subtask
    ``i`` of ``p`` owns partitions ``i, i+p, ...``); each partition counts
    ``seq`` up from 0, up to ``records_per_partition`` (None: forever). A batch
    holds up to ``batch_size`` records taken round-robin from the owned
    partitions, each partition's in ``seq`` order. Keys and payloads are pure
    functions of ``(partition, seq, seed)``, so a rerun or a restore emits
    identical records: keys are ``splitmix64`` of them, reduced to ``keys``
    distinct values uniformly or Zipf-distributed (exponent ``zipf_exponent``,
    key 0 the hottest); the payload is ``payload_bytes`` letters starting at
    ``'A' + seq % 26``.

    ``event_time`` (a :class:`GeneratedEventTime`) adds an int64 timestamp field,
    a pure function of ``(partition, seq, seed)`` too, for event-time jobs
    (:meth:`timestamps_of`); without it the dtype is the four fields above.
    Partitions are the source's splits (``split_field``): watermarks are
    generated per partition.

    ``rate_per_subtask`` (records/s) paces each subtask by sleeping in
    ``on_timer``, never spinning; after a stall (backpressure) it catches up by
    at most one batch. ``clock`` and ``sleep`` exist for tests.

    ``hold_end(s)``: once a subtask emitted its last record it stays idle ``s`` seconds
    before its data ends, so a run that a test stops part way (``spillover verify``'s
    rescaled and stopped runs) cannot end first however fast the machine is; 0 ends at
    once. The records are the same either way.

    Operator state: ``{"next_seq": {"<partition>": seq}}``; ``restore`` takes the
    entries of the partitions this subtask owns (missing ones start at 0), so
    the union of every subtask's state also restores at another parallelism.
    """

    is_source = True
    split_field = "partition"

    def __init__(
        self,
        partitions: int,
        records_per_partition: int | None = None,
        rate_per_subtask: float | None = None,
        payload_bytes: int = 100,
        keys: int = 10_000,
        key_distribution: str = "uniform",
        batch_size: int = 1024,
        seed: int = 0,
        *,
        zipf_exponent: float = 1.1,
        event_time: GeneratedEventTime | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if partitions < 1:
            raise ConfigError(f"partitions must be >= 1, got {partitions}")
        if records_per_partition is not None and records_per_partition < 0:
            raise ConfigError(f"records_per_partition must be >= 0, got {records_per_partition}")
        if rate_per_subtask is not None and not rate_per_subtask > 0:
            raise ConfigError(f"rate_per_subtask must be > 0 or None, got {rate_per_subtask}")
        if keys < 1 or batch_size < 1:
            raise ConfigError(f"keys and batch_size must be >= 1, got {keys} and {batch_size}")
        if key_distribution not in ("uniform", "zipf"):
            raise ConfigError(
                f"key_distribution must be 'uniform' or 'zipf', got {key_distribution!r}"
            )
        if key_distribution == "zipf" and not zipf_exponent > 0:
            raise ConfigError(f"zipf_exponent must be > 0, got {zipf_exponent}")
        self.partitions = partitions
        self.records_per_partition = records_per_partition
        self.rate = rate_per_subtask
        self.payload_bytes = payload_bytes
        self.keys = keys
        self.key_distribution = key_distribution
        self.zipf_exponent = zipf_exponent
        self.batch_size = batch_size
        self.seed = seed
        self.clock = clock
        self.sleep = sleep
        self.event_time = event_time
        self.hold_end_s = 0.0  # hold_end()
        self.out_dtype = self.dtype(payload_bytes, event_time)
        self._zipf_cdf: npt.NDArray[np.float64] | None = None

    @staticmethod
    def dtype(
        payload_bytes: int = 100, event_time: GeneratedEventTime | None = None
    ) -> np.dtype[Any]:
        """The record dtype: ``partition`` i4, ``seq`` i8, ``key`` i8, ``payload`` S<n>,
        and with ``event_time`` its timestamp field (i8) last."""
        if payload_bytes < 1:
            raise ConfigError(f"payload_bytes must be >= 1, got {payload_bytes}")
        fields = [
            ("partition", "<i4"),
            ("seq", "<i8"),
            ("key", "<i8"),
            ("payload", f"S{payload_bytes}"),
        ]
        if event_time is not None:
            if event_time.field in {f for f, _ in fields}:
                raise ConfigError(f"event time field {event_time.field!r} is taken")
            fields.append((event_time.field, "<i8"))
        return np.dtype(fields)

    def open(self, ctx: OperatorContext) -> None:
        super().open(ctx)
        self._parts = np.arange(ctx.subtask_index, self.partitions, ctx.parallelism, dtype=np.int64)
        self._next = np.zeros(len(self._parts), dtype=np.int64)
        self._turn = 0  # rotates which partitions get the remainder of a batch
        self._share_cache: dict[tuple[int, int, int], npt.NDArray[np.int64]] = {}
        self._ref: float | None = None  # pacing: the time up to which records are "paid"
        self._exhausted_at: float | None = None  # when it emitted its last record (hold_end_s)
        self._chunk = 1.0
        if self.rate is not None:
            self._chunk = min(max(self.rate * _PACE_INTERVAL, 1.0), float(self.batch_size))
        self._pattern = letter_pattern(self.payload_bytes)
        self._layout = fill_layout(self.out_dtype)
        self._mix = self._seed_mix()

    @property
    def bounded(self) -> bool:
        return self.records_per_partition is not None

    def splits_of(self, subtask: int, parallelism: int) -> tuple[str, ...] | None:
        """Partitions are the splits: subtask ``i`` of ``p`` reads ``i, i+p, ...``."""
        return tuple(str(p) for p in range(subtask, self.partitions, parallelism))

    def assign_splits(self, splits: tuple[str, ...]) -> None:
        self._parts = np.array(sorted(int(s) for s in splits), dtype=np.int64)
        self._next = np.zeros(len(self._parts), dtype=np.int64)

    def restore(self, state: Any) -> None:
        next_seq = {int(p): int(s) for p, s in dict(state["next_seq"]).items()}
        self._next = np.array([next_seq.get(int(p), 0) for p in self._parts], dtype=np.int64)

    def restore_rescaled(self, states: list[Any]) -> None:
        """Partitions move between subtasks: merge every old subtask's offsets, keep ours."""
        merged: dict[str, int] = {}
        for st in states:
            if st is not None:
                merged.update({str(p): int(q) for p, q in dict(st["next_seq"]).items()})
        self.restore({"next_seq": merged})

    def snapshot(self, checkpoint_id: int) -> OperatorSnapshot:
        next_seq = {str(p): int(s) for p, s in zip(self._parts, self._next, strict=True)}
        return OperatorSnapshot({"next_seq": next_seq})

    def _seed_mix(self) -> int:
        return (self.seed * 0xD1B54A32D192ED03) & _MASK64

    def keys_of(self, partition: npt.ArrayLike, seq: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """The key of each ``(partition, seq)`` (the same function the records use)."""
        seed_mix = _U64(self._seed_mix())
        p = np.asarray(partition, dtype=np.int64).astype(np.uint64)
        s = np.asarray(seq, dtype=np.int64).astype(np.uint64)
        h = _splitmix64(s + p * _U64(0x9E3779B97F4A7C15) + seed_mix)
        if self.key_distribution == "uniform":
            return (h % _U64(self.keys)).astype(np.int64)
        cdf = self._zipf_cdf
        if cdf is None:
            cdf = np.cumsum(np.arange(1, self.keys + 1, dtype=np.float64) ** -self.zipf_exponent)
            cdf /= cdf[-1]
            self._zipf_cdf = cdf
        u = (h >> _U64(11)).astype(np.float64) * 2.0**-53
        ranks = np.searchsorted(cdf, u, side="right")
        return np.minimum(ranks, self.keys - 1).astype(np.int64)

    def timestamps_of(self, partition: npt.ArrayLike, seq: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """The event timestamp of each ``(partition, seq)`` (needs ``event_time``)."""
        et = self.event_time
        if et is None:
            raise ConfigError("this GeneratorSource has no event_time")
        s = np.asarray(seq, dtype=np.int64)
        if not et.max_disorder_ms:
            return s * et.step_ms
        seed_mix = _U64(((self.seed + 1) * 0x8CB92BA72F3D8DD7) & _MASK64)
        p = np.asarray(partition, dtype=np.int64).astype(np.uint64)
        h = _splitmix64(s.astype(np.uint64) * _U64(0xD6E8FEB86659FD93) + p + seed_mix)
        jitter = (h % _U64(et.max_disorder_ms + 1)).astype(np.int64)
        return s * et.step_ms + et.max_disorder_ms - jitter

    def active_splits(self) -> npt.NDArray[np.int64]:
        """The partitions this subtask still reads (not exhausted)."""
        limit = self.records_per_partition
        return self._parts if limit is None else self._parts[self._next < limit]

    def _allowance(self) -> int:
        """Records the pace allows now, sleeping first until at least one chunk is due."""
        assert self.rate is not None
        now = self.clock()
        ref = now if self._ref is None else max(self._ref, now - self.batch_size / self.rate)
        missing = self._chunk - (now - ref) * self.rate
        if missing > 0:
            self.sleep(missing / self.rate)
            now = self.clock()
        self._ref = ref
        return int(min((now - ref) * self.rate + 1e-9, self.batch_size))

    def on_timer(self) -> bool:
        limit = self.records_per_partition
        # Every partition (a slice: views, no copies) or the ones not exhausted.
        active: npt.NDArray[np.intp] | slice
        if limit is None:
            active, m = slice(None), len(self._parts)
        else:
            left = np.flatnonzero(self._next < limit)
            active, m = left, len(left)
        if not m:
            return self._holding()
        n = self.batch_size if self.rate is None else self._allowance()
        if n == 0:
            return True
        counts = self._shares(n, m)
        total = n  # the shares of n add up to n
        if limit is not None:
            counts = np.minimum(counts, limit - self._next[active])
            total = int(counts.sum())
        if self.rate is not None:
            assert self._ref is not None
            self._ref += total / self.rate
        if total:
            self.ctx.output.emit(self._batch(active, counts, total))
        return limit is None or bool((self._next < limit).any()) or self._holding()

    def hold_end(self, seconds: float) -> None:
        """Before it is opened: stay idle ``seconds`` after the last record before the
        data ends (see the class docstring)."""
        if not seconds >= 0:
            raise ConfigError(f"hold_end seconds must be >= 0, got {seconds}")
        self.hold_end_s = float(seconds)

    def _holding(self) -> bool:
        """Exhausted: whether the data has yet to end (``hold_end_s``); idles a little
        per call rather than spinning, staying responsive to the task's mailbox."""
        if not self.hold_end_s:
            return False
        now = self.clock()
        if self._exhausted_at is None:
            self._exhausted_at = now
        left = self._exhausted_at + self.hold_end_s - now
        if left <= 0:
            return False
        self.sleep(min(left, _HOLD_POLL_S))
        return True

    def _shares(self, n: int, m: int) -> npt.NDArray[np.int64]:
        """How ``n`` records are shared by ``m`` partitions: ``n // m`` each, the
        remainder to the ones from ``_turn`` on, which then moves past them. The same
        few arrays recur batch after batch: kept (read-only) instead of rebuilt."""
        key = (n, m, self._turn)
        counts = self._share_cache.get(key)
        if counts is None:
            counts = np.full(m, n // m, dtype=np.int64)
            counts[(np.arange(m) - self._turn) % m < n % m] += 1
            counts.flags.writeable = False
            if len(self._share_cache) >= 64:  # a paced source's n varies
                self._share_cache.clear()
            self._share_cache[key] = counts
        self._turn = (self._turn + n % m) % m
        return counts

    def _batch(
        self, active: npt.NDArray[np.intp] | slice, counts: npt.NDArray[np.int64], total: int
    ) -> Batch:
        out = np.empty(total, dtype=self.out_dtype)
        uniform = self.key_distribution == "uniform"
        # Partition, seq, payload and a uniform key in one native pass; keys_of and
        # timestamps_of (numpy) are the same functions, and do what it does not.
        fill_generated(
            out,
            self._parts[active],
            self._next[active],
            counts,
            self._mix,
            self.keys if uniform else 0,
            self._pattern,
            self._layout,
        )
        self._next[active] += counts
        if not uniform:
            out["key"] = self.keys_of(out["partition"], out["seq"])
        if self.event_time is not None:
            out[self.event_time.field] = self.timestamps_of(out["partition"], out["seq"])
        return out
