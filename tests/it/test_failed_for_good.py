"""A run whose restart strategy is exhausted fails for good, but loses nothing it
committed: ``spillover verify`` restores it from its latest checkpoint, runs it to
the end without failures and compares the whole output exactly, still calling the
run not exact (it did not survive its failures)."""

from __future__ import annotations

from pathlib import Path

from spillover.runtime.failures import FailureInjector, FailureSpec
from spillover.verify import VerifySpec
from spillover.verify.compare import compare
from spillover.verify.run import run_once, run_stopped


def test_a_run_that_fails_for_good_lost_nothing_it_committed(tmp_path: Path) -> None:
    spec = VerifySpec(
        topology="pipeline",
        parallelism=1,
        records=16000,
        failures=2,
        interval_ms=20,
        policy="aligned",
        # One restart for two failures: the second ends the run.
        options={"restart-strategy.fixed-delay.attempts": 1},
    )
    base = run_once(spec, str(tmp_path), "baseline", FailureInjector(), executor="local")
    failures = FailureInjector(
        [
            FailureSpec("operator", "running-total", after_records=6000),
            FailureSpec("operator", "running-total", after_records=6000),
        ]
    )
    out = run_once(spec, str(tmp_path), "with-failures", failures)
    assert len(failures.fired) == 2
    assert out.result.status == "failed" and out.finished_status == "finished"
    assert out.finished_from is not None
    report = compare(spec, base, out)
    assert not report.exact
    assert not report.lost and not report.duplicated and not report.unexpected
    assert not report.reordered and not report.wrong_totals and not report.state_mismatch
    assert any("failed for good" in e for e in report.errors), report.text()
    assert report.vacuous() == []


def test_a_run_that_fails_for_good_before_its_drain_lost_nothing_it_committed(
    tmp_path: Path,
) -> None:
    """The drain is due only once every failure fired, and the last one ends the run:
    the drain never comes, and the run finished from its latest checkpoint is
    compared whole."""
    spec = VerifySpec(
        topology="pipeline",
        parallelism=1,
        records=16000,
        failures=2,
        interval_ms=20,
        policy="aligned",
        stop="drain",
        options={"restart-strategy.fixed-delay.attempts": 1},
    )
    base = run_once(spec, str(tmp_path), "baseline", FailureInjector(), executor="local")
    failures = FailureInjector(
        [
            FailureSpec("operator", "running-total", after_records=4000),
            FailureSpec("operator", "running-total", after_records=4000),
        ]
    )
    out = run_stopped(spec, str(tmp_path), "with-stop", failures, stop_after=120.0)
    assert out.result.savepoint is None and out.finished_from is not None
    assert out.result.status == "failed" and out.finished_status == "finished"
    report = compare(spec, base, out)
    assert not report.lost and not report.duplicated and not report.unexpected
    assert any("nothing it had committed lost" in e for e in report.errors), report.text()
