"""What the loop benchmark's runs add up to (:func:`summarise`,
:func:`summarise_termination`), how they compare with the targets (:func:`compare`)
and the tables ``docs/benchmarks.md`` shows (:func:`to_markdown`,
:func:`termination_markdown`). Running them is ``iteration.py``'s.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from spillover.benchmark.iteration import (
    TERMINATION_TARGET_MS,
    UNALIGNED_RATIO_TARGET,
    LoopRun,
    TerminationRun,
)
from spillover.benchmark.runner import _stats

__all__ = ["compare", "summarise", "summarise_termination", "termination_markdown", "to_markdown"]


def _range(xs: Sequence[float]) -> dict[str, float] | None:
    if not xs:
        return None
    return {"median": float(statistics.median(xs)), "min": float(min(xs)), "max": float(max(xs))}


def summarise(runs: Sequence[LoopRun]) -> dict[str, dict[str, Any]]:
    """Per variant: checkpoint durations pooled over its runs (median, p90, max), the
    range of the runs' medians, and medians (min–max over runs) of the rest."""
    groups: dict[str, list[LoopRun]] = {}
    for r in runs:
        groups.setdefault(r.variant, []).append(r)
    out: dict[str, dict[str, Any]] = {}
    for name, rs in groups.items():
        ok = [r for r in rs if r.status != "failed"]
        pooled = [d for r in ok for d in r.durations_ms]
        row: dict[str, Any] = {
            "runs": len(ok),
            "failed": len(rs) - len(ok),
            "checkpoints": sum(r.checkpoints for r in ok),
            "aborted": sum(r.aborted for r in ok),
            "duration_ms": _stats(pooled),
            "run_medians_ms": _range(
                [m for r in ok if (m := r.duration_ms.get("median")) is not None]
            ),
        }
        row["inflight_first"] = _range(
            [r.inflight_first_last[0] for r in ok if r.inflight_first_last]
        )
        row["inflight_last"] = _range(
            [r.inflight_first_last[1] for r in ok if r.inflight_first_last]
        )
        for metric in (
            "inflight_bytes",
            "head_inflight_bytes",
            "logged_bytes",
            "feedback_spilled_bytes",
            "backlog_records",
            "throughput_rps",
            "raw_write_ms",
            "raw_write_fsync_ms",
            "source_backpressured_share",
        ):
            row[metric] = _range([float(v) for r in ok if (v := getattr(r, metric)) is not None])
        out[name] = row
    return out


def compare(summary: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The targets: the loop's unaligned median checkpoint duration over the straight
    job's (pooled medians), and the loop's output rate with unaligned checkpoints over
    the rate without checkpoints."""

    def get(variant: str, metric: str, stat: str = "median") -> float | None:
        v: float | None = ((summary.get(variant) or {}).get(metric) or {}).get(stat)
        return v

    loop_u, straight_u = (
        get("loop unaligned", "duration_ms"),
        get("straight unaligned", "duration_ms"),
    )
    ratio = None if loop_u is None or not straight_u else round(loop_u / straight_u, 3)
    rps_u, rps_none = get("loop unaligned", "throughput_rps"), get("loop none", "throughput_rps")
    thr = None if rps_u is None or not rps_none else round(rps_u / rps_none, 3)
    return {
        "loop_to_straight_unaligned_median": ratio,
        "target": UNALIGNED_RATIO_TARGET,
        "target_met": None if ratio is None else ratio <= UNALIGNED_RATIO_TARGET,
        "loop_unaligned_to_none_throughput": thr,
    }


def summarise_termination(runs: Sequence[TerminationRun]) -> dict[str, dict[str, Any]]:
    """Per policy: the latency's median and max over the finished runs."""
    out: dict[str, dict[str, Any]] = {}
    for policy in dict.fromkeys(r.policy for r in runs):
        rs = [r for r in runs if r.policy == policy]
        lat = [r.latency_ms for r in rs if r.status == "finished" and r.latency_ms is not None]
        low = [
            r.exit_latency_ms
            for r in rs
            if r.status == "finished" and r.exit_latency_ms is not None
        ]
        row: dict[str, Any] = {
            "runs": len(lat),
            "failed": len(rs) - len(lat),
            "latency_ms": _range(lat),
            "exit_latency_ms": _range(low),
            "run_s": _range([r.run_s for r in rs if r.status == "finished"]),
            "rounds": _range([float(max(r.rounds)) for r in rs if r.rounds]),
            "target_ms": TERMINATION_TARGET_MS,
            "target_met": None if not lat else max(lat) <= TERMINATION_TARGET_MS,
        }
        out[policy] = row
    return out


def _cell(stat: dict[str, float] | None, scale: float = 1.0, digits: int = 0) -> str:
    if stat is None:
        return "–"
    med, lo, hi = (round(stat[k] / scale, digits) + 0.0 for k in ("median", "min", "max"))
    return f"{med:,.{digits}f} ({lo:,.{digits}f}–{hi:,.{digits}f})"


def to_markdown(summary: dict[str, dict[str, Any]]) -> str:
    """One row per variant: pooled checkpoint durations, then medians (min–max) of
    the runs."""

    def dur(d: dict[str, float | None]) -> str:
        if d.get("median") is None:
            return "–"
        return " / ".join(f"{d[k]:,.0f}" for k in ("median", "p90", "max"))

    rows = [
        "| variant | runs | checkpoints (aborted) | duration median / p90 / max (ms) "
        "| run medians (ms) | in-flight (KiB) | in-flight first → last (KiB) "
        "| head in-flight (KiB) | head log (KiB) "
        "| feedback spilled (MiB) | loop backlog at stop (records) | out of the loop (records/s) "
        "| raw write / + fsync of the log (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in summary.items():
        failed = f" (+{r['failed']} failed)" if r["failed"] else ""
        raw = "–"
        if r["raw_write_ms"] is not None and r["raw_write_fsync_ms"] is not None:
            raw = f"{r['raw_write_ms']['median']:.1f} / {r['raw_write_fsync_ms']['median']:.1f}"
        loop = name.startswith("loop")
        first, last = r["inflight_first"], r["inflight_last"]
        growth = (
            "–"
            if first is None or last is None
            else (f"{first['median'] / 1024:,.0f} → {last['median'] / 1024:,.0f}")
        )
        rows.append(
            f"| {name} | {r['runs']}{failed} | {r['checkpoints']} ({r['aborted']}) "
            f"| {dur(r['duration_ms'])} | {_cell(r['run_medians_ms'])} "
            f"| {_cell(r['inflight_bytes'], 1024)} | {growth} "
            f"| {_cell(r['head_inflight_bytes'], 1024)} "
            f"| {_cell(r['logged_bytes'], 1024)} "
            f"| {_cell(r['feedback_spilled_bytes'], 1 << 20, 1) if loop else '–'} "
            f"| {_cell(r['backlog_records']) if loop else '–'} "
            f"| {_cell(r['throughput_rps'])} | {raw} |"
        )
    return "\n".join(rows) + "\n"


def termination_markdown(summary: dict[str, dict[str, Any]]) -> str:
    rows = [
        "| policy | runs | body's last final pass → loop ended (ms), upper bound "
        "| exit's last record → loop ended (ms), lower bound | probe rounds | run (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for policy, r in summary.items():
        failed = f" (+{r['failed']} failed)" if r["failed"] else ""
        lat = r["latency_ms"]
        rows.append(
            f"| {policy} | {r['runs']}{failed} | {_cell(lat, digits=1)} "
            f"| {_cell(r['exit_latency_ms'], digits=1)} | {_cell(r['rounds'])} "
            f"| {_cell(r['run_s'], digits=2)} |"
        )
    return "\n".join(rows) + "\n"
