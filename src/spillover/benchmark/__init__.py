"""Checkpoints under backpressure: one run of a backpressured job per barrier policy.

The job: an unthrottled ``GeneratorSource`` (int64 keys out of ``keys``, payloads of
``payload_bytes``) → ``key_by("key")`` → ``KeyedCount`` → ``rebalance()`` → a sink
paced at ``sink_rate`` records/s per subtask, so every channel is full and a barrier
that waits behind data waits long. Each policy runs ``warmup_s + duration_s`` on
``executor``; the policies of ``compare_local`` run again on the local executor right
after, for the cost of the executor (when the sinks' pace holds the runs back: whether
it keeps that pace). Checkpoint figures cover the checkpoints
triggered after the warm-up; sink throughput is the sink's live ``records_in``
metric, sampled by the driver at warm-up end and run end.
"""

from __future__ import annotations

import csv
import itertools
import json
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
from typing import Any, TextIO

import numpy as np

from spillover.config import Config
from spillover.deploy import EXECUTORS, create_executor
from spillover.errors import ConfigError
from spillover.runtime.connectors.sinks import ThrottledSink
from spillover.runtime.connectors.sources import GeneratorSource
from spillover.runtime.graph import StreamEnvironment
from spillover.runtime.jobmaster import JobResult
from spillover.runtime.operators import KeyedCount

POLICIES = ("none", "aligned", "unaligned", "timeout", "max-inflight")
DEFAULT_EXECUTOR = "spark"
# With --executor spark, the policies repeated on the local executor unless told
# otherwise: the no-checkpoint baseline and the main policy, to keep the run short.
COMPARE_AUTO = ("none", "unaligned")
# Targets of docs/benchmarks.md.
DURATION_RATIO_TARGET = 50.0  # aligned median duration / unaligned median duration
THROUGHPUT_RATIO_TARGET = 0.95  # unaligned sink throughput / sink throughput without checkpoints
EXECUTOR_COST_TARGET = 0.10  # at most this share of the local executor's sink throughput lost
# A run whose sinks took this share of their pace (sink_rate x parallelism) was held back
# by them: compared at that pace, executors show whether they keep it, not what they cost.
PACED_SHARE = 0.95
SAMPLE_EVERY_S = 1.0  # the sink's records_in is read this often (the throughput plot)
_STOPPED = "job attempt ended"  # the coordinator's reason for checkpoints cut off by the stop
_PLACEHOLDER_DIR = "/nonexistent/spillover-bench"  # only to check configs before any run


@dataclass
class BenchSpec:
    """What to run; checked when built (a bad value raises :class:`ConfigError`).

    ``compare_local``: the policies to run again on the local executor, each right
    after its run on ``executor``; None picks :data:`COMPARE_AUTO` (those of them in
    ``policies``) with the spark executor and none with the local one.
    """

    policies: Sequence[str] = POLICIES
    parallelism: int = 2
    duration_s: float = 15.0
    warmup_s: float = 5.0
    interval_ms: int = 1000
    sink_rate: float = 5000.0  # records/s per sink subtask: lower is stronger backpressure
    keys: int = 10_000
    payload_bytes: int = 100
    aligned_timeout_ms: int = 100
    max_inflight_bytes: int = 1024 * 1024
    checkpoint_dir: str | None = None  # None: a temporary directory, removed afterwards
    executor: str = DEFAULT_EXECUTOR
    master: str | None = None  # the Spark master; None: the embedded local one
    compare_local: Sequence[str] | None = None

    def __post_init__(self) -> None:
        self.policies = tuple(self.policies)
        problems = _names_problems(self.policies, POLICIES)
        if problems or not self.policies:
            raise BenchSpecError(
                "bad policies",
                field="policies",
                detail=f"{list(self.policies)}: {problems or 'none given'}",
                hint=f"one or more of {', '.join(POLICIES)}, each once",
            )
        if self.executor not in EXECUTORS:
            raise BenchSpecError(
                "bad executor",
                field="executor",
                detail=repr(self.executor),
                hint=f"choose one of {', '.join(EXECUTORS)}",
            )
        if self.master is not None and self.executor != "spark":
            raise BenchSpecError(
                "master needs the spark executor",
                field="master",
                detail=f"{self.master!r} with executor {self.executor!r}",
                hint="add --executor spark",
            )
        if (
            self.master is not None
            and not self.master.startswith("local")
            and self.checkpoint_dir is None
            and set(self.policies) != {"none"}
        ):
            raise ConfigError(
                f"master {self.master!r} runs subtasks on other machines: they need "
                "checkpoint storage they all reach",
                hint="give --checkpoint-dir a shared URI (s3://..., hdfs://...)",
            )
        if self.compare_local is None:
            auto = COMPARE_AUTO if self.executor == "spark" else ()
            self.compare_local = tuple(p for p in self.policies if p in auto)
        self.compare_local = tuple(self.compare_local)
        problems = _names_problems(self.compare_local, self.policies, "not run")
        if problems:
            raise BenchSpecError(
                "bad compare_local",
                field="compare_local",
                detail=f"{list(self.compare_local)} against policies {list(self.policies)}: "
                + problems,
                hint="compare only policies that run, each once",
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

    def runs(self) -> list[tuple[str, str]]:
        """``(executor, policy)`` of every run, in order."""
        out = []
        for policy in self.policies:
            out.append((self.executor, policy))
            if policy in (self.compare_local or ()):
                out.append(("local", policy))
        return out

    @property
    def run_s(self) -> float:
        """Seconds of one run, warm-up included."""
        return self.warmup_s + self.duration_s

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
        d["compare_local"] = list(self.compare_local or ())
        return d


class BenchSpecError(ConfigError):
    """A bad :class:`BenchSpec` field. ``field`` names it, and the message calls it by
    that name, so that the command line can name the flag that set it instead."""

    def __init__(self, message: str, *, field: str = "", **kw: Any) -> None:
        super().__init__(message, **kw)
        self.field = field


def _names_problems(names: Sequence[str], allowed: Sequence[str], unknown: str = "unknown") -> str:
    """What is wrong with a list of names, each to be one of ``allowed`` at most once;
    empty when nothing is."""
    bad = [n for n in names if n not in allowed]
    twice = sorted({n for n in names if names.count(n) > 1} - set(bad))
    problems = [f"{', '.join(bad)} {unknown}"] if bad else []
    return "; ".join(problems + ([f"{', '.join(twice)} named twice"] if twice else []))


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ConfigError(f"bad {name}", detail=f"{value!r} is not {rule}")


def build_job(spec: BenchSpec, name: str) -> StreamEnvironment:
    """The benchmark's job; its sink operator has the uid ``sink``."""
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
        .sink(ThrottledSink(spec.sink_rate), uid="sink")
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
    checkpoint_duration_ms: dict[str, float | None] = field(default_factory=dict)
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
        infl = self.inflight_bytes.get("median")
        infl_text = "-" if infl is None else _fmt_bytes(infl)
        return (
            f"{who}: {self.checkpoints} checkpoints ({self.aborted} aborted"
            f"{f', {self.cut_off} cut off by the stop' if self.cut_off else ''}), "
            f"median {med}, p90 {p90}, in-flight median "
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
        sampled = _Samples()
        stop = threading.Event()
        started = time.monotonic()
        started_wall = time.time()
        sampler = threading.Thread(
            target=_sample,
            args=(
                lambda: ex.live_metric("sink", "records_in"),
                started,
                # The last sample a little before the stop, so the job still runs then.
                (spec.warmup_s, spec.run_s - min(0.2, spec.duration_s / 10)),
                sampled,
                stop,
                on_tick,
            ),
            name="bench-sampler",
            daemon=True,
        )
        sampler.start()
        try:
            result = ex.run(stop_after=spec.run_s)
        finally:
            stop.set()
            sampler.join()
        return _summarise(spec, policy, kind, result, started_wall, sampled)
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)


def _sample(
    read: Callable[[], float],
    started: float,
    window: tuple[float, float],
    out: _Samples,
    stop: threading.Event,
    on_tick: Callable[[float], None] | None,
) -> None:
    """Reads the sink's records every :data:`SAMPLE_EVERY_S` until ``window`` ends,
    and at both its ends (seconds since ``started``); gives up once ``stop`` is set
    before a sample is due (the job ended early)."""
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


class ProgressBar:
    """Which run is going and how far, on ``stream`` (stderr by default).

    On a terminal one line is redrawn in place; otherwise (a log, a pipe) each run
    prints one plain line when it starts.
    """

    def __init__(
        self,
        runs: int,
        run_s: float,
        warmup_s: float = 0.0,
        stream: TextIO | None = None,
        tty: bool | None = None,
        width: int = 20,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.runs, self.run_s, self.warmup_s, self.width = runs, run_s, warmup_s, width
        self.index = 0
        self.label = ""
        self._lock = threading.Lock()
        self._drawn = False

    def start(self, executor: str, policy: str) -> None:
        """Run ``index + 1`` of ``runs`` begins."""
        self.index += 1
        self.label = f"{executor} {policy}"
        if self.tty:
            self.update(0.0)
            return
        done = (self.index - 1) * self.run_s
        print(
            f"[{self.index}/{self.runs}] {self.label}: {self.run_s:g} s "
            f"(total {done:g}/{self.runs * self.run_s:g} s)",
            file=self.stream,
            flush=True,
        )

    def update(self, elapsed: float) -> None:
        """The current run has gone ``elapsed`` seconds (drawn on a terminal only)."""
        if not self.tty:
            return
        e = min(max(elapsed, 0.0), self.run_s)
        filled = round(self.width * e / self.run_s) if self.run_s > 0 else self.width
        bar = "#" * filled + "-" * (self.width - filled)
        total = (self.index - 1) * self.run_s + e
        phase = "warm-up" if e < self.warmup_s else "measuring"
        with self._lock:
            self.stream.write(
                f"\r\x1b[K[{self.index}/{self.runs}] {self.label:<24} [{bar}] "
                f"{e:3.0f}/{self.run_s:g} s {phase:<9}, "
                f"total {total:.0f}/{self.runs * self.run_s:g} s"
            )
            self.stream.flush()
            self._drawn = True

    def clear(self) -> None:
        """Removes the line, so other output starts on a clean line."""
        with self._lock:
            if self._drawn:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
                self._drawn = False


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
    """Runs every run of ``spec.runs()`` in order; returns the JSON-able report.

    ``progress`` gets one line per finished run; ``bar`` is moved along meanwhile.
    """
    policies: dict[str, dict[str, Any]] = {}
    local: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    try:
        for kind, policy in spec.runs():
            if bar is not None:
                bar.start(kind, policy)
            r = run_policy(spec, policy, executor=kind, on_tick=None if bar is None else bar.update)
            is_baseline = policy in policies  # the policy's run on spec.executor came first
            (local if is_baseline else policies)[policy] = r.to_dict()
            if bar is not None:
                bar.clear()
            if progress is not None:
                progress(r.line() + (" (local comparison)" if is_baseline else ""))
    finally:
        if bar is not None:
            bar.clear()
    return {
        "spec": spec.to_dict(),
        "machine": machine(),
        "executor": spec.executor,
        "elapsed_s": round(time.monotonic() - started, 1),
        "policies": policies,
        "local": local,
        "comparison": compare(policies, local, spec.sink_rate * spec.parallelism),
    }


def runs(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every run of a report: the bench executor's, then the local comparison's."""
    return [*results["policies"].values(), *results.get("local", {}).values()]


def to_markdown(results: dict[str, Any]) -> str:
    """A table with one row per run, the ratios and their targets, then the
    executor's throughput against the local executor's when compared."""
    rows = [
        "| executor | policy | checkpoints | aborted | duration median / p90 / max (ms) "
        "| start delay median / p90 (ms) | alignment median / p90 (ms) "
        "| in-flight median / max | sink records/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    tagged = [(r, "") for r in results["policies"].values()]
    tagged += [(r, " (comparison)") for r in results.get("local", {}).values()]
    for r, tag in tagged:
        name = r["policy"]
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
        rows.append(
            f"| {r['executor']}{tag} | {label} | "
            + " | ".join(cells)
            + f" | {r['throughput_rps']:,.0f} |"
        )
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
    vs = c.get("executor_vs_local") or {}
    if vs:
        ex = results.get("executor", results["spec"]["executor"])
        target = f"cost ≤ {c['executor_cost_target']:.0%}"
        lines += [
            "",
            f"| policy | {ex} records/s | local (comparison) records/s | {ex} / local | {target} |",
            "|---|---:|---:|---:|---|",
        ]
        for policy, v in vs.items():
            ratio = "–" if v["ratio"] is None else f"{v['ratio']:.3f}×"
            if v["target_met"] is None:
                verdict = "–"
            elif v.get("paced"):
                verdict = f"paced: {'keeps up' if v['target_met'] else 'falls behind'}"
            else:
                verdict = "met" if v["target_met"] else "not met"
            if v["cost"] is not None:
                verdict += f" ({v['cost']:+.1%})"
            lines.append(
                f"| {policy} | {v['throughput_rps'] or 0:,.0f} "
                f"| {v['local_throughput_rps'] or 0:,.0f} | {ratio} | {verdict} |"
            )
        paced = [p for p, v in vs.items() if v.get("paced")]
        if paced:
            spec = results["spec"]
            lines += [
                "",
                f"- Paced ({', '.join(paced)}): the sinks take at most "
                f"{c['sink_pace_rps']:,.0f} records/s ({spec['sink_rate']:g} per subtask × "
                f"{spec['parallelism']}) and a run reached {PACED_SHARE:.0%} of that, so both "
                f"executors were held to it: the ratio says whether {ex} keeps the pace, not "
                "what it costs. For a cost, give --sink-rate above what the job reaches.",
            ]
    return "\n".join(lines).rstrip() + "\n"


RUN_COLUMNS = (
    "executor",
    "policy",
    "status",
    "window_s",
    "sink_records",
    "throughput_rps",
    "vs_local",
    "checkpoints",
    "aborted",
    "cut_off",
    *(f"duration_ms_{k}" for k in ("median", "p90", "max")),
    *(f"start_delay_ms_{k}" for k in ("median", "p90", "max")),
    *(f"alignment_ms_{k}" for k in ("median", "p90", "max")),
    "inflight_bytes_median",
    "inflight_bytes_max",
    "source_backpressured_share",
)
CHECKPOINT_COLUMNS = (
    "executor",
    "policy",
    "checkpoint_id",
    "trigger_s",
    "in_window",
    "status",
    "duration_ms",
    "start_delay_ms",
    "alignment_ms",
    "inflight_bytes",
    "state_bytes",
    "reason",
)


def _run_row(r: dict[str, Any], vs_local: dict[str, Any] | None) -> dict[str, Any]:
    row = {k: r[k] for k in RUN_COLUMNS if k in r}
    row["vs_local"] = "" if vs_local is None or vs_local["ratio"] is None else vs_local["ratio"]
    for metric, prefix in (
        ("checkpoint_duration_ms", "duration_ms"),
        ("start_delay_ms", "start_delay_ms"),
        ("alignment_ms", "alignment_ms"),
        ("inflight_bytes", "inflight_bytes"),
    ):
        for k, v in r[metric].items():
            row[f"{prefix}_{k}"] = "" if v is None else v
    return row


def write_results(results: dict[str, Any], out_dir: str, plots: bool = True) -> list[str]:
    """Writes the report into ``out_dir`` (created): ``bench.json``, ``bench.md``,
    ``bench.csv`` (one row per run), ``checkpoints.csv`` (one row per checkpoint) and,
    with ``plots``, the PNGs of :func:`plot`. Returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, n) for n in ("bench.json", "bench.md")]
    with open(paths[0], "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
    with open(paths[1], "w") as f:
        f.write(to_markdown(results))
    vs = results["comparison"].get("executor_vs_local") or {}
    path = os.path.join(out_dir, "bench.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, RUN_COLUMNS)
        w.writeheader()
        for r in results["policies"].values():
            w.writerow(_run_row(r, vs.get(r["policy"])))
        for r in results.get("local", {}).values():
            w.writerow(_run_row(r, None))
    paths.append(path)
    path = os.path.join(out_dir, "checkpoints.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, CHECKPOINT_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in runs(results):
            for c in r["checkpoint_list"]:
                w.writerow({**c, "executor": r["executor"], "policy": r["policy"]})
    paths.append(path)
    if plots:
        paths += plot(results, out_dir)
    return paths


PLOTS = ("checkpoint-duration.png", "inflight-bytes.png", "throughput.png")


def plot(results: dict[str, Any], out_dir: str) -> list[str]:
    """Draws :data:`PLOTS` into ``out_dir`` from a report (also one read back from
    ``bench.json``): checkpoint duration and persisted in-flight bytes per checkpoint
    over time, one series per policy; sink throughput per policy and executor, and
    over time per run. Returns the paths written."""
    from matplotlib.figure import Figure  # lazily: only the plots need matplotlib

    spec = results["spec"]
    ex = results.get("executor", spec["executor"])
    colors = {p: f"C{i}" for i, p in enumerate(POLICIES)}
    warmup, end = spec["warmup_s"], spec["warmup_s"] + spec["duration_s"]
    setting = (
        f"parallelism {spec['parallelism']}, checkpoint every {spec['interval_ms']} ms, "
        f"sink {spec['sink_rate']:g} records/s per subtask"
    )
    with_cps = [r for r in results["policies"].values() if r["policy"] != "none"]
    paths = []

    def checkpoint_plot(title: str, ylabel: str, value: Callable[[dict[str, Any]], float]) -> Any:
        fig = Figure(figsize=(9, 4.8), layout="constrained")
        ax = fig.add_subplot()
        ax.axvspan(0, warmup, color="0.92", label="warm-up (not measured)")
        for r in with_cps:
            cps = sorted(r["checkpoint_list"], key=lambda c: c["trigger_s"])
            done = [c for c in cps if c["status"] == "completed"]
            ax.plot(
                [c["trigger_s"] for c in done],
                [value(c) for c in done],
                "o-",
                ms=3,
                lw=1,
                color=colors[r["policy"]],
                label=r["policy"],
            )
            aborted = [c for c in cps if c["status"] != "completed"]
            if aborted:
                ax.plot(
                    [c["trigger_s"] for c in aborted],
                    [value(c) for c in aborted],
                    "x",
                    color=colors[r["policy"]],
                    label=f"{r['policy']}, aborted",
                )
        ax.set_xlim(0, end)
        ax.set_xlabel("checkpoint trigger, seconds since the run started")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title} ({ex} executor)\n{setting}", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
        return fig

    fig = checkpoint_plot(
        "Checkpoint duration, trigger to last acknowledgement",
        "duration (ms, log scale)",
        lambda c: max(float(c["duration_ms"]), 0.1),
    )
    fig.axes[0].set_yscale("log")
    paths.append(_save(fig, out_dir, "checkpoint-duration.png"))
    fig = checkpoint_plot(
        "In-flight bytes persisted per checkpoint, all subtasks",
        "in-flight bytes (KiB)",
        lambda c: float(c["inflight_bytes"]) / 1024,
    )
    paths.append(_save(fig, out_dir, "inflight-bytes.png"))

    fig = Figure(figsize=(12, 4.8), layout="constrained")
    bars, series = fig.subplots(1, 2, width_ratios=(1, 1.4))
    local = results.get("local", {})
    names = list(results["policies"])
    groups = [(ex, results["policies"])] + ([("local", local)] if local else [])
    width = 0.8 / len(groups)
    for g, (kind, runs) in enumerate(groups):
        xs = [i + (g - (len(groups) - 1) / 2) * width for i, p in enumerate(names) if p in runs]
        ys = [runs[p]["throughput_rps"] for p in names if p in runs]
        label = kind if g == 0 else "local (comparison)"
        drawn = bars.bar(xs, ys, width, label=label, color=f"C{g}", alpha=0.85 if g == 0 else 0.5)
        bars.bar_label(drawn, fmt="{:,.0f}", fontsize=7)
    bars.set_xticks(range(len(names)), names)
    bars.set_ylabel("sink records/s")
    bars.set_title("Per policy, measured window", fontsize=10)
    bars.legend(fontsize=8, loc="lower right")
    bars.grid(True, axis="y", alpha=0.3)
    series.axvspan(0, warmup, color="0.92", label="warm-up")
    for g, (_, runs) in enumerate(groups):
        for r in runs.values():
            pairs = list(itertools.pairwise([[0.0, 0], *r["sink_series"]]))
            ts = [(a[0] + b[0]) / 2 for a, b in pairs]
            rates = [(b[1] - a[1]) / (b[0] - a[0]) if b[0] > a[0] else 0.0 for a, b in pairs]
            series.plot(
                ts,
                rates,
                "-" if g == 0 else "--",
                lw=1,
                color=colors[r["policy"]],
                label=r["policy"] if g == 0 else f"{r['policy']}, local",
            )
    series.set_xlim(0, end)
    series.set_ylim(bottom=0)
    series.set_xlabel("seconds since the run started")
    series.set_ylabel(f"sink records/s, over {SAMPLE_EVERY_S:g} s")
    series.set_title("Sink throughput over time", fontsize=10)
    fig.suptitle(f"Sink throughput ({setting})", fontsize=10)
    series.grid(True, alpha=0.3)
    series.legend(fontsize=8, ncol=2)
    paths.append(_save(fig, out_dir, "throughput.png"))
    return paths


def _save(fig: Any, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    return path


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:,.0f}" if v >= 10 else f"{v:.1f}"
