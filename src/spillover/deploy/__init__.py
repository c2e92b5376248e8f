"""Deployments: where a job's subtasks run. ``create_executor`` is the one place
that names every deployment: local threads, local worker processes, Spark."""

from __future__ import annotations

from typing import Any

from spillover.config import Config
from spillover.deploy.local import LocalExecutor
from spillover.errors import ConfigError
from spillover.runtime.graph import JobGraph, StreamEnvironment
from spillover.runtime.jobmaster import Executor

EXECUTORS = ("local", "processes", "spark")


def create_executor(
    kind: str | None,
    job: JobGraph | StreamEnvironment,
    config: Config | None = None,
    *,
    master: str | None = None,
    **options: Any,
) -> Executor:
    """An executor by name: ``local`` (threads in this process), ``processes`` (worker
    processes on this machine, wired as Spark's workers are) or ``spark`` (a barrier
    stage per attempt on ``master``, default the embedded local master). None takes
    both from the configuration (``spillover.executor``, ``spillover.spark.master``).
    ``options`` are those of :class:`LocalExecutor`."""
    if kind is None:
        dep = (config or Config()).deployment
        kind = dep.executor.value
        if kind == "spark" and master is None:
            master = dep.spark_master
    if kind in ("local", "processes") and master is not None:
        raise ConfigError("--master needs the spark executor", hint="add --executor spark")
    if kind == "local":
        return LocalExecutor(job, config, **options)
    if kind == "processes":
        from spillover.deploy.processes import ProcessExecutor  # imports pyspark's pickler

        return ProcessExecutor(job, config, **options)
    if kind == "spark":
        from spillover.deploy.spark import SparkExecutor  # imports pyspark: only when asked

        return SparkExecutor(job, config, master=master, **options)
    raise ConfigError(f"unknown executor {kind!r}", hint=f"choose one of {', '.join(EXECUTORS)}")
