"""A drained stop commits every record its sources emitted before the drain ended
them, once: the check holds the committed output against the sources' positions in
the savepoint, so it finds a lost tail, and chaos scenario ``29-60`` (a drain asked
as an operator failure struck, under storage faults and a commit failure, that
committed nothing) is held to it: its sources had emitted nothing that survived."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from spillover.chaos.faults import Faults, enospc, faulty_dir
from spillover.runtime.failures import FailureInjector, FailureSpec
from spillover.verify import VerifySpec
from spillover.verify.output import _commit_order, output_of
from spillover.verify.run import _TwoRuns, compare_drained, run_once, run_stopped


def test_the_check_of_a_drain_finds_the_tail_it_lost(tmp_path: Path) -> None:
    """A real drained run is exact; with its last committed file gone (the tail of
    a drain lost), the same check reports exactly that file's records lost."""
    spec = VerifySpec(topology="pipeline", parallelism=1, records=8000, stop="drain")
    base = run_once(spec, str(tmp_path), "baseline", FailureInjector(), executor="local")
    half = 0.5 * base.result.duration_s
    drained = run_stopped(spec, str(tmp_path), "with-stop", FailureInjector(), half)
    report = compare_drained(spec, base, drained)
    assert report.exact and report.records > 0, report.text()
    assert report.drain_emitted == report.records

    assert drained.out_dir is not None
    files = sorted(
        (f for f in os.listdir(drained.out_dir) if f.endswith(".parquet")), key=_commit_order
    )
    last = os.path.join(drained.out_dir, files[-1])
    tail = output_of(spec, drained.result, drained.out_dir, base.max_parallelism).rows
    os.remove(last)
    kept = output_of(spec, drained.result, drained.out_dir, base.max_parallelism)
    lost_rows = len(tail) - len(kept.rows)
    assert lost_rows > 0
    report = compare_drained(spec, base, kept)
    assert not report.exact
    assert len(report.lost) == min(lost_rows, 1000)
    assert report.drain_emitted == len(tail)


class _ClosesFail:
    """ENOSPC on the next ``count`` closes of checkpoint files once armed (29-60's
    storage fault: "close ENOSPC for 42")."""

    def __init__(self, count: int) -> None:
        self.count, self.armed = count, threading.Event()
        self.lock = threading.Lock()

    def __call__(self, op: str, path: str) -> BaseException | None:
        if op != "close" or "/chk-" not in path or not self.armed.is_set():
            return None
        with self.lock:
            if self.count <= 0:
                return None
            self.count -= 1
        return enospc()


def test_a_drain_asked_as_the_job_fails_commits_what_its_sources_emitted(tmp_path: Path) -> None:
    """Chaos 29-60, its timing forced: ``finishing`` at parallelism 3, aligned
    checkpoints every 20 ms with up to 4 concurrent; the drained stop is asked as an
    operator failure strikes (so the next attempt, restored from a checkpoint that
    may precede every record, drains at once), 42 closes of checkpoint files fail
    with ENOSPC from then on, and a commit failure strikes the next notification (the
    drain's savepoint's, or one before it). The job ends finished with a savepoint,
    and it committed once every record its sources emitted by then (their positions
    in the savepoint; in 29-60, none), and nothing else."""
    closes = _ClosesFail(42)
    faults = Faults(rules=[closes])
    with faulty_dir(str(tmp_path / "checkpoints"), scheme="drainfault", faults=faults) as (uri, _):
        spec = VerifySpec(
            topology="finishing",
            parallelism=3,
            records=8000,
            failures=2,
            seed=29 * 1_000_003 + 60,
            interval_ms=20,
            policy="aligned",
            stop="drain",
            checkpoint_dir=uri,
            options={
                "execution.checkpointing.max-concurrent-checkpoints": 4,
                "execution.checkpointing.tolerable-failed-checkpoints": 1_000_000,
                "restart-strategy.fixed-delay.attempts": 22,
            },
        )
        base = run_once(spec, str(tmp_path), "baseline", FailureInjector(), executor="local")
        failures = FailureInjector(
            [FailureSpec("operator", "windows", 1, after_records=257), FailureSpec("commit")]
        )
        struck = threading.Event()
        failures.on_fire = lambda index, attempt: struck.set() if index == 0 else None
        runs = _TwoRuns(spec, str(tmp_path), "with-stop", failures, hold_end_s=30.0)

        def stop() -> None:
            if struck.wait(120):
                closes.armed.set()
                runs.first.stop_with_savepoint(drain=True)

        stopper = threading.Thread(target=stop, daemon=True)
        stopper.start()
        first = runs.first.run(timeout=300)
        stopper.join()
        assert first.status == "finished" and first.savepoint, first.failures
        faults.disarm()
        out = runs.resume(first, first.savepoint, spec.parallelism)
        out.result.savepoint = first.savepoint
        assert out.result.status == "finished", out.result.failures
        report = compare_drained(spec, base, out)  # reads the savepoint's positions
    assert [f.point for f in failures.fired][:1] == ["operator"]
    assert report.exact, report.text()
    assert report.drain_emitted == report.records
    if not report.records:  # as in 29-60: restarted before any checkpoint held a record
        assert report.vacuous()[0].startswith("Vacuous: the drain ended the sources before")
