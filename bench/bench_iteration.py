"""Loops (FLIP-15) under backpressure, checkpoints by policy, next to a straight job;
and how soon a bounded loop ends (``spillover.benchmark.iteration``).

Run: ``PYTHONPATH=src .venv/bin/python -m pytest bench/bench_iteration.py --benchmark-only -q -s``

The loop job (parallelism 2, local executor): paced sources → ``key_by`` → a loop
of 8 to 16 passes per record (keyed feedback, 128-byte records) → the loop's exit
→ sinks paced at 2,000 records/s per subtask (the sources at 1.1× that), with
checkpoints every second. One alternation runs every variant once, in order: the
loop without checkpoints, aligned, unaligned and aligned with a 100 ms timeout;
the job of ``spillover bench`` at the same sink pace with unaligned checkpoints;
the loop unaligned with the pure-Python engine (``SPILLOVER_PURE=1``).
``SPILLOVER_BENCH_ROUNDS`` alternations (default 3) follow each other, so the
machine's load hits every variant alike. After each loop run with a log, the
head's logged bytes of its median checkpoint are written again, without and with
fsync (the machine's limit).

The termination test runs the bounded loop (5,000 records per partition, nothing
paced) ``SPILLOVER_BENCH_LOOP_END_RUNS`` times (default 5) per policy, without
checkpoints and with unaligned ones alternating: from the last record leaving
the loop to the last head's ``loop_ended_at``, bounded from above by the body's
last final pass and from below by the exit task's last emission.

``SPILLOVER_BENCH_LOOP_WARMUP`` (s, default 3), ``SPILLOVER_BENCH_LOOP_DURATION``
(s, default 8), ``SPILLOVER_BENCH_LOOP_SINK_RATE`` (records/s per sink subtask,
default 2000), ``SPILLOVER_BENCH_LOOP_PURE`` (``0`` leaves the pure-Python engine
out). Targets (docs/benchmarks.md): the loop's unaligned median checkpoint at most
2× the straight job's; the loop ends at most 100 ms after its last record left it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from spillover.benchmark.iteration import (
    LoopRun,
    LoopSpec,
    TerminationRun,
    run_variant,
    termination_once,
    variants,
)
from spillover.benchmark.iteration_report import (
    compare,
    summarise,
    summarise_termination,
    termination_markdown,
    to_markdown,
)
from spillover.benchmark.runner import machine

ROUNDS = int(os.environ.get("SPILLOVER_BENCH_ROUNDS", "3"))
WARMUP_S = float(os.environ.get("SPILLOVER_BENCH_LOOP_WARMUP", "3"))
DURATION_S = float(os.environ.get("SPILLOVER_BENCH_LOOP_DURATION", "8"))
SINK_RATE = float(os.environ.get("SPILLOVER_BENCH_LOOP_SINK_RATE", "2000"))
PURE = os.environ.get("SPILLOVER_BENCH_LOOP_PURE", "1") != "0"
END_RUNS = int(os.environ.get("SPILLOVER_BENCH_LOOP_END_RUNS", "5"))


def _spec(tmp_path: Path) -> LoopSpec:
    return LoopSpec(
        warmup_s=WARMUP_S, duration_s=DURATION_S, sink_rate=SINK_RATE, checkpoint_dir=str(tmp_path)
    )


def test_loop_checkpoints(benchmark: Any, tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    runs: list[LoopRun] = []
    load = [os.getloadavg()[0]]

    def alternation() -> None:
        for job, policy, pure in variants(pure=PURE):
            r = run_variant(spec, job, policy, pure)
            print(f"\n{r.line()}", flush=True)
            runs.append(r)
        load.append(os.getloadavg()[0])

    benchmark.pedantic(alternation, rounds=ROUNDS, iterations=1)
    summary = summarise(runs)
    verdict = compare(summary)
    benchmark.extra_info["spec"] = spec.to_dict()
    benchmark.extra_info["machine"] = {**machine(), "load_avg_1m_per_round": load}
    benchmark.extra_info["variants"] = summary
    benchmark.extra_info["comparison"] = verdict
    benchmark.extra_info["all"] = [r.to_dict() for r in runs]
    print("\n" + to_markdown(summary), flush=True)
    print(f"{verdict}\nload average (1 min) before/after each round: {load}", flush=True)
    for r in runs:
        assert r.status != "failed", r.line()


def test_loop_termination(benchmark: Any, tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    runs: list[TerminationRun] = []

    def alternation() -> None:
        for policy in ("none", "unaligned"):
            r = termination_once(spec, policy)
            print(f"\n{r.line()}", flush=True)
            runs.append(r)

    benchmark.pedantic(alternation, rounds=END_RUNS, iterations=1)
    summary = summarise_termination(runs)
    benchmark.extra_info["termination"] = summary
    benchmark.extra_info["all"] = [r.to_dict() for r in runs]
    benchmark.extra_info["load_avg_1m"] = os.getloadavg()[0]
    print("\n" + termination_markdown(summary), flush=True)
    for r in runs:
        assert r.status == "finished", r.line()
