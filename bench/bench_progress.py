"""Progress under frequent failures (the third benchmark of FLIP-76's test plan):
records committed per minute by a backpressured job that fails every 5 s.

Run: ``PYTHONPATH=src .venv/bin/python -m pytest bench/bench_progress.py --benchmark-only -q -s``

Job: an unthrottled generator source (parallelism 2) → rebalance → a paced sink
(5,000 records/s per subtask, :class:`ThrottledSink`) that writes through a
:class:`ParquetSink`, the two-phase-commit sink: a record counts as committed once
a completed checkpoint published its file. The sink backpressures the source, so
the network buffers between them stay full. Checkpoints every second, aligned or
unaligned; restarts at once (fixed delay 0) from the latest completed checkpoint.

Failure: the sink's subtask 0 raises after it handled 25,000 records in an
attempt (5 s at its pace: every 5 s of processing), through the runtime's
:class:`FailureInjector`, which plays the same script on the local executor and
on Spark. Each case runs ``SPILLOVER_BENCH_PROGRESS_DURATION`` seconds (default
30) and is measured against the same job without failures in the same run (the
ceiling). ``SPILLOVER_BENCH_PROGRESS_EXECUTORS`` picks ``local``, ``spark`` or
both (default both).

Figures (``extra_info`` and printed): committed records/min and its share of the
ceiling, restarts, checkpoints completed per attempt, and the work lost per
failure: records the sink handled in a failed attempt that no checkpoint of that
attempt committed (from the committed files, named by attempt, and the sink's
count sampled every 20 ms, so within ~100 records).
"""

from __future__ import annotations

import os
import re
import statistics
import tempfile
import threading
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from spillover.config import Config
from spillover.deploy import create_executor
from spillover.runtime.connectors import GeneratorSource, ParquetSink, ThrottledSink
from spillover.runtime.failures import FailureInjector, FailureSpec
from spillover.runtime.graph import StreamEnvironment

DURATION_S = float(os.environ.get("SPILLOVER_BENCH_PROGRESS_DURATION", "30"))
EXECUTORS = [
    e.strip()
    for e in os.environ.get("SPILLOVER_BENCH_PROGRESS_EXECUTORS", "local,spark").split(",")
    if e.strip()
]
PARALLELISM = 2
SINK_RATE = 5_000.0  # records/s per sink subtask
FAILURE_EVERY_S = 5.0
INTERVAL = "1 s"
_PART = re.compile(r"part-\d+-a(\d+)-")

_ceilings: dict[tuple[str, str], float] = {}


def _job(out: Path) -> StreamEnvironment:
    env = StreamEnvironment("progress", parallelism=PARALLELISM)
    source = GeneratorSource(
        partitions=2 * PARALLELISM,
        records_per_partition=None,
        rate_per_subtask=None,
        payload_bytes=100,
    )
    env.from_source(source, uid="source").rebalance().sink(
        ThrottledSink(SINK_RATE, ParquetSink(str(out))), uid="sink"
    )
    return env


def _config(ckpt: str, policy: str) -> Config:
    return Config.from_dict(
        {
            "state.checkpoints.dir": ckpt,
            "execution.checkpointing.interval": INTERVAL,
            "execution.checkpointing.unaligned.enabled": str(policy == "unaligned").lower(),
            "execution.checkpointing.tolerable-failed-checkpoints": 1_000_000,
            "restart-strategy.type": "fixed-delay",
            "restart-strategy.fixed-delay.attempts": 1_000,
            "restart-strategy.fixed-delay.delay": "0 s",
        }
    )


def _committed_by_attempt(out: Path) -> dict[int, int]:
    rows: dict[int, int] = {}
    for f in out.glob("part-*.parquet"):
        m = _PART.match(f.name)
        assert m, f.name
        rows[int(m.group(1))] = rows.get(int(m.group(1)), 0) + pq.read_metadata(f).num_rows
    return rows


def _run(executor: str, policy: str, failing: bool) -> dict[str, Any]:
    failures = FailureInjector(
        [
            FailureSpec("operator", "sink", 0, after_records=int(FAILURE_EVERY_S * SINK_RATE))
            for _ in range(int(DURATION_S / FAILURE_EVERY_S) + 1)
        ]
        if failing
        else []
    )
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "out"
        ex = create_executor(
            executor, _job(out), _config(str(Path(d) / "ckpt"), policy), failures=failures
        )
        ex.prepare()  # Spark's start-up is not part of the measured run
        handled: dict[int, float] = {}  # per attempt, the sink's last sampled count
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.02):
                run = ex._current
                if run is not None:  # local: an attempt; Spark: a generation
                    a = getattr(run, "attempt", getattr(run, "generation", -1))
                    handled[a] = max(handled.get(a, 0.0), ex.live_metric("sink"))

        t = threading.Thread(target=sample, daemon=True)
        t.start()
        try:
            result = ex.run(timeout=DURATION_S + 120, stop_after=DURATION_S)
        finally:
            done.set()
            t.join()
        committed = _committed_by_attempt(out)
    assert result.status == "stopped", result.failures
    restarts = result.attempts - 1
    failed_attempts = range(restarts)  # each of them ended by a failure
    lost = [handled.get(a, 0.0) - committed.get(a, 0) for a in failed_attempts]
    completed = len(result.completed_checkpoints())
    return {
        "committed": sum(committed.values()),
        "committed_per_min": round(sum(committed.values()) / DURATION_S * 60),
        "restarts": restarts,
        "checkpoints_completed": completed,
        "checkpoints_aborted": len(result.checkpoints) - completed,
        "checkpoints_per_attempt": round(completed / result.attempts, 2),
        "lost_per_failure_median": round(statistics.median(lost)) if lost else None,
        "lost_per_failure": [round(x) for x in lost],
    }


@pytest.mark.parametrize("failing", [False, True], ids=["ceiling", "failure-every-5s"])
@pytest.mark.parametrize("policy", ["aligned", "unaligned"])
@pytest.mark.parametrize("executor", EXECUTORS)
def test_progress_under_frequent_failures(
    benchmark: Any, executor: str, policy: str, failing: bool
) -> None:
    if executor == "spark":
        from spillover.deploy.spark import spark_context

        spark_context()  # started once, outside every measurement
    out: dict[str, Any] = {}

    def once() -> None:
        out.update(_run(executor, policy, failing))

    benchmark.pedantic(once, rounds=1, iterations=1)
    if not failing:
        _ceilings[executor, policy] = out["committed_per_min"]
    ceiling = _ceilings.get((executor, policy))
    if failing and ceiling:
        out["share_of_ceiling"] = round(out["committed_per_min"] / ceiling, 3)
    benchmark.extra_info.update(
        executor=executor, policy=policy, failing=failing, duration_s=DURATION_S, **out
    )
    print(f"\n{executor} {policy} {'failing' if failing else 'ceiling'}: {out}")
    assert out["committed"] > 0
    if failing:
        assert out["restarts"] >= 1
