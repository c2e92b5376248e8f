"""Restart in place in worker processes (the Spark executor's job master and workers,
without Spark): what fails while a stage waits for its restart costs no restart, old
attempts are freed, and a control fault strikes in the generation it names."""

from __future__ import annotations

import gc
import os
import signal
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from spillover.deploy import create_executor
from spillover.deploy.spark import runner
from spillover.deploy.spark.messages import WorkerJoined
from spillover.runtime.failures import FailureInjector, FailureSpec
from spillover.runtime.network.tcp.faults import NetworkFault
from spillover.verify import VerifySpec, compare, run_once
from spillover.verify.spec import config_for
from support.stages import count_stages

pytest.importorskip("pyspark")  # its pickler carries the job to the workers

SPEC = VerifySpec(
    topology="pipeline",
    parallelism=2,
    records=20_000,
    rate_per_subtask=10_000.0,
    failures=1,
    policy="unaligned",
    interval_ms=200,
    executor="processes",
)


@pytest.mark.slow
def test_a_worker_lost_while_a_stage_is_kept_costs_no_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the default budget (one restart), an operator failure and then a worker
    killed as the in-place restart begins: the attempt starts a new stage itself
    instead of failing, so the job finishes in two attempts, its output exact."""
    spec = replace(SPEC, options={"restart-strategy.fixed-delay.attempts": 1})
    baseline = run_once(spec, str(tmp_path), "baseline", FailureInjector(), executor="local")
    stages, in_place = count_stages(monkeypatch)
    rebuild = runner._SparkAttempt._rebuild
    killed: list[int] = []

    def kill_then_rebuild(self: Any, stage: Any) -> Any:
        if not killed:
            killed.append(int(stage.owner.workers[1]["pid"]))
            os.kill(killed[0], signal.SIGKILL)
        return rebuild(self, stage)

    monkeypatch.setattr(runner._SparkAttempt, "_rebuild", kill_then_rebuild)
    failures = FailureInjector([FailureSpec("operator", "running-total", 0, after_records=8_000)])
    actual = run_once(spec, str(tmp_path), "killed", failures)
    result = actual.result
    assert killed and result.status == "finished", result.failures
    assert result.attempts == 2 and len(result.failures) == 1, result.failures
    assert "InducedFailure" in result.failures[0]
    assert stages == [0, 1] and in_place == [False, False]
    report = compare(spec, baseline, actual)
    assert report.exact, report.text()


@pytest.mark.slow
def test_attempts_restarted_in_place_are_not_kept_alive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three restarts in place in one stage: when the last begins, no attempt is still
    reachable but the stage's submitter, the one it takes over from and itself."""
    spec = replace(SPEC, failures=3)
    attempts: list[weakref.ref[Any]] = []
    alive: list[list[int]] = []
    init, rebuild = runner._SparkAttempt.__init__, runner._SparkAttempt._rebuild

    def tracked_init(self: Any, *a: Any) -> None:
        init(self, *a)
        attempts.append(weakref.ref(self))

    def checked_rebuild(self: Any, stage: Any) -> Any:
        gc.collect()
        alive.append(sorted(a.generation for r in attempts if (a := r()) is not None))
        return rebuild(self, stage)

    monkeypatch.setattr(runner._SparkAttempt, "__init__", tracked_init)
    monkeypatch.setattr(runner._SparkAttempt, "_rebuild", checked_rebuild)
    failures = FailureInjector(
        [
            FailureSpec("operator", "running-total", 0, after_records=3_000),
            FailureSpec("operator", "running-total", 1, after_records=3_000),
            FailureSpec("operator", "running-total", 0, after_records=3_000),
        ]
    )
    result = run_once(spec, str(tmp_path), "chain", failures).result
    assert result.status == "finished" and result.attempts == 4, result.failures
    assert alive == [[0, 1], [0, 1, 2], [0, 2, 3]]


@pytest.mark.slow
def test_a_control_fault_strikes_in_the_generation_it_names_after_a_restart_in_place(
    tmp_path: Path,
) -> None:
    """A control connection reset aimed at generation 1, which runs in place in the
    stage generation 0 started: it strikes there (the attempt fails on the lost
    worker) and the job still finishes."""
    graph = SPEC.factory()(str(tmp_path / "out"), "fault", SPEC.parallelism).build()
    cfg = config_for(SPEC, str(tmp_path / "ckpt")).with_options(
        {"restart-strategy.fixed-delay.attempts": 3}
    )
    failures = FailureInjector([FailureSpec("operator", "running-total", 0, after_records=8_000)])
    fault = NetworkFault("control", "reset", after=3, worker=0, generation=1)
    ex = create_executor("processes", graph, cfg, failures=failures, network_fault=fault)
    result = ex.run(timeout=600)
    assert result.status == "finished", result.failures
    assert "InducedFailure" in result.failures[0]
    assert result.attempts == 3 and len(result.failures) == 2, result.failures
    assert "WorkerLostError: worker 0 " in result.failures[1], result.failures


def _small_job() -> Any:
    from spillover.runtime.connectors.generator import GeneratorSource
    from spillover.runtime.connectors.throttled import ThrottledSink
    from spillover.runtime.graph import StreamEnvironment

    env = StreamEnvironment("small", parallelism=1)
    env.from_source(GeneratorSource(partitions=1, records_per_partition=10), uid="s").sink(
        ThrottledSink(1e9), uid="k"
    )
    return env


def test_a_reset_with_a_finished_worker_keeps_no_stage() -> None:
    """A worker that finished between the failure and the reset rebuilds nothing: the
    reset gives up on it at once, though the other worker's confirmation follows."""
    run: Any = runner.SparkExecutor(_small_job(), cancel_grace_s=5.0)._attempt(1, None, None)
    run.n = 2
    run.events.put(WorkerJoined("reset", 0))
    run.events.put(WorkerJoined("finished", 1))
    run.events.put(WorkerJoined("reset", 1))
    assert run._reset() is False
    assert run.events.get_nowait() == WorkerJoined("reset", 1)  # not waited for


def test_a_stage_is_ended_when_stopping_the_coordinator_raises() -> None:
    class Server:
        closed = False

        def close(self) -> None:
            self.closed = True

    ex = runner.SparkExecutor(_small_job())
    run: Any = ex._attempt(0, None, None)
    server = Server()
    stage = runner._Stage(server, run, ex.graph, run.n, run)  # type: ignore[arg-type]

    def stop() -> None:
        raise RuntimeError("the coordinator could not stop")

    run.coordinator.stop = stop
    with pytest.raises(RuntimeError):
        run._finish(None, stage, None, False)
    assert server.closed


def test_a_release_that_raises_still_ends_the_job_and_its_status() -> None:
    """What frees a kept stage fails (say the SparkContext is gone): the run still
    returns its result and the job's status says it ended."""
    from spillover.deploy.local import LocalExecutor

    class Failing(LocalExecutor):
        def _release(self) -> None:
            raise RuntimeError("the SparkContext is stopped")

    ex = Failing(_small_job())
    result = ex.run(timeout=60)
    assert result.status == "finished"
    assert ex.status.snapshot().state == "FINISHED"
