"""Jobs on Spark: the embedded local master, one barrier stage per generation.

One SparkContext serves the whole test process (Spark allows one per process); the
standalone-cluster test runs its driver in a subprocess of its own.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from spillover.deploy.spark import SparkExecutor, spark_context
from spillover.deploy.spark.control import ControlError, ControlServer, connect
from spillover.deploy.spark.messages import (
    Hello,
    StageEnded,
    SubtaskDone,
    Sync,
    WorkerJoined,
    WorkerLost,
)
from spillover.errors import ConfigError
from spillover.runtime.api import Batch, Operator
from spillover.runtime.checkpointing.metadata import CheckpointStorage
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.connectors.parquet import ParquetSink
from spillover.runtime.failures import FailureInjector, FailureSpec
from spillover.runtime.graph import StreamEnvironment
from spillover.verify import VerifySpec, config_for, verify

pytest.importorskip("pyspark")


@pytest.fixture(scope="module")
def sc() -> Any:
    return spark_context()


# The same workers run as Spark tasks or as worker processes here (deploy/processes.py).
EXECUTORS = pytest.mark.parametrize("executor", ["spark", "processes"])


@EXECUTORS
def test_job_on_spark_is_exact_with_induced_failures(sc: Any, executor: str) -> None:
    """Every kind of failure, fired in Spark workers (or worker processes), restarts
    the job from its latest checkpoint: the committed output equals a failure-free
    local run's."""
    spec = VerifySpec(
        topology="pipeline",
        parallelism=2,
        records=20_000,
        failures=4,
        policy="unaligned",
        executor=executor,
    )
    report = verify(spec)
    assert report.exact, report.text()
    assert len(report.failures_fired) == 4  # each fired once, though workers hold copies
    assert report.attempts == 5


@EXECUTORS
def test_rescaled_restore_on_spark_is_exact(sc: Any, executor: str) -> None:
    """An unaligned checkpoint holding in-flight data, taken on Spark at parallelism 3,
    restores at 2 on Spark: nothing lost or duplicated, keys in their key groups."""
    spec = VerifySpec(
        topology="keyed-parallelisms",
        parallelism=3,
        rescale_to=2,
        records=30_000,
        failures=1,
        policy="unaligned",
        executor=executor,
    )
    report = verify(spec)
    assert report.exact, report.text()
    assert report.restored_inflight > 0


@EXECUTORS
def test_killed_worker_process_restarts_the_job_and_output_is_exact(
    sc: Any, tmp_path: Path, executor: str
) -> None:
    from spillover.verify.chaos import run_killing_a_worker

    out = run_killing_a_worker(str(tmp_path), executor=executor)
    assert out["killed"], "no checkpoint completed before the job ended: lengthen it"
    assert out["status"] == "finished" and out["attempts"] >= 2, out
    assert out["exact"], out["report"]
    assert len(out["restart_s"]) == out["attempts"] - 1  # each restart timed
    # The job master blames the killed worker, not the channels it broke.
    assert "WorkerLostError" in out["failures"][0] or "killed" in out["failures"][0].lower()


def test_generations_are_named_in_the_spark_ui(
    sc: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from spillover.deploy.spark import runner

    checked: list[int] = []
    check = runner._check_shippable

    def counted(spec: Any) -> None:
        checked.append(spec.generation)
        check(spec)

    monkeypatch.setattr(runner, "_check_shippable", counted)
    env = StreamEnvironment("ui-named", parallelism=2)
    env.from_source(
        GeneratorSource(partitions=2, records_per_partition=2_000), uid="src"
    ).rebalance().sink(ParquetSink(str(tmp_path / "out")), uid="sink")
    failures = FailureInjector([FailureSpec("operator", "sink", 0, after_records=100)])
    cfg = config_for(VerifySpec(), str(tmp_path / "ckpt"))
    # One stage per generation (a restart in place would run both in one).
    cfg = cfg.with_options({"spillover.restart-in-place.enabled": False})
    result = SparkExecutor(env, cfg, failures=failures).run(timeout=120)
    assert result.status == "finished" and result.attempts == 2
    assert checked == [0]  # the job is pickled to check it once, not per generation
    # Both generations' sink subtasks name their files for the job's one run.
    assert result.run_id is not None
    names = [p.name for p in (tmp_path / "out").glob("part-*.parquet")]
    assert names and {n.rpartition("-")[2][:6] for n in names} == {result.run_id[:6]}
    url = sc.uiWebUrl
    if not url:
        pytest.skip("the Spark UI is off")
    app = sc.applicationId
    # The UI answers slowly on a busy machine: what it lists is the point, not how fast.
    with urllib.request.urlopen(f"{url}/api/v1/applications/{app}/jobs", timeout=120) as r:
        jobs = json.load(r)
    described = {j.get("description") for j in jobs}
    assert {"ui-named generation 0", "ui-named generation 1"} <= described


def test_too_few_task_slots_are_refused_before_any_stage(sc: Any) -> None:
    env = StreamEnvironment("too-wide", parallelism=sc.defaultParallelism + 1)
    env.from_source(GeneratorSource(partitions=1, records_per_partition=1), uid="s").sink(
        _Discard(), uid="k"
    )
    with pytest.raises(ConfigError, match=r"task slots.*needs"):
        SparkExecutor(env).run(timeout=30)


class _Discard(Operator):
    def process(self, batch: Batch, input_index: int = 0) -> None:
        pass


class _HoldsALock(_Discard):
    def __init__(self) -> None:
        self.lock = threading.Lock()


def test_a_job_that_cannot_travel_to_workers_is_refused_clearly(sc: Any) -> None:
    env = StreamEnvironment("unshippable", parallelism=1)
    env.from_source(GeneratorSource(partitions=1, records_per_partition=1), uid="s").sink(
        _HoldsALock(), uid="k"
    )
    with pytest.raises(ConfigError, match="cannot be shipped") as e:
        SparkExecutor(env).run(timeout=30)
    assert "lock" in str(e.value.detail)
    # The refusal closes the generation's control endpoint: no accept thread lingers.
    endpoints = [t for t in threading.enumerate() if t.name.startswith("spillover-control (")]
    assert not endpoints, endpoints


def test_control_endpoint_admits_only_the_job_secret() -> None:
    secret = os.urandom(32)
    got: list[Any] = []

    def serve(conn: Any) -> None:
        got.append(conn.recv())
        conn.send(("welcome", 7))

    server = ControlServer(secret, serve)
    try:
        with pytest.raises(ControlError, match=r"refused|failed"):
            connect(server.address, os.urandom(32), timeout=5)
        conn = connect(server.address, secret, timeout=5)
        conn.send(("hello", 1, [2, 3]))
        assert conn.recv() == ("welcome", 7)
        conn.close()
        assert got == [("hello", 1, [2, 3])]
        assert any("wrong secret" in r for r in server.refused)
    finally:
        server.close()


def test_control_endpoint_keeps_accepting_after_an_accept_error() -> None:
    """An accept that fails (say, out of file descriptors) does not end the endpoint:
    a worker connecting afterwards is still admitted."""
    secret = os.urandom(32)
    server = ControlServer(secret, lambda conn: conn.send(("welcome",)))
    real = server._listener

    class Flaky:
        failures = 3

        def accept(self) -> Any:
            if Flaky.failures:
                Flaky.failures -= 1
                raise OSError(24, "Too many open files")
            return real.accept()

        def shutdown(self, how: int) -> None:
            real.shutdown(how)

        def close(self) -> None:
            real.close()

    server._listener = Flaky()  # type: ignore[assignment]
    try:
        deadline = time.monotonic() + 5
        while Flaky.failures and time.monotonic() < deadline:
            time.sleep(0.01)
        assert Flaky.failures == 0, "the endpoint stopped accepting at the first error"
        conn = connect(server.address, secret, timeout=5)
        assert conn.recv() == ("welcome",)
        conn.close()
    finally:
        server.close()


def test_control_endpoint_refuses_a_short_secret() -> None:
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        ControlServer(b"short", lambda c: None)


def test_rescale_to_available_slots_shrinks_the_job_only_when_slots_are_missing() -> None:
    from spillover.deploy.spark import rescale_to_available_slots

    class Cluster:
        def __init__(self, have: int, task_slots: int = 1) -> None:
            self.have, self.slots, self.task_slots = have, 4, task_slots

        def available_slots(self) -> int:
            return self.have

    policy = rescale_to_available_slots(lambda p: f"job at {p}", wait_s=0.0)  # type: ignore[arg-type,return-value]
    err = RuntimeError("executor lost")
    assert policy(Cluster(2), 0, err) == "job at 2"  # half the cluster is gone
    assert policy(Cluster(2, task_slots=3), 0, err) == "job at 6"  # 3 subtasks a worker
    assert policy(Cluster(4), 0, err) is None  # enough slots: the same job
    assert policy(Cluster(0), 0, err) is None  # nothing registered yet: wait, do not shrink to 0


def test_a_users_job_file_runs_on_spark(sc: Any, tmp_path: Path) -> None:
    """`spillover verify --executor spark --job file.py:make_job`: the workers cannot
    import the user's file, so it travels with the job."""
    job = tmp_path / "my_orders_job.py"
    job.write_text(
        "from spillover.runtime.graph import StreamEnvironment\n"
        "from spillover.runtime.connectors import ParquetSink, ThrottledSink\n"
        "from spillover.runtime.connectors import GeneratorSource\n"
        "\n"
        "def keep(batch):  # defined here: the workers cannot import this file\n"
        "    return batch['seq'] >= 0\n"
        "\n"
        "def make_job(out_dir, name, parallelism):\n"
        "    env = StreamEnvironment(name, parallelism=parallelism, max_parallelism=128)\n"
        "    src = GeneratorSource(partitions=4, records_per_partition=5000,\n"
        "                          rate_per_subtask=20_000, keys=100, payload_bytes=8)\n"
        "    env.from_source(src, uid='orders').filter(keep, uid='keep').key_by('key').sink(\n"
        "        ThrottledSink(15_000, inner=ParquetSink(out_dir)), uid='sink')\n"
        "    return env\n"
    )
    spec = VerifySpec(
        job=f"{job}:make_job",
        parallelism=2,
        records=20_000,
        failures=2,
        policy="unaligned",
        order=None,
        executor="spark",
    )
    report = verify(spec)
    assert report.exact, report.text()
    assert len(report.failures_fired) == 2


def test_sinks_on_spark_commit_only_with_a_checkpoint(sc: Any, tmp_path: Path) -> None:
    """A bounded job whose only checkpoint, the final one, fails: its sinks must not
    have published at the end of their input (the restart replays everything, so an
    early publish would commit every record twice)."""
    from spillover.verify import compare, run_once

    spec = VerifySpec(
        topology="pipeline",
        parallelism=2,
        records=5_000,
        interval_ms=600_000,  # no periodic checkpoint: the final one is the first
        failures=1,
        policy="unaligned",
        executor="spark",
    )
    baseline = run_once(spec, str(tmp_path), "baseline", FailureInjector(), executor="local")
    failures = FailureInjector([FailureSpec("snapshot", "parquet-sink", 0)])
    actual = run_once(spec, str(tmp_path), "final-fails", failures)
    assert actual.result.attempts == 2 and len(failures.fired) == 1, actual.result.failures
    report = compare(spec, baseline, actual)
    assert report.exact, report.text()


def test_a_worker_marks_broken_channels_so_the_master_blames_the_cause() -> None:
    from spillover.deploy.spark.runner import _is_consequence, _subtask_error
    from spillover.deploy.spark.worker import _error_info
    from spillover.runtime.failures import InducedFailure
    from spillover.runtime.network.errors import ChannelFailedError
    from spillover.runtime.network.tcp import ProtocolError, TransportError

    def blamed(err: BaseException) -> bool:
        info = _error_info(err)
        assert info is not None
        return not _is_consequence(_subtask_error(("op", 0), info))

    assert not blamed(ChannelFailedError("channel 1 failed: the producer failed"))
    assert not blamed(TransportError("connection lost"))
    assert blamed(ProtocolError("a data frame beyond the announced credit"))  # a bug there
    assert blamed(InducedFailure("induced failure: operator at op#0"))


def test_a_stage_ending_before_the_workers_last_messages_is_not_a_lost_worker() -> None:
    """The stage's end (from Spark) can overtake the workers' last done messages (over
    the control connections): the generation finished, it did not lose a worker; a
    stage that ended with subtasks that never report fails after a short grace."""
    from spillover.deploy.spark.runner import WorkerLostError

    env = StreamEnvironment("stage-ends-first", parallelism=2)
    env.from_source(GeneratorSource(partitions=2, records_per_partition=1), uid="s").sink(
        _Discard(), uid="k"
    )
    ex = SparkExecutor(env)
    run = ex._attempt(0, None, None)
    run.events.put(StageEnded(None))
    for key in run.proxies:
        run.events.put(SubtaskDone(key, None))
    assert run._loop(time.monotonic() + 10, None, None) is None

    run = ex._attempt(1, None, None)
    run.events.put(StageEnded(None))
    run.events.put(SubtaskDone(("s", 0), None))
    started = time.monotonic()
    error = run._loop(time.monotonic() + 10, None, None)
    assert isinstance(error, WorkerLostError) and "ended early" in str(error)
    assert time.monotonic() - started < 5


def _connected_pair(secret: bytes) -> tuple[ControlServer, Any, Any]:
    """A control endpoint, a worker's connection to it and the master's end of it."""
    import queue

    ends: queue.SimpleQueue[Any] = queue.SimpleQueue()
    server = ControlServer(secret, ends.put)
    worker = connect(server.address, secret, timeout=5)
    return server, worker, ends.get(timeout=5)


def test_an_unreadable_control_message_is_a_control_error() -> None:
    import struct

    secret = os.urandom(32)
    server, worker, master = _connected_pair(secret)
    try:
        master.sock.sendall(struct.pack("<I", 7) + b"garbage")
        with pytest.raises(ControlError, match="unreadable"):
            worker.recv()
    finally:
        worker.close()
        master.close()
        server.close()


def test_a_malformed_message_from_a_worker_fails_the_generation() -> None:
    """The master's thread for a worker does not die quietly on a message that is not
    the protocol's (the job would wait forever): the worker counts as lost."""
    env = StreamEnvironment("malformed", parallelism=1)
    env.from_source(GeneratorSource(partitions=1, records_per_partition=1), uid="s").sink(
        _Discard(), uid="k"
    )
    ex = SparkExecutor(env)
    run = ex._attempt(0, None, None)
    server = ControlServer(ex.secret, run._on_connect)
    try:
        worker = connect(server.address, ex.secret, timeout=5)
        worker.send(Hello(0, 0, ("127.0.0.1", 1), os.getpid(), "here"))
        assert run.events.get(timeout=5) == WorkerJoined("hello", 0)
        worker.send(("done", "s"))  # not one of the protocol's messages
        ev = run.events.get(timeout=5)
        assert isinstance(ev, WorkerLost) and "malformed" in ev.reason, ev
        with pytest.raises(ControlError):  # and the worker is told
            worker.recv()
        worker.close()
    finally:
        server.close()


def test_a_worker_cancels_its_subtasks_on_a_malformed_message_from_the_master() -> None:
    import queue

    from spillover.deploy.spark.worker import _control_loop, _Current

    class Subtask:
        cancelled = False

        def cancel(self) -> None:
            self.cancelled = True

    secret = os.urandom(32)
    server, worker, master = _connected_pair(secret)
    try:
        subtask = Subtask()
        current = _Current()
        current.begin(0, {("s", 0): subtask})  # type: ignore[dict-item]
        inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        master.send(("post",))  # not one of the protocol's messages
        _control_loop(worker, current, threading.Event(), inbox)
        assert subtask.cancelled
        assert inbox.get_nowait() is None  # and the worker's main thread is told
        with pytest.raises(ControlError):  # the master sees this worker gone
            master.recv()
    finally:
        worker.close()
        master.close()
        server.close()


def test_the_kill_routine_raises_what_the_job_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from spillover.verify import chaos

    class Broken:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def prepare(self) -> None:
            pass

        def workers(self) -> dict[int, Any]:
            return {}

        def completed_ids(self) -> list[int]:
            return []

        def run(self, timeout: float) -> Any:
            raise ConfigError("the cluster refused the job")

    monkeypatch.setattr(chaos, "run_once", lambda *args, **kwargs: None)
    monkeypatch.setattr(chaos, "create_executor", Broken)
    with pytest.raises(ConfigError, match="refused the job"):
        chaos.run_killing_a_worker(str(tmp_path), spec=chaos.kill_spec(records=100))


def test_sources_do_not_end_unless_every_worker_confirmed_the_final_checkpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ending the sources before a worker holds the final checkpoint's completion could
    end its sink without committing: the generation fails instead, after one wait."""
    from spillover.deploy.spark import runner

    monkeypatch.setattr(runner, "SYNC_TIMEOUT_S", 0.3)
    env = StreamEnvironment("unsynced", parallelism=3)
    env.from_source(GeneratorSource(partitions=3, records_per_partition=1), uid="s").sink(
        _Discard(), uid="k"
    )
    run = SparkExecutor(env)._attempt(0, None, None)

    class Silent:  # a worker that never answers
        def __init__(self) -> None:
            self.sent: list[Any] = []

        def send(self, message: Any) -> None:
            self.sent.append(message)

    waits: list[float | None] = []

    class RecordingEvent(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            if threading.current_thread() is threading.main_thread():
                waits.append(timeout)
            return super().wait(timeout)

    monkeypatch.setattr(runner.threading, "Event", RecordingEvent)
    conns = {i: Silent() for i in range(3)}
    run.conns.update(conns)  # type: ignore[arg-type]
    run._terminate_sources()
    # One deadline for all the workers, not one wait of SYNC_TIMEOUT_S each.
    assert sum(w or 0.0 for w in waits) <= 0.3, waits
    assert all(isinstance(m, Sync) for c in conns.values() for m in c.sent)
    ev = run.events.get_nowait()
    assert isinstance(ev, WorkerLost) and "sync" in ev.reason, ev


def test_finish_output_is_committed_once_on_spark(sc: Any, tmp_path: Path) -> None:
    """FLIP-147 on Spark: the short branch of the finishing job ends (its tasks
    report their exit over the control connection), the main source fails later in a
    worker, and the restore does not run the finished branch again: the committed
    output, finish() summaries included, equals a failure-free local run's."""
    from spillover.verify import compare, run_once
    from spillover.verify.topologies import SUMMARY_PARTITION

    spec = VerifySpec(
        topology="finishing",
        parallelism=2,
        records=30_000,
        rate_per_subtask=5_000,
        failures=1,
        interval_ms=100,
        executor="spark",
        num_retained=1000,  # the restored checkpoint stays to be read afterwards
    )
    base = run_once(spec, str(tmp_path), "base", FailureInjector(), executor="local")
    # 12,000 of the main source's 15,000 records per subtask: 2.4 s in.
    failures = FailureInjector([FailureSpec("operator", "source", 0, after_records=12_000)])
    other = run_once(spec, str(tmp_path), "failing", failures)
    assert len(failures.fired) == 1 and other.result.attempts == 2
    assert other.result.restored_from, "the failure restored a checkpoint"
    job = Path(str(other.result.checkpoint_dir))
    meta = CheckpointStorage(str(job.parent), job.name).read_metadata(other.result.restored_from[0])
    assert meta["tasks"]["short-source"]["finished"] == "fully"
    summaries = other.rows[other.rows["partition"] >= SUMMARY_PARTITION]
    assert len(summaries) == 4
    report = compare(spec, base, other)
    assert report.exact, report.text()


@pytest.mark.parametrize("unaligned", [False, True])
def test_stop_with_savepoint_on_spark_resumes_exactly(
    sc: Any, tmp_path: Path, unaligned: bool
) -> None:
    """A stop without drain reaches the sources in the Spark workers (unaligned: the
    savepoint's barrier and the tasks' suspension travel over the control
    connections); the savepoint it leaves resumes (here on the local executor) with
    every record committed once."""
    from spillover.config import Config
    from spillover.deploy.local import LocalExecutor
    from spillover.verify.output import read_output

    out = tmp_path / "out"

    # Paced to 20 s on Spark, so the stop lands while the sources still run however
    # loaded the machine (at 4,000 records/s one run under load ended first); the
    # savepoint resumes unpaced (the rate is no part of its state or topology).
    def job(rate: float | None = 1_000) -> StreamEnvironment:
        env = StreamEnvironment("stop-on-spark", parallelism=2, max_parallelism=128)
        env.from_source(
            GeneratorSource(
                partitions=2, records_per_partition=20_000, payload_bytes=16, rate_per_subtask=rate
            ),
            uid="source",
        ).rebalance().sink(ParquetSink(str(out)), uid="sink")
        return env

    cfg = Config.from_dict(
        {"execution.checkpointing.interval": "100 ms", "state.checkpoints.dir": str(tmp_path)}
    )
    ex = SparkExecutor(job(), cfg)

    def stop() -> None:
        while not ex.completed_ids():
            time.sleep(0.01)
        ex.stop_with_savepoint(drain=False, unaligned=unaligned)

    stopper = threading.Thread(target=stop, daemon=True)
    stopper.start()
    result = ex.run(timeout=300)
    stopper.join()
    assert result.status == "stopped" and result.savepoint is not None, result
    stops = [c for c in result.checkpoints if c["savepoint"]]
    assert stops and stops[-1]["status"] == "completed", result.checkpoints
    first = read_output(str(out))
    assert 0 < len(first) < 40_000, "stopped while the job ran"
    resumed = LocalExecutor(job(None), cfg, restore_checkpoint=result.savepoint).run(timeout=120)
    assert resumed.status == "finished"
    rows = read_output(str(out))
    ids = rows["partition"] * 1_000_000 + rows["seq"]
    assert len(ids) == len(set(ids.tolist())) == 40_000


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault",
    ["data:reset:after=40:worker=1", "data:stall:after=40:worker=0", "control:stall:after=4"],
)
def test_a_connection_reset_or_stalled_fails_over_and_output_is_exact(
    sc: Any, tmp_path: Path, fault: str
) -> None:
    """A TCP data connection between workers reset or stalled, or a worker's control
    connection stalled: the attempt fails (a stall once ``heartbeat.timeout`` passed
    in silence), the job restarts from its latest checkpoint, and the committed
    output equals a failure-free local run's: no hang, no gap."""
    from spillover.runtime.network.tcp.faults import NetworkFault
    from spillover.verify.chaos import run_with_network_fault

    out = run_with_network_fault(str(tmp_path), NetworkFault.parse(fault))
    assert out["status"] == "finished" and out["attempts"] == 2, out
    assert out["exact"], out["report"]
    # A reset is seen as a peer's end gone; a stall only as its silence.
    why = ("reset", "closed the connection") if "reset" in fault else ("nothing heard",)
    assert any(w in out["failures"][0] for w in why), out["failures"]
