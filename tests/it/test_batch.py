"""Batch execution (execution.runtime-mode: batch): the same result as streaming,
stage by stage through result files the engine writes; a failed task re-runs only
its region; a lost or corrupt result re-runs only its producer; a restarted master
re-runs only what had not finished, and a reused result damaged inside is found by
its reader."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from spillover.config import Config
from spillover.deploy import create_executor
from spillover.errors import ConfigError, SpilloverError
from spillover.runtime.batch.results import ResultHandle
from spillover.runtime.connectors import GeneratorSource
from spillover.runtime.failures import FailureInjector, FailureSpec
from spillover.runtime.jobevents import EVENTS_DIR, JobEventLog
from spillover.verify import VerifySpec, verify
from support.batch_jobs import (
    SplitlessSource,
    batch_config,
    expected,
    finished_in_log,
    job,
    source,
    source_kwargs,
    staged_job,
    totals,
)


def test_a_batch_job_gives_the_streaming_result(tmp_path: Path) -> None:
    ex = create_executor("local", job(tmp_path / "streaming"), Config())
    assert ex.run(timeout=120).status == "finished"
    ex = create_executor("local", job(tmp_path / "batch"), batch_config(tmp_path))
    result = ex.run(timeout=120)
    assert result.status == "finished", result.failures
    assert totals(tmp_path / "batch") == totals(tmp_path / "streaming") == expected()
    assert {m["runs"] for m in result.tasks.values()} == {1.0}
    # the run's result files are gone once it finished
    assert not list((tmp_path / "ckpt" / "batchjob").glob("*/results"))


def test_a_failed_consumer_re_runs_only_its_region(tmp_path: Path) -> None:
    failures = FailureInjector([FailureSpec("operator", "sum", 1, after_records=100)])
    ex = create_executor("local", job(tmp_path / "out"), batch_config(tmp_path), failures=failures)
    result = ex.run(timeout=120)
    assert result.status == "finished", result.failures
    assert totals(tmp_path / "out") == expected()
    runs = {name: m["runs"] for name, m in result.tasks.items()}
    assert runs == {"src#0": 1, "src#1": 1, "sum#0": 1, "sum#1": 2}
    assert len(result.failures) == 1


def _scheduler(tmp_path: Path, damage: Any) -> tuple[Any, Any]:
    """Runs the job's stages with ``damage(result file)`` applied to src#1's result
    as soon as src#1 finished (before any consumer reads it)."""
    from spillover.runtime.batch.scheduler import BatchScheduler
    from spillover.storage.location import Location

    done: list[Any] = []

    def on_finished(key: Any, results: Any) -> None:
        if key == ("src", 1) and not done:
            done.append(key)
            damage(Path(results[0].gate.uri))

    s = BatchScheduler(
        job(tmp_path / "out").build(),
        batch_config(tmp_path),
        results=Location.parse(str(tmp_path / "results")),
        run_id="0123456789abcdef",
        failures=FailureInjector(),
        flush_interval=0.005,
        on_finished=on_finished,
    )
    return s, s.run(deadline=None)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_deleted_result_re_runs_only_its_producer(tmp_path: Path) -> None:
    _, outcome = _scheduler(tmp_path, lambda p: p.unlink())
    assert outcome.error is None, outcome.failures
    assert totals(tmp_path / "out") == expected()
    assert outcome.runs[("src", 0)] == 1 and outcome.runs[("src", 1)] == 2
    assert all("src#1 cannot be read" in f for f in outcome.failures)


def test_a_corrupted_result_re_runs_only_its_producer(tmp_path: Path) -> None:
    _, outcome = _scheduler(tmp_path, _flip)
    assert outcome.error is None, outcome.failures
    assert totals(tmp_path / "out") == expected()
    assert outcome.runs[("src", 0)] == 1 and outcome.runs[("src", 1)] == 2
    assert all("src#1 cannot be read" in f for f in outcome.failures)


# ---- progress recovery ----------------------------------------------------------------


def test_a_failed_run_started_again_re_runs_only_what_had_not_finished(tmp_path: Path) -> None:
    cfg = batch_config(tmp_path, **{"restart-strategy.type": "none"})
    failures = FailureInjector([FailureSpec("operator", "sink", 0, after_records=1)])
    first = create_executor("local", staged_job(tmp_path / "out"), cfg, failures=failures).run(
        timeout=120
    )
    assert first.status == "failed"
    again = create_executor("local", staged_job(tmp_path / "out"), cfg).run(timeout=120)
    assert again.status == "finished", again.failures
    assert again.recovery is not None and "resuming batch run" in again.recovery
    assert again.run_id == first.run_id
    reused = {"src#0", "src#1", "sum#0", "sum#1"}
    assert reused <= set(again.reused_tasks)
    assert {k for k, m in again.tasks.items() if m["runs"] > 0} == {"sink#0", "sink#1"} - (
        set(again.reused_tasks)
    )
    assert totals(tmp_path / "out") == expected()
    # finished once: no task-finished record is repeated
    records = [(u, i) for u, i, _ in finished_in_log(tmp_path / "ckpt")]
    assert sorted(records) == sorted(set(records)) and len(records) == 6
    # a finished job is not run again
    third = create_executor("local", staged_job(tmp_path / "out"), cfg).run(timeout=120)
    assert third.already_finished and third.status == "finished"


class FailsOnceItsPeerFinished(GeneratorSource):
    """The staged job's source (with or without splits) whose subtask 1 fails once
    the log says subtask 0 finished: a source stage left part way, whatever the
    timing."""

    def __init__(self, ckpt: Path, splits: bool) -> None:
        super().__init__(**source_kwargs(), keys=500)
        self.ckpt, self.splits = ckpt, splits

    def splits_of(self, subtask: int, parallelism: int) -> tuple[str, ...] | None:
        return super().splits_of(subtask, parallelism) if self.splits else None

    def on_timer(self) -> bool:
        if self.ctx.subtask_index == 1:
            deadline = time.monotonic() + 60
            while ("src", 0) not in _logged(self.ckpt):
                assert time.monotonic() < deadline, "src#0 did not finish"
                time.sleep(0.01)
            raise RuntimeError("src#1 fails once src#0 finished")
        return super().on_timer()


@pytest.mark.parametrize("splits", [True, False], ids=["source-with-splits", "splitless-source"])
def test_a_source_left_part_way_is_reused_only_if_it_can_say_its_splits(
    tmp_path: Path, splits: bool
) -> None:
    """Flink's SupportsBatchSnapshot: a restarted master reuses a finished source
    subtask only if the log holds its source's split assignment (the unfinished
    subtasks then read exactly theirs); otherwise the source stage runs again whole,
    and so does whatever read it. Both give the exact output."""
    cfg = batch_config(tmp_path, **{"restart-strategy.type": "none"})
    failing = FailsOnceItsPeerFinished(tmp_path / "ckpt", splits)
    first = create_executor("local", staged_job(tmp_path / "out", gen=failing), cfg).run(
        timeout=120
    )
    assert first.status == "failed"
    assert ("src", 0) in _logged(tmp_path / "ckpt")
    gen = source() if splits else SplitlessSource(**source_kwargs(), keys=500)
    again = create_executor("local", staged_job(tmp_path / "out", gen=gen), cfg).run(timeout=120)
    assert again.status == "finished", again.failures
    assert totals(tmp_path / "out") == expected()
    runs = {name: m["runs"] for name, m in again.tasks.items()}
    assert again.recovery is not None and "resuming batch run" in again.recovery
    if splits:
        assert runs["src#0"] == 0 and "src#0" in again.reused_tasks
        assert "runs again whole" not in again.recovery
    else:
        assert runs["src#0"] == 1 and not again.reused_tasks
        assert "source 'src' runs again whole: 1 of its 2 subtasks finished" in again.recovery
    assert runs["src#1"] == 1


def _flip_trailer(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-40] ^= 0x01  # the trailer's frame count
    path.write_bytes(bytes(data))


def test_a_damaged_result_end_found_on_restart_re_runs_just_its_producer(
    tmp_path: Path,
) -> None:
    """A restart checks each reused result at its ends (no frame read): a damaged
    trailer is found there, before any task runs."""
    cfg = batch_config(tmp_path, **{"restart-strategy.type": "none"})
    failures = FailureInjector([FailureSpec("operator", "sum", 0, after_records=1)])
    first = create_executor("local", staged_job(tmp_path / "out"), cfg, failures=failures).run(
        timeout=120
    )
    assert first.status == "failed"
    (path,) = [p for p in (tmp_path / "ckpt" / "staged").glob("*/results/src-00001-*/out-*.spill")]
    _flip_trailer(path)
    again = create_executor("local", staged_job(tmp_path / "out"), cfg).run(timeout=120)
    assert again.status == "finished", again.failures
    assert again.recovery is not None and "src#1 runs again" in again.recovery
    assert again.tasks["src#0"]["reused"] == 1 and again.tasks["src#0"]["runs"] == 0
    assert again.tasks["src#1"]["runs"] == 1
    assert totals(tmp_path / "out") == expected()


def test_a_rescaled_restart_reads_finished_results_by_key_group(tmp_path: Path) -> None:
    cfg = batch_config(tmp_path, **{"restart-strategy.type": "none"})
    failures = FailureInjector([FailureSpec("operator", "sum", 0, after_records=1)])
    first = create_executor(
        "local", staged_job(tmp_path / "out", sum_parallelism=2), cfg, failures=failures
    ).run(timeout=120)
    assert first.status == "failed"
    # the sum stage at 3 reads the sources' files, written for 2, by key group
    again = create_executor("local", staged_job(tmp_path / "out", sum_parallelism=3), cfg).run(
        timeout=120
    )
    assert again.status == "finished", again.failures
    assert {"src#0", "src#1"} <= set(again.reused_tasks)
    assert {again.tasks[f"sum#{i}"]["runs"] for i in range(3)} == {1.0}
    assert totals(tmp_path / "out") == expected()


# ---- a killed driver -------------------------------------------------------------------


def _drive(out: str, ckpt: str) -> None:
    """A child driver: the staged job with a slow last stage."""
    cfg = batch_config(Path(ckpt).parent)
    create_executor("local", staged_job(Path(out), sink_rate=1000.0), cfg).run(timeout=300)


def _logged(ckpt: Path) -> set[tuple[str, int]]:
    try:
        return {(u, i) for u, i, _ in finished_in_log(ckpt)}
    except (OSError, SpilloverError):
        return set()  # not written yet


def _kill_when(tmp_path: Path, point: set[tuple[str, int]]) -> set[tuple[str, int]]:
    """Starts a child driver and SIGKILLs it once the log says every task of
    ``point`` finished; returns what the log said had finished then."""
    ctx = multiprocessing.get_context("spawn")
    ckpt = tmp_path / "ckpt"
    child = ctx.Process(target=_drive, args=(str(tmp_path / "out"), str(ckpt)))
    child.start()
    try:
        deadline = time.monotonic() + 120
        while not point <= (done := _logged(ckpt)):
            assert child.is_alive(), "the driver ended before the kill point"
            assert time.monotonic() < deadline, f"no kill point after 120 s: {done}"
            time.sleep(0.02)
    finally:
        os.kill(child.pid or 0, signal.SIGKILL)
        child.join()
    return done


def test_a_driver_killed_between_and_during_stages_re_runs_only_the_unfinished(
    tmp_path: Path,
) -> None:
    sources = {("src", 0), ("src", 1)}
    sums = {("sum", 0), ("sum", 1)}
    at_first = _kill_when(tmp_path, sources)  # the sources' stage is over
    assert sources <= at_first and not {("sink", 0), ("sink", 1)} & at_first
    at_second = _kill_when(tmp_path, sums)  # the last stage runs
    assert sources | sums <= at_second
    cfg = batch_config(tmp_path)
    last = create_executor("local", staged_job(tmp_path / "out", 1000.0), cfg).run(timeout=300)
    assert last.status == "finished", last.failures
    assert totals(tmp_path / "out") == expected()
    # finished tasks never ran again: each is logged finished once, by the start
    # that ran it, and the last start reused them
    records = [(u, i) for u, i, _ in finished_in_log(tmp_path / "ckpt")]
    assert sorted(records) == sorted(set(records))
    assert {f"{u}#{i}" for u, i in at_second} <= set(last.reused_tasks)
    for name in last.reused_tasks:
        assert last.tasks[name]["runs"] == 0
    assert last.recovery is not None and "resuming batch run" in last.recovery


def test_a_result_corrupted_inside_after_a_kill_re_runs_only_its_producer(
    tmp_path: Path,
) -> None:
    """A frame damaged inside a reused result passes the restart's check of the file's
    ends; the consumer reading it finds it by its checksum, fails (its output is not
    kept), and only the damaged result's producer runs again: exact output."""
    sources = {("src", 0), ("src", 1)}
    sums = {("sum", 0), ("sum", 1)}
    at_kill = _kill_when(tmp_path, sources | sums)  # the sinks' stage runs
    assert not {("sink", 0), ("sink", 1)} & at_kill
    log = JobEventLog.open(tmp_path / "ckpt" / "staged" / EVENTS_DIR)
    (h,) = [ResultHandle.from_dict(r) for r in log.replay().finished_tasks[("sum", 1)].results]
    start, end = h.gate.channel_ranges[0]  # what sink#0 reads of sum#1's result
    path = Path(h.gate.uri)
    data = bytearray(path.read_bytes())
    data[(start + end) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    cfg = batch_config(tmp_path, **{"restart-strategy.type": "none"})
    last = create_executor("local", staged_job(tmp_path / "out", 1000.0), cfg).run(timeout=300)
    assert last.status == "finished", last.failures
    assert totals(tmp_path / "out") == expected()
    assert last.recovery is not None and "4 of 6 task(s) finished and are reused" in last.recovery
    runs = {name: m["runs"] for name, m in last.tasks.items()}
    assert runs["src#0"] == runs["src#1"] == runs["sum#0"] == 0  # reused, never re-run
    assert runs["sum#1"] == 1  # the damaged result's producer, once
    assert last.failures and all("sum#1 cannot be read" in f for f in last.failures)
    # its first reader found the damaged frame: restart-strategy none did not end the job
    assert any("sink#0" in f and "checksum" in f for f in last.failures)


# ---- spillover verify in batch mode --------------------------------------------------------


def test_verify_a_batch_run_with_task_failures(tmp_path: Path) -> None:
    spec = VerifySpec(
        records=20_000, rate_per_subtask=None, failures=3, runtime_mode="batch", seed=3
    )
    report = verify(spec, str(tmp_path))
    assert report.exact, report.text()


def test_verify_a_batch_run_whose_driver_is_killed(tmp_path: Path) -> None:
    spec = VerifySpec(
        records=20_000, rate_per_subtask=5_000.0, failures=0, runtime_mode="batch", kill_driver=3
    )
    report = verify(spec, str(tmp_path))
    assert report.exact, report.text()
    assert len(report.driver_starts) >= 2
    assert all("finished tasks in the log" in s for s in report.driver_starts)


def test_a_batch_verify_cannot_stop_or_rescale() -> None:
    with pytest.raises(ConfigError, match="batch run cannot be stopped"):
        VerifySpec(runtime_mode="batch", stop="savepoint").check()
    with pytest.raises(ConfigError, match="unknown runtime mode"):
        VerifySpec(runtime_mode="bulk").check()
