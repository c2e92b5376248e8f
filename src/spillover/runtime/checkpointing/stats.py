"""Checkpoint statistics for people and scripts (Flink's ``CheckpointStatsTracker``).

The coordinator reports each checkpoint it triggers and each one that ends through
:class:`CheckpointStatsListener`; :class:`CheckpointStatsTracker` keeps what a
reader needs (counts, the latest of each kind, a bounded history, the last restore)
and hands out frozen :class:`CheckpointRecord` values from any thread. It never
writes back: the coordinator's own ``history`` stays the source of ``JobResult``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from spillover.runtime.network.events import BarrierKind

if TYPE_CHECKING:
    from spillover.runtime.checkpointing.coordinator import CheckpointStats

logger = logging.getLogger(__name__)

# Flink's ``web.checkpoints.history``, larger: a chart wants more than ten points.
HISTORY_SIZE = 100


class CheckpointStatsListener(Protocol):
    """What the coordinator tells about its checkpoints (on its own thread)."""

    def checkpoint_triggered(self, stats: CheckpointStats, kind: int, num_subtasks: int) -> None:
        """A checkpoint went out with barriers of ``kind`` to ``num_subtasks`` subtasks;
        ``stats`` keeps filling as acknowledgements come in."""

    def savepoint_triggered(self, checkpoint_id: int) -> None:
        """The checkpoint just triggered is a savepoint (exported once it completes)."""

    def checkpoint_ended(self, stats: CheckpointStats) -> None:
        """A checkpoint completed or was aborted (``stats.status`` says which)."""


@dataclass(frozen=True)
class SubtaskRecord:
    """One subtask's acknowledgement of a checkpoint (the task's own metrics)."""

    vertex: str
    index: int
    ack_ms: int  # wall-clock milliseconds
    metrics: Mapping[str, float]

    def metric(self, name: str) -> float:
        return float(self.metrics.get(name, 0.0))


@dataclass(frozen=True)
class CheckpointRecord:
    """One checkpoint as a reader sees it: Flink's ``AbstractCheckpointStats``."""

    checkpoint_id: int
    trigger_ms: int
    status: str  # IN_PROGRESS | COMPLETED | FAILED
    checkpoint_type: str  # CHECKPOINT | UNALIGNED_CHECKPOINT | SAVEPOINT
    is_savepoint: bool
    num_subtasks: int
    subtasks: tuple[SubtaskRecord, ...] = ()
    duration_ms: float = 0.0
    external_path: str | None = None
    failure_ms: int | None = None
    failure_message: str | None = None

    @property
    def num_acknowledged(self) -> int:
        return len(self.subtasks)

    def total(self, metric: str) -> int:
        return int(sum(s.metric(metric) for s in self.subtasks))

    @property
    def latest_ack_ms(self) -> int:
        return max((s.ack_ms for s in self.subtasks), default=self.trigger_ms)

    @property
    def end_to_end_ms(self) -> int:
        """``end_to_end_duration``: as Flink's for a completed checkpoint, trigger to
        the last acknowledgement (``duration_ms`` adds its completion: the metadata
        durable and the completion logged), and for a failed one, to the failure; for
        one in progress the time so far (Flink's: to its latest acknowledgement)."""
        if self.status == "COMPLETED":
            return max(0, self.latest_ack_ms - self.trigger_ms)
        if self.failure_ms is not None:
            return max(0, self.failure_ms - self.trigger_ms)
        return max(0, round(self.duration_ms))

    @property
    def state_size(self) -> int:
        """Bytes of operator state and in-flight data the checkpoint holds."""
        return self.total("state_bytes") + self.total("inflight_bytes")

    @property
    def checkpointed_size(self) -> int:
        """Bytes written for this checkpoint (what it references of earlier ones left out)."""
        return max(0, self.state_size - self.total("referenced_bytes"))

    def vertices(self) -> dict[str, list[SubtaskRecord]]:
        out: dict[str, list[SubtaskRecord]] = {}
        for s in self.subtasks:
            out.setdefault(s.vertex, []).append(s)
        return out


@dataclass(frozen=True)
class RestoredRecord:
    """The checkpoint or savepoint the running attempt restored."""

    checkpoint_id: int
    restore_ms: int
    is_savepoint: bool
    external_path: str | None


@dataclass(frozen=True)
class CheckpointStatsSnapshot:
    """Everything the tracker knows at one instant."""

    restored_count: int
    completed_count: int
    failed_count: int
    in_progress: tuple[CheckpointRecord, ...]
    history: tuple[CheckpointRecord, ...]  # newest first, in-progress ones included
    completed: tuple[CheckpointRecord, ...]  # every retained-in-memory completed one
    latest_completed: CheckpointRecord | None = None
    latest_savepoint: CheckpointRecord | None = None
    latest_failed: CheckpointRecord | None = None
    restored: RestoredRecord | None = None

    @property
    def total_count(self) -> int:
        return self.completed_count + self.failed_count + len(self.in_progress)

    def find(self, checkpoint_id: int) -> CheckpointRecord | None:
        return next((c for c in self.history if c.checkpoint_id == checkpoint_id), None)


@dataclass
class _Live:
    stats: CheckpointStats
    kind: int
    num_subtasks: int
    savepoint: bool = False


def _checkpoint_type(kind: int, savepoint: bool) -> str:
    if savepoint:
        return "SAVEPOINT"
    return "UNALIGNED_CHECKPOINT" if kind == BarrierKind.UNALIGNED else "CHECKPOINT"


class CheckpointStatsTracker:
    """Thread-safe statistics of a job's checkpoints over every attempt.

    ``locate(checkpoint_id)`` gives a completed checkpoint's directory (its
    ``external_path``); a savepoint's is its export, told by :meth:`exported`.
    """

    def __init__(self, locate: Callable[[int], str | None] | None = None) -> None:
        self._lock = threading.Lock()
        self._locate = locate
        self._live: dict[int, _Live] = {}
        self._ended: list[CheckpointRecord] = []  # oldest first, bounded
        self._completed = 0
        self._failed = 0
        self._restored_count = 0
        self._restored: RestoredRecord | None = None
        self._latest: dict[str, CheckpointRecord] = {}
        self._exports: dict[int, str] = {}  # exported before the coordinator ended them
        self._listeners: list[Callable[[CheckpointRecord], None]] = []

    # -- the coordinator's side (CheckpointStatsListener) ---------------------------------

    def checkpoint_triggered(self, stats: CheckpointStats, kind: int, num_subtasks: int) -> None:
        with self._lock:
            self._live[stats.checkpoint_id] = _Live(stats, kind, num_subtasks, stats.savepoint)

    def savepoint_triggered(self, checkpoint_id: int) -> None:
        with self._lock:
            live = self._live.get(checkpoint_id)
            if live is not None:
                live.savepoint = True

    def checkpoint_ended(self, stats: CheckpointStats) -> None:
        with self._lock:
            live = self._live.pop(stats.checkpoint_id, None)
            kind, n, savepoint = (
                (live.kind, live.num_subtasks, live.savepoint)
                if live is not None
                else (0, len(stats.subtasks), stats.savepoint)
            )
            completed = stats.status == "completed"
            path = self._exports.pop(stats.checkpoint_id, None)
            savepoint = savepoint or path is not None
            if completed and path is None and self._locate is not None:
                path = self._locate(stats.checkpoint_id)
            record = self._record(stats, kind, n, savepoint, path)
            if completed:
                self._completed += 1
                self._latest["savepoint" if savepoint else "completed"] = record
                if savepoint:  # Flink's latest completed counts savepoints too
                    self._latest["completed"] = record
            else:
                self._failed += 1
                self._latest["failed"] = record
            self._ended.append(record)
            del self._ended[:-HISTORY_SIZE]
            listeners = list(self._listeners)
        for f in listeners:
            try:
                f(record)
            except Exception as e:  # a reader's failure must not fail the checkpoint
                logger.warning("checkpoint statistics listener failed: %s", e)

    # -- the job master's side -------------------------------------------------------------

    def exported(self, checkpoint_id: int, path: str) -> None:
        """Checkpoint ``checkpoint_id`` was exported as a savepoint to ``path``."""
        with self._lock:
            if checkpoint_id in self._live:
                self._exports[checkpoint_id] = path
                return
            for i, r in enumerate(self._ended):
                if r.checkpoint_id == checkpoint_id:
                    r = self._ended[i] = replace(
                        r, external_path=path, is_savepoint=True, checkpoint_type="SAVEPOINT"
                    )
                    self._latest["savepoint"] = r
                    if self._latest.get("completed", r).checkpoint_id == checkpoint_id:
                        self._latest["completed"] = r

    def restored(self, checkpoint_id: int, path: str | None, is_savepoint: bool) -> None:
        """An attempt restored checkpoint ``checkpoint_id`` (from ``path``)."""
        with self._lock:
            self._restored_count += 1
            self._restored = RestoredRecord(
                checkpoint_id, int(time.time() * 1000), is_savepoint, path
            )

    def on_ended(self, listener: Callable[[CheckpointRecord], None]) -> None:
        """Calls ``listener`` with each checkpoint that ends (on the coordinator's thread)."""
        with self._lock:
            self._listeners.append(listener)

    # -- readers -------------------------------------------------------------------------------

    def snapshot(self) -> CheckpointStatsSnapshot:
        with self._lock:
            live = [
                self._record(v.stats, v.kind, v.num_subtasks, v.savepoint, None)
                for v in self._live.values()
            ]
            ended = list(self._ended)
            return CheckpointStatsSnapshot(
                restored_count=self._restored_count,
                completed_count=self._completed,
                failed_count=self._failed,
                in_progress=tuple(sorted(live, key=lambda r: r.checkpoint_id)),
                history=tuple(sorted([*ended, *live], key=lambda r: r.checkpoint_id, reverse=True)),
                completed=tuple(r for r in ended if r.status == "COMPLETED"),
                latest_completed=self._latest.get("completed"),
                latest_savepoint=self._latest.get("savepoint"),
                latest_failed=self._latest.get("failed"),
                restored=self._restored,
            )

    @staticmethod
    def _record(
        stats: CheckpointStats, kind: int, n: int, savepoint: bool, path: str | None
    ) -> CheckpointRecord:
        subtasks = []
        # A dict copy is atomic under the GIL: the coordinator's thread may be adding.
        for key, metrics in sorted(dict(stats.subtasks).items()):
            vertex, _, index = key.rpartition("#")
            acked = float(metrics.get("acked_ms", 0.0))
            subtasks.append(
                SubtaskRecord(vertex, int(index), stats.trigger_ms + int(acked), dict(metrics))
            )
        status = {"completed": "COMPLETED", "aborted": "FAILED"}.get(stats.status, "IN_PROGRESS")
        failed = status == "FAILED"
        return CheckpointRecord(
            checkpoint_id=stats.checkpoint_id,
            trigger_ms=stats.trigger_ms,
            status=status,
            checkpoint_type=_checkpoint_type(kind, savepoint),
            is_savepoint=savepoint,
            num_subtasks=n,
            subtasks=tuple(subtasks),
            duration_ms=stats.duration_ms
            if status != "IN_PROGRESS"
            else time.time() * 1000 - stats.trigger_ms,
            external_path=path,
            failure_ms=stats.trigger_ms + int(stats.duration_ms) if failed else None,
            failure_message=stats.reason or None if failed else None,
        )
