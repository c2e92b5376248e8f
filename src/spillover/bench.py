"""Checkpoints under backpressure: one run of a backpressured job per barrier policy.

The job: an unthrottled ``GeneratorSource`` (int64 keys out of ``keys``, payloads of
``payload_bytes``) → ``key_by("key")`` → ``KeyedCount`` → ``rebalance()`` → a sink
paced at ``sink_rate`` records/s per subtask, so every channel is full and a barrier
that waits behind data waits long. Each policy runs ``warmup_s + duration_s`` on the
local executor; checkpoint figures cover the checkpoints triggered after the warm-up,
sink throughput the records the sinks took between warm-up end and run end.
"""

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
from typing import Any, ClassVar

import numpy as np

from spillover.config import Config
from spillover.errors import ConfigError
from spillover.runtime.api import Batch, Operator, OperatorContext
from spillover.runtime.executor import JobResult, LocalExecutor
from spillover.runtime.graph import StreamEnvironment
from spillover.runtime.operators import KeyedCount
from spillover.runtime.sinks import ThrottledSink
from spillover.runtime.sources import GeneratorSource

POLICIES = ("none", "aligned", "unaligned", "timeout", "max-inflight")
EXECUTORS = ("local",)
# Targets of docs/benchmarks.md.
DURATION_RATIO_TARGET = 50.0  # aligned median duration / unaligned median duration
THROUGHPUT_RATIO_TARGET = 0.95  # unaligned sink throughput / sink throughput without checkpoints
_STOPPED = "job attempt ended"  # the coordinator's reason for checkpoints cut off by the stop
_PLACEHOLDER_DIR = "/nonexistent/spillover-bench"  # only to check configs before any run


@dataclass
class BenchSpec:
    """What to run; checked when built (a bad value raises :class:`ConfigError`)."""

    policies: Sequence[str] = POLICIES
    parallelism: int = 2
    duration_s: float = 30.0
    warmup_s: float = 5.0
    interval_ms: int = 1000
    sink_rate: float = 5000.0  # records/s per sink subtask
    keys: int = 10_000
    payload_bytes: int = 100
    aligned_timeout_ms: int = 100
    max_inflight_bytes: int = 1024 * 1024
    checkpoint_dir: str | None = None  # None: a temporary directory, removed afterwards
    executor: str = "local"

    def __post_init__(self) -> None:
        self.policies = tuple(self.policies)
        bad = [p for p in self.policies if p not in POLICIES]
        if bad or not self.policies:
            raise ConfigError(
                "bad policies",
                detail=f"got {list(self.policies)}",
                hint=f"choose one or more of {', '.join(POLICIES)}",
            )
        if len(set(self.policies)) != len(self.policies):
            raise ConfigError("bad policies", detail=f"{list(self.policies)} names one twice")
        if self.executor not in EXECUTORS:
            raise ConfigError(
                f"executor {self.executor!r} is not available for benchmarks yet",
                hint="use 'local' (threads in this process)",
            )
        _check(self.parallelism >= 1, "parallelism", self.parallelism, ">= 1")
        _check(self.duration_s > 0, "duration_s", self.duration_s, "> 0")
        _check(self.warmup_s >= 0, "warmup_s", self.warmup_s, ">= 0")
        _check(self.sink_rate > 0, "sink_rate", self.sink_rate, "> 0")
        _check(self.keys >= 1, "keys", self.keys, ">= 1")
        _check(self.payload_bytes >= 1, "payload_bytes", self.payload_bytes, ">= 1")
        _check(self.aligned_timeout_ms > 0, "aligned_timeout_ms", self.aligned_timeout_ms, "> 0")
        for policy in self.policies:  # every config key checked before the first run
            self.config(policy, self.checkpoint_dir or _PLACEHOLDER_DIR)

    def config(self, policy: str, checkpoint_dir: str) -> Config:
        """The runtime configuration of one policy's run."""
        options: dict[str, Any] = {
            "parallelism.default": self.parallelism,
            "restart-strategy.type": "none",  # a failure ends the run: it is not measured
        }
        if policy != "none":
            options["execution.checkpointing.interval"] = f"{self.interval_ms} ms"
            options["state.checkpoints.dir"] = checkpoint_dir
        if policy in ("unaligned", "timeout", "max-inflight"):
            options["execution.checkpointing.unaligned.enabled"] = True
        if policy == "timeout":
            options["execution.checkpointing.aligned-checkpoint-timeout"] = (
                f"{self.aligned_timeout_ms} ms"
            )
        if policy == "max-inflight":
            options["execution.checkpointing.unaligned.max-inflight-bytes"] = (
                self.max_inflight_bytes
            )
        return Config.from_dict(options)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["policies"] = list(self.policies)
        return d


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ConfigError(f"bad {name}", detail=f"{value!r} is not {rule}")


class _SinkCounts:
    """Records received per sink subtask of one run, read from the driver thread."""

    runs: ClassVar[dict[str, _SinkCounts]] = {}

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[int, int] = {}

    def add(self, subtask: int, n: int) -> None:
        with self._lock:
            self._counts[subtask] = self._counts.get(subtask, 0) + n

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())


class RecordCounter(Operator):
    """A sink that counts the records of each batch into the run's :class:`_SinkCounts`.

    Subtasks get deep copies of the operator, so it holds only the run's id.
    """

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id

    def open(self, ctx: OperatorContext) -> None:
        super().open(ctx)
        self._counts = _SinkCounts.runs[self.run_id]

    def process(self, batch: Batch, input_index: int = 0) -> None:
        self._counts.add(self.ctx.subtask_index, len(batch))


def build_job(spec: BenchSpec, name: str, run_id: str) -> StreamEnvironment:
    """The benchmark's job; the sinks count into ``_SinkCounts.runs[run_id]``."""
    p = spec.parallelism
    env = StreamEnvironment(name, parallelism=p)
    source = GeneratorSource(
        partitions=2 * p,
        records_per_partition=None,
        rate_per_subtask=None,
        payload_bytes=spec.payload_bytes,
        keys=spec.keys,
    )
    (
        env.from_source(source, uid="source")
        .key_by("key")
        .process(KeyedCount("key", out="updates"), uid="count")
        .rebalance()
        .sink(ThrottledSink(spec.sink_rate, inner=RecordCounter(run_id)), uid="sink")
    )
    return env


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
    """What one policy's run measured; ``checkpoint_list`` holds every checkpoint."""

    policy: str
    status: str  # stopped (ran its time) | failed (see failures)
    window_s: float
    sink_records: int
    throughput_rps: float
    checkpoints: int = 0  # completed, triggered within the window
    aborted: int = 0  # aborted within the window, not counting one cut off by the stop
    cut_off: int = 0  # still running when the run stopped
    checkpoint_duration_ms: dict[str, float | None] = field(default_factory=dict)
    start_delay_ms: dict[str, float | None] = field(default_factory=dict)
    alignment_ms: dict[str, float | None] = field(default_factory=dict)
    inflight_bytes: dict[str, float | None] = field(default_factory=dict)
    trigger_times_exact: bool = True
    source_backpressured_share: float = 0.0
    failures: list[str] = field(default_factory=list)
    checkpoint_list: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        """One line of progress."""
        rps = f"sink {self.throughput_rps:,.0f} records/s"
        if self.status == "failed":
            return f"{self.policy}: FAILED: {'; '.join(self.failures)}"
        if self.policy == "none":
            return f"{self.policy}: no checkpoints, {rps}"
        d = self.checkpoint_duration_ms
        med = "-" if d.get("median") is None else f"{d['median']:.0f} ms"
        p90 = "-" if d.get("p90") is None else f"{d['p90']:.0f} ms"
        infl = self.inflight_bytes.get("median")
        infl_text = "-" if infl is None else _fmt_bytes(infl)
        return (
            f"{self.policy}: {self.checkpoints} checkpoints ({self.aborted} aborted"
            f"{f', {self.cut_off} cut off by the stop' if self.cut_off else ''}), "
            f"median {med}, p90 {p90}, in-flight median "
            f"{infl_text}, {rps}"
        )


def _summarise(
    spec: BenchSpec,
    policy: str,
    result: JobResult,
    started_wall: float,
    samples: list[tuple[float, int]],
) -> PolicyResult:
    (t1, n1), (t2, n2) = samples if len(samples) == 2 else [(0.0, 0), (0.0, 0)]
    window = t2 - t1
    cps = [dict(c) for c in result.checkpoints if not c.get("final")]
    offsets, exact = trigger_offsets(cps, spec.interval_ms / 1000, started_wall)
    end = spec.warmup_s + spec.duration_s
    for c, off in zip(cps, offsets, strict=True):
        c["trigger_s"] = round(off, 3)
        c["in_window"] = spec.warmup_s <= off < end
    inside = [c for c in cps if c["in_window"]]
    done = [c for c in inside if c["status"] == "completed"]
    cut = [c for c in inside if c["status"] == "aborted" and c.get("reason") == _STOPPED]
    sources = [m for k, m in result.tasks.items() if k.startswith("source#")]
    return PolicyResult(
        policy=policy,
        status=result.status,
        window_s=round(window, 3),
        sink_records=n2 - n1,
        throughput_rps=round((n2 - n1) / window, 1) if window > 0 else 0.0,
        checkpoints=len(done),
        aborted=sum(c["status"] == "aborted" for c in inside) - len(cut),
        cut_off=len(cut),
        checkpoint_duration_ms=_stats([c["duration_ms"] for c in done]),
        start_delay_ms=_stats([c["start_delay_ms"] for c in done]),
        alignment_ms=_stats([c["alignment_ms"] for c in done]),
        inflight_bytes=_stats([c["inflight_bytes"] for c in done], p90=False),
        trigger_times_exact=exact,
        source_backpressured_share=round(
            statistics.fmean(m.get("backpressured_share", 0.0) for m in sources), 3
        )
        if sources
        else 0.0,
        failures=list(result.failures),
        checkpoint_list=cps,
    )


def run_policy(spec: BenchSpec, policy: str, checkpoint_dir: str | None = None) -> PolicyResult:
    """Runs the job once under ``policy`` for ``warmup_s + duration_s`` seconds.

    ``checkpoint_dir`` defaults to ``spec.checkpoint_dir``, else a temporary directory
    removed afterwards. Each run's checkpoints go under a job name of their own.
    """
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}", hint=f"choose from {POLICIES}")
    base = checkpoint_dir or spec.checkpoint_dir
    temp = None if base is not None or policy == "none" else tempfile.mkdtemp("-spillover-bench")
    run_id = uuid.uuid4().hex[:8]
    counts = _SinkCounts.runs[run_id] = _SinkCounts()
    try:
        env = build_job(spec, f"bench-{policy}-{run_id}", run_id)
        executor = LocalExecutor(env, spec.config(policy, base or temp or _PLACEHOLDER_DIR))
        samples: list[tuple[float, int]] = []
        stop = threading.Event()
        started = time.monotonic()
        started_wall = time.time()
        sampler = threading.Thread(
            target=_sample_at,
            args=(
                counts.total,
                [started + spec.warmup_s, started + spec.warmup_s + spec.duration_s],
                samples,
                stop,
            ),
            name="bench-sampler",
            daemon=True,
        )
        sampler.start()
        result = executor.run(stop_after=spec.warmup_s + spec.duration_s)
        stop.set()
        sampler.join()
        return _summarise(spec, policy, result, started_wall, samples)
    finally:
        del _SinkCounts.runs[run_id]
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)


def _sample_at(
    read: Callable[[], int],
    times: list[float],
    out: list[tuple[float, int]],
    stop: threading.Event,
) -> None:
    """Appends ``(time, count)`` at each of ``times``; gives up once ``stop`` is set
    before a sample is due (the job ended early)."""
    for t in times:
        if stop.wait(max(0.0, t - time.monotonic())):
            return
        out.append((time.monotonic(), read()))


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


def compare(policies: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The two ratios of the targets, None where a policy did not run or measured 0."""

    def ratio(num: float | None, den: float | None) -> float | None:
        return None if num is None or not den else round(num / den, 3)

    def median(policy: str) -> float | None:
        value: float | None = (
            policies.get(policy, {}).get("checkpoint_duration_ms", {}).get("median")
        )
        return value

    def rps(policy: str) -> float | None:
        value: float | None = policies.get(policy, {}).get("throughput_rps")
        return value

    dur = ratio(median("aligned"), median("unaligned"))
    thr = ratio(rps("unaligned"), rps("none"))
    return {
        "aligned_to_unaligned_median_duration": dur,
        "duration_target": DURATION_RATIO_TARGET,
        "duration_target_met": None if dur is None else dur >= DURATION_RATIO_TARGET,
        "unaligned_to_none_throughput": thr,
        "throughput_target": THROUGHPUT_RATIO_TARGET,
        "throughput_target_met": None if thr is None else thr >= THROUGHPUT_RATIO_TARGET,
    }


def run(spec: BenchSpec, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Runs every policy of ``spec`` in order; returns the JSON-able report."""
    policies: dict[str, dict[str, Any]] = {}
    for policy in spec.policies:
        r = run_policy(spec, policy)
        policies[policy] = r.to_dict()
        if progress is not None:
            progress(r.line())
    return {
        "spec": spec.to_dict(),
        "machine": machine(),
        "policies": policies,
        "comparison": compare(policies),
    }


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:,.0f}" if v >= 10 else f"{v:.1f}"


def to_markdown(results: dict[str, Any]) -> str:
    """A table with one row per policy, then the two ratios and their targets."""
    rows = [
        "| policy | checkpoints | aborted | duration median / p90 / max (ms) "
        "| start delay median / p90 (ms) | alignment median / p90 (ms) "
        "| in-flight median / max | sink records/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results["policies"].items():
        d, s, a, i = (
            r["checkpoint_duration_ms"],
            r["start_delay_ms"],
            r["alignment_ms"],
            r["inflight_bytes"],
        )
        if name == "none":
            cells = ["–"] * 6
        else:
            cells = [
                str(r["checkpoints"]),
                str(r["aborted"]) + (f" (+{r['cut_off']} cut off)" if r["cut_off"] else ""),
                f"{_ms(d['median'])} / {_ms(d['p90'])} / {_ms(d['max'])}",
                f"{_ms(s['median'])} / {_ms(s['p90'])}",
                f"{_ms(a['median'])} / {_ms(a['p90'])}",
                "–"
                if i["median"] is None
                else f"{_fmt_bytes(i['median'])} / {_fmt_bytes(i['max'])}",
            ]
        label = f"{name} (failed)" if r["status"] == "failed" else name
        rows.append(f"| {label} | " + " | ".join(cells) + f" | {r['throughput_rps']:,.0f} |")
    c = results["comparison"]
    lines = [*rows, ""]
    if c["aligned_to_unaligned_median_duration"] is not None:
        met = "met" if c["duration_target_met"] else "not met"
        lines.append(
            f"- aligned / unaligned median checkpoint duration: "
            f"{c['aligned_to_unaligned_median_duration']:,.1f}× "
            f"(target ≥ {c['duration_target']:g}×: {met})"
        )
    if c["unaligned_to_none_throughput"] is not None:
        met = "met" if c["throughput_target_met"] else "not met"
        lines.append(
            f"- unaligned / no-checkpoint sink throughput: "
            f"{c['unaligned_to_none_throughput']:.3f}× "
            f"(target ≥ {c['throughput_target']:g}×: {met})"
        )
    return "\n".join(lines).rstrip() + "\n"
