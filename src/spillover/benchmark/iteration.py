"""Loops (FLIP-15) under backpressure: what checkpoints of a loop cost next to those
of a straight job, what the iteration head logs, and how soon a bounded loop ends.

The job (:func:`build_loop_job`): a paced ``GeneratorSource`` (100-byte payloads)
→ ``key_by("key")`` → an iteration head; the body counts a record's ``left`` down
by one per pass (``min_rounds`` to ``max_rounds`` passes, by ``seq``), the
feedback is keyed; :class:`LoopExit` lets records with nothing left out of the loop
→ ``rebalance()`` → a sink paced at ``sink_rate`` records/s per subtask. The
sources run at ``source_share`` times the sinks' pace, so the sinks hold the job
back. Every operator works on whole batches (numpy), none per record.

:func:`run_loop` runs it for ``warmup_s + duration_s`` under one checkpoint policy
and reads, over the window after the warm-up: the completed checkpoints' durations,
their in-flight bytes, the head subtasks' share of them and the part that is the
feedback channels' state (the head's log), from the metadata of every checkpoint
(all are retained); the loop's output rate (``exit``'s ``records_out``); the bytes
the feedback spilled. :func:`run_straight` runs the job of ``spillover bench`` at
the same sink pace for comparison, :func:`termination_once` a bounded loop without
pacing, for the time from the last record leaving the loop to the heads learning
that the loop is done (``loop_ended_at``).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from spillover.benchmark.runner import _stats, run_policy, run_sampled, trigger_offsets
from spillover.benchmark.spec import _STOPPED, BenchSpec
from spillover.benchmark.stop import _pure_engine, raw_write
from spillover.config import Config
from spillover.config.policies import policy_options
from spillover.deploy import create_executor
from spillover.errors import ConfigError, SpilloverError
from spillover.runtime.api import Batch, Operator
from spillover.runtime.checkpointing.checkpoint_meta import CheckpointMetadata
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.connectors.throttled import ThrottledSink
from spillover.runtime.graph import StreamEnvironment

LOOP_POLICIES = ("none", "aligned", "unaligned", "timeout")
UNALIGNED_RATIO_TARGET = 2.0  # loop's unaligned median / the straight job's, at most
TERMINATION_TARGET_MS = 100.0  # last record out of the loop -> the loop ended, at most
HEAD, EXIT, SINK = "head", "exit", "sink"


def loop_dtype(payload_bytes: int) -> np.dtype[Any]:
    """The loop's records: the generator's fields and ``left``, the passes to go."""
    return np.dtype(
        [
            ("partition", "<i4"),
            ("seq", "<i8"),
            ("key", "<i8"),
            ("left", "<i8"),
            ("payload", f"S{payload_bytes}"),
        ]
    )


@dataclass
class LoopSpec:
    """What the loop bench runs; checked when built."""

    parallelism: int = 2
    warmup_s: float = 3.0
    duration_s: float = 8.0
    interval_ms: int = 1000
    sink_rate: float = 2000.0  # records/s per sink subtask
    source_share: float = 1.1  # the sources' pace over the sinks' (> 1: backpressure)
    payload_bytes: int = 100
    keys: int = 10_000
    min_rounds: int = 8  # passes round the loop per record: min_rounds .. max_rounds
    max_rounds: int = 16
    aligned_timeout_ms: int = 100
    records_per_partition: int = 5000  # the bounded job of the termination runs
    checkpoint_dir: str | None = None  # None: the system's temporary directory

    def __post_init__(self) -> None:
        for name, ok in (
            ("parallelism", self.parallelism >= 1),
            ("warmup_s", self.warmup_s >= 0),
            ("duration_s", self.duration_s > 0),
            ("interval_ms", self.interval_ms > 0),
            ("sink_rate", self.sink_rate > 0),
            ("source_share", self.source_share > 0),
            ("payload_bytes", self.payload_bytes >= 1),
            ("keys", self.keys >= 1),
            ("min_rounds", 1 <= self.min_rounds <= self.max_rounds),
            ("records_per_partition", self.records_per_partition >= 1),
        ):
            if not ok:
                raise ConfigError(f"bad {name}", detail=repr(getattr(self, name)))

    @property
    def run_s(self) -> float:
        return self.warmup_s + self.duration_s

    @property
    def mean_rounds(self) -> float:
        return (self.min_rounds + self.max_rounds) / 2

    def config(self, policy: str, base: str) -> Config:
        """One run's configuration: checkpoints under ``base`` (every one retained, so
        that each one's metadata can be read after the run), spills there too."""
        spill = os.path.join(base, "spill")
        os.makedirs(spill, exist_ok=True)
        options: dict[str, Any] = {
            "parallelism.default": self.parallelism,
            "restart-strategy.type": "none",  # a failure ends the run: it is not measured
            "io.tmp.dirs": spill,
        }
        if policy != "none":
            options["execution.checkpointing.interval"] = f"{self.interval_ms} ms"
            options["state.checkpoints.dir"] = os.path.join(base, "checkpoints")
            options["state.checkpoints.num-retained"] = 100_000
        options.update(policy_options(policy, aligned_timeout_ms=self.aligned_timeout_ms))
        return Config.from_dict(options)

    def straight(self) -> BenchSpec:
        """The job of ``spillover bench`` at this spec's sink pace, window and interval."""
        return BenchSpec(
            policies=("unaligned",),
            parallelism=self.parallelism,
            duration_s=self.duration_s,
            warmup_s=self.warmup_s,
            interval_ms=self.interval_ms,
            sink_rate=self.sink_rate,
            keys=self.keys,
            payload_bytes=self.payload_bytes,
            aligned_timeout_ms=self.aligned_timeout_ms,
            checkpoint_dir=self.checkpoint_dir,
            executor="local",
            compare_local=(),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class LoopExit(Operator):
    """Lets the records with no pass left out of the loop; ``last_exit_at`` in its
    metrics is ``time.time()`` when it last emitted."""

    def __init__(self, dtype: np.dtype[Any]) -> None:
        self.out_dtype = dtype

    def process(self, batch: Batch, input_index: int = 0) -> None:
        done = batch[batch["left"] == 0]
        if len(done):
            self.ctx.output.emit(done)
            self.ctx.metrics["last_exit_at"] = time.time()


class LoopStep(Operator):
    """One pass of the body: ``left`` counted down by one; ``last_final_pass_at`` in
    its metrics is ``time.time()`` when it last emitted a record with none left (on
    its way back to the head, to leave the loop there)."""

    def __init__(self, dtype: np.dtype[Any]) -> None:
        self.out_dtype = dtype

    def process(self, batch: Batch, input_index: int = 0) -> None:
        out = batch.copy()
        out["left"] -= 1
        self.ctx.output.emit(out)
        if not out["left"].all():
            self.ctx.metrics["last_final_pass_at"] = time.time()


class _Discard(Operator):
    """A sink that drops what it gets (the termination runs pace nothing)."""

    def process(self, batch: Batch, input_index: int = 0) -> None:
        pass


def build_loop_job(spec: LoopSpec, name: str, *, bounded: bool = False) -> StreamEnvironment:
    """The loop job (module docstring); ``bounded``: ``records_per_partition`` per
    partition, sources and sinks unpaced."""
    p = spec.parallelism
    dtype = loop_dtype(spec.payload_bytes)
    spread = spec.max_rounds - spec.min_rounds + 1
    lowest = spec.min_rounds

    def enter(batch: Batch) -> Batch:
        out = np.empty(len(batch), dtype)
        for f in ("partition", "seq", "key", "payload"):
            out[f] = batch[f]
        out["left"] = lowest + batch["seq"] % spread
        return out

    def going(batch: Batch) -> Batch:
        return np.asarray(batch["left"] > 0)

    env = StreamEnvironment(name, parallelism=p, max_parallelism=128)
    partitions = 2 * p
    source = GeneratorSource(
        partitions=partitions,
        records_per_partition=spec.records_per_partition if bounded else None,
        rate_per_subtask=None if bounded else spec.sink_rate * spec.source_share,
        payload_bytes=spec.payload_bytes,
        keys=spec.keys,
        batch_size=512,
    )
    loop = (
        env.from_source(source, uid="source")
        .map(enter, dtype, uid="enter")
        .key_by("key")
        .iterate(uid=HEAD)
    )
    body = loop.filter(going, uid="body").process(LoopStep(dtype), uid="step")
    loop.close_with(body.key_by("key"))
    sink: Operator = _Discard() if bounded else ThrottledSink(spec.sink_rate)
    loop.process(LoopExit(dtype), uid=EXIT).rebalance().sink(sink, uid=SINK)
    return env


@dataclass
class LoopRun:
    """One run of one variant: its checkpoints (completed, triggered in the window)
    and what the loop delivered. Bytes are medians over those checkpoints."""

    job: str  # loop | straight
    policy: str
    pure: bool
    status: str
    window_s: float = 0.0
    exits: int = 0  # records out of the loop (straight: into the sinks) in the window
    throughput_rps: float = 0.0
    checkpoints: int = 0
    aborted: int = 0  # not counting one cut off by the stop
    durations_ms: list[float] = field(default_factory=list)
    duration_ms: dict[str, float | None] = field(default_factory=dict)
    inflight_bytes: float | None = None  # every subtask's, median
    inflight_first_last: list[int] = field(default_factory=list)  # the window's first, last
    head_inflight_bytes: float | None = None  # the head subtasks' in-flight, median
    logged_bytes: float | None = None  # ... of it their feedback channels' state, median
    logged_sizes: list[int] = field(default_factory=list)  # per head subtask, median one
    feedback_spilled_bytes: int = 0  # over the whole run
    backlog_records: int = 0  # emitted by the sources, not out of the loop, at the stop
    raw_write_ms: float | None = None  # logged_sizes written, not synced
    raw_write_fsync_ms: float | None = None  # ... written and fsynced
    source_backpressured_share: float = 0.0
    failures: list[str] = field(default_factory=list)

    @property
    def variant(self) -> str:
        return f"{self.job}{' pure' if self.pure else ''} {self.policy}"

    def to_dict(self) -> dict[str, Any]:
        return {"variant": self.variant, **asdict(self)}

    def line(self) -> str:
        if self.status == "failed":
            return f"{self.variant}: FAILED: {'; '.join(self.failures)}"
        d = self.duration_ms
        return (
            f"{self.variant}: {self.checkpoints} checkpoints ({self.aborted} aborted), median "
            f"{_fmt(d.get('median'))} ms, p90 {_fmt(d.get('p90'))} ms; in-flight "
            f"{_fmt(self.inflight_bytes)} B, head {_fmt(self.head_inflight_bytes)} B, "
            f"logged {_fmt(self.logged_bytes)} B; spilled {self.feedback_spilled_bytes:,} B; "
            f"{self.throughput_rps:,.0f} records/s out; backlog {self.backlog_records:,}"
        )


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _fmt2(v: float | None) -> str:
    return "-" if v is None else f"{v:,.2f}"


def _feedback_gates(meta: CheckpointMetadata) -> dict[str, set[int]]:
    """Per iteration head's uid, the gates (input positions) of its feedback."""
    out = {}
    for uid, v in (meta.graph or {}).items():
        if v.iteration_head:
            out[uid] = {i for i, e in enumerate(v.inputs) if e.feedback}
    return out


def head_bytes(meta: CheckpointMetadata) -> tuple[int, list[int]]:
    """A checkpoint's head subtasks: their in-flight bytes in all, and each one's
    feedback channel state (the log), from the checkpoint's metadata."""
    total, logged = 0, []
    for uid, gates in _feedback_gates(meta).items():
        for _, st in sorted(meta.operator(uid).subtasks.items()):
            total += int(st.metrics.get("inflight_bytes", 0))
            handles = st.channel_state.input if st.channel_state is not None else ()
            logged.append(sum(h.raw_bytes for h in handles if h.gate_id in gates))
    return total, logged


def run_loop(spec: LoopSpec, policy: str, *, pure: bool = False, timeout_s: float = 600) -> LoopRun:
    """Runs the loop job once under ``policy`` (one of :data:`LOOP_POLICIES`) on the
    local executor; ``pure`` with the engine's pure-Python twin (``SPILLOVER_PURE=1``)."""
    if policy not in LOOP_POLICIES:
        raise ConfigError(f"unknown policy {policy!r}", hint=f"choose from {LOOP_POLICIES}")
    base = tempfile.mkdtemp("-spillover-loop", dir=spec.checkpoint_dir)
    out = LoopRun("loop", policy, pure, "failed")
    try:
        env = build_loop_job(spec, f"loop-{policy}-{uuid.uuid4().hex[:8]}")
        ex = create_executor("local", env, spec.config(policy, base))
        ex.prepare()
        with _pure_engine(pure):
            result, sampled, started_wall = run_sampled(
                ex,
                lambda: ex.live_metric(EXIT, "records_out"),
                spec.warmup_s,
                spec.run_s,
                spec.duration_s,
                timeout_s=timeout_s,
            )
        out.status = "failed" if sampled.error else result.status
        out.failures = list(result.failures) + ([sampled.error] if sampled.error else [])
        if len(sampled.window) == 2:
            (t1, n1), (t2, n2) = sampled.window
            out.window_s = round(t2 - t1, 3)
            out.exits = n2 - n1
            out.throughput_rps = round(out.exits / out.window_s, 1) if out.window_s > 0 else 0.0
        tasks = result.tasks
        out.feedback_spilled_bytes = int(
            sum(m.get("feedback_spilled_bytes", 0.0) for m in tasks.values())
        )
        emitted = sum(
            m.get("records_out", 0.0) for k, m in tasks.items() if k.startswith("source#")
        )
        left = sum(m.get("records_out", 0.0) for k, m in tasks.items() if k.startswith(f"{EXIT}#"))
        out.backlog_records = int(emitted - left)
        sources = [m for k, m in tasks.items() if k.startswith("source#")]
        if sources:
            out.source_backpressured_share = round(
                statistics.fmean(m.get("backpressured_share", 0.0) for m in sources), 3
            )
        if policy != "none":
            _checkpoint_figures(spec, out, result.checkpoints, started_wall, ex.storage, base)
        return out
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _in_window(
    spec: LoopSpec, checkpoints: Sequence[dict[str, Any]], started_wall: float
) -> tuple[list[dict[str, Any]], int]:
    """The completed checkpoints triggered in the window (not the final one), oldest
    first, and how many aborted there (not counting one cut off by the stop)."""
    cps = sorted(
        (c for c in checkpoints if not c.get("final")), key=lambda c: int(c["checkpoint_id"])
    )
    offsets, _ = trigger_offsets(cps, spec.interval_ms / 1000, started_wall)
    inside = [c for c, off in zip(cps, offsets, strict=True) if spec.warmup_s <= off < spec.run_s]
    done = [c for c in inside if c["status"] == "completed"]
    aborted = [c for c in inside if c["status"] == "aborted" and c.get("reason") != _STOPPED]
    return done, len(aborted)


def _checkpoint_figures(
    spec: LoopSpec,
    out: LoopRun,
    checkpoints: Sequence[dict[str, Any]],
    started_wall: float,
    storage: Any,
    base: str,
) -> None:
    done, out.aborted = _in_window(spec, checkpoints, started_wall)
    out.checkpoints = len(done)
    out.durations_ms = [float(c["duration_ms"]) for c in done]
    out.duration_ms = _stats(out.durations_ms)
    inflight = [int(c["inflight_bytes"]) for c in done]
    if inflight:
        out.inflight_bytes = float(statistics.median(inflight))
        out.inflight_first_last = [inflight[0], inflight[-1]]
    heads: list[tuple[int, list[int]]] = []
    for c in done:
        try:
            heads.append(head_bytes(storage.read(int(c["checkpoint_id"]))))
        except (OSError, KeyError, ValueError, SpilloverError) as e:
            out.failures.append(f"checkpoint {c['checkpoint_id']}'s metadata: {e!r}")
    if heads:
        out.head_inflight_bytes = float(statistics.median(h[0] for h in heads))
        by_log = sorted(heads, key=lambda h: sum(h[1]))
        out.logged_bytes = float(statistics.median(sum(h[1]) for h in heads))
        out.logged_sizes = by_log[(len(by_log) - 1) // 2][1]  # the (lower) median one's
        if sum(out.logged_sizes):
            out.raw_write_ms, out.raw_write_fsync_ms = raw_write(out.logged_sizes, base)


def run_straight(spec: LoopSpec) -> LoopRun:
    """The job of ``spillover bench`` with unaligned checkpoints, at this spec's sink
    pace, through ``runner.run_policy``: the straight job to compare the loop with."""
    bench = spec.straight()
    r = run_policy(bench, "unaligned")
    cps = [c for c in r.checkpoint_list if c["in_window"] and c["status"] == "completed"]
    inflight = [int(c["inflight_bytes"]) for c in cps]
    durations = [float(c["duration_ms"]) for c in cps]
    return LoopRun(
        job="straight",
        policy="unaligned",
        pure=False,
        status=r.status,
        window_s=r.window_s,
        exits=r.sink_records,
        throughput_rps=r.throughput_rps,
        checkpoints=r.checkpoints,
        aborted=r.aborted,
        durations_ms=durations,
        duration_ms=_stats(durations),
        inflight_bytes=float(statistics.median(inflight)) if inflight else None,
        inflight_first_last=[inflight[0], inflight[-1]] if inflight else [],
        source_backpressured_share=r.source_backpressured_share,
        failures=list(r.failures),
    )


def variants(pure: bool = True) -> list[tuple[str, str, bool]]:
    """``(job, policy, pure)`` of one alternation."""
    out = [("loop", p, False) for p in LOOP_POLICIES] + [("straight", "unaligned", False)]
    return out + ([("loop", "unaligned", True)] if pure else [])


def run_variant(spec: LoopSpec, job: str, policy: str, pure: bool) -> LoopRun:
    if job == "straight":
        return run_straight(spec)
    return run_loop(spec, policy, pure=pure)


@dataclass
class TerminationRun:
    """One bounded run: when the last record left the loop and when its heads knew
    the loop was done (``time.time()``), and the probe rounds it took.

    A head hands the last record to the exit between the body's last final pass
    (``last_final_pass_at``: the record still has to come back) and the exit task's
    last emission (``last_exit_at``: one channel behind the head, which is never
    chained): ``latency_ms`` (the last head's end minus the body's last final pass)
    bounds the time from the last record leaving to the loop ending from above,
    ``exit_latency_ms`` (minus the exit's last emission) from below; the latter is
    negative when the exit task took that last record after the heads ended."""

    policy: str
    status: str
    records: int = 0  # out of the loop
    run_s: float = 0.0
    last_exit_at: float = 0.0  # the exit task's last emission
    last_final_pass_at: float = 0.0  # the body's last record with no pass left
    loop_ended_at: list[float] = field(default_factory=list)  # per head subtask
    latency_ms: float | None = None  # the last head's end - the body's last final pass
    exit_latency_ms: float | None = None  # the last head's end - the exit's last emission
    rounds: list[int] = field(default_factory=list)
    rounds_quiet: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        if self.status != "finished":
            return f"termination {self.policy}: {self.status}: {'; '.join(self.failures)}"
        return (
            f"termination {self.policy}: {self.records:,} records in {self.run_s:.2f} s; "
            f"loop ended {_fmt2(self.exit_latency_ms)} ms after the exit's last record, "
            f"{_fmt2(self.latency_ms)} ms after the body's last final pass; "
            f"rounds {self.rounds}, quiet {self.rounds_quiet}"
        )


def termination_once(
    spec: LoopSpec, policy: str = "none", timeout_s: float = 300
) -> TerminationRun:
    """Runs the bounded loop job to its end (``records_per_partition`` per partition,
    nothing paced) under ``policy``; see :class:`TerminationRun`."""
    base = tempfile.mkdtemp("-spillover-loop-end", dir=spec.checkpoint_dir)
    out = TerminationRun(policy, "failed")
    try:
        env = build_loop_job(spec, f"loop-end-{uuid.uuid4().hex[:8]}", bounded=True)
        ex = create_executor("local", env, spec.config(policy, base))
        t0 = time.monotonic()
        result = ex.run(timeout=timeout_s)
        out.run_s = round(time.monotonic() - t0, 3)
        out.status, out.failures = result.status, list(result.failures)
        tasks = result.tasks
        exits = [m for k, m in tasks.items() if k.startswith(f"{EXIT}#")]
        heads = [m for k, m in sorted(tasks.items()) if k.startswith(f"{HEAD}#")]
        bodies = [m for k, m in tasks.items() if k.startswith("body#")]
        out.records = int(sum(m.get("records_out", 0.0) for m in exits))
        out.last_exit_at = max((m.get("last_exit_at", 0.0) for m in exits), default=0.0)
        out.last_final_pass_at = max(
            (m.get("last_final_pass_at", 0.0) for m in bodies), default=0.0
        )
        out.loop_ended_at = [m.get("loop_ended_at", 0.0) for m in heads]
        out.rounds = [int(m.get("loop_rounds", 0)) for m in heads]
        out.rounds_quiet = [int(m.get("loop_rounds_quiet", 0)) for m in heads]
        if out.last_exit_at and out.loop_ended_at and all(out.loop_ended_at):
            ended = max(out.loop_ended_at)
            out.latency_ms = round((ended - out.last_final_pass_at) * 1000, 2)
            out.exit_latency_ms = round((ended - out.last_exit_at) * 1000, 2)
        expected = 2 * spec.parallelism * spec.records_per_partition
        if out.status == "finished" and out.records != expected:
            out.status = "failed"
            out.failures.append(f"{out.records} records left the loop, not {expected}")
        return out
    finally:
        shutil.rmtree(base, ignore_errors=True)
