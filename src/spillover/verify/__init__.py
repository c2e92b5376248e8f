"""Exactly-once verification of whole jobs: built-in topologies, induced failures,
and an exact comparison with a failure-free run.

Every topology ends in a keyed running total whose output is the same whatever
the batching and timing: keys are made per source partition, so each key's
records arrive in sequence order on one channel, and every record comes out
with its key's total after it. The committed Parquet output and the final keyed
state of a run with failures must equal those of a run without.

The rescaling topologies (``RESCALE_TOPOLOGIES``) add edges that do not keep that
order (rebalance, broadcast); each is checked on what it promises
(``check_promises``): the exact multiset of records always, running totals only
where order is kept, else the final keyed count and sum per key, and for a
broadcast input one copy of every broadcast record per subtask.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from spillover.config import Config
from spillover.deploy import create_executor
from spillover.errors import ConfigError
from spillover.keygroups import KeyGroupRange, key_groups
from spillover.runtime.api import (
    Batch,
    KeyedState,
    Operator,
    OperatorContext,
    StateDescriptor,
)
from spillover.runtime.connectors.sinks import ParquetSink, ThrottledSink
from spillover.runtime.connectors.sources import GeneratorSource
from spillover.runtime.failures import FailureInjector
from spillover.runtime.graph import DataStream, StreamEnvironment
from spillover.runtime.jobmaster import JobResult
from spillover.runtime.operators import CoMap, TwoInputOperator
from spillover.storage.location import Location

OUT_DTYPE = np.dtype([("partition", "<i4"), ("seq", "<i8"), ("key", "<i8"), ("total", "<i8")])
# The keyed subtask that emitted a record, so the check can place its key.
STAMP_FIELDS = [("subtask", "<i4"), ("parallelism", "<i4")]
KEYS_PER_PARTITION = 97
RESCALE_TOPOLOGIES = (
    "rebalance-chain",
    "keyed-parallelisms",
    "broadcast",
    "stateless-between-keyed",
    "custom-partitioner",
)
TOPOLOGIES = ("pipeline", "multi-input", "union", *RESCALE_TOPOLOGIES)
POLICIES = ("aligned", "unaligned", "timeout", "max-inflight")


class RunningTotal(Operator):
    """Keyed: every record leaves with its key's running total of ``seq + 1``.

    Vectorised: the batch is sorted by key (stable, so each key's records keep
    their order), totals are group-wise cumulative sums plus the stored total.
    Each record also carries the subtask that emitted it (``STAMP_FIELDS``).
    """

    out_dtype = np.dtype(OUT_DTYPE.descr + STAMP_FIELDS)

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
        out = np.empty(len(batch), self.out_dtype)
        out["partition"] = batch["partition"]
        out["seq"] = batch["seq"]
        out["key"] = keys
        out["total"][order] = totals
        out["subtask"] = self.ctx.subtask_index
        out["parallelism"] = self.ctx.parallelism
        self.ctx.output.emit(out)


class SubtaskStamp(Operator):
    """Passes records on with ``subtask`` and ``parallelism`` set to its own subtask's.

    Chain it right after a keyed operator (:func:`stamp_subtask`) and the
    verification checks that every committed key lies in that subtask's key groups.
    """

    def __init__(self, in_dtype: Any) -> None:
        dt = np.dtype(in_dtype)
        names = dt.names or ()
        extra = [(n, t) for n, t in STAMP_FIELDS if n not in names]
        self.out_dtype = np.dtype(dt.descr + extra) if extra else dt

    def process(self, batch: Batch, input_index: int = 0) -> None:
        if batch.dtype == self.out_dtype:
            out = batch.copy()
        else:
            out = np.empty(len(batch), self.out_dtype)
            for name in batch.dtype.names or ():
                out[name] = batch[name]
        out["subtask"] = self.ctx.subtask_index
        out["parallelism"] = self.ctx.parallelism
        self.ctx.output.emit(out)


def stamp_subtask(stream: DataStream, uid: str = "subtask-stamp") -> DataStream:
    """``stream`` with ``subtask`` and ``parallelism`` fields of the subtask that emitted
    each record; call it on the output of the keyed operator, before any rebalance."""
    return stream.process(SubtaskStamp(stream.dtype), uid=uid)


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


class JobFactory(Protocol):
    """Builds the user's job to verify: ``make_job(out_dir, name, parallelism)``.

    Called once per run (without failures, with failures, and again at
    ``rescale_to`` when rescaling) with a fresh ``out_dir``; the environment must
    be named ``name``, run at ``parallelism``, and build the same graph (uids,
    max parallelism, source partitions) whatever the parallelism. Its source(s)
    must be bounded and replayable (a ``GeneratorSource`` or any source with the
    same guarantees), and it ends in ``ParquetSink(out_dir)`` (possibly inside a
    ``ThrottledSink``), whose committed output has these columns:

    - ``partition``, ``seq`` (ints): identify the source record the row comes
      from; the multiset of ``(partition, seq)`` must equal the failure-free run's;
    - ``key`` (int64, optional): the key the job keys by; order is checked per
      ``(partition, key)`` instead of per ``partition``;
    - ``total`` (optional): compared row by row with the failure-free run;
    - ``subtask`` and ``parallelism`` (optional, together, see
      :func:`stamp_subtask`): the keyed subtask that emitted the row; its key must
      lie in that subtask's key groups;
    - the ``VerifySpec.order_by`` column when one is named.
    """

    def __call__(self, out_dir: str, name: str, parallelism: int) -> StreamEnvironment: ...


def load_job(ref: str) -> JobFactory:
    """The factory named ``module:attr`` (``attr`` may be dotted) or ``path/to/file.py:attr``."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"bad job reference {ref!r}", hint="write module:function or path/to/file.py:function"
        )
    if module_name.endswith(".py") or os.sep in module_name:
        path = os.path.abspath(module_name)
        name = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
        file_spec = importlib.util.spec_from_file_location(name, path)
        if file_spec is None or file_spec.loader is None or not os.path.isfile(path):
            raise ConfigError(f"no Python file {path} for job {ref!r}")
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[name] = module  # dataclasses and pickling look modules up by name
        file_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ConfigError(f"cannot import the module of job {ref!r}", detail=str(e)) from e
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{module_name} has no {attr!r} for job {ref!r}") from None
    if not callable(obj):
        raise ConfigError(f"job {ref!r} is not callable")
    _ship_by_value(module)
    factory: JobFactory = obj
    return factory


def _ship_by_value(module: Any) -> None:
    """A job module outside the installed packages (a file next to the user, a test
    module) travels to Spark workers by value: they could not import it by name, and
    its operators and functions are part of the job."""
    path = getattr(module, "__file__", None)
    if not path or any(p in path for p in ("site-packages", "dist-packages")):
        return
    try:
        from pyspark import cloudpickle
    except ImportError:  # no Spark: nothing travels
        return
    cloudpickle.register_pickle_by_value(module)  # type: ignore[no-untyped-call]


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
    # The user's job (a factory or "module:function"); None: the built-in ``topology``.
    # Of the fields above, a user's job uses parallelism, rescale_to, policy and its
    # settings, failures, seed, interval_ms, and records (per source) to place failures.
    job: JobFactory | str | None = None
    # "per-key": per (partition, key), or per partition without a key column, the
    # committed seqs increase; None: order is not checked.
    order: str | None = "per-key"
    # The column that orders a key's records; None: commit order (then the job must
    # bring each key's records to the sink without a rebalance). Built-ins: "total".
    order_by: str | None = None
    # The uid of a keyed operator whose final state must equal the failure-free run's,
    # and optionally the one state of it to compare (default: every state it holds).
    # Built-ins: "running-total" and "total".
    state_uid: str | None = None
    state: str | None = None
    # Where the runs with failures go: "local" (threads here) or "spark" (a barrier
    # stage per attempt on ``master``, default the embedded local master). The
    # failure-free reference run always uses the local executor.
    executor: str = "local"
    master: str | None = None
    # Where checkpoints go (a path or pyarrow URI such as s3://...): each run uses
    # <checkpoint_dir>/<run name>. None: under the work directory.
    checkpoint_dir: str | None = None

    def describe(self) -> str:
        """``topology <name>`` or ``job <module:function>``."""
        if self.job is None:
            return f"topology {self.topology}"
        if isinstance(self.job, str):
            return f"job {self.job}"
        fn = self.job
        qual = getattr(fn, "__qualname__", type(fn).__qualname__)
        return f"job {getattr(fn, '__module__', '?')}:{qual}"

    def factory(self) -> JobFactory:
        """The job to run: the user's, or the built-in topology."""
        if self.job is None:
            return lambda out_dir, name, parallelism: build(self, out_dir, name, parallelism)
        if isinstance(self.job, str):
            return load_job(self.job)
        return self.job

    def checks(self) -> tuple[str | None, str | None, str | None]:
        """``(order_by, state_uid, state)`` in effect: the built-ins fill in their own."""
        if self.job is None:
            return (
                self.order_by or "total",
                self.state_uid or "running-total",
                self.state or ("total" if self.state_uid is None else None),
            )
        return self.order_by, self.state_uid, self.state

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
    if spec.topology in RESCALE_TOPOLOGIES:
        build_rescale_topology(spec, env, out_dir, p)
        return env

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
    rows: np.ndarray[Any, Any]  # committed rows, in commit order
    state: dict[Any, Any]
    fired: list[str] = field(default_factory=list)
    restored_inflight: int = 0  # in-flight bytes of the checkpoint a rescale restored
    out_dir: str | None = None  # where the run committed its output
    max_parallelism: int = 0


ID_COLUMNS = ("partition", "seq")
OPTIONAL_COLUMNS = ("key", "total", "subtask", "parallelism")
# ParquetSink's names: part-<subtask>-a<attempt>-c<last checkpoint>-<counter>.parquet
_PART = re.compile(r"part-(\d+)-a(\d+)-c(\d+)-(\d+)\.parquet$")


def _commit_order(name: str) -> tuple[int, int, int, str]:
    """Sorts committed files as they were committed: a subtask writes one file per
    checkpoint interval, named after the checkpoint before it, and a key moves to
    another subtask only at a restore, whose files continue from that checkpoint."""
    m = _PART.match(name)
    if m is None:
        return (sys.maxsize, 0, 0, name)
    subtask, _, checkpoint, counter = map(int, m.groups())
    return (checkpoint, counter, subtask, name)


def read_output(out_dir: str, extra: tuple[str, ...] = ()) -> np.ndarray[Any, Any]:
    """The committed rows under ``out_dir`` in commit order: ``partition``, ``seq``, the
    optional contract columns present, and ``extra`` columns (see :class:`JobFactory`)."""
    import pyarrow.parquet as pq

    files = [f for f in os.listdir(out_dir) if f.endswith(".parquet") and not f.startswith("_")]
    if not files:
        return np.empty(0, [(n, "<i8") for n in ID_COLUMNS])
    files.sort(key=_commit_order)
    t = pq.read_table([os.path.join(out_dir, f) for f in files])
    names = set(t.column_names)
    missing = [n for n in (*ID_COLUMNS, *extra) if n not in names]
    if missing:
        raise ConfigError(
            f"the committed output under {out_dir} has no column {', '.join(missing)}",
            detail=f"its columns: {', '.join(t.column_names)}",
            hint="see the output contract of spillover.verify.JobFactory",
        )
    if ("subtask" in names) != ("parallelism" in names):
        raise ConfigError(
            f"the committed output under {out_dir} has one of subtask and parallelism",
            hint="add both (stamp_subtask) or neither",
        )
    wanted = list(dict.fromkeys(n for n in (*ID_COLUMNS, *OPTIONAL_COLUMNS, *extra) if n in names))
    cols = {n: t.column(n).to_numpy() for n in wanted}
    ints = (*ID_COLUMNS, "key", "subtask", "parallelism")
    rows = np.empty(t.num_rows, [(n, "<i8" if n in ints else cols[n].dtype) for n in wanted])
    for n in wanted:
        rows[n] = cols[n]
    return rows


def _read_output(out_dir: str) -> np.ndarray[Any, Any]:
    return read_output(out_dir)


def final_state(
    result: JobResult,
    max_parallelism: int,
    uid: str,
    name: str | None = None,
    *,
    required: bool = True,
) -> dict[Any, Any]:
    """The keyed state of operator ``uid`` at the run's last checkpoint: ``{key: value}``
    of state ``name``, or ``{(state, key): value}`` of every state when ``name`` is None
    (a list state's value is the tuple of its entries). An operator or state that is
    not there raises :class:`ConfigError` when ``required``, else gives ``{}``."""
    from spillover.runtime.checkpointing.metadata import CheckpointStorage
    from spillover.runtime.state import HeapKeyedStateBackend

    if result.checkpoint_dir is None:
        return {}
    job = Location.parse(result.checkpoint_dir)
    latest = CheckpointStorage(job.parent.uri, job.name).latest()
    if latest is None:
        return {}
    keyed = [
        entry.get("keyed") or {}
        for task in latest.metadata["tasks"].values()
        for entry in task.get("subtasks", {}).values()
    ]
    handles = [k[uid] for k in keyed if k.get(uid) is not None]
    kinds = {e["name"]: (e["kind"], np.dtype(e["dtype"])) for h in handles for e in h["states"]}
    if (name is not None and name not in kinds) or not handles:
        if not required:
            return {}
        operators = ", ".join(sorted({u for k in keyed for u in k})) or "none"
        raise ConfigError(
            f"no keyed state {name or ''!s} of operator {uid!r} in the last checkpoint",
            detail=f"its states: {', '.join(sorted(kinds))}"
            if handles
            else f"keyed operators: {operators}",
        )
    backend = HeapKeyedStateBackend(max_parallelism, KeyGroupRange(0, max_parallelism - 1))
    backend.restore(handles)
    out: dict[Any, Any] = {}
    for state_name in [name] if name is not None else sorted(kinds):
        kind, dtype = kinds[state_name]
        keys, values = backend.state(StateDescriptor(state_name, kind, dtype)).items()
        order = np.argsort(keys, kind="stable")
        grouped: dict[int, list[Any]] = {}
        for key, value in zip(keys[order].tolist(), values[order].tolist(), strict=True):
            grouped.setdefault(key, []).append(value)
        for key, vs in grouped.items():
            out[key if name is not None else (state_name, key)] = (
                tuple(vs) if kind == "list" else vs[0]
            )
    return out


def _final_state(result: JobResult, max_parallelism: int) -> dict[Any, Any]:
    return final_state(result, max_parallelism, "running-total", "total", required=False)


def _state_of(spec: VerifySpec, result: JobResult, max_parallelism: int) -> dict[Any, Any]:
    _, uid, name = spec.checks()
    if uid is None:
        return {}
    return final_state(result, max_parallelism, uid, name, required=spec.job is not None)


def _read(spec: VerifySpec, out_dir: str) -> np.ndarray[Any, Any]:
    order_by = spec.checks()[0]
    return read_output(out_dir, (order_by,) if order_by and spec.order else ())


def _checkpoints(spec: VerifySpec, workdir: str, name: str) -> str:
    if spec.checkpoint_dir is None:
        return os.path.join(workdir, name, "checkpoints")
    return Location.parse(spec.checkpoint_dir).child(name).uri


def config_for(spec: VerifySpec, ckpt: str) -> Config:
    """The runtime configuration of ``spec``'s runs, checkpoints under ``ckpt``."""
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


def _executor(
    spec: VerifySpec, graph: Any, cfg: Config, executor: str | None = None, **options: Any
) -> Any:
    """``executor`` (default ``spec.executor``) for ``graph``."""
    kind = executor or spec.executor
    if kind == "local":
        return create_executor("local", graph, cfg, **options)
    if callable(spec.job):
        _ship_by_value(sys.modules.get(getattr(spec.job, "__module__", "")))
    return create_executor(kind, graph, cfg, master=spec.master, **options)


def run_once(
    spec: VerifySpec,
    workdir: str,
    name: str,
    failures: FailureInjector,
    executor: str | None = None,
) -> RunOutput:
    """One run to the end; ``executor`` overrides ``spec.executor``."""
    out_dir = os.path.join(workdir, name, "output")
    ckpt = _checkpoints(spec, workdir, name)
    os.makedirs(out_dir, exist_ok=True)
    graph = spec.factory()(out_dir, name, spec.parallelism).build()
    cfg = config_for(spec, ckpt)
    result = _executor(spec, graph, cfg, executor, failures=failures).run(timeout=600)
    return output_of(spec, result, out_dir, graph.max_parallelism, failures)


def output_of(
    spec: VerifySpec,
    result: JobResult,
    out_dir: str,
    max_parallelism: int,
    failures: FailureInjector | None = None,
) -> RunOutput:
    """What a run of ``spec`` committed to ``out_dir`` and its final keyed state, for
    :func:`compare`."""
    return RunOutput(
        result,
        _read(spec, out_dir),
        _state_of(spec, result, max_parallelism),
        [s.describe() for s in failures.fired] if failures is not None else [],
        out_dir=out_dir,
        max_parallelism=max_parallelism,
    )


def run_rescaled(
    spec: VerifySpec, workdir: str, name: str, failures: FailureInjector, stop_after: float
) -> RunOutput:
    """Runs at ``spec.parallelism`` until every induced failure happened and the latest
    completed checkpoint holds in-flight data (or ``stop_after`` seconds), stops it as
    a crash would, restores that checkpoint at ``spec.rescale_to`` and runs to the end."""

    def ready(history: list[dict[str, Any]]) -> bool:
        done = [c for c in history if c["status"] == "completed" and not c["final"]]
        inflight = spec.policy == "aligned" or (bool(done) and done[-1]["inflight_bytes"] > 0)
        return failures.pending == 0 and bool(done) and inflight

    assert spec.rescale_to is not None
    out_dir = os.path.join(workdir, name, "output")
    ckpt = _checkpoints(spec, workdir, name)
    os.makedirs(out_dir, exist_ok=True)
    cfg = config_for(spec, ckpt)
    make_job = spec.factory()
    first = _executor(
        spec, make_job(out_dir, name, spec.parallelism).build(), cfg, failures=failures
    )
    r1 = first.run(timeout=600, stop_after=stop_after, stop_when=ready)
    completed = r1.completed_checkpoints()
    if r1.status == "finished":
        raise RuntimeError(
            "the run ended before it was stopped: give it more records (or a slower sink), "
            "so that every induced failure happens and then a checkpoint completes"
            + (" with in-flight data" if spec.policy != "aligned" else "")
            + " while it runs"
        )
    if not completed:
        raise RuntimeError("no checkpoint completed before the stop: lengthen the run")
    # Only the latest completed checkpoint keeps exactly-once: sinks published up to it.
    restored = completed[-1]
    graph = make_job(out_dir, name, spec.rescale_to).build()
    second = _executor(spec, graph, cfg, restore_checkpoint=restored["checkpoint_id"])
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
        _read(spec, out_dir),
        _state_of(spec, r2, graph.max_parallelism),
        [s.describe() for s in failures.fired],
        out_dir=out_dir,
        max_parallelism=graph.max_parallelism,
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
    # (node uid.state, key, expected, found) of order-free topologies (check_promises)
    keyed_state_mismatch: list[tuple[str, int, int | None, int | None]] = field(
        default_factory=list
    )
    # (new subtask, partition, seq, times) of broadcast records not seen exactly once
    broadcast_wrong: list[tuple[int, int, int, int]] = field(default_factory=list)
    # (partition, seq) committed with failures but never without
    unexpected: list[tuple[int, int]] = field(default_factory=list)
    # (partition, seq, key, key group, subtask, parallelism): a key outside the key
    # groups of the subtask that emitted it
    misplaced: list[tuple[int, int, int, int, int, int]] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)  # what an exact verdict proves
    errors: list[str] = field(default_factory=list)  # why a run did not finish
    # Why each failed attempt of the run with failures failed (induced or not).
    attempt_failures: list[str] = field(default_factory=list)
    # In-flight bytes held by the checkpoints that the run's restarts restored from
    # (what inflight_replayed must be non-zero for).
    inflight_restored: int = 0

    def shortfalls(self) -> list[str]:
        """Why the run proved less than its spec asked for, even when exact."""
        out = []
        if len(self.failures_fired) < self.spec.failures:
            out.append(
                f"only {len(self.failures_fired)} of {self.spec.failures} induced failures "
                "happened: give the job more records (or fewer failures)"
            )
        if self.spec.rescale_to and self.spec.policy != "aligned" and not self.restored_inflight:
            out.append(
                "the restored checkpoint held no in-flight data: slow the sink down "
                "(e.g. a ThrottledSink) so that records queue up under backpressure"
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["spec"] = self.spec.__dict__
        return d

    def text(self) -> str:
        rescale = f" -> {self.spec.rescale_to}" if self.spec.rescale_to else ""
        lines = [
            f"{self.spec.describe()}, parallelism {self.spec.parallelism}{rescale}, "
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
        lines += [f"WARNING: {s}" for s in self.shortfalls()]
        if self.exact:
            proved = "; ".join(self.checks) or "no record lost, duplicated or reordered"
            lines.append(f"EXACT: {proved}")
            return "\n".join(lines)
        lines.append(f"NOT EXACT (job {self.status})")
        lines += [f"  {e}" for e in self.errors]
        lines += [f"  failed {f}" for f in self.attempt_failures]
        for title, items in (
            ("lost (partition, seq)", self.lost),
            ("duplicated (partition, seq, times)", self.duplicated),
            ("not in the failure-free output (partition, seq)", self.unexpected),
            ("reordered (partition, seq)", self.reordered),
            ("wrong running total (partition, seq, total)", self.wrong_totals),
            (
                "outside the key groups of their subtask "
                "(partition, seq, key, key group, subtask, parallelism)",
                self.misplaced,
            ),
            ("final state differs (key, expected, found)", self.state_mismatch),
            ("keyed state differs (state, key, expected, found)", self.keyed_state_mismatch),
            (
                "broadcast records not seen once (subtask, partition, seq, times)",
                self.broadcast_wrong,
            ),
        ):
            if items:
                shown = ", ".join(map(str, items[:20]))
                more = f" ... and {len(items) - 20} more" if len(items) > 20 else ""
                lines.append(f"  {len(items)} {title}: {shown}{more}")
        return "\n".join(lines)


def _unpack(i: Any) -> tuple[int, int]:
    return int(i >> 40), int(i & ((1 << 40) - 1))


def _ids(rows: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.int64]]:
    return np.asarray(rows["partition"].astype(np.int64) << 40 | rows["seq"].astype(np.int64))


def _count_diff(
    e_ids: np.ndarray[Any, Any], a_ids: np.ndarray[Any, Any]
) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]], list[tuple[int, int]]]:
    """Lost, duplicated (with the times seen) and unexpected records: the difference of
    the two multisets of ``(partition, seq)``."""
    ids = np.union1d(e_ids, a_ids)
    e_u, e_c = np.unique(e_ids, return_counts=True)
    a_u, a_c = np.unique(a_ids, return_counts=True)
    ce = np.zeros(len(ids), np.int64)
    ca = np.zeros(len(ids), np.int64)
    ce[np.searchsorted(ids, e_u)] = e_c
    ca[np.searchsorted(ids, a_u)] = a_c
    lost = [_unpack(i) for i in ids[ca < ce][:1000]]
    dup = (ca > ce) & (ce > 0)
    duplicated = [
        (*_unpack(i), int(c)) for i, c in zip(ids[dup][:1000], ca[dup][:1000], strict=True)
    ]
    unexpected = [_unpack(i) for i in ids[(ce == 0) & (ca > 0)][:1000]]
    return lost, duplicated, unexpected


def _pairs(ids: np.ndarray[Any, Any], values: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``(id, value)`` rows as opaque bytes, to test membership of whole pairs."""
    pairs = np.empty(len(ids), [("id", "<i8"), ("value", values.dtype)])
    pairs["id"], pairs["value"] = ids, values
    return pairs.view(f"V{pairs.dtype.itemsize}")


def _reordered(rows: np.ndarray[Any, Any], order_by: str | None) -> list[tuple[int, int]]:
    """Records committed after a later record of their ``(partition, key)`` (or partition),
    in ``order_by`` order, or in commit order."""
    if not len(rows):
        return []
    names = rows.dtype.names or ()
    ordinal = rows[order_by] if order_by else np.arange(len(rows))
    key = rows["key"] if "key" in names else np.zeros(len(rows), np.int64)
    order = np.lexsort((ordinal, key, rows["partition"]))
    p, k, s = rows["partition"][order], key[order], rows["seq"][order]
    same = (p[1:] == p[:-1]) & (k[1:] == k[:-1])
    back = np.flatnonzero(same & (s[1:] < s[:-1]))
    return [(int(p[i + 1]), int(s[i + 1])) for i in back[:1000]]


def _misplaced(
    rows: np.ndarray[Any, Any], max_parallelism: int
) -> list[tuple[int, int, int, int, int, int]]:
    """``(partition, seq, key, key group, subtask, parallelism)`` of every row whose key
    is not in the key groups of the subtask that emitted it."""
    names = rows.dtype.names or ()
    if not len(rows) or max_parallelism < 1 or "subtask" not in names or "key" not in names:
        return []
    kg = key_groups(np.ascontiguousarray(rows["key"], dtype=np.int64), max_parallelism)
    owner = kg.astype(np.int64) * rows["parallelism"] // max_parallelism
    bad = np.flatnonzero(owner != rows["subtask"])[:1000]
    cols = ("partition", "seq", "key", "subtask", "parallelism")
    found = [tuple(int(r[c]) for c in cols) for r in rows[bad]]
    return [(p, s, k, int(g), t, n) for (p, s, k, t, n), g in zip(found, kg[bad], strict=True)]


def compare(spec: VerifySpec, expected: RunOutput, actual: RunOutput) -> Report:
    """Every difference between a failure-free run and a run with failures."""
    e, a = expected.rows, actual.rows
    e_names, a_names = e.dtype.names or (), a.dtype.names or ()
    e_ids, a_ids = _ids(e), _ids(a)
    lost, duplicated, unexpected = _count_diff(e_ids, a_ids)
    checks = ["every record committed as often as without failures"]
    wrong: list[tuple[int, int, int]] = []
    if "total" in e_names and "total" in a_names:
        # Totals must equal the failure-free ones record by record.
        known = np.isin(a_ids, e_ids)
        totals = a["total"].astype(e["total"].dtype)
        ok = np.isin(_pairs(a_ids, totals), _pairs(e_ids, e["total"]))
        wrong = [
            (int(r["partition"]), int(r["seq"]), r["total"].item()) for r in a[known & ~ok][:1000]
        ]
        checks.append("per-record totals equal")
    order_by, state_uid, _ = spec.checks()
    reordered: list[tuple[int, int]] = []
    if spec.order == "per-key":
        reordered = _reordered(a, order_by)
        per = "(partition, key)" if "key" in a_names else "partition"
        checks.append(f"order per {per} kept" + (f" (by {order_by})" if order_by else ""))
    misplaced = _misplaced(a, actual.max_parallelism)
    if "subtask" in a_names and "key" in a_names:
        checks.append("every key in its subtask's key groups")
    keys = sorted(set(expected.state) | set(actual.state), key=repr)
    mismatch = [
        (k, expected.state.get(k), actual.state.get(k))
        for k in keys
        if expected.state.get(k) != actual.state.get(k)
    ]
    if expected.state:
        checks.append(f"final keyed state of {state_uid} equal")
    r = actual.result
    exact = (
        r.status == "finished"
        and expected.result.status == "finished"
        and not lost
        and not duplicated
        and not unexpected
        and not reordered
        and not wrong
        and not misplaced
        and not mismatch
        and len(a) == len(e)
    )
    report = Report(
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
        unexpected=unexpected,
        misplaced=misplaced,
        checks=checks,
        errors=[
            f"the run {label} {run.result.status}: {run.result.failures[-1]}"
            for label, run in (("without failures", expected), ("with failures", actual))
            if run.result.status != "finished" and run.result.failures
        ],
        attempt_failures=list(actual.result.failures),
        inflight_restored=_inflight_restored(r),
    )
    return check_promises(spec, expected, actual, report)


def _inflight_restored(r: JobResult) -> int:
    """In-flight bytes of the completed checkpoints the run restored from."""
    held = {int(c["checkpoint_id"]): int(c["inflight_bytes"]) for c in r.completed_checkpoints()}
    return sum(held.get(cid, 0) for cid in r.restored_from)


def verify(spec: VerifySpec, workdir: str | None = None) -> Report:
    """Runs the job without and with ``spec.failures`` induced failures."""
    if spec.order not in ("per-key", None):
        raise ConfigError(f"order must be 'per-key' or None, got {spec.order!r}")
    if spec.master is not None and spec.executor != "spark":
        raise ConfigError(
            "a Spark master (--master) needs the spark executor",
            detail=f"master {spec.master!r} with executor {spec.executor!r}",
            hint="add --executor spark (VerifySpec.executor='spark')",
        )
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="spillover-verify-")
    try:
        baseline = run_once(spec, workdir, "baseline", FailureInjector(), executor="local")
        if spec.job is not None and baseline.result.status == "finished" and not len(baseline.rows):
            raise ConfigError(
                f"{spec.describe()} committed nothing without failures",
                hint="end it in ParquetSink(out_dir), with out_dir the factory's first argument",
            )
        graph = spec.factory()(os.path.join(workdir, "probe"), "probe", spec.parallelism).build()
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
            # A bound; stop_when decides. Spark adds a stage start per attempt.
            stop_after = 0.8 * baseline.result.duration_s + 5.0
            if spec.executor != "local":
                stop_after += 30.0
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


# --- topologies for rescaling recovery ---------------------------------------------------------

BROADCAST_DTYPE = np.dtype(
    [
        ("partition", "<i4"),
        ("seq", "<i8"),
        ("key", "<i8"),
        ("subtask", "<i4"),  # the receiving subtask of a broadcast record; -1: a main record
        ("parallelism", "<i4"),  # the receiving operator's parallelism then (0: main)
    ]
)
BROADCAST_VIEW_DIR = "broadcast-view"  # under the output directory: the broadcast rows
# Topologies whose keyed operator sees a key's records in no promised order: their
# ``total`` column is the value a record added, so totals and order prove nothing there.
ORDER_FREE_TOPOLOGIES = ("rebalance-chain",)
# The keyed states compared with the failure-free run, per topology: (node uid, state name).
KEYED_CHECKS: dict[str, tuple[tuple[str, str], ...]] = {
    "rebalance-chain": (("count-sum", "count-sum.count"), ("count-sum", "count-sum.sum")),
    "keyed-parallelisms": (("running-total-2", "running-total-2.total"),),
    "stateless-between-keyed": (
        ("count-sum", "count-sum.count"),
        ("count-sum", "count-sum.sum"),
    ),
    "custom-partitioner": (
        ("count-sum", "count-sum.count"),
        ("count-sum", "count-sum.sum"),
    ),
}


def key_modulo(keys: np.ndarray[Any, Any], n: int) -> np.ndarray[Any, Any]:
    """The custom partitioner of the ``custom-partitioner`` topology: key mod n."""
    return np.asarray(keys, dtype=np.int64) % n


class CheckRouting(Operator):
    """Stateless: passes records on, failing the job on one the partitioner did not pick
    for this subtask (recovered records included)."""

    def __init__(self, out_dtype: Any) -> None:
        self.out_dtype = np.dtype(out_dtype)

    def process(self, batch: Batch, input_index: int = 0) -> None:
        picked = key_modulo(batch["key"], self.ctx.parallelism)
        wrong = picked != self.ctx.subtask_index
        if wrong.any():
            key = int(batch["key"][wrong][0])
            raise RuntimeError(
                f"subtask {self.ctx.subtask_index} of {self.ctx.parallelism} received key "
                f"{key}, which the partitioner sends to {int(picked[wrong][0])}"
            )
        if len(batch):
            self.ctx.output.emit(batch)


def _running_totals(
    state: KeyedState, keys: np.ndarray[Any, Any], values: np.ndarray[Any, Any]
) -> np.ndarray[Any, Any]:
    """Per record, its key's running total of ``values`` up to and with it (batch order
    per key); the batch's sums are added to ``state``."""
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    values = np.ascontiguousarray(values, dtype=np.int64)
    order = np.argsort(keys, kind="stable")
    k, v = keys[order], values[order]
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
    counts = np.diff(np.r_[starts, len(k)])
    csum = np.cumsum(v)
    uniq = k[starts]
    prev, has = state.get(uniq)
    base = np.where(has, prev, 0).astype(np.int64)
    totals = np.empty(len(k), np.int64)
    totals[order] = csum - np.repeat(csum[starts] - v[starts], counts) + np.repeat(base, counts)
    state.put(uniq, np.add.reduceat(v, starts))
    return totals


class RunningTotalOfTotals(Operator):
    """Keyed, behind a running total: every record leaves with its key's running sum of
    the totals it arrived with, so a record reordered on the way here changes it; it is
    stamped with the emitting subtask, like ``RunningTotal``."""

    out_dtype = RunningTotal.out_dtype

    def open(self, ctx: OperatorContext) -> None:
        super().open(ctx)
        assert ctx.keyed is not None, "RunningTotalOfTotals runs after key_by"
        self.totals = ctx.keyed.state(StateDescriptor(f"{ctx.uid}.total", "sum", np.int64))

    def process(self, batch: Batch, input_index: int = 0) -> None:
        out = np.empty(len(batch), self.out_dtype)
        for name in ("partition", "seq", "key"):
            out[name] = batch[name]
        out["total"] = _running_totals(self.totals, batch["key"], batch["total"])
        out["subtask"] = self.ctx.subtask_index
        out["parallelism"] = self.ctx.parallelism
        self.ctx.output.emit(out)


class CountSum(Operator):
    """Keyed and order-free: counts records and sums ``value_field`` per key (states
    ``<uid>.count`` and ``<uid>.sum``); every record leaves with ``total`` set to the
    value it added, which does not depend on arrival order, and the emitting subtask."""

    out_dtype = RunningTotal.out_dtype

    def __init__(self, value_field: str) -> None:
        self.value_field = value_field

    def open(self, ctx: OperatorContext) -> None:
        super().open(ctx)
        assert ctx.keyed is not None, "CountSum runs after key_by"
        self.count = ctx.keyed.state(StateDescriptor(f"{ctx.uid}.count", "sum", np.int64))
        self.sum = ctx.keyed.state(StateDescriptor(f"{ctx.uid}.sum", "sum", np.int64))

    def process(self, batch: Batch, input_index: int = 0) -> None:
        keys = np.ascontiguousarray(batch["key"], dtype=np.int64)
        values = np.ascontiguousarray(batch[self.value_field], dtype=np.int64)
        order = np.argsort(keys, kind="stable")
        k = keys[order]
        starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
        self.count.put(k[starts], np.diff(np.r_[starts, len(k)]).astype(np.int64))
        self.sum.put(k[starts], np.add.reduceat(values[order], starts))
        out = np.empty(len(batch), self.out_dtype)
        out["partition"] = batch["partition"]
        out["seq"] = batch["seq"]
        out["key"] = keys
        out["total"] = values
        out["subtask"] = self.ctx.subtask_index
        out["parallelism"] = self.ctx.parallelism
        self.ctx.output.emit(out)


class BroadcastView(TwoInputOperator):
    """Input 0, the main records, passes on (``subtask`` -1); input 1, broadcast, leaves
    one row per record tagged with the receiving subtask and parallelism, so the output
    shows every broadcast record each subtask saw."""

    out_dtype = BROADCAST_DTYPE

    def _rows(self, batch: Batch, subtask: int, parallelism: int) -> None:
        out = np.empty(len(batch), BROADCAST_DTYPE)
        out["partition"] = batch["partition"]
        out["seq"] = batch["seq"]
        out["key"] = batch["key"]
        out["subtask"] = subtask
        out["parallelism"] = parallelism
        self.ctx.output.emit(out)

    def process1(self, batch: Batch) -> None:
        self._rows(batch, -1, 0)

    def process2(self, batch: Batch) -> None:
        self._rows(batch, self.ctx.subtask_index, self.ctx.parallelism)


class MainRunningTotal(RunningTotal):
    """``RunningTotal`` of the broadcast topology's main records (broadcast rows skipped)."""

    def process(self, batch: Batch, input_index: int = 0) -> None:
        main = batch[batch["subtask"] < 0]
        if len(main):
            super().process(main, input_index)


def _is_broadcast_row(batch: Batch) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """The rows of ``BroadcastView`` that record a broadcast record's arrival."""
    return np.asarray(batch["subtask"] >= 0)


def _broadcast_records(spec: VerifySpec) -> tuple[int, int]:
    """Partitions and records per partition of the broadcast source: a quarter of the
    main records, so its subtasks run about as long as the main ones."""
    partitions = 2 * spec.parallelism
    return partitions, max(1, spec.records // 4 // partitions)


def build_rescale_topology(spec: VerifySpec, env: StreamEnvironment, out_dir: str, p: int) -> None:
    """Adds one of ``RESCALE_TOPOLOGIES`` to ``env`` at parallelism ``p``.

    - ``rebalance-chain``: one source subtask ("global") -> rebalance -> keys ->
      rebalance ("shuffle") -> key_by -> count and sum per key;
    - ``keyed-parallelisms``: key_by -> running total at ``p`` -> key_by -> running
      total of the totals at ``p + 1``;
    - ``broadcast``: keyed main records and a broadcast source into a two-input
      operator; main records -> key_by -> running total; broadcast rows -> their sink
      under ``out_dir/broadcast-view``;
    - ``stateless-between-keyed``: key_by -> running total -> stateless map at
      ``p + 1`` -> key_by -> count and sum of the totals per key;
    - ``custom-partitioner``: a custom partitioner (key mod n) -> a stateless
      operator at ``p + 1`` that fails on a record routed elsewhere -> key_by ->
      count and sum per key.
    """
    rate = spec.rate_per_subtask
    partitions = 2 * spec.parallelism  # fixed across rescaling: partitions move

    def generator(seed: int, per_partition: int, rate_per_subtask: float | None) -> GeneratorSource:
        return GeneratorSource(
            partitions=partitions,
            records_per_partition=per_partition,
            payload_bytes=100,
            keys=10_000,
            rate_per_subtask=rate_per_subtask,
            batch_size=512,
            seed=seed,
        )

    def keyed_source() -> DataStream:
        gen = generator(spec.seed, max(1, spec.records // partitions), rate)
        s = env.from_source(gen, uid="source")
        return s.map(_per_partition_keys(0), uid="keys")

    def sink(stream: DataStream, offered: float | None) -> None:
        """The committed output; it takes ``sink_share`` of the ``offered`` records/s."""
        op: Operator = ParquetSink(out_dir)
        if offered and spec.sink_share < 1:
            op = ThrottledSink(offered * spec.sink_share / stream.node.parallelism, inner=op)
        stream.rebalance().sink(op, uid="parquet-sink")

    if spec.topology == "rebalance-chain":
        total = rate * spec.parallelism if rate else None  # what spec.parallelism would offer
        gen = generator(spec.seed, max(1, spec.records // partitions), total)
        src = env.from_source(gen, uid="source", parallelism=1)
        keys = src.rebalance().map(_per_partition_keys(0), uid="keys", parallelism=p)
        shuffled = keys.rebalance().map(_same, uid="shuffle")
        sink(shuffled.key_by("key").process(CountSum("seq"), uid="count-sum"), total)
    elif spec.topology == "keyed-parallelisms":
        totals = keyed_source().key_by("key").process(RunningTotal(), uid="running-total")
        again = totals.key_by("key").process(
            RunningTotalOfTotals(), uid="running-total-2", parallelism=p + 1
        )
        sink(again, rate * p if rate else None)
    elif spec.topology == "stateless-between-keyed":
        totals = keyed_source().key_by("key").process(RunningTotal(), uid="running-total")
        between = totals.rebalance().map(_same, uid="stateless", parallelism=p + 1)
        counted = between.key_by("key").process(CountSum("total"), uid="count-sum", parallelism=p)
        sink(counted, rate * p if rate else None)
    elif spec.topology == "custom-partitioner":
        keyed = keyed_source()
        routed = keyed.partition_custom(key_modulo, "key").process(
            CheckRouting(keyed.dtype), uid="custom-routed", parallelism=p + 1
        )
        counted = routed.key_by("key").process(CountSum("seq"), uid="count-sum", parallelism=p)
        sink(counted, rate * p if rate else None)
    elif spec.topology == "broadcast":
        _, b_per = _broadcast_records(spec)
        b = env.from_source(
            generator(spec.seed + 2, b_per, rate / 4 if rate else None), uid="broadcast-source"
        )
        co = (
            keyed_source()
            .key_by("key")
            .connect(b.broadcast())
            .process(BroadcastView(), uid="broadcast-join")
        )
        sink(
            co.key_by("key").process(MainRunningTotal(), uid="running-total"),
            rate * p if rate else None,
        )
        view = co.rebalance().filter(_is_broadcast_row, uid="broadcast-rows")
        view.sink(ParquetSink(os.path.join(out_dir, BROADCAST_VIEW_DIR)), uid="broadcast-sink")
    else:
        raise ValueError(f"unknown topology {spec.topology!r}; choose from {TOPOLOGIES}")


def _read_rows(directory: str, dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    """The committed rows of a ParquetSink directory, as ``dtype``."""
    import pyarrow.parquet as pq

    files = []
    if os.path.isdir(directory):
        files = sorted(f for f in os.listdir(directory) if f.endswith(".parquet"))
    rows = np.empty(0, dtype)
    if files:
        t = pq.read_table([os.path.join(directory, f) for f in files])
        rows = np.empty(t.num_rows, dtype)
        for name in dtype.names or ():
            rows[name] = t.column(name).to_numpy()
    return rows


def broadcast_wrong(
    spec: VerifySpec, rows: np.ndarray[Any, Any]
) -> list[tuple[int, int, int, int]]:
    """``(subtask, partition, seq, times)`` for every broadcast record that a subtask of
    the last parallelism did not see exactly once.

    A subtask ``d`` restored at another parallelism inherits the view of old subtask
    ``broadcast_source(d, old)`` (its processed records were committed under the old
    tag, its in-flight ones are replayed to ``d``), so its view is the rows of both.
    """
    from spillover.rescale import broadcast_source

    old = spec.parallelism
    new = spec.rescale_to or old
    partitions, per = _broadcast_records(spec)
    ids = rows["partition"].astype(np.int64) * per + rows["seq"]
    valid = (rows["partition"] >= 0) & (rows["partition"] < partitions)
    valid &= (rows["seq"] >= 0) & (rows["seq"] < per)
    wrong: list[tuple[int, int, int, int]] = []
    for d in range(new):
        mine = (rows["parallelism"] == new) & (rows["subtask"] == d)
        mine |= (rows["parallelism"] == old) & (rows["subtask"] == broadcast_source(d, old))
        times = np.bincount(ids[mine & valid], minlength=partitions * per)
        bad = np.flatnonzero(times != 1)
        wrong += [(d, int(i // per), int(i % per), int(times[i])) for i in bad[:1000]]
        foreign = rows[mine & ~valid]  # records the broadcast source never made
        wrong += [(d, int(r["partition"]), int(r["seq"]), 1) for r in foreign[:1000]]
    return wrong[:1000]


def check_promises(
    spec: VerifySpec, expected: RunOutput, actual: RunOutput, report: Report
) -> Report:
    """Adds to ``report`` what a rescaling topology promises beyond ``compare``: its
    order-free keyed states equal the failure-free run's, and for ``broadcast`` every
    subtask of the last parallelism saw every broadcast record exactly once."""
    if spec.job is not None:
        return report
    if spec.topology in ORDER_FREE_TOPOLOGIES:
        vacuous = ("per-record totals", "order per")
        report.checks = [c for c in report.checks if not c.startswith(vacuous)]
    for uid, name in KEYED_CHECKS.get(spec.topology, ()):
        e = final_state(expected.result, expected.max_parallelism, uid, name)
        a = final_state(actual.result, actual.max_parallelism, uid, name, required=False)
        report.keyed_state_mismatch += [
            (name, k, e.get(k), a.get(k)) for k in sorted(set(e) | set(a)) if e.get(k) != a.get(k)
        ][:1000]
        report.checks.append(f"final {name} per key equal")
    if spec.topology == "broadcast":
        if actual.out_dir is None:
            raise ValueError("the run's output directory is unknown (RunOutput.out_dir)")
        rows = _read_rows(os.path.join(actual.out_dir, BROADCAST_VIEW_DIR), BROADCAST_DTYPE)
        report.broadcast_wrong = broadcast_wrong(spec, rows)
        report.checks.append("every broadcast record seen once by every subtask")
    report.exact = report.exact and not report.keyed_state_mismatch and not report.broadcast_wrong
    return report
