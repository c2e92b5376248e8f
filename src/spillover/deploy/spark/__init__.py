"""Run spillover jobs on Spark: the job master on the driver, subtasks in barrier stages.

See docs/spark.md. ``SparkExecutor(job, config, master=...)`` runs like
:class:`~spillover.deploy.local.LocalExecutor`; ``spark_context()`` gives the
embedded local master (or the active context).
"""

from __future__ import annotations

from spillover.deploy.spark.logs import spark_log_file
from spillover.deploy.spark.runner import (
    SparkExecutor,
    SubtaskFailedError,
    WorkerLostError,
    rescale_to_available_slots,
    spark_context,
)

__all__ = [
    "SparkExecutor",
    "SubtaskFailedError",
    "WorkerLostError",
    "rescale_to_available_slots",
    "spark_context",
    "spark_log_file",
]
