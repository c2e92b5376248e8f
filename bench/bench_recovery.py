"""Driver failover: how soon a restarted driver commits again, and what the job event
log costs.

Run: ``PYTHONPATH=src .venv/bin/python -m pytest bench/bench_recovery.py --benchmark-only -q -s``

``test_first_commit_after_a_driver_kill``: a streaming job (generator at 20,000
records/s per subtask -> ParquetSink, parallelism 2, unaligned checkpoints every
second) runs in a child driver process until three checkpoints completed, is
SIGKILLed, and the same job is started again in a new process. Timed from the new
process's start: its subtasks running (interpreter, imports, lease, log replay,
restore plan), and the first part file published after the restart (the first
checkpoint after the restore, so about one interval more). Next to it, in the same
round: a process that only starts the interpreter and imports spillover (the
machine's floor for any restart), and the same restart resumed by hand the old way
(``execution.state-recovery.path`` at the newest checkpoint, no log read). There is
no pure-Python variant: the work is the same Python either way. Flink's master
failover needs a high-availability service (ZooKeeper or Kubernetes), which this
machine does not run.

``test_event_log_overhead``: the ``spillover bench`` job, sinks unpaced, unaligned
checkpoints every 100 ms (ten log flushes a second, ten times the default rate),
with the event log and without it (the master's log switched off in the process),
alternating. Target (docs/benchmarks.md): with / without >= 0.97.

``SPILLOVER_BENCH_ROUNDS`` alternations (default 3).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from spillover.benchmark import BenchSpec
from spillover.benchmark.runner import run_policy
from spillover.config import Config
from spillover.deploy import create_executor
from spillover.runtime.connectors import GeneratorSource, ParquetSink
from spillover.runtime.graph import StreamEnvironment
from spillover.runtime.jobmaster import Executor

ROUNDS = int(os.environ.get("SPILLOVER_BENCH_ROUNDS", "3"))
RATE = 20_000.0


def _job(out: str) -> StreamEnvironment:
    env = StreamEnvironment("failover", parallelism=2)
    gen = GeneratorSource(partitions=4, rate_per_subtask=RATE, payload_bytes=100)
    env.from_source(gen, uid="src").sink(ParquetSink(out), uid="sink")
    return env


def _config(ckpt: str, restore: str | None = None) -> Config:
    options = {
        "state.checkpoints.dir": ckpt,
        "execution.checkpointing.interval": "1 s",
        "execution.checkpointing.unaligned.enabled": "true",
    }
    if restore is not None:
        options["execution.state-recovery.path"] = restore
    return Config.from_dict(options)


def _drive(out: str, ckpt: str, restore: str | None, marks: str) -> None:
    """A child driver: notes when its subtasks run (seconds since the epoch)."""
    import threading

    ex = create_executor("local", _job(out), _config(ckpt, restore))

    def note() -> None:
        while ex.running_since() is None:
            time.sleep(0.002)
        Path(marks).write_text(str(time.time()))

    threading.Thread(target=note, daemon=True).start()
    ex.run(timeout=600)


def _parts(out: Path) -> set[str]:
    return {p.name for p in out.glob("part-*.parquet")} if out.exists() else set()


def _newest_checkpoint(ckpt: Path) -> Path:
    done = [d for d in ckpt.glob("failover/chk-*") if (d / "_metadata").exists()]
    return max(done, key=lambda d: int(d.name[4:]))


def _restart(tmp: Path, manual: bool) -> dict[str, float]:
    """Kills a driver after three checkpoints, starts the job again; times the restart."""
    out, ckpt = tmp / "out", tmp / "ckpt"
    ctx = multiprocessing.get_context("spawn")
    first = ctx.Process(target=_drive, args=(str(out), str(ckpt), None, str(tmp / "m0")))
    first.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if len(list(ckpt.glob("failover/chk-*/_metadata"))) >= 1 and len(_parts(out)) >= 6:
            break
        time.sleep(0.01)
    os.kill(first.pid or 0, signal.SIGKILL)
    first.join()
    before = _parts(out)
    restore = str(_newest_checkpoint(ckpt)) if manual else None
    marks = tmp / "m1"
    began = time.time()
    second = ctx.Process(target=_drive, args=(str(out), str(ckpt), restore, str(marks)))
    second.start()
    try:
        while time.monotonic() < deadline + 60:
            if _parts(out) - before:
                break
            time.sleep(0.002)
        committed = time.time()
        while not marks.exists():
            time.sleep(0.01)
        running = float(marks.read_text())
    finally:
        os.kill(second.pid or 0, signal.SIGKILL)
        second.join()
    return {"running_s": running - began, "first_commit_s": committed - began}


def _floor() -> float:
    began = time.time()
    subprocess.run([sys.executable, "-c", "import spillover.deploy"], check=True)
    return time.time() - began


def _median(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} s ({min(xs):.2f}-{max(xs):.2f})"


def test_first_commit_after_a_driver_kill(benchmark: Any, tmp_path: Path) -> None:
    runs: dict[str, list[dict[str, float]]] = {"log": [], "manual": []}
    floors: list[float] = []
    n = [0]

    def alternation() -> None:
        floors.append(_floor())
        for kind in ("log", "manual"):
            n[0] += 1
            r = _restart(tmp_path / f"{kind}-{n[0]}", manual=kind == "manual")
            print(f"\n{kind}: {r}", flush=True)
            runs[kind].append(r)

    benchmark.pedantic(alternation, rounds=ROUNDS, iterations=1)
    lines = [f"interpreter + import spillover: {_median(floors)}"]
    for kind, rs in runs.items():
        lines.append(
            f"{kind}: subtasks running {_median([r['running_s'] for r in rs])}, "
            f"first commit {_median([r['first_commit_s'] for r in rs])}"
        )
    benchmark.extra_info["restart"] = {"floor_s": floors, **runs}
    print("\n" + "\n".join(lines), flush=True)
    for r in runs["log"]:
        assert r["first_commit_s"] > r["running_s"] > 0


def test_event_log_overhead(benchmark: Any, tmp_path: Path, monkeypatch: Any) -> None:
    spec = BenchSpec(
        policies=["unaligned"],
        interval_ms=100,
        sink_rate=1e9,  # unpaced
        warmup_s=3.0,
        duration_s=8.0,
        checkpoint_dir=str(tmp_path),
    )
    with_log = Executor._begin_recovery
    rates: dict[str, list[float]] = {"with log": [], "without log": []}

    def alternation() -> None:
        for kind in rates:
            if kind == "without log":
                monkeypatch.setattr(Executor, "_begin_recovery", lambda self: None)
            else:
                monkeypatch.setattr(Executor, "_begin_recovery", with_log)
            r = run_policy(spec, "unaligned")
            assert r.status == "stopped", r.failures
            rates[kind].append(r.throughput_rps)
            print(f"\n{kind}: {r.throughput_rps:,.0f} records/s", flush=True)

    benchmark.pedantic(alternation, rounds=ROUNDS, iterations=1)
    ratio = statistics.median(rates["with log"]) / statistics.median(rates["without log"])
    benchmark.extra_info["throughput"] = {**rates, "ratio": ratio}
    print(f"\nevent log overhead: with / without = {ratio:.3f} (target >= 0.97)", flush=True)
    assert ratio > 0


if __name__ == "__main__":
    pytest.main([__file__, "--benchmark-only", "-q", "-s"])
