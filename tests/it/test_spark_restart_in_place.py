"""Restart in place on Spark: an operator failure with every worker alive restarts
the job in the running barrier stage, its workers rebuilding their subtasks from the
restore; what the old attempt left on a connection never reaches the new one."""

from __future__ import annotations

import os
import queue
import signal
from pathlib import Path
from typing import Any

import pytest

from spillover.deploy.spark import runner
from spillover.deploy.spark.messages import Post, Reset, SwitchToUnaligned, Wired, WorkerJoined
from spillover.deploy.spark.worker import _Current, _follow, fenced
from spillover.runtime.failures import FailureInjector, FailureSpec
from spillover.runtime.jobevents import (
    EVENTS_DIR,
    GenerationEnded,
    GenerationStarted,
    JobEventLog,
)
from spillover.verify import VerifySpec, compare, run_once
from support.stages import count_stages

pytest.importorskip("pyspark")

SPEC = VerifySpec(
    topology="pipeline",
    parallelism=2,
    records=20_000,
    rate_per_subtask=10_000.0,
    failures=1,
    policy="unaligned",
    interval_ms=200,
    executor="spark",
)


@pytest.fixture(scope="module")
def sc() -> Any:
    return runner.spark_context()


@pytest.mark.slow
def test_an_operator_failure_restarts_in_place_and_output_is_exact(
    sc: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A running total throws in a worker: the next attempt runs in the same Spark
    stage (no second stage submitted), restores the latest checkpoint, and the
    committed output equals a failure-free local run's."""
    baseline = run_once(SPEC, str(tmp_path), "baseline", FailureInjector(), executor="local")
    stages, in_place = count_stages(monkeypatch)
    failures = FailureInjector([FailureSpec("operator", "running-total", 1, after_records=8_000)])
    actual = run_once(SPEC, str(tmp_path), "in-place", failures)
    assert actual.result.attempts == 2 and len(failures.fired) == 1, actual.result.failures
    assert "InducedFailure" in actual.result.failures[0]
    assert stages == [0] and in_place == [False, True]
    report = compare(SPEC, baseline, actual)
    assert report.exact, report.text()
    # The job event log tells the restart as it tells one in a new stage.
    log = JobEventLog.open(Path(str(actual.result.checkpoint_dir)) / EVENTS_DIR)
    events = list(log.events())
    started = [e for e in events if isinstance(e, GenerationStarted)]
    ended = [e for e in events if isinstance(e, GenerationEnded)]
    assert [e.generation for e in started] == [0, 1]
    assert started[1].cause.startswith("restart after SubtaskFailedError")
    assert started[1].restore_path is not None
    assert [e.generation for e in ended] == [0, 1] and ended[0].cause.startswith("failed:")


@pytest.mark.slow
def test_a_worker_killed_during_the_in_place_restart_falls_back_to_a_new_stage(
    sc: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worker 1's process is killed as the in-place restart begins: no subtask of the
    attempt ran yet, so it starts a new stage itself without failing: the job takes
    the attempts a restart in a new stage takes, and the output is exact."""
    baseline = run_once(SPEC, str(tmp_path), "baseline", FailureInjector(), executor="local")
    stages, in_place = count_stages(monkeypatch)
    rebuild = runner._SparkAttempt._rebuild
    killed: list[int] = []

    def kill_then_rebuild(self: Any, stage: Any) -> Any:
        if not killed:
            pid = int(stage.owner.workers[1]["pid"])
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        return rebuild(self, stage)

    monkeypatch.setattr(runner._SparkAttempt, "_rebuild", kill_then_rebuild)
    failures = FailureInjector([FailureSpec("operator", "running-total", 0, after_records=8_000)])
    actual = run_once(SPEC, str(tmp_path), "killed", failures)
    result = actual.result
    assert killed and result.attempts == 2 and len(result.failures) == 1, result.failures
    assert "InducedFailure" in result.failures[0]
    assert stages == [0, 1] and in_place == [False, False]
    report = compare(SPEC, baseline, actual)
    assert report.exact, report.text()


class _Recording:
    """A subtask that records what the control thread hands it."""

    def __init__(self) -> None:
        self.posted: list[object] = []
        self.switched: list[int] = []

    def post(self, message: object) -> None:
        self.posted.append(message)

    def request_unaligned(self, cid: int) -> None:
        self.switched.append(cid)

    def cancel(self) -> None:
        pass


def test_a_workers_control_thread_drops_messages_of_another_generation() -> None:
    """After a reset to generation 1, a Post or a switch of generation 0 (queued by the
    old coordinator) reaches no subtask; generation 1's do."""
    task = _Recording()
    current = _Current()
    current.begin(1, {("op", 0): task})  # type: ignore[dict-item]
    conn: Any = None  # neither message answers the master
    _follow(conn, Post("op", 0, "stale", generation=0), current)
    _follow(conn, SwitchToUnaligned("op", 0, 7, generation=0), current)
    assert task.posted == [] and task.switched == []
    _follow(conn, Post("op", 0, "fresh", generation=1), current)
    _follow(conn, SwitchToUnaligned("op", 0, 8, generation=1), current)
    assert task.posted == ["fresh"] and task.switched == [8]


def test_the_master_drops_a_wired_or_reset_of_another_generation() -> None:
    from spillover.runtime.connectors.generator import GeneratorSource
    from spillover.runtime.graph import StreamEnvironment

    env = StreamEnvironment("fenced", parallelism=1)
    env.from_source(GeneratorSource(partitions=1, records_per_partition=1), uid="s").rebalance()
    ex = runner.SparkExecutor(env)
    run = ex._attempt(1, None, None)
    run._dispatch(0, Wired(0, 0))
    run._dispatch(0, Reset(0, 0))
    with pytest.raises(queue.Empty):
        run.events.get_nowait()
    run._dispatch(0, Wired(0, 1))
    assert run.events.get_nowait() == WorkerJoined("wired", 0)


def test_gates_of_a_generation_are_served_under_their_own_name() -> None:
    assert fenced("count#0", 3) == "count#0@3" != fenced("count#0", 4)


def test_a_stale_frame_of_the_old_generation_is_dropped_not_delivered() -> None:
    """A worker's TCP receiver outlives a reset: the old generation's producer, still
    connected, sends a frame after it; a producer of the old generation connects
    late. Neither reaches the new generation's gate, which gets only its own data."""
    import contextlib

    from spillover.runtime.network.buffers import BufferPool, NetworkBuffer
    from spillover.runtime.network.errors import NetworkError
    from spillover.runtime.network.gate import InputGate
    from spillover.runtime.network.partition import ResultPartition
    from spillover.runtime.network.tcp import HandshakeError, TcpReceiver, connect_tcp

    secret = b"restart in place secret"
    rcv = TcpReceiver(secret, "127.0.0.1", 0, poll_interval=0.05)

    def link(generation: int) -> tuple[ResultPartition, Any]:
        part = ResultPartition(1, BufferPool(64, 16), f"p@{generation}")
        sub = connect_tcp(part, 0, rcv.address, fenced("g", generation), 0, secret)
        return part, sub

    def gate() -> InputGate:
        return InputGate(1, floating_buffers=4, buffers_per_channel=2, name="g")

    try:
        old_gate = gate()
        rcv.register(old_gate, fenced("g", 0))
        old_part, old_sub = link(0)
        old_part.emit(0, NetworkBuffer.unpooled(b"old"))
        item = old_gate.poll(10.0)
        assert item is not None and bytes(item[1]) == b"old"
        item[1].release()
        # The reset: the old subtask's gate cancelled and no longer served.
        old_gate.cancel()
        rcv.unregister(fenced("g", 0))
        new_gate = gate()
        rcv.register(new_gate, fenced("g", 1))
        with contextlib.suppress(NetworkError):  # the stale frame, if its link still takes it
            old_part.emit(0, NetworkBuffer.unpooled(b"stale"), timeout=1.0)
        with pytest.raises(HandshakeError):
            link(0)  # a late producer of the old generation is refused
        new_part, new_sub = link(1)
        new_part.emit(0, NetworkBuffer.unpooled(b"new"))
        item = new_gate.poll(10.0)
        assert item is not None and bytes(item[1]) == b"new"
        item[1].release()
        assert new_gate.poll(0.3) is None  # and nothing else, the stale frame least
        new_part.finish()
        assert new_sub.close(10.0)
        old_sub.close(1.0)
    finally:
        rcv.close()
