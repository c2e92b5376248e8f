"""Files per checkpoint (issue 15): a backpressured job with unaligned checkpoints on
the local executor, at several parallelisms, with one channel-state file per gate
(``max-subtasks-per-channel-state-file`` 1), the default 5, and one file per process
(N = parallelism).

Run: ``PYTHONPATH=src .venv/bin/python -m pytest bench/bench_files.py --benchmark-only -q -s``

Per run: files and bytes per checkpoint (everything under ``chk-<id>`` but the
metadata), checkpoint duration (median, p90), and the ``_metadata`` size. The
machine's limit, in the same run: the time to create and write the same number of
files of the same sizes raw (``os.open``/``write``/``close``), without fsync (what
the engine does by default) and with it.

``SPILLOVER_BENCH_FILES_PARALLELISM`` (comma-separated, default ``8,32``) and
``SPILLOVER_BENCH_FILES_SECONDS`` (measured seconds per run, default 6) set the size.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spillover.config import Config
from spillover.deploy.local import LocalExecutor
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.connectors.parquet import ParquetSink
from spillover.runtime.connectors.throttled import ThrottledSink
from spillover.runtime.graph import StreamEnvironment

PARALLELISM = [
    int(p) for p in os.environ.get("SPILLOVER_BENCH_FILES_PARALLELISM", "8,32").split(",")
]
SECONDS = float(os.environ.get("SPILLOVER_BENCH_FILES_SECONDS", "6"))
RATE = 4_000  # records/s per sink subtask: the sink is the bottleneck


def backpressured_job(out: str, parallelism: int) -> StreamEnvironment:
    """Generator source, key_by, map, and a Parquet sink throttled to ``RATE`` records/s
    per subtask (the bottleneck); ``bench_s3_files.py`` runs it too."""
    env = StreamEnvironment("files", parallelism=parallelism, max_parallelism=max(128, parallelism))
    gen = GeneratorSource(
        partitions=parallelism,
        records_per_partition=10_000_000,
        payload_bytes=100,
        keys=10_000,
        batch_size=256,
        seed=3,
    )
    src = env.from_source(gen, uid="source")
    keyed = src.key_by("key").map(lambda b: b, uid="map")
    keyed.sink(ThrottledSink(RATE, inner=ParquetSink(out)), uid="sink")
    return env


def _checkpoint_files(chk: Path) -> tuple[list[int], int]:
    sizes = [
        (Path(root) / f).stat().st_size
        for root, _, files in os.walk(chk)
        for f in files
        if not f.startswith("_metadata")
    ]
    return sizes, (chk / "_metadata").stat().st_size


def _raw_limit(sizes: list[int], fsync: bool) -> float:
    """Seconds to create and write ``len(sizes)`` files of these sizes in one directory."""
    with tempfile.TemporaryDirectory(dir=os.environ.get("SPILLOVER_BENCH_DIR")) as d:
        data = os.urandom(max(sizes, default=0))
        t0 = time.perf_counter()
        for i, n in enumerate(sizes):
            fd = os.open(os.path.join(d, f"f{i}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, data[:n])
            if fsync:
                os.fsync(fd)
            os.close(fd)
        return time.perf_counter() - t0


def _run(tmp: Path, parallelism: int, per_file: int) -> dict[str, Any]:
    ckpt = tmp / f"ckpt-{parallelism}-{per_file}"
    cfg = Config.from_dict(
        {
            "execution.checkpointing.interval": "300 ms",
            "execution.checkpointing.unaligned.enabled": True,
            "execution.checkpointing.unaligned.max-subtasks-per-channel-state-file": per_file,
            "state.checkpoints.dir": str(ckpt),
            "state.checkpoints.num-retained": 1000,
        }
    )
    env = backpressured_job(str(tmp / f"out-{parallelism}-{per_file}"), parallelism)
    ex = LocalExecutor(env, cfg)
    r = ex.run(timeout=SECONDS * 10 + 120, stop_after=SECONDS)
    done = [c for c in r.checkpoints if c["status"] == "completed" and not c["final"]]
    files, nbytes, meta = [], [], []
    all_sizes: list[int] = []
    for c in done:
        sizes, m = _checkpoint_files(ckpt / "files" / f"chk-{c['checkpoint_id']}")
        files.append(len(sizes))
        nbytes.append(sum(sizes))
        meta.append(m)
        all_sizes += sizes
    durations = sorted(c["duration_ms"] for c in done)
    n = max(1, len(done))
    return {
        "parallelism": parallelism,
        "per_file": per_file,
        "checkpoints": len(done),
        "files_per_checkpoint": statistics.median(files) if files else 0,
        "bytes_per_checkpoint": statistics.median(nbytes) if nbytes else 0,
        "metadata_bytes": statistics.median(meta) if meta else 0,
        "duration_ms_median": statistics.median(durations) if durations else 0,
        # linear, as spillover bench reports it (the old index rule gave the minimum
        # of two checkpoints as their p90)
        "duration_ms_p90": float(np.percentile(durations, 90)) if durations else 0,
        # the machine's limit for the files of one checkpoint (averaged over all)
        "raw_create_ms": _raw_limit(all_sizes, False) * 1000 / n,
        "raw_create_fsync_ms": _raw_limit(all_sizes, True) * 1000 / n,
    }


def per_file_sweep(
    benchmark: Any, run: Callable[[int], dict[str, Any]], subtasks: int
) -> list[dict[str, Any]]:
    """``run`` once per ``max-subtasks-per-channel-state-file`` of 1, 5 and ``subtasks``
    (one timed round for all), each result printed as a JSON line and kept in the
    benchmark's ``extra_info``; every run must have completed a checkpoint."""
    results: list[dict[str, Any]] = []

    def go() -> None:
        for per_file in sorted({1, 5, subtasks}):
            results.append(run(per_file))

    benchmark.pedantic(go, rounds=1, iterations=1)
    benchmark.extra_info["runs"] = results
    print()
    for r in results:
        print(json.dumps(r))
    for r in results:
        assert r["checkpoints"] > 0, r
    return results


@pytest.mark.parametrize("parallelism", PARALLELISM)
def test_files_per_checkpoint(benchmark: Any, tmp_path: Path, parallelism: int) -> None:
    results = per_file_sweep(
        benchmark, lambda per_file: _run(tmp_path, parallelism, per_file), parallelism
    )
    one, *shared = results
    for r in shared:
        assert r["files_per_checkpoint"] < one["files_per_checkpoint"], (one, r)
