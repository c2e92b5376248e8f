"""A job master that survives its own death: driver processes SIGKILLed at random
points and started again with the same command resume the run exactly; a finished
job is not run again; a second master is refused; half-written checkpoints of a
dead driver are skipped, deleted, and their ids never reused."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from spillover.config import Config
from spillover.deploy import create_executor
from spillover.errors import ConfigError, SpilloverError
from spillover.runtime.connectors import GeneratorSource, ParquetSink
from spillover.runtime.failures import FailureInjector
from spillover.runtime.graph import StreamEnvironment
from spillover.runtime.jobevents import (
    EVENTS_DIR,
    CheckpointCompleted,
    GenerationStarted,
    JobEventLog,
    JobLease,
    LeaseHeldError,
    LeaseHolder,
)
from spillover.verify import VerifySpec, compare, run_once
from spillover.verify.driver import run_killing_the_driver

SLOW_SPEC: dict[str, Any] = {
    "topology": "pipeline",
    "parallelism": 2,
    "failures": 0,
    "interval_ms": 100,
}


def _spec(policy: str, records: int = 40_000, **kw: Any) -> VerifySpec:
    """A pipeline of a few seconds: long enough to be killed part way."""
    options: dict[str, Any] = {**SLOW_SPEC, "rate_per_subtask": 10_000.0, **kw}
    return VerifySpec(records=records, policy=policy, **options)


def _killed_exactly(spec: VerifySpec, tmp_path: Path, kills: int, seed: int, **kw: Any) -> Any:
    base = run_once(spec, str(tmp_path), "baseline", FailureInjector(), executor="local")
    out, starts = run_killing_the_driver(spec, str(tmp_path), "killed", kills, seed=seed, **kw)
    report = compare(spec, base, out)
    assert report.exact, report.text() + "\n" + "\n".join(s.describe() for s in starts)
    return out, starts


def _log(tmp_path: Path, name: str = "killed") -> JobEventLog:
    return JobEventLog.open(tmp_path / name / "checkpoints" / name / EVENTS_DIR)


def _check_ids_never_reused(log: JobEventLog) -> None:
    """Checkpoint ids only grow, and every generation starts above every id logged
    before it and at or above the previous generation's first id."""
    logged, first = 0, 0
    for e in log.events():
        if isinstance(e, CheckpointCompleted):
            assert e.checkpoint_id > logged, (e, logged)
            logged = e.checkpoint_id
        elif isinstance(e, GenerationStarted):
            assert e.first_checkpoint_id > logged and e.first_checkpoint_id >= first, e
            first = e.first_checkpoint_id


def _outlasting(kills: int) -> int:
    """Records per source that the paced job (10,000 records/s per subtask, two
    subtasks) cannot finish within ``kills`` killed starts: a random kill comes at
    most 3.4 s after its start, the other points sooner (at a checkpoint), whatever
    the machine's speed, so every kill lands while the job still runs."""
    return int((kills * 3.4 + 2) * 20_000)


def test_a_driver_killed_at_random_points_resumes_exactly(tmp_path: Path) -> None:
    spec = _spec("unaligned", records=_outlasting(4))
    out, starts = _killed_exactly(spec, tmp_path, kills=4, seed=3)
    assert sum(s.killed for s in starts) == 4
    assert out.result.status == "finished"
    assert out.result.recovery is not None and "resuming run" in out.result.recovery
    _check_ids_never_reused(_log(tmp_path))


@pytest.mark.parametrize("point", ["unlogged", "logged", "restoring"])
def test_a_driver_killed_inside_the_master_resumes_exactly(point: str, tmp_path: Path) -> None:
    """Between a checkpoint's metadata and its log record (that checkpoint is not
    restored: the tasks never heard of it), between the record and the tasks'
    notification (it is restored; its commits happen on restore), and while tasks
    restore a checkpoint."""
    points = ("after-checkpoint", point) if point == "restoring" else (point,)
    _, starts = _killed_exactly(
        _spec("unaligned"), tmp_path, kills=len(points), seed=1, points=points, cycle=True
    )
    assert [s.killed for s in starts] == [True] * len(points) + [False], starts
    log = _log(tmp_path)
    _check_ids_never_reused(log)
    if point == "unlogged":
        # The killed start wrote a checkpoint's metadata after its first logged one
        # and died before logging it: deleted on resume, its id not reused.
        logged = starts[0].checkpoint_after
        gens = [e for e in log.events() if isinstance(e, GenerationStarted)]
        assert len(gens) == 2 and gens[1].first_checkpoint_id >= logged + 2
        job = tmp_path / "killed" / "checkpoints" / "killed"
        left = [int(d.name[4:]) for d in job.glob("chk-*")]
        assert not [c for c in left if logged < c < gens[1].first_checkpoint_id], left


def test_a_resumed_master_deletes_what_its_dead_master_subsumed(tmp_path: Path) -> None:
    """Killed between its second checkpoint's log record and the tasks' notification,
    the master never deleted the first one, which the second subsumed (retention 1):
    the next master takes over the dead one's retention and deletes it with the rest
    of the dead master's, once its own checkpoints subsume them (how many a run ends
    with depends on the timing of its last ones, killed or not: not compared)."""
    _, starts = _killed_exactly(
        _spec("unaligned"), tmp_path, kills=1, seed=1, points=("logged",), cycle=True
    )
    assert [s.killed for s in starts] == [True, False], starts

    def complete(name: str) -> list[int]:
        job = tmp_path / name / "checkpoints" / name
        return sorted(int(d.name[4:]) for d in job.glob("chk-*") if (d / "_metadata").exists())

    killed = complete("killed")
    assert killed and min(killed) > starts[0].checkpoint_after, (killed, starts[0].describe())


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["aligned", "unaligned", "timeout", "max-inflight"])
def test_many_driver_kills_under_every_policy(policy: str, tmp_path: Path) -> None:
    """Six kills per policy, 24 over the four: every run exact."""
    spec = _spec(policy, records=_outlasting(6))
    _, starts = _killed_exactly(spec, tmp_path, kills=6, seed=11)
    assert sum(s.killed for s in starts) == 6
    _check_ids_never_reused(_log(tmp_path))


@pytest.mark.slow
def test_a_spark_driver_killed_twice_resumes_exactly(tmp_path: Path) -> None:
    spec = _spec("unaligned", records=60_000, executor="spark")
    _, starts = _killed_exactly(
        spec, tmp_path, kills=2, seed=2, points=("after-checkpoint", "logged")
    )
    assert sum(s.killed for s in starts) == 2


# --- one master per job, finished jobs, starting over ---------------------------------


def _job(out: Path, records: int = 4000, *, mode: str = "error", rate: float | None = None) -> Any:
    env = StreamEnvironment("job", parallelism=2)
    gen = GeneratorSource(
        partitions=4, records_per_partition=records // 4, payload_bytes=16, rate_per_subtask=rate
    )
    env.from_source(gen, uid="src").sink(ParquetSink(str(out), mode=mode), uid="sink")
    return env


def _config(ckpt: Path, **extra: Any) -> Config:
    return Config.from_dict(
        {"state.checkpoints.dir": str(ckpt), "execution.checkpointing.interval": "50 ms", **extra}
    )


def _rows(out: Path) -> np.ndarray[Any, Any]:
    """The committed records' ids (partition and seq), sorted."""
    t = pq.read_table(str(out))
    ids = t.column("partition").to_numpy().astype(np.int64) * 10**9 + t.column("seq").to_numpy()
    return np.sort(ids)


def test_a_finished_job_is_not_run_again_and_can_start_over(tmp_path: Path) -> None:
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    first = create_executor("local", _job(out), _config(ckpt)).run(timeout=120)
    assert first.status == "finished" and not first.already_finished
    rows = _rows(out)
    again = create_executor("local", _job(out), _config(ckpt)).run(timeout=120)
    assert again.status == "finished" and again.already_finished and again.attempts == 0
    assert again.recovery is not None and "already finished" in again.recovery
    assert "execution.job-recovery.enabled: false" in again.recovery
    assert again.run_id == first.run_id
    np.testing.assert_array_equal(_rows(out), rows)  # nothing ran
    # Starting over into the same output is refused unless asked to overwrite.
    fresh = _config(ckpt, **{"execution.job-recovery.enabled": "false"})
    refused = create_executor("local", _job(out), fresh).run(timeout=120)
    assert refused.status == "failed"
    assert "committed output of another run" in refused.failures[-1]
    np.testing.assert_array_equal(_rows(out), rows)
    over = create_executor("local", _job(out, mode="overwrite"), fresh).run(timeout=120)
    assert over.status == "finished" and over.run_id != first.run_id
    assert over.recovery is not None and "fresh run" in over.recovery
    np.testing.assert_array_equal(_rows(out), rows)  # the same records once, not twice


def test_append_keeps_both_runs_output(tmp_path: Path) -> None:
    out = tmp_path / "out"
    create_executor("local", _job(out), _config(tmp_path / "a")).run(timeout=120)
    create_executor("local", _job(out, mode="append"), _config(tmp_path / "b")).run(timeout=120)
    seqs = _rows(out)
    assert len(seqs) == 2 * 4000 and len(np.unique(seqs)) == 4000


def test_a_sink_mode_must_be_known() -> None:
    with pytest.raises(ConfigError, match="unknown ParquetSink mode"):
        ParquetSink("/tmp/x", mode="replace")


def _hold(ckpt: str, out: str, ready: Any) -> None:
    ex = create_executor("local", _job(Path(out), 10**8, rate=1000.0), _config(Path(ckpt)))
    ready.set()
    ex.run(timeout=120)


def test_a_second_master_of_a_running_job_is_refused(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=_hold, args=(str(tmp_path / "ckpt"), str(tmp_path / "out"), ready))
    child.start()
    try:
        events = tmp_path / "ckpt" / "job" / EVENTS_DIR
        lease = events / "_lease"
        deadline = time.monotonic() + 120
        while not lease.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lease.exists()
        # The lease comes before the log's first record: wait until the log names the
        # run, or a master killed before that left no run to resume.
        while JobEventLog.open(events).replay().submitted is None:
            assert time.monotonic() < deadline, "the child never logged its run"
            time.sleep(0.05)
        with pytest.raises(LeaseHeldError, match="another master runs this job") as e:
            create_executor("local", _job(tmp_path / "out2"), _config(tmp_path / "ckpt")).run()
        assert f"pid {child.pid}" in str(e.value)
    finally:
        os.kill(child.pid or 0, signal.SIGKILL)
        child.join()
    # Its process is gone: the next master takes the lease over at once and resumes.
    r = create_executor("local", _job(tmp_path / "out", 2000), _config(tmp_path / "ckpt")).run(
        timeout=60, stop_after=1.0
    )
    assert r.recovery is not None and "its previous master died" in r.recovery


def test_a_stale_lease_of_another_host_is_taken_over_after_expiry(tmp_path: Path) -> None:
    events = tmp_path / "ckpt" / "job" / EVENTS_DIR
    events.mkdir(parents=True)
    elsewhere = LeaseHolder("elsewhere", 1, "t" * 32)
    JobLease(events, ttl_s=3600, holder=elsewhere).acquire()
    cfg = _config(tmp_path / "ckpt")
    with pytest.raises(LeaseHeldError, match="elsewhere pid 1"):
        create_executor("local", _job(tmp_path / "out"), cfg).run(timeout=60)
    # The same holder's lease, renewed for the last time an hour ago: expired.
    JobLease(events, ttl_s=60, holder=elsewhere, clock=lambda: time.time() - 3600).acquire()
    r = create_executor("local", _job(tmp_path / "out"), cfg).run(timeout=60)
    assert r.status == "finished"


def test_an_unreadable_log_refuses_to_resume(tmp_path: Path) -> None:
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    create_executor("local", _job(out, 10**7, rate=20_000.0), _config(ckpt)).run(
        timeout=60,
        stop_when=lambda history: sum(c["status"] == "completed" for c in history) >= 2,
    )
    segments = sorted((ckpt / "job" / EVENTS_DIR).glob("events-*.log"))
    assert len(segments) >= 3
    middle = segments[1]
    data = bytearray(middle.read_bytes())
    data[len(data) // 2] ^= 0xFF
    middle.write_bytes(bytes(data))
    with pytest.raises(SpilloverError) as e:
        create_executor("local", _job(out), _config(ckpt)).run(timeout=60)
    assert middle.name in str(e.value)


# --- a driver that dies during a stop-with-savepoint ----------------------------------


def _start(tmp_path: Path, *args: Any, **kw: Any) -> tuple[int, Any]:
    """One start of the child driver: its exit code and its result (None if killed)."""
    import multiprocessing
    import pickle

    from support.stop_driver import drive

    result_path = tmp_path / "result.pickle"
    result_path.unlink(missing_ok=True)
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=drive, args=(*args, str(result_path)), kwargs=kw)
    child.start()
    child.join(timeout=300)
    assert not child.is_alive(), "the driver hung"
    if not result_path.exists():
        return child.exitcode, None
    with open(result_path, "rb") as f:
        return child.exitcode, pickle.load(f)


def _killed_in_a_stop(
    tmp_path: Path, name: str, stop: str, kill_at: str
) -> tuple[VerifySpec, Any, tuple[Any, ...]]:
    """The failure-free run's output, and the job's first start killed during its
    ``stop`` at ``kill_at``; returns the spec, that output and the job's arguments."""
    spec = _spec("unaligned", records=_outlasting(1))
    base = run_once(spec, str(tmp_path), "baseline", FailureInjector(), executor="local")
    out, ckpt = tmp_path / name / "output", tmp_path / name / "checkpoints"
    out.mkdir(parents=True)
    job = (spec, str(out), name, str(ckpt))
    code, killed = _start(tmp_path, *job, stop=stop, kill_at=kill_at)
    assert killed is None and code == -signal.SIGKILL
    return spec, base, job


@pytest.mark.parametrize(
    ("stop", "kill_at"),
    [
        ("savepoint", "requested"),
        ("unaligned-savepoint", "savepoint"),
        pytest.param("savepoint", "savepoint", marks=pytest.mark.slow),
        pytest.param("unaligned-savepoint", "requested", marks=pytest.mark.slow),
    ],
)
def test_a_stop_survives_its_drivers_death(stop: str, kill_at: str, tmp_path: Path) -> None:
    """The driver dies once the stop is logged, or once its savepoint is: the next
    start, asked nothing, resumes the run and carries the stop out (the job ends
    ``stopped`` with a savepoint, and its log says the stop ended), and the job
    resumed from that savepoint ends exactly as a run without any of it."""
    from spillover.verify.output import output_of

    spec, base, job = _killed_in_a_stop(tmp_path, "stopped", stop, kill_at)
    out, ckpt = Path(job[1]), Path(job[3])
    log = JobEventLog.open(ckpt / "stopped" / EVENTS_DIR)
    pending = log.replay().stop
    assert pending is not None and pending.unaligned == (stop == "unaligned-savepoint")
    # Started again with the same command, but nobody asks it to stop.
    code, resumed = _start(tmp_path, *job, stop=None, kill_at=None)
    assert code == 0 and resumed is not None
    assert resumed.status == "stopped" and resumed.savepoint, resumed
    assert resumed.recovery is not None and "then it stops, as asked before" in resumed.recovery
    state = JobEventLog.open(ckpt / "stopped" / EVENTS_DIR).replay()
    assert state.stop is None and state.status == "cancelled"
    assert [c.command for c in state.commands] == ["stop"]
    # The savepoint resumes the job to its end, exactly.
    code, last = _start(tmp_path, *job, stop=None, kill_at=None, restore=resumed.savepoint)
    assert code == 0 and last is not None and last.status == "finished", last
    report = compare(spec, base, output_of(spec, last, str(out), base.max_parallelism))
    assert report.exact, report.text()


def test_a_drained_stop_survives_its_drivers_death(tmp_path: Path) -> None:
    """Killed once the drained stop is logged: the next start drains and finishes
    the job for good, every record its sources emitted committed once."""
    from spillover.verify.output import output_of
    from spillover.verify.run import compare_drained

    spec, base, job = _killed_in_a_stop(tmp_path, "drained", "drain", "requested")
    out = Path(job[1])
    code, resumed = _start(tmp_path, *job, stop=None, kill_at=None)
    assert code == 0 and resumed is not None
    assert resumed.status == "finished" and resumed.savepoint, resumed
    actual = output_of(spec, resumed, str(out), base.max_parallelism)
    assert 0 < len(actual.rows) < len(base.rows), "drained part way"
    # Every record the sources emitted (their positions in the savepoint), once.
    report = compare_drained(spec, base, actual)
    assert report.exact, report.text()
    # Started again, the job has nothing left to run.
    code, again = _start(tmp_path, *job, stop=None, kill_at=None)
    assert code == 0 and again is not None and again.already_finished, again
