"""The ``iteration`` topology: a loop whose exact result is known in advance.

Every record gets a Collatz counter ``n = seq % 12 + 1`` and goes round a loop
(FLIP-15): each pass through the body takes one Collatz step and counts it, and
a record leaves the loop once its counter reached 1, with its step count (0 to
19 passes). Every edge is keyed, the feedback too, so a rescaled restore
redistributes the head's logged feedback (and all other in-flight data) by key
group. Behind the loop, an order-free keyed count
and sum per key; each record leaves with ``total = seq * 1000 + steps``, so the
exact comparison with the failure-free run checks every record's step count,
and a record lost or replayed inside the loop shows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from spillover.runtime.api import Batch, Operator
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.connectors.parquet import ParquetSink
from spillover.runtime.connectors.throttled import ThrottledSink
from spillover.runtime.graph import StreamEnvironment
from spillover.verify.topologies import CountSum, per_partition_keys

if TYPE_CHECKING:
    from spillover.verify.spec import VerifySpec

LOOP_DTYPE = np.dtype(
    [("partition", "<i4"), ("seq", "<i8"), ("key", "<i8"), ("n", "<i8"), ("steps", "<i8")]
)
EXIT_DTYPE = np.dtype([*LOOP_DTYPE.descr, ("code", "<i8")])
COLLATZ_MOD = 12  # a record starts at seq % 12 + 1: 0 to 19 passes round the loop


def collatz_steps(n: int) -> int:
    """Passes a record starting at ``n`` makes round the loop (the reference)."""
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps


def _enter(batch: Batch) -> Batch:
    out = np.empty(len(batch), LOOP_DTYPE)
    out["partition"] = batch["partition"]
    out["seq"] = batch["seq"]
    out["key"] = batch["key"]
    out["n"] = batch["seq"] % COLLATZ_MOD + 1
    out["steps"] = 0
    return out


def _done(batch: Batch) -> Batch:
    return np.asarray(batch["n"] == 1)


def _going(batch: Batch) -> Batch:
    return np.asarray(batch["n"] != 1)


def _step(batch: Batch) -> Batch:
    out = batch.copy()
    n = batch["n"]
    out["n"] = np.where(n % 2 == 0, n // 2, 3 * n + 1)
    out["steps"] = batch["steps"] + 1
    return out


def _leave(batch: Batch) -> Batch:
    out = np.empty(len(batch), EXIT_DTYPE)
    for name in LOOP_DTYPE.names or ():
        out[name] = batch[name]
    out["code"] = batch["seq"] * 1000 + batch["steps"]
    return out


def build_iteration(
    spec: VerifySpec, out_dir: str, name: str, parallelism: int
) -> StreamEnvironment:
    """The ``iteration`` topology at ``parallelism`` (the loop's and every operator's)."""
    p = parallelism
    env = StreamEnvironment(name, parallelism=p, max_parallelism=128)
    partitions = 2 * spec.parallelism  # fixed across rescaling: partitions move
    gen = GeneratorSource(
        partitions=partitions,
        records_per_partition=max(1, spec.records // partitions),
        payload_bytes=100,
        keys=10_000,
        rate_per_subtask=spec.rate_per_subtask,
        batch_size=512,
        seed=spec.seed,
    )
    records = (
        env.from_source(gen, uid="source")
        .map(per_partition_keys(0), uid="keys")
        .map(_enter, LOOP_DTYPE, uid="enter")
    )
    # Keyed edges everywhere, so every edge's in-flight data rescales.
    loop = records.key_by("key").iterate(uid="loop-head")
    body = (
        loop.key_by("key")
        .filter(_going, uid="loop-body")
        .map(_step, LOOP_DTYPE, uid="collatz-step")
    )
    loop.close_with(body.key_by("key"))
    left = loop.key_by("key").filter(_done, uid="loop-exit").map(_leave, EXIT_DTYPE, uid="leave")
    counted = left.key_by("key").process(CountSum("code"), uid="count-sum")
    sink: Operator = ParquetSink(out_dir)
    if spec.rate_per_subtask and spec.sink_share < 1:
        sink = ThrottledSink(spec.rate_per_subtask * spec.sink_share, inner=sink)
    counted.rebalance().sink(sink, uid="parquet-sink")
    return env
