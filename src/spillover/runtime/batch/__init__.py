"""Batch execution (``execution.runtime-mode: batch``): blocking exchanges whose
result partitions the engine writes, scheduling by pipelined region, region
failover, and progress recovery after the job master's death (docs/recovery.md,
"Batch jobs")."""

from __future__ import annotations

from spillover.runtime.batch.mode import runs_as_batch
from spillover.runtime.batch.regions import Region, TaskKey, pipelined_regions, producers_of

__all__ = ["Region", "TaskKey", "pipelined_regions", "producers_of", "runs_as_batch"]
