"""Batch jobs shared by the batch tests (local and Spark): a keyed sum behind a
generator, its exact totals, the configuration, and the job's log."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from spillover.config import Config
from spillover.runtime.connectors import GeneratorSource, ParquetSink
from spillover.runtime.connectors.throttled import ThrottledSink
from spillover.runtime.graph import StreamEnvironment
from spillover.runtime.jobevents import EVENTS_DIR, JobEventLog, TaskFinished
from spillover.runtime.operators import KeyedSum

RECORDS = 20_000


def source_kwargs() -> dict[str, Any]:
    return {"partitions": 4, "records_per_partition": RECORDS // 4, "payload_bytes": 16}


def source() -> GeneratorSource:
    return GeneratorSource(**source_kwargs(), keys=500)


def job(out: Path, *, parallelism: int = 2, sum_parallelism: int | None = None) -> Any:
    """source -> key_by -> running sum per key -> Parquet."""
    env = StreamEnvironment("batchjob", parallelism=parallelism, max_parallelism=128)
    gen = source()
    (
        env.from_source(gen, uid="src")
        .key_by("key")
        .process(KeyedSum("key", "seq"), uid="sum", parallelism=sum_parallelism)
        .sink(ParquetSink(str(out)), uid="sink", parallelism=sum_parallelism)
    )
    return env


def totals(out: Path) -> dict[int, int]:
    """The final sum per key (the running sums only grow: the largest is the total)."""
    t = pq.read_table(str(out))
    keys, sums = t.column("key").to_numpy(), t.column("seq").to_numpy()
    order = np.lexsort((sums, keys))
    last = np.r_[keys[order][1:] != keys[order][:-1], True]
    return dict(zip(keys[order][last].tolist(), sums[order][last].tolist(), strict=True))


def expected() -> dict[int, int]:
    gen = source()
    parts = np.repeat(np.arange(4), RECORDS // 4)
    seqs = np.tile(np.arange(RECORDS // 4), 4)
    keys = gen.keys_of(parts, seqs)
    out: dict[int, int] = {}
    for k, s in zip(keys.tolist(), seqs.tolist(), strict=True):
        out[k] = out.get(k, 0) + s
    return out


def batch_config(tmp_path: Path, **extra: Any) -> Config:
    return Config.from_dict(
        {
            "execution.runtime-mode": "batch",
            "state.checkpoints.dir": str(tmp_path / "ckpt"),
            "restart-strategy.fixed-delay.delay": "0 ms",
            "restart-strategy.fixed-delay.attempts": 3,
            **extra,
        }
    )


class SplitlessSource(GeneratorSource):
    """The generator as a source that reads its partitions by subtask but cannot say
    which (no split assignment: what Flink's ``SupportsBatchSnapshot`` would give)."""

    def splits_of(self, subtask: int, parallelism: int) -> tuple[str, ...] | None:
        return None


def staged_job(
    out: Path,
    sink_rate: float | None = None,
    sum_parallelism: int = 2,
    gen: GeneratorSource | None = None,
) -> Any:
    """Three stages: source -> key_by -> sum -> rebalance -> Parquet (paced when
    ``sink_rate``), so the last stage can be slow on purpose; ``gen`` replaces the
    source (built with :func:`source_kwargs`)."""
    env = StreamEnvironment("staged", parallelism=2, max_parallelism=128)
    sink: Any = ParquetSink(str(out))
    if sink_rate is not None:
        sink = ThrottledSink(sink_rate, sink)
    (
        env.from_source(source() if gen is None else gen, uid="src")
        .key_by("key")
        .process(KeyedSum("key", "seq"), uid="sum", parallelism=sum_parallelism)
        .rebalance()
        .sink(sink, uid="sink", parallelism=2)
    )
    return env


def finished_in_log(ckpt: Path, job_name: str = "staged") -> list[tuple[str, int, int]]:
    """``(uid, subtask, generation)`` of every task-finished record, in log order."""
    log = JobEventLog.open(ckpt / job_name / EVENTS_DIR)
    return [
        (e.vertex_uid, e.subtask, e.generation) for e in log.events() if isinstance(e, TaskFinished)
    ]
