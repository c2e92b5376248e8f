"""Benchmark specs the benchmark smoke tests share."""

from __future__ import annotations

from pathlib import Path

from spillover.benchmark import BenchSpec


def short_spec(checkpoint_dir: Path) -> BenchSpec:
    """A short unaligned run on the local executor at a low sink rate, checkpointing
    every 100 ms into ``checkpoint_dir``: enough for a recovery, a rescale or a stop to
    have checkpoints to work from, quick enough for a smoke test."""
    return BenchSpec(
        policies=["unaligned"],
        warmup_s=0.3,
        interval_ms=100,
        sink_rate=2_000,
        checkpoint_dir=str(checkpoint_dir),
        executor="local",
    )
