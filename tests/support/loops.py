"""Loop jobs the whole-job tests share (FLIP-15): a countdown loop whose records go
round a given number of times, and a loop whose feedback doubles every round."""

from __future__ import annotations

from typing import Any

import numpy as np

from spillover.runtime.api import Batch, Operator
from spillover.runtime.connectors.collecting import CollectingSink
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.graph import StreamEnvironment

LOOP_DTYPE = np.dtype([("partition", "<i4"), ("seq", "<i8"), ("key", "<i8"), ("left", "<i8")])
DOUBLING_DTYPE = np.dtype([("id", "<i8"), ("generation", "<i8")])


def countdown_job(
    name: str,
    rounds: list[int],
    *,
    parallelism: int = 2,
    records_per_partition: int | None = 200,
    rate_per_subtask: float | None = None,
    feedback: str = "key_by",
) -> StreamEnvironment:
    """Record ``seq`` goes round the loop ``rounds[seq % len(rounds)]`` times, then
    leaves it unchanged but for ``left`` (0) into an exactly-once CollectingSink."""
    table = np.asarray(rounds, dtype=np.int64)

    def enter(batch: Batch) -> Batch:
        out = np.empty(len(batch), LOOP_DTYPE)
        for f in ("partition", "seq", "key"):
            out[f] = batch[f]
        out["left"] = table[batch["seq"] % len(table)]
        return out

    def step(batch: Batch) -> Batch:
        out = batch.copy()
        out["left"] -= 1
        return out

    env = StreamEnvironment(name, parallelism=parallelism, max_parallelism=128)
    gen = GeneratorSource(
        partitions=2 * parallelism,
        records_per_partition=records_per_partition,
        payload_bytes=8,
        rate_per_subtask=rate_per_subtask,
        batch_size=64,
    )
    loop = (
        env.from_source(gen, uid="source").map(enter, LOOP_DTYPE, uid="enter").iterate(uid="head")
    )
    body = loop.filter(lambda b: b["left"] > 0, uid="body").map(step, LOOP_DTYPE, uid="step")
    loop.close_with(body.key_by("key") if feedback == "key_by" else body)
    loop.filter(lambda b: b["left"] == 0, uid="exit").sink(CollectingSink(name), uid="sink")
    return env


class CountingSink(Operator):
    """Counts what reaches it and sums its ``id`` field, keeping nothing else (so a
    test's memory is the loop's); the totals are in the task metrics."""

    def process(self, batch: Batch, input_index: int = 0) -> None:
        m = self.ctx.metrics
        m["exits"] = m.get("exits", 0) + len(batch)
        m["id_sum"] = m.get("id_sum", 0) + int(batch["id"].sum())


def doubling_job(name: str, records: int, generations: int) -> StreamEnvironment:
    """Every record goes round ``generations`` times and doubles each round: the
    feedback grows to ``records * 2**generations`` records, far more than the
    network holds, so only a spilling feedback edge lets the loop finish."""

    def enter(batch: Batch) -> Batch:
        out = np.empty(len(batch), DOUBLING_DTYPE)
        out["id"] = batch["partition"].astype(np.int64) * 1_000_000 + batch["seq"]
        out["generation"] = 0
        return out

    def double(batch: Batch) -> Batch:
        out = np.repeat(batch, 2)
        out["generation"] += 1
        return out

    env = StreamEnvironment(name, parallelism=2, max_parallelism=128)
    gen = GeneratorSource(partitions=2, records_per_partition=records // 2, payload_bytes=8)
    loop = (
        env.from_source(gen, uid="source")
        .map(enter, DOUBLING_DTYPE, uid="enter")
        .iterate(uid="head")
    )
    body = loop.filter(lambda b: b["generation"] < generations, uid="body").flat_map(
        double, DOUBLING_DTYPE, uid="double"
    )
    loop.close_with(body.rebalance())
    loop.filter(lambda b: b["generation"] == generations, uid="exit").sink(
        CountingSink(), uid="sink"
    )
    return env


TINY_NETWORK: dict[str, Any] = {
    "taskmanager.memory.segment-size": "4 kb",
    "taskmanager.network.memory.buffers-per-channel": 1,
    "taskmanager.network.memory.floating-buffers-per-gate": 0,
    "taskmanager.network.memory.buffers-per-partition": 4,
}
