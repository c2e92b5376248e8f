"""Checkpoints under backpressure, one run per policy (``spillover.benchmark.runner``).

Run: ``PYTHONPATH=src .venv/bin/python -m pytest bench/bench_checkpoints.py --benchmark-only -q``

The job and the figures are those of ``spillover bench`` (docs/benchmarks.md),
shortened by default: 10 s measured after 2 s of warm-up per policy.
``SPILLOVER_BENCH_CHECKPOINTS_DURATION`` and ``SPILLOVER_BENCH_CHECKPOINTS_WARMUP``
(seconds) lengthen it (30 and 5 for the figures in the docs);
``SPILLOVER_BENCH_CHECKPOINTS_POLICIES`` (comma-separated) picks the policies.
One round: the timing is the whole sequence of runs; the figures go to
``extra_info``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from spillover.benchmark import POLICIES, BenchSpec, run

DURATION_S = float(os.environ.get("SPILLOVER_BENCH_CHECKPOINTS_DURATION", "10"))
WARMUP_S = float(os.environ.get("SPILLOVER_BENCH_CHECKPOINTS_WARMUP", "2"))
SELECTED = os.environ.get("SPILLOVER_BENCH_CHECKPOINTS_POLICIES", ",".join(POLICIES))


def test_checkpoints_under_backpressure(benchmark: Any, tmp_path: Path) -> None:
    spec = BenchSpec(
        policies=[p.strip() for p in SELECTED.split(",") if p.strip()],
        duration_s=DURATION_S,
        warmup_s=WARMUP_S,
        checkpoint_dir=str(tmp_path),
    )
    results: dict[str, Any] = {}

    def go() -> None:
        results.update(run(spec))

    benchmark.pedantic(go, rounds=1, iterations=1)
    benchmark.extra_info["spec"] = results["spec"]
    for name, r in results["policies"].items():
        benchmark.extra_info[name] = {
            "checkpoints": r["checkpoints"],
            "aborted": r["aborted"],
            "checkpoint_duration_ms_median": r["checkpoint_duration_ms"]["median"],
            "start_delay_ms_median": r["start_delay_ms"]["median"],
            "alignment_ms_median": r["alignment_ms"]["median"],
            "inflight_bytes_median": r["inflight_bytes"]["median"],
            "throughput_rps": r["throughput_rps"],
        }
    benchmark.extra_info["comparison"] = results["comparison"]
    for name, r in results["policies"].items():
        assert r["status"] == "stopped", name
        assert r["throughput_rps"] > 0, name
