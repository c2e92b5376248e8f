"""Stop-with-savepoint under backpressure, aligned against unaligned
(``spillover.benchmark.stop``).

Run: ``PYTHONPATH=src .venv/bin/python -m pytest bench/bench_stop.py --benchmark-only -q -s``

The job of ``spillover bench`` (parallelism 2, sinks paced at 5,000 records/s per
subtask, unaligned checkpoints every second) runs until the warm-up passed and two
checkpoints completed, then is stopped with a savepoint; each stop is timed from
the request to the savepoint's completion and to ``run`` returning. One
alternation runs every variant once, in order: aligned and unaligned stops on
each executor, then both with the pure-Python engine (``SPILLOVER_PURE=1``, local
executor); ``SPILLOVER_BENCH_ROUNDS`` alternations (default 3) follow each other,
so that the machine's load hits every variant alike. After each stop, the same
file sizes as its savepoint are written, without and with fsync (the machine's
limit). Figures (medians, min–max) go to ``extra_info`` and are printed.

``SPILLOVER_BENCH_STOP_EXECUTORS`` (default ``local,spark``),
``SPILLOVER_BENCH_STOP_WARMUP`` (seconds, default 5), ``SPILLOVER_BENCH_STOP_PURE``
(``0`` leaves the pure-Python engine out). Target (docs/benchmarks.md): the
unaligned stop's savepoint completes under 100 ms after the request.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from spillover.benchmark import BenchSpec
from spillover.benchmark.stop import StopResult, stop_once, summarise, to_markdown, variants

ROUNDS = int(os.environ.get("SPILLOVER_BENCH_ROUNDS", "3"))
EXECUTORS = [
    e.strip() for e in os.environ.get("SPILLOVER_BENCH_STOP_EXECUTORS", "local,spark").split(",")
]
WARMUP_S = float(os.environ.get("SPILLOVER_BENCH_STOP_WARMUP", "5"))
PURE = os.environ.get("SPILLOVER_BENCH_STOP_PURE", "1") != "0"


def test_stop_with_savepoint(benchmark: Any, tmp_path: Path) -> None:
    spec = BenchSpec(policies=["unaligned"], warmup_s=WARMUP_S, checkpoint_dir=str(tmp_path))
    if "spark" in EXECUTORS:
        from spillover.deploy.spark import spark_context

        spark_context()  # started once, before every measurement
    results: list[StopResult] = []

    def alternation() -> None:
        for executor, kind, pure in variants(EXECUTORS, pure=PURE):
            r = stop_once(spec, kind, executor, pure=pure)
            print(f"\n{r.line()}", flush=True)
            results.append(r)

    benchmark.pedantic(alternation, rounds=ROUNDS, iterations=1)
    summary = summarise(results)
    benchmark.extra_info["stops"] = summary
    benchmark.extra_info["all"] = [r.to_dict() for r in results]
    print("\n" + to_markdown(summary), flush=True)
    for r in results:
        assert r.status == "stopped", r.line()
