"""Flink's REST JSON, field for field, built from the job's frozen snapshots
(``runtime/rest/messages`` in Flink: ``JobDetailsInfo``, ``CheckpointingStatistics``,
``CheckpointStatistics``, ``TaskCheckpointStatisticsWithSubtaskDetails``,
``CheckpointConfigInfo``, ``JobExceptionsInfoWithHistory``). Sizes are bytes and
durations milliseconds, as in Flink."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

from spillover.errors import ConfigError
from spillover.rest.job import Operation, ServedJob
from spillover.runtime.checkpointing.stats import (
    CheckpointRecord,
    CheckpointStatsSnapshot,
    SubtaskRecord,
)
from spillover.runtime.jobstatus import TERMINAL
from spillover.runtime.live_rescale import RescaleStatus

_PERCENTILES = (("p50", 0.5), ("p90", 0.9), ("p95", 0.95), ("p99", 0.99), ("p999", 0.999))


def _now_ms() -> int:
    return int(time.time() * 1000)


def min_max_avg(values: Sequence[float]) -> dict[str, float]:
    """Flink's ``StatsSummaryDto``: min, max, avg and percentiles (nearest rank)."""
    if not values:
        return {"min": 0, "max": 0, "avg": 0, **{k: 0 for k, _ in _PERCENTILES}}
    ordered = sorted(values)
    n = len(ordered)

    def pct(q: float) -> float:
        return ordered[min(n - 1, max(0, math.ceil(q * n) - 1))]

    return {
        "min": ordered[0],
        "max": ordered[-1],
        "avg": round(sum(ordered) / n),
        **{k: pct(q) for k, q in _PERCENTILES},
    }


def _persisted(c: CheckpointRecord) -> int:
    return c.total("inflight_bytes")


def _processed(c: CheckpointRecord) -> int:
    return c.total("bytes_during_alignment")


def checkpoint_json(c: CheckpointRecord, *, tasks: bool = False) -> dict[str, Any]:
    """One checkpoint (``CheckpointStatistics``): completed, failed or in progress."""
    out: dict[str, Any] = {
        "className": {
            "COMPLETED": ".CompletedCheckpointStatistics",
            "FAILED": ".FailedCheckpointStatistics",
        }.get(c.status, ".PendingCheckpointStatistics"),
        "id": c.checkpoint_id,
        "status": c.status,
        "is_savepoint": c.is_savepoint,
        "savepointFormat": "CANONICAL" if c.is_savepoint else None,
        "trigger_timestamp": c.trigger_ms,
        "latest_ack_timestamp": c.latest_ack_ms,
        "checkpointed_size": c.checkpointed_size,
        "state_size": c.state_size,
        "end_to_end_duration": c.end_to_end_ms,
        "alignment_buffered": 0,
        "processed_data": _processed(c),
        "persisted_data": _persisted(c),
        "num_subtasks": c.num_subtasks,
        "num_acknowledged_subtasks": c.num_acknowledged,
        "checkpoint_type": c.checkpoint_type,
        # Not in Flink's: trigger to completion (the metadata durable), the slowest
        # subtask's start delay and alignment, for charts.
        "completion_duration": round(c.duration_ms),
        "start_delay": round(max((s.metric("start_delay_ms") for s in c.subtasks), default=0)),
        "alignment_duration": round(max((s.metric("alignment_ms") for s in c.subtasks), default=0)),
    }
    if c.status == "COMPLETED":
        out["external_path"] = c.external_path
        out["discarded"] = False
    elif c.status == "FAILED":
        out["failure_timestamp"] = c.failure_ms
        out["failure_message"] = c.failure_message
    if tasks:
        out["tasks"] = {v: _task_json(c, v, subs) for v, subs in c.vertices().items()}
    return out


def _task_json(c: CheckpointRecord, vertex: str, subs: Sequence[SubtaskRecord]) -> dict[str, Any]:
    latest = max((s.ack_ms for s in subs), default=c.trigger_ms)
    state = sum(int(s.metric("state_bytes") + s.metric("inflight_bytes")) for s in subs)
    return {
        "id": c.checkpoint_id,
        "status": c.status,
        "latest_ack_timestamp": latest,
        "checkpointed_size": max(0, state - sum(int(s.metric("referenced_bytes")) for s in subs)),
        "state_size": state,
        "end_to_end_duration": max(0, latest - c.trigger_ms),
        "alignment_buffered": 0,
        "processed_data": sum(int(s.metric("bytes_during_alignment")) for s in subs),
        "persisted_data": sum(int(s.metric("inflight_bytes")) for s in subs),
        "num_subtasks": len(subs),
        "num_acknowledged_subtasks": len(subs),
    }


def subtasks_json(c: CheckpointRecord, vertex: str, parallelism: int) -> dict[str, Any]:
    """``TaskCheckpointStatisticsWithSubtaskDetails``: a vertex's subtasks in a
    checkpoint, with a summary; subtasks that did not acknowledge say ``pending_or_failed``."""
    subs = c.vertices().get(vertex, [])
    by_index = {s.index: s for s in subs}
    n = max(parallelism, max(by_index, default=-1) + 1)
    rows: list[dict[str, Any]] = []
    for i in range(n):
        s = by_index.get(i)
        if s is None:
            rows.append({"index": i, "status": "pending_or_failed"})
            continue
        rows.append(
            {
                "index": i,
                "status": "completed",
                "ack_timestamp": s.ack_ms,
                "end_to_end_duration": max(0, s.ack_ms - c.trigger_ms),
                "state_size": int(s.metric("state_bytes") + s.metric("inflight_bytes")),
                "checkpointed_size": int(
                    s.metric("state_bytes")
                    + s.metric("inflight_bytes")
                    - s.metric("referenced_bytes")
                ),
                "checkpoint": {
                    "sync": round(s.metric("sync_ms")),
                    "async": round(max(0.0, s.metric("acked_ms") - s.metric("sync_ms"))),
                },
                "alignment": {
                    "buffered": 0,
                    "processed": int(s.metric("bytes_during_alignment")),
                    "persisted": int(s.metric("inflight_bytes")),
                    "duration": round(s.metric("alignment_ms")),
                },
                "start_delay": round(s.metric("start_delay_ms")),
                "unaligned_checkpoint": s.metric("inflight_bytes") > 0
                or c.checkpoint_type == "UNALIGNED_CHECKPOINT",
                "aborted": False,
            }
        )
    done = [r for r in rows if r["status"] == "completed"]

    def col(f: Any) -> dict[str, float]:
        return min_max_avg([f(r) for r in done])

    return {
        **_task_json(c, vertex, subs),
        "num_subtasks": n,
        "summary": {
            "state_size": col(lambda r: r["state_size"]),
            "checkpointed_size": col(lambda r: r["checkpointed_size"]),
            "end_to_end_duration": col(lambda r: r["end_to_end_duration"]),
            "checkpoint_duration": {
                "sync": col(lambda r: r["checkpoint"]["sync"]),
                "async": col(lambda r: r["checkpoint"]["async"]),
            },
            "alignment": {
                "buffered": col(lambda r: 0),
                "processed": col(lambda r: r["alignment"]["processed"]),
                "persisted": col(lambda r: r["alignment"]["persisted"]),
                "duration": col(lambda r: r["alignment"]["duration"]),
            },
            "start_delay": col(lambda r: r["start_delay"]),
        },
        "subtasks": rows,
    }


def checkpoints_json(s: CheckpointStatsSnapshot) -> dict[str, Any]:
    """``CheckpointingStatistics``: counts, summary, latest and history."""
    done = s.completed

    def summary(f: Any) -> dict[str, float]:
        return min_max_avg([f(c) for c in done])

    restored = s.restored
    return {
        "counts": {
            "restored": s.restored_count,
            "total": s.total_count,
            "in_progress": len(s.in_progress),
            "completed": s.completed_count,
            "failed": s.failed_count,
        },
        "summary": {
            "checkpointed_size": summary(lambda c: c.checkpointed_size),
            "state_size": summary(lambda c: c.state_size),
            "end_to_end_duration": summary(lambda c: c.end_to_end_ms),
            "completion_duration": summary(lambda c: round(c.duration_ms)),
            "alignment_buffered": summary(lambda c: 0),
            "processed_data": summary(_processed),
            "persisted_data": summary(_persisted),
        },
        "latest": {
            "completed": _maybe(s.latest_completed),
            "savepoint": _maybe(s.latest_savepoint),
            "failed": _maybe(s.latest_failed),
            "restored": None
            if restored is None
            else {
                "id": restored.checkpoint_id,
                "restore_timestamp": restored.restore_ms,
                "is_savepoint": restored.is_savepoint,
                "external_path": restored.external_path,
            },
        },
        "history": [checkpoint_json(c) for c in s.history],
    }


def _maybe(c: CheckpointRecord | None) -> dict[str, Any] | None:
    return None if c is None else checkpoint_json(c)


def checkpoint_config_json(job: ServedJob) -> dict[str, Any]:
    """``CheckpointConfigInfo``."""
    cfg = job.executor.config
    cp = cfg.checkpointing
    storage = job.executor.storage
    return {
        "mode": cp.mode.value.lower(),
        "interval": round((cp.interval_s or 0) * 1000) or 0x7FFFFFFFFFFFFFFF,
        "timeout": round(cp.timeout_s * 1000),
        "min_pause": round(cp.min_pause_s * 1000),
        "max_concurrent": cp.max_concurrent_checkpoints,
        "externalization": {"enabled": True, "delete_on_cancellation": False},
        "state_backend": "HashMapStateBackend",
        "checkpoint_storage": "FileSystemCheckpointStorage",
        "checkpoint_storage_path": None if storage is None else storage.uri,
        "unaligned_checkpoints": cp.unaligned,
        "tolerable_failed_checkpoints": cp.tolerable_failed_checkpoints,
        "aligned_checkpoint_timeout": round(cp.aligned_checkpoint_timeout_s * 1000),
        "checkpoints_after_tasks_finish": True,
        "state_changelog_enabled": False,
        "changelog_periodic_materialization_interval": 0,
        "changelog_storage": "memory",
        "state_retention": cfg.state.num_retained,
    }


def vertex_metrics(job: ServedJob) -> dict[str, dict[str, dict[str, float]]]:
    """Per vertex uid, per subtask index: the task's live metrics, with Flink's rates."""
    live = job.executor.task_metrics()
    result = job.result
    if result is not None and not live:
        live = dict(result.tasks)
    out: dict[str, dict[str, dict[str, float]]] = {}
    now = time.monotonic()
    for key, m in live.items():
        uid, _, index = key.rpartition("#")
        row = dict(m)
        for name, per_second, scale in (
            ("records_in", "records_in_per_s", 1.0),
            ("records_out", "records_out_per_s", 1.0),
            ("backpressured_seconds", "backpressured_ms_per_s", 1000.0),
            ("busy_seconds", "busy_ms_per_s", 1000.0),
        ):
            rate = job.meter.rate(f"{key}:{name}", float(m.get(name, 0.0)) * scale, now)
            row[per_second] = min(rate, 1000.0) if scale == 1000.0 else rate
        out.setdefault(uid, {})[index] = row
    return out


def job_json(job: ServedJob) -> dict[str, Any]:
    """``JobDetailsInfo``: the job, its state's timestamps, its vertices and plan."""
    st = job.executor.status.snapshot()
    g = job.executor.graph
    metrics = vertex_metrics(job)
    end = st.end_ms
    now = _now_ms()
    vertices = []
    nodes = []
    for v in g.vertices:
        subs = metrics.get(v.uid, {}).values()
        vertices.append(
            {
                "id": v.uid,
                "name": " -> ".join(n.name or n.uid for n in v.nodes),
                "maxParallelism": g.max_parallelism,
                "parallelism": v.parallelism,
                "status": st.state,
                "start-time": st.start_ms,
                "end-time": end if end is not None else -1,
                "duration": (end or now) - st.start_ms,
                "tasks": {st.state: v.parallelism},
                "metrics": {
                    "read-records": int(_sum(subs, "records_in")),
                    "read-records-complete": True,
                    "write-records": int(_sum(subs, "records_out")),
                    "write-records-complete": True,
                    "accumulated-backpressured-time": int(
                        _sum(subs, "backpressured_seconds") * 1000
                    ),
                    "accumulated-busy-time": int(_sum(subs, "busy_seconds") * 1000),
                },
                # Not in Flink's JobDetailsInfo: what the dashboard draws.
                "records-in-per-second": _sum(subs, "records_in_per_s"),
                "records-out-per-second": _sum(subs, "records_out_per_s"),
                "backpressured-ms-per-second": max(
                    (s.get("backpressured_ms_per_s", 0.0) for s in subs), default=0.0
                ),
            }
        )
        nodes.append(
            {
                "id": v.uid,
                "parallelism": v.parallelism,
                "operator": "",
                "operator_strategy": "",
                "description": " -> ".join(n.uid for n in v.nodes),
                "inputs": [
                    {
                        "num": e.input_index,
                        "id": g.vertices[e.source].uid,
                        "ship_strategy": e.kind.value.upper(),
                        "exchange": "pipelined_bounded",
                    }
                    for e in sorted(g.inputs_of(v.id), key=lambda e: e.input_index)
                ],
            }
        )
    return {
        "jid": job.job_id,
        "name": job.name,
        "isStoppable": False,
        "state": st.state,
        "job-type": "STREAMING",
        "start-time": st.start_ms,
        "end-time": end if end is not None else -1,
        "duration": (end or now) - st.start_ms,
        "maxParallelism": g.max_parallelism,
        "now": now,
        "timestamps": dict(st.timestamps),
        "vertices": vertices,
        "status-counts": {st.state: len(vertices)},
        "plan": {"jid": job.job_id, "name": job.name, "type": "STREAMING", "nodes": nodes},
        "numRestarts": st.num_restarts,
        # Not in Flink's JobDetailsInfo: the latest live rescale.
        "rescale": rescale_json(job.rescale_status()),
    }


def rescale_json(r: RescaleStatus | None) -> dict[str, Any] | None:
    """The latest live rescale: ``status`` (``IN_PROGRESS``, ``COMPLETED``, ``FAILED``),
    the parallelisms, the savepoint's checkpoint and the milliseconds from the
    request to the first record at the new parallelism."""
    if r is None:
        return None
    return {
        "request-id": r.request_id,
        "status": r.status,
        "from-parallelism": r.from_parallelism,
        "to-parallelism": r.to_parallelism,
        "savepoint-checkpoint": r.savepoint_id,
        "request-to-first-record-ms": r.first_record_ms,
        "failure": r.failure,
    }


def parse_resource_requirements(body: dict[str, Any]) -> dict[str, int]:
    """Flink's ``JobResourceRequirements`` body, ``{vertex: {"parallelism":
    {"lowerBound": n, "upperBound": n}}}``, as the parallelism per vertex uid (the
    upper bound; the lower bound may not exceed it). ConfigError if malformed."""
    if not body:
        raise ConfigError(
            "the body names no vertex",
            hint='{"<vertex id>": {"parallelism": {"lowerBound": 1, "upperBound": 3}}}',
        )
    wanted = {}
    for uid, req in body.items():
        bounds = req.get("parallelism") if isinstance(req, dict) else None
        upper = bounds.get("upperBound") if isinstance(bounds, dict) else None
        lower = bounds.get("lowerBound", 1) if isinstance(bounds, dict) else None
        if not isinstance(upper, int) or not isinstance(lower, int) or isinstance(upper, bool):
            raise ConfigError(
                f"vertex {uid!r}: parallelism needs integer lowerBound and upperBound",
                detail=str(req),
            )
        if lower > upper:
            raise ConfigError(f"vertex {uid!r}: lowerBound {lower} exceeds upperBound {upper}")
        wanted[str(uid)] = upper
    return wanted


def _sum(rows: Iterable[dict[str, float]], name: str) -> float:
    return float(sum(r.get(name, 0.0) for r in rows))


def jobs_overview_json(job: ServedJob) -> dict[str, Any]:
    return {"jobs": [{"id": job.job_id, "status": job.executor.status.snapshot().state}]}


def exceptions_json(job: ServedJob) -> dict[str, Any]:
    """``JobExceptionsInfoWithHistory``: newest first."""
    st = job.executor.status.snapshot()
    entries: list[dict[str, Any]] = [
        {
            "exceptionName": e.name,
            "stacktrace": e.stacktrace,
            "timestamp": e.timestamp_ms,
            "taskName": None,
            "endpoint": None,
            "taskManagerId": None,
            "failureLabels": {},
            "concurrentExceptions": [],
            "message": e.message,
            "attempt": e.attempt,
        }
        for e in reversed(st.exceptions)
    ]
    root = entries[0] if entries and st.state in TERMINAL else None
    return {
        "root-exception": None if root is None else root["stacktrace"],
        "timestamp": None if root is None else root["timestamp"],
        "all-exceptions": [],
        "truncated": False,
        "exceptionHistory": {"entries": entries, "truncated": False},
        "numRestarts": st.num_restarts,
    }


def operation_json(op: Operation) -> dict[str, Any]:
    """``AsynchronousOperationResult`` of a savepoint or stop trigger."""
    if op.status != "COMPLETED":
        return {"status": {"id": op.status}, "operation": None}
    if op.failure is not None:
        cause = {"class": "SavepointFailed", "stack-trace": op.failure}
        return {"status": {"id": "COMPLETED"}, "operation": {"failure-cause": cause}}
    return {"status": {"id": "COMPLETED"}, "operation": {"location": op.location}}
