"""Running the bench: one backpressured job per policy (and the local
comparison), its checkpoints and sink throughput summarised, and the verdicts."""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from spillover.benchmark.progress import (
    ProgressBar,
)
from spillover.benchmark.results import _fmt_bytes
from spillover.benchmark.spec import (
    _PLACEHOLDER_DIR,
    _STOPPED,
    DURATION_RATIO_TARGET,
    EXECUTOR_COST_TARGET,
    PACED_SHARE,
    SAMPLE_EVERY_S,
    THROUGHPUT_RATIO_TARGET,
    BenchSpec,
    build_job,
)
from spillover.config.policies import POLICIES
from spillover.deploy import create_executor
from spillover.errors import ConfigError
from spillover.runtime.jobmaster import JobResult


def _stats(values: Sequence[float], p90: bool = True) -> dict[str, float | None]:
    """Median, 90th percentile (linear) and max; None each when there is no value."""
    keys = ("median", "p90", "max") if p90 else ("median", "max")
    if not values:
        return dict.fromkeys(keys)
    out = {"median": float(statistics.median(values)), "max": float(max(values))}
    if p90:
        out["p90"] = float(np.percentile(np.asarray(values, dtype=float), 90))
    return {k: round(out[k], 3) for k in keys}


def trigger_offsets(
    checkpoints: Sequence[dict[str, Any]], interval_s: float, started_wall: float
) -> tuple[list[float], bool]:
    """Seconds from job start to each checkpoint's trigger, and whether they are exact.

    Exact when the summaries carry ``trigger_ms``. Otherwise rebuilt from the
    coordinator's schedule (one checkpoint at a time, the first ``interval_s`` after
    start, each next one ``interval_s`` after the previous trigger or when the
    previous one ended, whichever is later): off by the coordinator's reaction time,
    a few ms per checkpoint.
    """
    if checkpoints and all("trigger_ms" in c for c in checkpoints):
        return [c["trigger_ms"] / 1000 - started_wall for c in checkpoints], True
    order = sorted(range(len(checkpoints)), key=lambda i: checkpoints[i]["checkpoint_id"])
    offsets = [0.0] * len(checkpoints)
    t = interval_s
    for i in order:
        offsets[i] = t
        t += max(interval_s, checkpoints[i]["duration_ms"] / 1000)
    return offsets, False


@dataclass
class PolicyResult:
    """What one run measured; ``checkpoint_list`` holds every checkpoint and
    ``sink_series`` the sink's ``records_in`` as ``[seconds since start, records]``."""

    policy: str
    executor: str
    status: str  # stopped (ran its time) | failed (see failures)
    window_s: float
    sink_records: int
    throughput_rps: float
    checkpoints: int = 0  # completed, triggered within the window
    aborted: int = 0  # aborted within the window, not counting one cut off by the stop
    cut_off: int = 0  # still running when the run stopped
    # Trigger to completion: the metadata durable and the completion recorded.
    checkpoint_duration_ms: dict[str, float | None] = field(default_factory=dict)
    # Trigger to the last acknowledgement: Flink's end_to_end_duration (docs/benchmarks.md).
    checkpoint_acked_ms: dict[str, float | None] = field(default_factory=dict)
    start_delay_ms: dict[str, float | None] = field(default_factory=dict)
    alignment_ms: dict[str, float | None] = field(default_factory=dict)
    inflight_bytes: dict[str, float | None] = field(default_factory=dict)
    trigger_times_exact: bool = True
    source_backpressured_share: float = 0.0
    failures: list[str] = field(default_factory=list)
    checkpoint_list: list[dict[str, Any]] = field(default_factory=list)
    sink_series: list[list[float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        """One line of progress."""
        who = f"{self.executor} {self.policy}"
        rps = f"sink {self.throughput_rps:,.0f} records/s"
        if self.status == "failed":
            return f"{who}: FAILED: {'; '.join(self.failures)}"
        if self.policy == "none":
            return f"{who}: no checkpoints, {rps}"
        d = self.checkpoint_duration_ms
        med = "-" if d.get("median") is None else f"{d['median']:.0f} ms"
        p90 = "-" if d.get("p90") is None else f"{d['p90']:.0f} ms"
        acked = self.checkpoint_acked_ms.get("median")
        acked_text = "" if acked is None else f" ({acked:.0f} ms to the last ack)"
        infl = self.inflight_bytes.get("median")
        infl_text = "-" if infl is None else _fmt_bytes(infl)
        return (
            f"{who}: {self.checkpoints} checkpoints ({self.aborted} aborted"
            f"{f', {self.cut_off} cut off by the stop' if self.cut_off else ''}), "
            f"median {med}{acked_text}, p90 {p90}, in-flight median "
            f"{infl_text}, {rps}"
        )


def _summarise(
    spec: BenchSpec,
    policy: str,
    executor: str,
    result: JobResult,
    started_wall: float,
    sampled: _Samples,
) -> PolicyResult:
    (t1, n1), (t2, n2) = sampled.window if len(sampled.window) == 2 else [(0.0, 0), (0.0, 0)]
    window = t2 - t1
    cps = [dict(c) for c in result.checkpoints if not c.get("final")]
    offsets, exact = trigger_offsets(cps, spec.interval_ms / 1000, started_wall)
    for c, off in zip(cps, offsets, strict=True):
        c["trigger_s"] = round(off, 3)
        c["in_window"] = spec.warmup_s <= off < spec.run_s
    inside = [c for c in cps if c["in_window"]]
    done = [c for c in inside if c["status"] == "completed"]
    cut = [c for c in inside if c["status"] == "aborted" and c.get("reason") == _STOPPED]
    sources = [m for k, m in result.tasks.items() if k.startswith("source#")]
    return PolicyResult(
        policy=policy,
        executor=executor,
        status="failed" if sampled.error else result.status,
        window_s=round(window, 3),
        sink_records=n2 - n1,
        throughput_rps=round((n2 - n1) / window, 1) if window > 0 else 0.0,
        checkpoints=len(done),
        aborted=sum(c["status"] == "aborted" for c in inside) - len(cut),
        cut_off=len(cut),
        checkpoint_duration_ms=_stats([c["duration_ms"] for c in done]),
        checkpoint_acked_ms=_stats([c["acked_ms"] for c in done]),
        start_delay_ms=_stats([c["start_delay_ms"] for c in done]),
        alignment_ms=_stats([c["alignment_ms"] for c in done]),
        inflight_bytes=_stats([c["inflight_bytes"] for c in done], p90=False),
        trigger_times_exact=exact,
        source_backpressured_share=round(
            statistics.fmean(m.get("backpressured_share", 0.0) for m in sources), 3
        )
        if sources
        else 0.0,
        failures=list(result.failures) + ([sampled.error] if sampled.error else []),
        checkpoint_list=cps,
        sink_series=[[t, n] for t, n in sampled.series],
    )


@dataclass
class _Samples:
    """The sink's records_in as read by the driver during one run."""

    window: list[tuple[float, int]] = field(default_factory=list)  # (monotonic, records) x2
    series: list[tuple[float, int]] = field(default_factory=list)  # (s since start, records)
    error: str = ""
    # When the subtasks started running (the window counts from there, so a slow
    # stage start on a busy machine is not measured), and whether the window ended.
    started_wall: float | None = None
    done: threading.Event = field(default_factory=threading.Event)


def run_policy(
    spec: BenchSpec,
    policy: str,
    checkpoint_dir: str | None = None,
    executor: str | None = None,
    on_tick: Callable[[float], None] | None = None,
) -> PolicyResult:
    """Runs the job once under ``policy`` for ``spec.run_s`` seconds.

    ``executor`` defaults to ``spec.executor`` (the Spark master of the spec applies
    to the spark executor only). ``checkpoint_dir`` defaults to ``spec.checkpoint_dir``,
    else a temporary directory removed afterwards. Each run's checkpoints go under a
    job name of their own. ``on_tick`` gets the seconds since start at every sample.
    """
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}", hint=f"choose from {POLICIES}")
    kind = executor or spec.executor
    base = checkpoint_dir or spec.checkpoint_dir
    temp = None if base is not None or policy == "none" else tempfile.mkdtemp("-spillover-bench")
    run_id = uuid.uuid4().hex[:8]
    try:
        env = build_job(spec, f"bench-{kind}-{policy}-{run_id}")
        ex = create_executor(
            kind,
            env,
            spec.config(policy, base or temp or _PLACEHOLDER_DIR),
            master=spec.master if kind == "spark" else None,
        )
        ex.prepare()  # the cluster's start-up is not part of the measured run
        result, sampled, started_wall = run_sampled(
            ex,
            lambda: ex.live_metric("sink", "records_in"),
            spec.warmup_s,
            spec.run_s,
            spec.duration_s,
            on_tick=on_tick,
        )
        return _summarise(spec, policy, kind, result, started_wall, sampled)
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)


def run_sampled(
    ex: Any,
    read: Callable[[], float],
    warmup_s: float,
    run_s: float,
    duration_s: float,
    *,
    on_tick: Callable[[float], None] | None = None,
    timeout_s: float = 600.0,
) -> tuple[Any, _Samples, float]:
    """Runs the prepared executor ``ex`` while a thread samples ``read`` over the
    window from ``warmup_s`` to just before ``run_s`` (seconds since the subtasks
    started), and stops the job once the window is sampled. Returns the job's
    result, the samples and the wall-clock time the subtasks started."""
    sampled = _Samples()
    stop = threading.Event()
    started_wall = time.time()
    sampler = threading.Thread(
        target=_sample,
        args=(
            read,
            ex.running_since,
            # The last sample a little before the stop, so the job still runs then.
            (warmup_s, run_s - min(0.2, duration_s / 10)),
            sampled,
            stop,
            on_tick,
        ),
        name="bench-sampler",
        daemon=True,
    )
    sampler.start()
    try:
        # Stopped once the window, counted from the subtasks' start, is sampled.
        result = ex.run(timeout=run_s + timeout_s, stop_when=lambda _: sampled.done.is_set())
    finally:
        stop.set()
        sampler.join()
    return result, sampled, sampled.started_wall or started_wall


def _sample(
    read: Callable[[], float],
    running_since: Callable[[], float | None],
    window: tuple[float, float],
    out: _Samples,
    stop: threading.Event,
    on_tick: Callable[[float], None] | None,
) -> None:
    """Reads the sink's records every :data:`SAMPLE_EVERY_S` until ``window`` ends,
    and at both its ends (seconds since the subtasks started running), then sets
    ``out.done``; gives up once ``stop`` is set before a sample is due (the job
    ended early)."""
    started = running_since()
    while started is None:
        if stop.wait(0.01):
            return
        started = running_since()
    out.started_wall = time.time() - (time.monotonic() - started)
    try:
        _sample_window(read, started, window, out, stop, on_tick)
    finally:
        out.done.set()


def _sample_window(
    read: Callable[[], float],
    started: float,
    window: tuple[float, float],
    out: _Samples,
    stop: threading.Event,
    on_tick: Callable[[float], None] | None,
) -> None:
    end = window[1]
    ticks = {k * SAMPLE_EVERY_S for k in range(1, int(end / SAMPLE_EVERY_S) + 1)}
    for due in sorted(ticks | set(window)):
        if stop.wait(max(0.0, started + due - time.monotonic())):
            return
        now = time.monotonic()
        try:
            n = int(read())
        except Exception as e:  # a metric that cannot be read fails the run, not the bench
            out.error = f"reading the sink's records_in: {type(e).__name__}: {e}"
            return
        out.series.append((round(now - started, 3), n))
        if due in window:
            out.window.append((now, n))
        if on_tick is not None:
            on_tick(now - started)


def machine() -> dict[str, Any]:
    """Where the figures come from: CPU, cores, load, Python, commit."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=os.path.dirname(__file__),
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "commit": commit or None,
    }


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else round(num / den, 3)


def compare(
    policies: dict[str, dict[str, Any]],
    local: dict[str, dict[str, Any]] | None = None,
    pace_rps: float | None = None,
) -> dict[str, Any]:
    """The ratios of the targets, None where a policy did not run or measured 0.

    ``local``: the same policies on the local executor; ``executor_vs_local`` then
    gives, per policy, the sink throughput on the bench's executor over the local one.
    ``pace_rps``: what the sinks take at most, all subtasks together; a policy is
    ``paced`` when either run reached :data:`PACED_SHARE` of it. Both executors are then
    capped at that pace, and the ratio says whether the executor keeps it, not its cost.
    """

    def median(policy: str) -> float | None:
        value: float | None = (
            policies.get(policy, {}).get("checkpoint_duration_ms", {}).get("median")
        )
        return value

    def rps(runs: dict[str, dict[str, Any]], policy: str) -> float | None:
        value: float | None = runs.get(policy, {}).get("throughput_rps")
        return value

    dur = _ratio(median("aligned"), median("unaligned"))
    thr = _ratio(rps(policies, "unaligned"), rps(policies, "none"))
    vs_local = {}
    for policy in local or {}:
        here, there = rps(policies, policy), rps(local or {}, policy)
        r = _ratio(here, there)
        vs_local[policy] = {
            "throughput_rps": here,
            "local_throughput_rps": there,
            "ratio": r,
            "cost": None if r is None else round(1 - r, 3),
            "target_met": None if r is None else 1 - r <= EXECUTOR_COST_TARGET,
            "paced": None
            if r is None or not pace_rps
            else max(here or 0.0, there or 0.0) >= PACED_SHARE * pace_rps,
        }
    return {
        "aligned_to_unaligned_median_duration": dur,
        "duration_target": DURATION_RATIO_TARGET,
        "duration_target_met": None if dur is None else dur >= DURATION_RATIO_TARGET,
        "unaligned_to_none_throughput": thr,
        "throughput_target": THROUGHPUT_RATIO_TARGET,
        "throughput_target_met": None if thr is None else thr >= THROUGHPUT_RATIO_TARGET,
        "executor_vs_local": vs_local,
        "executor_cost_target": EXECUTOR_COST_TARGET,
        "sink_pace_rps": pace_rps,
    }


def run(
    spec: BenchSpec,
    progress: Callable[[str], None] | None = None,
    bar: ProgressBar | None = None,
) -> dict[str, Any]:
    """Runs every run of ``spec.runs()``, ``spec.repeat`` rounds of them (round 1 of
    every run, then round 2, ...); returns the JSON-able report.

    ``policies`` (and ``local``, the comparison's) hold one entry per policy: the
    medians over its rounds with their spread (:func:`aggregate`), and under
    ``runs`` every round's own figures. ``progress`` gets one line per finished
    run; ``bar`` is moved along meanwhile.
    """
    rounds: dict[str, list[dict[str, Any]]] = {}
    local_rounds: dict[str, list[dict[str, Any]]] = {}
    started = time.monotonic()
    try:
        for n in range(1, spec.repeat + 1):
            seen: set[str] = set()
            for kind, policy in spec.runs():
                if bar is not None:
                    bar.start(kind, policy, n)
                r = run_policy(
                    spec, policy, executor=kind, on_tick=None if bar is None else bar.update
                )
                is_baseline = policy in seen  # the policy's run on spec.executor came first
                seen.add(policy)
                (local_rounds if is_baseline else rounds).setdefault(policy, []).append(
                    {**r.to_dict(), "round": n}
                )
                if bar is not None:
                    bar.clear()
                if progress is not None:
                    where = f"round {n}/{spec.repeat}: " if spec.repeat > 1 else ""
                    progress(where + r.line() + (" (local comparison)" if is_baseline else ""))
    finally:
        if bar is not None:
            bar.clear()
    policies = {p: aggregate(rs) for p, rs in rounds.items()}
    local = {p: aggregate(rs) for p, rs in local_rounds.items()}
    return {
        "spec": spec.to_dict(),
        "machine": machine(),
        "executor": spec.executor,
        "elapsed_s": round(time.monotonic() - started, 1),
        "policies": policies,
        "local": local,
        "comparison": compare(policies, local, spec.sink_rate * spec.parallelism),
    }


# What the table shows with its spread over rounds: (metric, statistic) of each run.
SPREAD = (
    ("checkpoint_duration_ms", "median"),
    ("checkpoint_duration_ms", "p90"),
    ("checkpoint_acked_ms", "median"),
    ("checkpoint_acked_ms", "p90"),
    ("inflight_bytes", "median"),
    ("throughput_rps", None),
)


def spread_key(metric: str, stat: str | None) -> str:
    """The key of a figure in a policy's ``spread``: ``checkpoint_duration_ms.median``."""
    return metric if stat is None else f"{metric}.{stat}"


def aggregate(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One policy's figures over its rounds (each a :class:`PolicyResult` dict with its
    ``round``): the median over rounds of each run's median and p90 (the max of its
    maxes), counts summed, and in ``spread`` the ``[min, max]`` over rounds of the
    figures of :data:`SPREAD`. Failed rounds count in ``status`` and ``failures``
    only, unless every round failed. ``runs`` keeps every round."""
    ok = [r for r in rounds if r["status"] != "failed"] or list(rounds)

    def values(metric: str, stat: str | None) -> list[float]:
        got = (r[metric] if stat is None else r.get(metric, {}).get(stat) for r in ok)
        return [float(v) for v in got if v is not None]

    def median(metric: str, stat: str | None) -> float | None:
        vs = values(metric, stat)
        return round(float(statistics.median(vs)), 3) if vs else None

    def stats(metric: str) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for k in dict.fromkeys(k for r in rounds for k in r.get(metric, {})):
            vs = values(metric, k)
            out[k] = (max(vs) if vs else None) if k == "max" else median(metric, k)
        return out

    first = rounds[0]
    spread = {}
    for metric, stat in SPREAD:
        vs = values(metric, stat)
        spread[spread_key(metric, stat)] = [min(vs), max(vs)] if vs else None
    return {
        "policy": first["policy"],
        "executor": first["executor"],
        "status": "failed" if any(r["status"] == "failed" for r in rounds) else "stopped",
        "rounds": len(rounds),
        "window_s": median("window_s", None),
        "sink_records": int(sum(r["sink_records"] for r in ok)),
        "throughput_rps": median("throughput_rps", None) or 0.0,
        "checkpoints": sum(r["checkpoints"] for r in ok),
        "aborted": sum(r["aborted"] for r in ok),
        "cut_off": sum(r["cut_off"] for r in ok),
        **{
            m: stats(m)
            for m in (
                "checkpoint_duration_ms",
                "checkpoint_acked_ms",
                "start_delay_ms",
                "alignment_ms",
                "inflight_bytes",
            )
        },
        "spread": spread,
        "trigger_times_exact": all(r["trigger_times_exact"] for r in rounds),
        "source_backpressured_share": median("source_backpressured_share", None) or 0.0,
        "failures": [
            f"round {r['round']}: {f}" if len(rounds) > 1 else f
            for r in rounds
            for f in r["failures"]
        ],
        "runs": list(rounds),
    }
