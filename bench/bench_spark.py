"""Restarts on Spark: from a failure to the next generation running, next to the floor.

Run: ``PYTHONPATH=src .venv/bin/python -m pytest bench/bench_spark.py --benchmark-only -q``

Job: the ``pipeline`` verify topology (source → rebalance → shuffle → key_by →
running total → Parquet sink), parallelism 2, unaligned checkpoints every 200 ms, on
the embedded Spark master. Each case runs it with one failure and reads the restart
time the executor measured (``JobResult.restart_s``: from the failure's detection to
the next attempt's subtasks running; the restore of state happens after that, in
the subtasks):

- ``killed-worker``: a worker's Python process is SIGKILLed once a checkpoint
  completed (:func:`spillover.verify.chaos.run_killing_a_worker`);
- ``induced``: a subtask raises (an operator failure) on Spark;
- ``local-induced``: the same failure on the local executor (threads, no Spark);
- ``barrier-stage``: the floor: an empty barrier stage of the same width, submitted
  and collected (what any generation costs on Spark).

``SPILLOVER_BENCH_ROUNDS`` (default 3) sets the rounds; figures are medians.
Target (docs/benchmarks.md): a restart takes at most 3 s plus the restore itself.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

import pytest

from spillover.deploy.spark import spark_context
from spillover.runtime.failures import FailureInjector, FailureSpec
from spillover.verify import run_once
from spillover.verify.chaos import kill_spec, run_killing_a_worker

ROUNDS = int(os.environ.get("SPILLOVER_BENCH_ROUNDS", "3"))
RESTART_TARGET_S = 3.0
PARALLELISM = 2


def _induced(executor: str) -> float:
    failures = FailureInjector([FailureSpec("operator", "running-total", 1, after_records=20_000)])
    with tempfile.TemporaryDirectory() as d:
        out = run_once(kill_spec(PARALLELISM), d, "restart", failures, executor=executor)
    result = out.result
    assert result.status == "finished" and len(result.restart_s) == 1, result.failures
    return result.restart_s[0]


def _killed() -> float:
    """The restart ``run_killing_a_worker`` measured. Only the ``extra_info`` restart
    figures mean something for this case: pytest-benchmark's own time covers the whole
    call (a failure-free local run for the comparison, the run on Spark, the kill, the
    restart, the run to its end and the comparison of outputs)."""
    with tempfile.TemporaryDirectory() as d:
        out = run_killing_a_worker(d)
    assert out["exact"] and out["killed"] and len(out["restart_s"]) == 1, out
    return float(out["restart_s"][0])


def _barrier_stage() -> float:
    sc = spark_context()
    t = time.perf_counter()
    sc.parallelize(range(PARALLELISM), PARALLELISM).barrier().mapPartitions(
        lambda it: [os.getpid()]
    ).collect()
    return time.perf_counter() - t


CASES = {
    "killed-worker": _killed,
    "induced": lambda: _induced("spark"),
    "local-induced": lambda: _induced("local"),
    "barrier-stage": _barrier_stage,
}


@pytest.mark.parametrize("case", list(CASES))
def test_restart(benchmark: Any, case: str) -> None:
    spark_context()  # started once, outside every measurement
    _barrier_stage()  # Python workers up
    times: list[float] = []

    def once() -> None:
        times.append(CASES[case]())

    benchmark.pedantic(once, rounds=ROUNDS, iterations=1)
    med = statistics.median(times)
    benchmark.extra_info.update(
        {
            "case": case,
            "restart_s_median": round(med, 3),
            "restart_s_all": [round(x, 3) for x in times],
            "target_s": RESTART_TARGET_S,
            "target_met": med <= RESTART_TARGET_S if case != "barrier-stage" else None,
        }
    )
    print(f"\n{case}: restart median {med:.3f} s over {len(times)} rounds: {times}")
