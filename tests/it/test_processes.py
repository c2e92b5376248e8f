"""Jobs in worker processes on this machine (``spillover.executor: processes``): the
Spark executor's job master and workers, without Spark."""

from __future__ import annotations

from pathlib import Path

import pytest

from spillover.deploy import create_executor
from spillover.deploy.processes import ProcessExecutor
from spillover.verify import VerifySpec, verify
from spillover.verify.chaos import run_killing_a_worker

pytest.importorskip("pyspark")  # its pickler carries the job to the workers


def test_a_job_in_worker_processes_is_exact_with_induced_failures() -> None:
    """Failures fired in the worker processes restart the job from its latest
    checkpoint: the committed output equals a failure-free run's."""
    spec = VerifySpec(
        topology="pipeline",
        parallelism=2,
        records=20_000,
        failures=3,
        policy="unaligned",
        executor="processes",
    )
    report = verify(spec)
    assert report.exact, report.text()
    assert len(report.failures_fired) == 3
    assert report.attempts == 4


def test_a_rescaled_restore_in_worker_processes_is_exact() -> None:
    """An unaligned checkpoint with in-flight data taken by three worker processes
    restores into two: nothing lost or duplicated."""
    spec = VerifySpec(
        topology="keyed-parallelisms",
        parallelism=3,
        rescale_to=2,
        records=30_000,
        failures=1,
        policy="unaligned",
        executor="processes",
    )
    report = verify(spec)
    assert report.exact, report.text()
    assert report.restored_inflight > 0


def test_a_killed_worker_process_restarts_the_job_and_output_is_exact(tmp_path: Path) -> None:
    out = run_killing_a_worker(str(tmp_path), executor="processes")
    assert out["killed"], "no checkpoint completed before the job ended: lengthen it"
    assert out["status"] == "finished" and out["attempts"] >= 2, out
    assert out["exact"], out["report"]
    # The job master blames the killed worker, not the channels it broke.
    assert "WorkerLostError" in out["failures"][0] or "killed" in out["failures"][0].lower()


def test_the_processes_executor_is_chosen_by_name_and_refuses_a_spark_master() -> None:
    from spillover.errors import ConfigError
    from spillover.runtime.connectors.generator import GeneratorSource
    from spillover.runtime.connectors.throttled import ThrottledSink
    from spillover.runtime.graph import StreamEnvironment

    env = StreamEnvironment("named", parallelism=1)
    env.from_source(GeneratorSource(partitions=1, records_per_partition=10), uid="s").sink(
        ThrottledSink(1000.0), uid="k"
    )
    assert isinstance(create_executor("processes", env), ProcessExecutor)
    with pytest.raises(ConfigError, match="spark executor"):
        create_executor("processes", env, master="spark://elsewhere:7077")
