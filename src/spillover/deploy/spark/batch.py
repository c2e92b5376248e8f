"""Batch jobs on Spark: each region (in batch mode, one subtask) runs as a Spark job
of one task, which reads its producers' result files from the job's shared storage
and writes its own there; the scheduler on the driver starts a region's job once
its producers finished. A task's failure travels back as its outcome, not as a
failed Spark job, so one failure never takes the other running regions down."""

from __future__ import annotations

import itertools
import threading
import uuid
from collections.abc import Callable
from typing import Any

from spillover.runtime.batch.launch import BatchTaskSpec, Running, TaskOutcome, run_here


def _run_task(spec: BatchTaskSpec) -> Callable[[Any], list[TaskOutcome]]:
    def work(_: Any) -> list[TaskOutcome]:
        return [run_here(spec)]

    return work


class _SparkRun:
    """A region's Spark job; ``cancel`` cancels its job group."""

    def __init__(self, sc: Any, group: str) -> None:
        self.sc = sc
        self.group = group
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        self.sc.cancelJobGroup(self.group)


class SparkLauncher:
    """Runs each batch task run as a one-task Spark job on ``sc``, submitted from a
    thread of the driver (Spark runs concurrent jobs side by side)."""

    def __init__(self, sc: Any, job_name: str) -> None:
        self.sc = sc
        self.job_name = job_name
        self.prefix = f"spillover-batch-{uuid.uuid4().hex[:8]}"
        self._count = itertools.count()

    def launch(self, spec: BatchTaskSpec, done: Callable[[TaskOutcome], None]) -> Running:
        run = _SparkRun(self.sc, f"{self.prefix}-{next(self._count)}")
        name = f"{spec.uid}#{spec.subtask}"
        thread = threading.Thread(
            target=self._submit, args=(spec, run, done), name=f"spark {name}", daemon=True
        )
        thread.start()
        return run

    def _submit(
        self, spec: BatchTaskSpec, run: _SparkRun, done: Callable[[TaskOutcome], None]
    ) -> None:
        try:
            self.sc.setJobGroup(
                run.group,
                f"{self.job_name} batch task {spec.uid}#{spec.subtask} (attempt {spec.attempt})",
                interruptOnCancel=True,
            )
            rdd = self.sc.parallelize([0], 1).mapPartitions(_run_task(spec))
            (outcome,) = rdd.collect()
        except BaseException as e:  # the Spark job itself failed (or was cancelled)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            outcome = TaskOutcome(
                spec.key, error=f"its Spark job failed: {first}", cancelled=run.cancelled
            )
        done(outcome)

    def close(self) -> None:
        pass
