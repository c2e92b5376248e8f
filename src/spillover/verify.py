"""Exactly-once verification of whole jobs: built-in topologies, induced failures,
and an exact comparison with a failure-free run.

Every topology ends in a keyed running total whose output is the same whatever
the batching and timing: keys are made per source partition, so each key's
records arrive in sequence order on one channel, and every record comes out
with its key's total after it. The committed Parquet output and the final keyed
state of a run with failures must equal those of a run without.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spillover.config import Config
from spillover.keygroups import KeyGroupRange
from spillover.runtime.api import Batch, Operator, OperatorContext, StateDescriptor
from spillover.runtime.executor import JobResult, LocalExecutor
from spillover.runtime.failures import FailureInjector
from spillover.runtime.graph import DataStream, StreamEnvironment
from spillover.runtime.operators import CoMap
from spillover.runtime.sinks import ParquetSink, ThrottledSink
from spillover.runtime.sources import GeneratorSource

OUT_DTYPE = np.dtype([("partition", "<i4"), ("seq", "<i8"), ("key", "<i8"), ("total", "<i8")])
KEYS_PER_PARTITION = 97
TOPOLOGIES = ("pipeline", "multi-input", "union")
POLICIES = ("aligned", "unaligned", "timeout", "max-inflight")


class RunningTotal(Operator):
    """Keyed: every record leaves with its key's running total of ``seq + 1``.

    Vectorised: the batch is sorted by key (stable, so each key's records keep
    their order), totals are group-wise cumulative sums plus the stored total.
    """

    out_dtype = OUT_DTYPE

    def open(self, ctx: OperatorContext) -> None:
        super().open(ctx)
        assert ctx.keyed is not None, "RunningTotal runs after key_by"
        self.totals = ctx.keyed.state(StateDescriptor("total", "sum", np.int64))

    def process(self, batch: Batch, input_index: int = 0) -> None:
        keys = np.ascontiguousarray(batch["key"])
        values = np.ascontiguousarray(batch["seq"]).astype(np.int64) + 1
        order = np.argsort(keys, kind="stable")
        k, v = keys[order], values[order]
        starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
        counts = np.diff(np.r_[starts, len(k)])
        csum = np.cumsum(v)
        before_group = np.repeat(csum[starts] - v[starts], counts)
        uniq = k[starts]
        prev, has = self.totals.get(uniq)
        base = np.where(has, prev, 0).astype(np.int64)
        totals = csum - before_group + np.repeat(base, counts)
        self.totals.put(uniq, np.add.reduceat(v, starts))
        out = np.empty(len(batch), OUT_DTYPE)
        out["partition"] = batch["partition"]
        out["seq"] = batch["seq"]
        out["key"] = keys
        out["total"][order] = totals
        self.ctx.output.emit(out)


def _same(batch: Batch) -> Batch:
    return batch


def _per_partition_keys(offset: int) -> Callable[[Batch], Batch]:
    def fn(batch: Batch) -> Batch:
        out = batch.copy()
        out["partition"] = batch["partition"] + offset
        out["key"] = (batch["partition"].astype(np.int64) + offset) * 1000 + (
            batch["key"] % KEYS_PER_PARTITION
        )
        return out

    return fn


@dataclass
class VerifySpec:
    topology: str = "pipeline"
    parallelism: int = 2
    records: int = 200_000  # per source
    rate_per_subtask: float | None = 50_000.0
    failures: int = 5
    seed: int = 1
    interval_ms: int = 100
    policy: str = "aligned"  # aligned | unaligned | timeout | max-inflight
    aligned_timeout_ms: int = 5
    max_inflight_bytes: int = 256 * 1024
    # The sink takes this share of what the sources offer: below 1, real backpressure.
    sink_share: float = 0.8
    # Restore at this parallelism: the run with failures stops part way, after a
    # checkpoint holding in-flight data, and is restored at ``rescale_to``.
    rescale_to: int | None = None

    def checkpoint_options(self) -> dict[str, Any]:
        """The config keys of the policy."""
        if self.policy == "aligned":
            return {}
        if self.policy == "unaligned":
            return {"execution.checkpointing.unaligned.enabled": True}
        if self.policy == "timeout":
            timeout = f"{self.aligned_timeout_ms} ms"
            return {
                "execution.checkpointing.unaligned.enabled": True,
                "execution.checkpointing.aligned-checkpoint-timeout": timeout,
            }
        if self.policy == "max-inflight":
            return {
                "execution.checkpointing.unaligned.enabled": True,
                "execution.checkpointing.unaligned.max-inflight-bytes": self.max_inflight_bytes,
            }
        raise ValueError(f"unknown policy {self.policy!r}; choose from {POLICIES}")


def build(
    spec: VerifySpec, out_dir: str, name: str, parallelism: int | None = None
) -> StreamEnvironment:
    """One of the built-in topologies, writing committed output to ``out_dir``."""
    p = parallelism or spec.parallelism
    env = StreamEnvironment(name, parallelism=p, max_parallelism=128)

    def source(uid: str, seed: int) -> DataStream:
        partitions = 2 * spec.parallelism  # fixed across rescaling: partitions move
        gen = GeneratorSource(
            partitions=partitions,
            records_per_partition=max(1, spec.records // partitions),
            payload_bytes=100,
            keys=10_000,
            rate_per_subtask=spec.rate_per_subtask,
            batch_size=512,
            seed=seed,
        )
        return env.from_source(gen, uid=uid)

    if spec.topology == "pipeline":
        s = source("source", spec.seed).map(_per_partition_keys(0), uid="keys")
        keyed = s.key_by("key")
    elif spec.topology == "union":
        a = source("source-a", spec.seed).map(_per_partition_keys(0), uid="keys-a")
        b = source("source-b", spec.seed + 1).map(_per_partition_keys(1000), uid="keys-b")
        keyed = a.key_by("key").union(b.key_by("key")).map(lambda x: x, uid="union")
        keyed = keyed.key_by("key")
    elif spec.topology == "multi-input":
        # Two keyed inputs of a two-input operator (key_by edges rescale; forward
        # edges into it would refuse to).
        a = source("source-a", spec.seed).map(_per_partition_keys(0), uid="keys-a")
        b = source("source-b", spec.seed + 1).map(_per_partition_keys(1000), uid="keys-b")
        dt = a.dtype
        merged = (
            a.key_by("key").connect(b.key_by("key")).process(CoMap(_same, _same, dt), uid="co-map")
        )
        keyed = merged.key_by("key")
    else:
        raise ValueError(f"unknown topology {spec.topology!r}; choose from {TOPOLOGIES}")
    totals = keyed.process(RunningTotal(), uid="running-total")
    sink: Operator = ParquetSink(out_dir)
    if spec.rate_per_subtask and spec.sink_share < 1:
        sources = 1 if spec.topology == "pipeline" else 2
        rate = spec.rate_per_subtask * sources * spec.sink_share
        sink = ThrottledSink(rate, inner=sink)
    totals.rebalance().sink(sink, uid="parquet-sink")
    return env


@dataclass
class RunOutput:
    result: JobResult
    rows: np.ndarray[Any, Any]
    state: dict[int, int]
    fired: list[str] = field(default_factory=list)
    restored_inflight: int = 0  # in-flight bytes of the checkpoint a rescale restored


def _read_output(out_dir: str) -> np.ndarray[Any, Any]:
    import pyarrow.parquet as pq

    files = [f for f in os.listdir(out_dir) if f.endswith(".parquet") and not f.startswith("_")]
    rows = np.empty(0, OUT_DTYPE)
    if files:
        t = pq.read_table([os.path.join(out_dir, f) for f in sorted(files)])
        rows = np.empty(t.num_rows, OUT_DTYPE)
        for name in OUT_DTYPE.names or ():
            rows[name] = t.column(name).to_numpy()
    return rows


def _final_state(result: JobResult, max_parallelism: int) -> dict[int, int]:
    from spillover.runtime.checkpoints import CheckpointStorage
    from spillover.runtime.state import HeapKeyedStateBackend

    if result.checkpoint_dir is None:
        return {}
    base, _, job = result.checkpoint_dir.rstrip("/").rpartition("/")
    latest = CheckpointStorage(base, job).latest()
    if latest is None:
        return {}
    handles = [
        h
        for entry in latest.metadata["tasks"].get("running-total", {}).get("subtasks", {}).values()
        for h in entry.get("keyed", {}).values()
    ]
    backend = HeapKeyedStateBackend(max_parallelism, KeyGroupRange(0, max_parallelism - 1))
    backend.restore(handles)
    keys, values = backend.state(StateDescriptor("total", "sum", np.int64)).items()
    return dict(zip(keys.tolist(), values.tolist(), strict=True))


def _config(spec: VerifySpec, ckpt: str) -> Config:
    return Config.from_dict(
        {
            "execution.checkpointing.interval": f"{spec.interval_ms} ms",
            "state.checkpoints.dir": ckpt,
            "restart-strategy.type": "fixed-delay",
            "restart-strategy.fixed-delay.attempts": spec.failures + 1,
            "restart-strategy.fixed-delay.delay": "10 ms",
            **spec.checkpoint_options(),
        }
    )


def run_once(spec: VerifySpec, workdir: str, name: str, failures: FailureInjector) -> RunOutput:
    out_dir = os.path.join(workdir, name, "output")
    ckpt = os.path.join(workdir, name, "checkpoints")
    os.makedirs(out_dir, exist_ok=True)
    graph = build(spec, out_dir, name).build()
    result = LocalExecutor(graph, _config(spec, ckpt), failures=failures).run(timeout=600)
    return RunOutput(
        result,
        _read_output(out_dir),
        _final_state(result, graph.max_parallelism),
        [s.describe() for s in failures.fired],
    )


def run_rescaled(
    spec: VerifySpec, workdir: str, name: str, failures: FailureInjector, stop_after: float
) -> RunOutput:
    """Runs at ``spec.parallelism`` until every induced failure happened and the latest
    completed checkpoint holds in-flight data (or ``stop_after`` seconds), stops it as
    a crash would, restores that checkpoint at ``spec.rescale_to`` and runs to the end."""

    def ready(history: list[dict[str, Any]]) -> bool:
        done = [c for c in history if c["status"] == "completed" and not c["final"]]
        return failures.pending == 0 and bool(done) and done[-1]["inflight_bytes"] > 0

    assert spec.rescale_to is not None
    out_dir = os.path.join(workdir, name, "output")
    ckpt = os.path.join(workdir, name, "checkpoints")
    os.makedirs(out_dir, exist_ok=True)
    cfg = _config(spec, ckpt)
    first = LocalExecutor(build(spec, out_dir, name).build(), cfg, failures=failures)
    r1 = first.run(timeout=600, stop_after=stop_after, stop_when=ready)
    completed = r1.completed_checkpoints()
    if r1.status == "finished":
        raise RuntimeError("the run ended before it was stopped: give it more records")
    if not completed:
        raise RuntimeError("no checkpoint completed before the stop: lengthen the run")
    # Only the latest completed checkpoint keeps exactly-once: sinks published up to it.
    restored = completed[-1]
    graph = build(spec, out_dir, name, spec.rescale_to).build()
    second = LocalExecutor(graph, cfg, restore_checkpoint=restored["checkpoint_id"])
    r2 = second.run(timeout=600)
    r2.attempts += r1.attempts
    r2.checkpoints = r1.checkpoints + r2.checkpoints
    r2.failures = r1.failures + r2.failures
    r2.restored_from = r1.restored_from + r2.restored_from
    r2.replayed_bytes += r1.replayed_bytes
    if r1.status not in ("stopped", "finished"):
        r2.status = r1.status
    out = RunOutput(
        r2,
        _read_output(out_dir),
        _final_state(r2, graph.max_parallelism),
        [s.describe() for s in failures.fired],
    )
    out.restored_inflight = int(restored["inflight_bytes"])
    return out


@dataclass
class Report:
    """The verdict: ``exact`` only when nothing was lost, duplicated or reordered."""

    spec: VerifySpec
    exact: bool
    records: int
    lost: list[tuple[int, int]]
    duplicated: list[tuple[int, int, int]]
    reordered: list[tuple[int, int]]
    wrong_totals: list[tuple[int, int, int]]
    state_mismatch: list[tuple[int, int | None, int | None]]
    failures_fired: list[str]
    inflight_persisted: int
    inflight_replayed: int
    restored_inflight: int
    attempts: int
    checkpoints_completed: int
    duration_s: float
    status: str

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["spec"] = self.spec.__dict__
        return d

    def text(self) -> str:
        rescale = f" -> {self.spec.rescale_to}" if self.spec.rescale_to else ""
        lines = [
            f"topology {self.spec.topology}, parallelism {self.spec.parallelism}{rescale}, "
            f"policy {self.spec.policy}: {self.records} records, {self.attempts} attempts, "
            f"{self.checkpoints_completed} checkpoints completed, {self.duration_s:.1f} s",
            f"failures induced ({len(self.failures_fired)}): "
            + (", ".join(self.failures_fired) or "none"),
            f"in-flight data: {self.inflight_persisted} bytes persisted by completed "
            f"checkpoints, {self.inflight_replayed} bytes replayed by restores",
        ]
        if self.spec.rescale_to:
            lines.append(
                f"rescaled from the latest checkpoint, which held {self.restored_inflight} "
                "bytes of in-flight data"
            )
        if self.exact:
            lines.append("EXACT: no record lost, duplicated or reordered; final state equal")
            return "\n".join(lines)
        lines.append(f"NOT EXACT (job {self.status})")
        for title, items in (
            ("lost (partition, seq)", self.lost),
            ("duplicated (partition, seq, times)", self.duplicated),
            ("reordered (partition, seq)", self.reordered),
            ("wrong running total (partition, seq, total)", self.wrong_totals),
            ("final state differs (key, expected, found)", self.state_mismatch),
        ):
            if items:
                shown = ", ".join(map(str, items[:20]))
                more = f" ... and {len(items) - 20} more" if len(items) > 20 else ""
                lines.append(f"  {len(items)} {title}: {shown}{more}")
        return "\n".join(lines)


def _unpack(i: Any) -> tuple[int, int]:
    return int(i >> 40), int(i & ((1 << 40) - 1))


def compare(spec: VerifySpec, expected: RunOutput, actual: RunOutput) -> Report:
    """Every difference between a failure-free run and a run with failures."""
    e, a = expected.rows, actual.rows
    e_ids = e["partition"].astype(np.int64) << 40 | e["seq"]
    a_ids = a["partition"].astype(np.int64) << 40 | a["seq"]
    uniq, counts = np.unique(a_ids, return_counts=True)
    lost_ids = np.setdiff1d(e_ids, a_ids)
    dup = uniq[counts > 1]
    lost = [_unpack(i) for i in lost_ids[:1000]]
    duplicated = [
        (*_unpack(i), int(c)) for i, c in zip(dup[:1000], counts[counts > 1][:1000], strict=True)
    ]
    # Running totals must equal the failure-free ones record by record.
    e_sorted = e[np.argsort(e_ids, kind="stable")]
    _, first = np.unique(a_ids, return_index=True)
    a_first = a[first]
    common = np.isin(a_first["partition"].astype(np.int64) << 40 | a_first["seq"], e_ids)
    a_common = a_first[common]
    idx = np.searchsorted(
        e_sorted["partition"].astype(np.int64) << 40 | e_sorted["seq"],
        a_common["partition"].astype(np.int64) << 40 | a_common["seq"],
    )
    bad = a_common["total"] != e_sorted["total"][idx]
    wrong = [(int(r["partition"]), int(r["seq"]), int(r["total"])) for r in a_common[bad][:1000]]
    # Order per key: within each committed file's order, totals per key grow.
    reordered: list[tuple[int, int]] = []
    if len(a):
        order = np.lexsort((a["total"], a["key"]))
        k, s = a["key"][order], a["seq"][order]
        same = k[1:] == k[:-1]
        back = np.flatnonzero(same & (s[1:] < s[:-1]))
        reordered = [(int(a["partition"][order][i + 1]), int(s[i + 1])) for i in back[:1000]]
    keys = sorted(set(expected.state) | set(actual.state))
    mismatch = [
        (k, expected.state.get(k), actual.state.get(k))
        for k in keys
        if expected.state.get(k) != actual.state.get(k)
    ]
    r = actual.result
    exact = (
        r.status == "finished"
        and expected.result.status == "finished"
        and not lost
        and not duplicated
        and not reordered
        and not wrong
        and not mismatch
        and len(a) == len(e)
    )
    return Report(
        spec,
        exact,
        len(a),
        lost,
        duplicated,
        reordered,
        wrong,
        mismatch[:1000],
        actual.fired,
        r.persisted_inflight_bytes,
        r.replayed_bytes,
        actual.restored_inflight,
        r.attempts,
        len(r.completed_checkpoints()),
        r.duration_s,
        r.status,
    )


def verify(spec: VerifySpec, workdir: str | None = None) -> Report:
    """Runs the topology without and with ``spec.failures`` induced failures."""
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="spillover-verify-")
    try:
        baseline = run_once(spec, workdir, "baseline", FailureInjector())
        graph = build(spec, os.path.join(workdir, "probe"), "probe").build()
        vertices = [(v.uid, v.parallelism) for v in graph.vertices]
        injector = FailureInjector.random(
            spec.failures,
            vertices,
            seed=spec.seed,
            records_per_subtask=max(1, spec.records // spec.parallelism),
        )
        started = time.monotonic()
        if spec.rescale_to is None:
            actual = run_once(spec, workdir, "with-failures", injector)
        else:
            stop_after = 0.8 * baseline.result.duration_s + 5.0  # a bound; stop_when decides
            actual = run_rescaled(spec, workdir, "with-failures", injector, stop_after)
        report = compare(spec, baseline, actual)
        report.duration_s = time.monotonic() - started
        return report
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)


def write_json(report: Report, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report.to_dict(), f, indent=1, default=str)
