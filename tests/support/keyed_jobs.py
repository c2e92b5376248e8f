"""A backpressured keyed job for the operating tests that check output exactly (live
rescale, claim modes, moved savepoints): four paced source partitions, key_by, an
exactly-once sink slower than them; and the exactness check."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np

from spillover.config import Config
from spillover.runtime.connectors.collecting import CollectingSink
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.connectors.throttled import ThrottledSink
from spillover.runtime.graph import StreamEnvironment
from spillover.runtime.jobmaster import Executor, JobResult
from support.operators import DecliningSnapshots

PARTITIONS, RECORDS = 4, 5_000  # per partition: about 5 s at the sinks' pace at 2


def keyed_job(name: str, parallelism: int = 2, declining: bool = False) -> StreamEnvironment:
    """Four paced source partitions, key_by, an exactly-once sink slower than them."""
    env = StreamEnvironment(name, parallelism=parallelism, max_parallelism=128)
    gen = GeneratorSource(
        partitions=PARTITIONS,
        records_per_partition=RECORDS,
        payload_bytes=16,
        rate_per_subtask=3_000,
        keys=200,
    )
    keyed = env.from_source(gen, uid="source").key_by("key")
    if declining:
        keyed = keyed.process(DecliningSnapshots(name, GeneratorSource.dtype(16)), uid="declining")
    keyed.sink(ThrottledSink(2_000, inner=CollectingSink(name)), uid="sink")
    return env


def keyed_config(tmp: Path, **extra: Any) -> Config:
    return Config.from_dict(
        {
            "execution.checkpointing.interval": "100 ms",
            "execution.checkpointing.unaligned.enabled": True,
            "state.checkpoints.dir": str(tmp / "ckpt"),
            "state.checkpoints.num-retained": 2,
            **extra,
        }
    )


def start(ex: Executor, keyed: str = "sink") -> tuple[threading.Thread, list[JobResult]]:
    """Runs the job on a thread; returns once its keyed vertex took 2,000 records."""
    out: list[JobResult] = []
    runner = threading.Thread(target=lambda: out.append(ex.run(timeout=180)), daemon=True)
    runner.start()
    while ex.live_metric(keyed) < 2_000:  # under way, and backpressured by now
        assert runner.is_alive(), out
        threading.Event().wait(0.01)
    return runner, out


def assert_exact(name: str) -> None:
    """Every generated record committed once, and in order per key and source
    partition in each sink subtask's commits (a key rescaled to another subtask
    continues there; the records of a key are committed in the order they came)."""
    rows = CollectingSink.records(name)
    ids = rows["partition"].astype(np.int64) * 1_000_000 + rows["seq"]
    assert len(np.unique(ids)) == len(ids), f"{len(ids) - len(np.unique(ids))} duplicates"
    assert len(ids) == PARTITIONS * RECORDS, f"{PARTITIONS * RECORDS - len(ids)} lost"
    for subtask, batches in CollectingSink.results(name).items():
        got = np.concatenate(batches)
        order = np.lexsort((np.arange(len(got)), got["partition"], got["key"]))
        k, p, s = got["key"][order], got["partition"][order], got["seq"][order]
        same = (k[1:] == k[:-1]) & (p[1:] == p[:-1])
        assert (s[1:][same] > s[:-1][same]).all(), f"order per key broken in sink {subtask}"
