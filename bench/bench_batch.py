"""Batch jobs that keep their progress: how long a batch job takes to finish after its
driver was SIGKILLed part way, against a full rerun.

Run: ``PYTHONPATH=src .venv/bin/python -m pytest bench/bench_batch.py --benchmark-only -q -s``

Job: ``GeneratorSource`` (100-byte payloads, a partition per subtask, 10,000 keys) ->
key_by -> a sum per key emitted once at the end of its input -> ``ParquetSink`` (the
sum and the sink chained), parallelism ``SPILLOVER_BENCH_BATCH_PARALLELISM`` (default
8: 16 tasks, so an embedded master of two slots, ``SPILLOVER_BENCH_BATCH_MASTER``
default ``local[2]``, one per core, runs them in waves),
``execution.runtime-mode: batch``; the source's result partitions (every record,
through the engine) are ``SPILLOVER_BENCH_BATCH_BYTES`` of records (default 1G;
``64M``-style suffixes). Every start of the job is a child driver process (spawned:
interpreter, imports, on Spark its JVM), timed from its start to its end.

Per round, on each executor of ``SPILLOVER_BENCH_BATCH_EXECUTORS`` (default
``spark``: the embedded Spark master; ``spark,local`` adds the local executor):

- ``full``: the job once, without a kill;
- ``kill 50 %`` and ``kill 90 %``: a start SIGKILLed at that share of the run: once
  its log names as many tasks finished as the full run's log (this round's, polled
  as it ran) had named that share of its time after its driver's start (the task
  is the unit of progress the log shows; a kill by the clock alone lands after
  the job's end whenever the load slows a start down), then the same
  job started again (progress recovery on, the default): the time from the new
  driver's start to the job's end, its ``start-up`` (from its start to the log's
  ``generation-started``: interpreter, imports, the lease, then the JVM, its
  SparkContext and a Python worker, started while the log is replayed and the
  reused results checked), and the tasks the log named finished at the kill,
  reused and run by the restart;
- ``rerun``: a start killed as at 90 %, then the job started again with
  ``execution.batch.job-recovery.enabled: false`` (what a restart costs without
  progress recovery: everything runs again); its start-up against the rerun is the
  floor of any restart's ratio on this machine (a restart with nothing left to do
  still starts a driver);
- the machine's limit: writing the same bytes raw in as many files as the
  source's result partitions (1 MiB writes, no fsync, as the engine's result
  files), and reading them back.

Target (issue 14): the restart after a kill at 90 % takes at most 0.2x the rerun.
``SPILLOVER_BENCH_ROUNDS`` rounds (default 1: a round runs the job about six times).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import GiB, MiB, _env_bytes
from spillover.config import Config
from spillover.deploy import create_executor
from spillover.errors import SpilloverError
from spillover.runtime.connectors import GeneratorSource, ParquetSink
from spillover.runtime.graph import StreamEnvironment
from spillover.runtime.jobevents import EVENTS_DIR, GenerationStarted, JobEventLog
from spillover.runtime.jobmaster import JobResult
from spillover.runtime.operators import KeyedSum

ROUNDS = int(os.environ.get("SPILLOVER_BENCH_ROUNDS", "1"))
EXECUTORS = os.environ.get("SPILLOVER_BENCH_BATCH_EXECUTORS", "spark").split(",")
PARALLELISM = int(os.environ.get("SPILLOVER_BENCH_BATCH_PARALLELISM", "8"))
PARTITIONS = PARALLELISM
# One Spark slot per core: tasks run in waves, as on a cluster sized to its cores
# (the embedded default, local[32], would run every task of a stage at once).
MASTER = os.environ.get("SPILLOVER_BENCH_BATCH_MASTER", "local[2]")
PAYLOAD = 100
KEYS = 10_000
JOB = "batchbench"
TARGET = 0.2


class SumAtEnd(KeyedSum):
    """The sum of ``seq`` per key, emitted once per key when the input ended (a batch
    aggregate: its output is one row per key, not one per record)."""

    def __init__(self) -> None:
        super().__init__("key", "seq", out="none")

    def finish(self) -> None:
        keys, sums = self.state.items()
        out = np.empty(len(keys), self.out_dtype)
        out["key"], out["seq"] = keys, sums
        self.ctx.output.emit(out)


def _source(total_bytes: int) -> GeneratorSource:
    probe = GeneratorSource(partitions=PARTITIONS, records_per_partition=1, payload_bytes=PAYLOAD)
    per = max(1, total_bytes // probe.out_dtype.itemsize // PARTITIONS)
    return GeneratorSource(
        partitions=PARTITIONS, records_per_partition=per, payload_bytes=PAYLOAD, keys=KEYS
    )


def _job(out: str, total_bytes: int) -> StreamEnvironment:
    env = StreamEnvironment(JOB, parallelism=PARALLELISM, max_parallelism=128)
    (
        env.from_source(_source(total_bytes), uid="src")
        .key_by("key")
        .process(SumAtEnd(), uid="sum")
        .sink(ParquetSink(out), uid="sink")
    )
    return env


def _config(ckpt: str, recovery: bool) -> Config:
    return Config.from_dict(
        {
            "execution.runtime-mode": "batch",
            "state.checkpoints.dir": ckpt,
            "execution.batch.job-recovery.enabled": recovery,
        }
    )


def _drive(executor: str, out: str, ckpt: str, recovery: bool, total: int, result: str) -> None:
    """A child driver: runs the job to its end and pickles its JobResult."""
    if executor == "spark":  # Spark's workers cannot import this file: SumAtEnd travels
        from pyspark import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[__name__])  # type: ignore[no-untyped-call]
    master = MASTER if executor == "spark" else None
    ex = create_executor(executor, _job(out, total), _config(ckpt, recovery), master=master)
    r = ex.run(timeout=3600)
    with open(result + ".tmp", "wb") as f:
        pickle.dump(r, f)
    os.replace(result + ".tmp", result)


def _start(
    executor: str,
    work: Path,
    total: int,
    *,
    out: str = "out",
    recovery: bool = True,
    kill_at: int | None = None,
    progress: list[tuple[float, int]] | None = None,
    startup: list[float] | None = None,
) -> tuple[float, JobResult | None]:
    """One start of the job's driver in a child process: (seconds from its start to its
    end, or to its SIGKILL once the log names ``kill_at`` tasks finished; its
    JobResult unless killed). ``progress`` gets (seconds since the start, tasks the
    log names finished) as they change; ``startup`` the seconds from the start to
    this start's ``generation-started`` record (see :func:`_generation_started`)."""
    result = work / "result.pickle"
    result.unlink(missing_ok=True)
    ctx = multiprocessing.get_context("spawn")
    args = (executor, str(work / out), str(work / "ckpt"), recovery, total, str(result))
    child = ctx.Process(target=_drive, args=args, name="spillover-bench-driver")
    wall = time.time()
    began = time.monotonic()
    child.start()
    if kill_at is not None:
        while child.is_alive() and _finished_in_log(work) < kill_at:
            time.sleep(0.02)
        if child.is_alive():
            os.kill(child.pid or 0, signal.SIGKILL)
            child.join()
            return time.monotonic() - began, None
    while child.is_alive() and (progress is not None or (startup is not None and not startup)):
        if progress is not None:
            n = _finished_in_log(work)
            if not progress or progress[-1][1] != n:
                progress.append((time.monotonic() - began, n))
        if startup is not None and not startup:
            at = _generation_started(work, wall)
            if at is not None:
                startup.append(at - wall)
        time.sleep(0.05)
    child.join()
    took = time.monotonic() - began
    assert child.exitcode == 0, f"the driver failed (exit code {child.exitcode})"
    if startup is not None and not startup:  # it ended between two polls
        at = _generation_started(work, wall)
        startup.append(float("nan") if at is None else at - wall)
    with open(result, "rb") as f:
        r: JobResult = pickle.load(f)
    assert r.status == "finished", r.failures
    return took, r


def _finished_in_log(work: Path) -> int:
    """How many tasks the job's event log names finished."""
    log = work / "ckpt" / JOB / EVENTS_DIR
    try:
        return len(JobEventLog.open(str(log)).replay().finished_tasks) if log.exists() else 0
    except (OSError, SpilloverError):  # a segment compacted away as it was read
        return 0


def _generation_started(work: Path, since: float) -> float | None:
    """When (seconds since the epoch) the log's first ``generation-started`` record
    appended at or after ``since`` was appended, or None if there is none yet:
    interpreter, imports, on Spark the JVM and its context, the lease, the log's
    replay and the check of every reused result. Polled while the start runs: a
    compaction later restates the record in a snapshot, stamped with the
    compaction's time (a job of more than 64 tasks compacts its log as it runs)."""
    log = work / "ckpt" / JOB / EVENTS_DIR
    try:
        entries = JobEventLog.open(str(log)).entries() if log.exists() else []
    except (OSError, SpilloverError):  # a segment compacted away as it was read
        return None
    ats = [e.at for e in entries if isinstance(e.event, GenerationStarted) and e.at >= since]
    return min(ats) if ats else None


def _killed_and_restarted(
    executor: str, work: Path, total: int, kill_at: int, recovery: bool
) -> dict[str, float]:
    """Kills a start once its log names ``kill_at`` tasks finished, starts the job
    again; times the second start."""
    killed_s, r = _start(executor, work, total, kill_at=kill_at)
    assert r is None, f"the job ended before {kill_at} tasks finished"
    finished = _finished_in_log(work)
    startup: list[float] = []
    took, r = _start(
        executor,
        work,
        total,
        out="out" if recovery else "out-rerun",
        recovery=recovery,
        startup=startup,
    )
    assert r is not None
    ran = sum(1 for m in r.tasks.values() if m.get("runs", 0) > 0)
    return {
        "killed_after_s": killed_s,
        "restart_s": took,
        "restart_startup_s": startup[0],
        "finished_at_kill": finished,
        "reused": len(r.reused_tasks),
        "ran": ran,
        "tasks": len(r.tasks),
    }


def _raw(work: Path, total: int) -> tuple[float, float]:
    """Seconds to write ``total`` bytes raw in PARALLELISM files (1 MiB writes, no
    fsync) and to read them back."""
    chunk = np.random.default_rng(1).integers(0, 256, MiB, dtype=np.uint8).tobytes()
    files = [work / f"raw-{i}" for i in range(PARALLELISM)]
    each = total // PARALLELISM
    began = time.monotonic()
    for path in files:
        with open(path, "wb") as f:
            for _ in range(max(1, each // MiB)):
                f.write(chunk)
    wrote = time.monotonic() - began
    began = time.monotonic()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.read(MiB):
                pass
    read = time.monotonic() - began
    for path in files:
        path.unlink()
    return wrote, read


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_restart_after_a_driver_kill(benchmark: Any, tmp_path: Path, executor: str) -> None:
    total = _env_bytes("SPILLOVER_BENCH_BATCH_BYTES", GiB)
    runs: dict[str, list[Any]] = {"full": [], "kill 50 %": [], "kill 90 %": [], "rerun": []}
    raw: list[tuple[float, float]] = []
    n = [0]

    def work(kind: str) -> Path:
        n[0] += 1
        path = tmp_path / f"{executor}-{kind.replace(' ', '').replace('%', '')}-{n[0]}"
        path.mkdir()
        return path

    def round_() -> None:
        raw.append(_raw(tmp_path, total))
        progress: list[tuple[float, int]] = []
        where = work("full")
        full, r = _start(executor, where, total, progress=progress)
        shutil.rmtree(where)  # a run's files go once it is measured: disk for one job
        assert r is not None
        runs["full"].append(full)
        print(f"\n{executor} full run: {full:.1f} s ({len(r.tasks)} tasks)", flush=True)
        for kind, share, recovery in (
            ("kill 50 %", 0.5, True),
            ("kill 90 %", 0.9, True),
            ("rerun", 0.9, False),
        ):
            # as many tasks as the full run had finished at that share of its time
            kill_at = max([1] + [n for t, n in progress if t <= share * full])
            where = work(kind)
            got = _killed_and_restarted(executor, where, total, kill_at, recovery)
            shutil.rmtree(where)
            got["killed_share_of_full"] = got["killed_after_s"] / full
            runs[kind].append(got)
            print(f"{executor} {kind}: {got}", flush=True)

    benchmark.pedantic(round_, rounds=ROUNDS, iterations=1)
    src = _source(total)
    nbytes = src.out_dtype.itemsize * src.records_per_partition * PARTITIONS
    rerun = _median([g["restart_s"] for g in runs["rerun"]])
    rerun_startup = _median([g["restart_startup_s"] for g in runs["rerun"]])
    lines = [
        f"{executor}: {nbytes / 1e9:.2f} GB of records "
        f"({src.records_per_partition * PARTITIONS:,} of {src.out_dtype.itemsize} B)",
        f"raw write {_median([w for w, _ in raw]):.1f} s, "
        f"read {_median([r for _, r in raw]):.1f} s",
        f"full run {_median(runs['full']):.1f} s",
        f"restart without progress recovery (rerun) {rerun:.1f} s (start-up "
        f"{rerun_startup:.1f} s: a restart's floor is {rerun_startup / rerun:.2f}x the rerun)",
    ]
    for kind in ("kill 50 %", "kill 90 %"):
        took = _median([g["restart_s"] for g in runs[kind]])
        last = runs[kind][-1]
        lines.append(
            f"{kind}: killed {last['killed_after_s']:.1f} s after its start "
            f"({last['killed_share_of_full']:.2f} of the full run's time); restart "
            f"{took:.1f} s = {took / rerun:.2f}x the rerun (start-up "
            f"{_median([g['restart_startup_s'] for g in runs[kind]]):.1f} s); finished at the kill "
            f"{last['finished_at_kill']}, reused {last['reused']}, ran {last['ran']} "
            f"of {last['tasks']} tasks"
        )
    benchmark.extra_info.update(
        bytes=nbytes, raw_s=raw, **{k.replace(" ", ""): v for k, v in runs.items()}
    )
    print("\n" + "\n".join(lines), flush=True)
    ratio = _median([g["restart_s"] for g in runs["kill 90 %"]]) / rerun
    print(f"restart after a kill at 90 % / rerun = {ratio:.2f} (target <= {TARGET})", flush=True)
    assert ratio > 0


if __name__ == "__main__":
    pytest.main([__file__, "--benchmark-only", "-q", "-s"])
