"""Checkpoints under backpressure: one run of a backpressured job per barrier policy.

The job: an unthrottled ``GeneratorSource`` (int64 keys out of ``keys``, payloads of
``payload_bytes``) → ``key_by("key")`` → ``KeyedCount`` → ``rebalance()`` → a sink
paced at ``sink_rate`` records/s per subtask, so every channel is full and a barrier
that waits behind data waits long. Each policy runs ``warmup_s + duration_s`` on
``executor``; the policies of ``compare_local`` run again on the local executor right
after, for the cost of the executor (when the sinks' pace holds the runs back: whether
it keeps that pace). Checkpoint figures cover the checkpoints
triggered after the warm-up; sink throughput is the sink's live ``records_in``
metric, sampled by the driver at warm-up end and run end.
"""

from __future__ import annotations

from spillover.benchmark.plots import (
    PLOTS,
    plot,
)
from spillover.benchmark.progress import (
    ProgressBar,
)
from spillover.benchmark.report import (
    CHECKPOINT_COLUMNS,
    RUN_COLUMNS,
    to_markdown,
    write_results,
)
from spillover.benchmark.results import runs
from spillover.benchmark.runner import (
    PolicyResult,
    compare,
    machine,
    run,
    run_policy,
    trigger_offsets,
)
from spillover.benchmark.spec import (
    COMPARE_AUTO,
    DEFAULT_EXECUTOR,
    DURATION_RATIO_TARGET,
    EXECUTOR_COST_TARGET,
    PACED_SHARE,
    SAMPLE_EVERY_S,
    THROUGHPUT_RATIO_TARGET,
    BenchSpec,
    BenchSpecError,
    build_job,
)

__all__ = [
    "CHECKPOINT_COLUMNS",
    "COMPARE_AUTO",
    "DEFAULT_EXECUTOR",
    "DURATION_RATIO_TARGET",
    "EXECUTOR_COST_TARGET",
    "PACED_SHARE",
    "PLOTS",
    "RUN_COLUMNS",
    "SAMPLE_EVERY_S",
    "THROUGHPUT_RATIO_TARGET",
    "BenchSpec",
    "BenchSpecError",
    "PolicyResult",
    "ProgressBar",
    "build_job",
    "compare",
    "machine",
    "plot",
    "run",
    "run_policy",
    "runs",
    "to_markdown",
    "trigger_offsets",
    "write_results",
]
