"""Barrier handling of a task's input: the aligned policy.

A task sees barriers of checkpoint n arrive on its input channels one by one.
The aligned policy blocks each channel that delivered barrier n, so records
behind the barrier wait, and keeps processing the others; once every live
channel has delivered it, the task snapshots its state, forwards the barrier
and unblocks everything. The unaligned and timeout policies live in their own
modules and share this interface.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


class Gate(Protocol):
    def block(self, channel: int) -> None: ...
    def unblock_all(self) -> None: ...


@dataclass
class AlignmentStats:
    """What one alignment cost; the coordinator's per-checkpoint metrics."""

    checkpoint_id: int
    first_barrier_at: float  # time.monotonic()
    aligned_at: float = 0.0
    bytes_during_alignment: int = 0

    @property
    def alignment_seconds(self) -> float:
        return max(0.0, self.aligned_at - self.first_barrier_at)


@dataclass
class BarrierHandler:
    """The aligned policy for one task input (one gate over all its channels).

    ``on_aligned(barrier, stats)`` runs when every live channel has delivered the
    barrier (the task snapshots and forwards it); ``on_aborted(checkpoint_id)``
    when an alignment is given up (a newer barrier, a cancel marker).

    ``exempt`` channels need not deliver it: an iteration head's feedback channels,
    whose barrier comes only after the head forwarded it. One that delivers it early
    (the barrier went round from another head subtask) is blocked like the others;
    ``last_seen`` tells the head which did.
    """

    gate: Gate
    num_channels: int
    on_aligned: Callable[[Any, AlignmentStats], None]
    on_aborted: Callable[[int], None]
    current: int = -1  # the checkpoint being aligned, -1 when idle
    latest: int = 0  # highest checkpoint id seen (later barriers of older ones are stale)
    seen: set[int] = field(default_factory=set)
    ended: set[int] = field(default_factory=set)  # channels past EndOfPartition
    stats: AlignmentStats | None = None
    barrier: Any = None
    exempt: frozenset[int] = frozenset()
    last_seen: set[int] = field(default_factory=set)  # the channels of the last alignment

    @property
    def aligning(self) -> bool:
        return self.current >= 0

    def on_barrier(self, channel: int, barrier: Any) -> None:
        cid = barrier.checkpoint_id
        if cid <= self.latest and cid != self.current:
            return  # a straggler of a checkpoint already completed or given up
        if cid > self.current and self.aligning:
            # A newer checkpoint's barrier while aligning: the older one cannot complete.
            self._abort()
        if not self.aligning:
            self.current = cid
            self.latest = max(self.latest, cid)
            self.seen = set()
            self.stats = AlignmentStats(cid, time.monotonic())
            self.barrier = barrier
        self.seen.add(channel)
        self.gate.block(channel)
        self._maybe_complete()

    def on_cancel(self, checkpoint_id: int) -> None:
        """A cancel marker (checkpoint aborted upstream)."""
        self.latest = max(self.latest, checkpoint_id)
        if self.current == checkpoint_id:
            self._abort()

    def on_end_of_partition(self, channel: int) -> None:
        """An ended channel no longer needs to deliver barriers."""
        self.ended.add(channel)
        if self.aligning:
            self._maybe_complete()

    def abort_current(self) -> None:
        if self.aligning:
            self._abort()

    def record_bytes(self, nbytes: int) -> None:
        """Bytes processed from still-open channels while aligning."""
        if self.stats is not None and self.aligning:
            self.stats.bytes_during_alignment += nbytes

    def _maybe_complete(self) -> None:
        if len(self.seen | self.ended | self.exempt) >= self.num_channels:
            stats, barrier = self.stats, self.barrier
            assert stats is not None
            stats.aligned_at = time.monotonic()
            self.current = -1
            self.last_seen, self.seen = self.seen, set()
            self.gate.unblock_all()
            self.on_aligned(barrier, stats)

    def _abort(self) -> None:
        cid = self.current
        self.current = -1
        self.seen = set()
        self.stats = None
        self.gate.unblock_all()
        self.on_aborted(cid)
