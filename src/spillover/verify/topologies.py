"""The built-in jobs: a keyed running total behind every topology, the
rescaling topologies (rebalance, broadcast, order-free), a job whose branches
finish at different times (FLIP-147) and users' job files."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from spillover.config.policies import CHECKPOINT_POLICIES
from spillover.errors import ConfigError
from spillover.runtime.api import (
    Batch,
    KeyedState,
    Operator,
    OperatorContext,
    OperatorSnapshot,
    StateDescriptor,
)
from spillover.runtime.connectors.generator import GeneratedEventTime, GeneratorSource
from spillover.runtime.connectors.parquet import ParquetSink
from spillover.runtime.connectors.throttled import ThrottledSink
from spillover.runtime.eventtime.strategy import WatermarkStrategy
from spillover.runtime.graph import DataStream, JobGraph, StreamEnvironment
from spillover.runtime.operators import CoMap, TwoInputOperator

if TYPE_CHECKING:
    from spillover.verify.spec import VerifySpec


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
TOPOLOGIES = ("pipeline", "multi-input", "union", "finishing", "iteration", *RESCALE_TOPOLOGIES)
# ``finishing``: the summary record of source partition ``p`` has partition
# ``SUMMARY_PARTITION + p`` (data records keep theirs).
SUMMARY_PARTITION = 100_000
SHORT_OFFSET = 1000  # ``finishing``: the short branch's partitions are 1000 + p
# What a built-in topology's sources add to their partitions before the sink
# (``per_partition_keys``): ``uid -> offset``, to map a source's savepoint position
# of partition ``p`` onto the committed rows of partition ``offset + p``.
SOURCE_PARTITION_OFFSETS = {
    "source": 0,
    "source-a": 0,
    "source-b": 1000,
    "short-source": SHORT_OFFSET,
}
# ``finishing``'s event-time branch: tumbling window counts of the main branch per
# key, committed under the output directory (``key``, ``window_end``, ``count``).
WINDOW_VIEW_DIR = "windows"
WINDOW_DTYPE = np.dtype([("key", "<i8"), ("window_end", "<i8"), ("count", "<i8")])
WINDOW_MS = 1_000
POLICIES = CHECKPOINT_POLICIES


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


class FinishSummary(Operator):
    """Forwards records and, in ``finish()``, emits one summary record per source
    partition this subtask owns: partition ``SUMMARY_PARTITION + p``, ``seq`` the
    records of ``p`` it saw, ``key`` the partition times 1000.

    Chain it right behind its source (``offset`` undoes the partition offset of
    :func:`per_partition_keys`): it owns the partitions its source subtask owns. The
    output depends on nothing but the job, so a run is exact only when ``finish()``
    output is committed once, whatever failed after the operator finished
    (FLIP-147). The state counts per partition and names the partitions already
    summarised. A restore at the same parallelism ignores the names: the runtime
    must not run a finished subtask again. A union restore at another parallelism
    uses them: a partially finished operator runs again there, and a partition
    whose old subtask had finished is not summarised twice."""

    def __init__(self, partitions: int, offset: int, dtype: Any) -> None:
        self.partitions = partitions
        self.offset = offset
        self.out_dtype = np.dtype(dtype)
        self.seen: dict[int, int] = {}
        self.emitted: set[int] = set()

    def process(self, batch: Batch, input_index: int = 0) -> None:
        parts, counts = np.unique(np.asarray(batch["partition"]) - self.offset, return_counts=True)
        for p, c in zip(parts.tolist(), counts.tolist(), strict=True):
            self.seen[p] = self.seen.get(p, 0) + c
        self.ctx.output.emit(batch)

    def snapshot(self, checkpoint_id: int) -> OperatorSnapshot:
        return OperatorSnapshot(
            {"seen": {str(p): n for p, n in self.seen.items()}, "emitted": sorted(self.emitted)}
        )

    def restore(self, state: Any) -> None:
        self.seen = {int(p): int(n) for p, n in dict(state["seen"]).items()}

    def restore_rescaled(self, states: list[Any]) -> None:
        for st in states:
            if st is not None:  # a partition's count lives with one old subtask
                self.seen.update({int(p): int(n) for p, n in dict(st["seen"]).items()})
                self.emitted.update(int(p) for p in st["emitted"])

    def finish(self) -> None:
        ctx = self.ctx
        own = [
            p
            for p in range(ctx.subtask_index, self.partitions, ctx.parallelism)
            if p not in self.emitted
        ]
        out = np.zeros(len(own), self.out_dtype)
        out["partition"] = [SUMMARY_PARTITION + p for p in own]
        out["seq"] = [self.seen.get(p, 0) for p in own]
        out["key"] = out["partition"].astype(np.int64) * 1000
        self.emitted.update(own)
        ctx.output.emit(out)


def per_partition_keys(offset: int) -> Callable[[Batch], Batch]:
    """A map giving each record the key of its source partition plus ``offset`` (keys made
    per partition keep each key's records in sequence order on one channel)."""

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


def checked_job(factory: JobFactory, job: str) -> JobFactory:
    """``factory``, refusing with a :class:`ConfigError` (naming ``job``, as
    ``job module:function``) what it returns when that is not a StreamEnvironment."""

    def make_job(out_dir: str, name: str, parallelism: int) -> StreamEnvironment:
        env: object = factory(out_dir, name, parallelism)
        if isinstance(env, StreamEnvironment):
            return env
        built = isinstance(env, JobGraph)
        raise ConfigError(
            f"{job} returned {type(env).__qualname__}, not a StreamEnvironment",
            hint="return the environment itself, not env.build()"
            if built
            else "the function must return the StreamEnvironment it built ('return env')",
        )

    return make_job


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


def build(
    spec: VerifySpec, out_dir: str, name: str, parallelism: int | None = None
) -> StreamEnvironment:
    """One of the built-in topologies, writing committed output to ``out_dir``."""
    p = parallelism or spec.parallelism
    env = StreamEnvironment(name, parallelism=p, max_parallelism=128)
    if spec.topology in RESCALE_TOPOLOGIES:
        build_rescale_topology(spec, env, out_dir, p)
        return env

    # finishing (and any with ``spec.event_time``): event time, each partition's
    # records 1 ms apart, up to 50 ms out of order, and watermarks that allow for it
    # (no record is ever late).
    timed = spec.topology == "finishing" or spec.event_time
    event_time = GeneratedEventTime(step_ms=1, max_disorder_ms=50) if timed else None
    watermarks = WatermarkStrategy.bounded_out_of_orderness("ts", 50) if timed else None

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
            event_time=event_time,
        )
        return env.from_source(gen, uid=uid, watermarks=watermarks)

    if spec.topology == "pipeline":
        s = source("source", spec.seed).map(per_partition_keys(0), uid="keys")
        keyed = s.key_by("key")
    elif spec.topology == "union":
        a = source("source-a", spec.seed).map(per_partition_keys(0), uid="keys-a")
        b = source("source-b", spec.seed + 1).map(per_partition_keys(1000), uid="keys-b")
        keyed = a.key_by("key").union(b.key_by("key")).map(lambda x: x, uid="union")
        keyed = keyed.key_by("key")
    elif spec.topology == "finishing":
        # A short branch, unpaced (it ends within the first checkpoints) with an
        # operator that emits in finish(), beside the paced main branch, whose
        # records are also counted in event-time windows.
        a = source("source", spec.seed).map(per_partition_keys(0), uid="keys")
        a.key_by("key").window_count(WINDOW_MS, timestamp_field="ts", uid="windows").sink(
            ParquetSink(os.path.join(out_dir, WINDOW_VIEW_DIR)), uid="window-sink"
        )
        partitions = 2 * spec.parallelism
        short = GeneratorSource(
            partitions=partitions,
            records_per_partition=max(1, spec.records // (10 * partitions)),
            payload_bytes=100,
            batch_size=512,
            seed=spec.seed + 1,
            event_time=event_time,
        )
        b = (
            env.from_source(short, uid="short-source", watermarks=watermarks)
            .map(per_partition_keys(SHORT_OFFSET), uid="short-keys")
            .process(FinishSummary(partitions, SHORT_OFFSET, a.dtype), uid="summary")
        )
        keyed = a.key_by("key").union(b.key_by("key")).map(lambda x: x, uid="union")
        keyed = keyed.key_by("key")
    elif spec.topology == "multi-input":
        # Two keyed inputs of a two-input operator (key_by edges rescale; forward
        # edges into it would refuse to).
        a = source("source-a", spec.seed).map(per_partition_keys(0), uid="keys-a")
        b = source("source-b", spec.seed + 1).map(per_partition_keys(1000), uid="keys-b")
        dt = a.dtype
        merged = (
            a.key_by("key").connect(b.key_by("key")).process(CoMap(_same, _same, dt), uid="co-map")
        )
        keyed = merged.key_by("key")
    else:
        raise ValueError(f"unknown topology {spec.topology!r}; choose from {TOPOLOGIES}")
    if spec.event_time and spec.topology != "finishing":
        first = s if spec.topology == "pipeline" else a
        first.key_by("key").window_count(WINDOW_MS, timestamp_field="ts", uid="windows").sink(
            ParquetSink(os.path.join(out_dir, WINDOW_VIEW_DIR)), uid="window-sink"
        )
    totals = keyed.process(RunningTotal(), uid="running-total")
    sink: Operator = ParquetSink(out_dir)
    if spec.rate_per_subtask and spec.sink_share < 1:
        sources = 1 if spec.topology == "pipeline" else 2
        rate = spec.rate_per_subtask * sources * spec.sink_share
        sink = ThrottledSink(rate, inner=sink)
    totals.rebalance().sink(sink, uid="parquet-sink")
    return env


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
ORDER_FREE_TOPOLOGIES = ("rebalance-chain", "iteration")
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
    "iteration": (("count-sum", "count-sum.count"), ("count-sum", "count-sum.sum")),
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
        return s.map(per_partition_keys(0), uid="keys")

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
        keys = src.rebalance().map(per_partition_keys(0), uid="keys", parallelism=p)
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
