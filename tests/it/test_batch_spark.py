"""Batch jobs on Spark: each region a Spark job of one task, the result partitions
on the job's shared storage; a failed task re-runs only its region, and a restarted
master reuses what finished."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from spillover.deploy.spark import SparkExecutor, spark_context
from spillover.runtime.failures import FailureInjector, FailureSpec
from support.batch_jobs import batch_config, expected, staged_job, totals

pytest.importorskip("pyspark")


@pytest.fixture(scope="module")
def sc() -> Any:
    return spark_context()


def test_a_batch_job_on_spark_re_runs_only_the_failed_region(sc: Any, tmp_path: Path) -> None:
    failures = FailureInjector([FailureSpec("operator", "sum", 1, after_records=100)])
    ex = SparkExecutor(
        staged_job(tmp_path / "out"), batch_config(tmp_path), spark_context=sc, failures=failures
    )
    result = ex.run(timeout=300)
    assert result.status == "finished", result.failures
    assert totals(tmp_path / "out") == expected()
    assert len(failures.fired) == 1  # fired in a worker, noted on the driver
    runs = {name: m["runs"] for name, m in result.tasks.items()}
    assert runs == {"src#0": 1, "src#1": 1, "sum#0": 1, "sum#1": 2, "sink#0": 1, "sink#1": 1}


def test_a_batch_job_on_spark_resumes_from_what_finished(sc: Any, tmp_path: Path) -> None:
    cfg = batch_config(tmp_path, **{"restart-strategy.type": "none"})
    failures = FailureInjector([FailureSpec("operator", "sink", 0, after_records=1)])
    first = SparkExecutor(
        staged_job(tmp_path / "out"), cfg, spark_context=sc, failures=failures
    ).run(timeout=300)
    assert first.status == "failed"
    again = SparkExecutor(staged_job(tmp_path / "out"), cfg, spark_context=sc).run(timeout=300)
    assert again.status == "finished", again.failures
    assert {"src#0", "src#1", "sum#0", "sum#1"} <= set(again.reused_tasks)
    assert totals(tmp_path / "out") == expected()


def test_a_batch_job_wider_than_the_cluster_runs_in_waves(sc: Any, tmp_path: Path) -> None:
    """A batch task is a Spark job of one task: a job whose parallelism exceeds the
    cluster's slots runs (its tasks wait for slots), where a streaming job's barrier
    stage needs a slot for every task at once."""
    from support.batch_jobs import job

    wide = sc.defaultParallelism + 1
    ex = SparkExecutor(
        job(tmp_path / "out", parallelism=wide, sum_parallelism=1),
        batch_config(tmp_path),
        spark_context=sc,
    )
    result = ex.run(timeout=300)
    assert result.status == "finished", result.failures
    assert totals(tmp_path / "out") == expected()
    assert len(result.tasks) == wide + 1  # the sources, and the sum chained to its sink
