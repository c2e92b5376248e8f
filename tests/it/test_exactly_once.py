"""Whole jobs with induced failures: exact output, and a verdict that sees loss."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from spillover.verify import VerifySpec, verify

# --- exactly-once with induced failures ----------------------------------------------------------


@pytest.mark.parametrize("topology", ["pipeline", "multi-input", "union"])
def test_exactly_once_with_five_induced_failures(topology: str, tmp_path: Path) -> None:
    spec = VerifySpec(
        topology=topology,
        parallelism=2,
        records=60_000,
        failures=5,
        seed=7,
        rate_per_subtask=40_000,
        interval_ms=60,
    )
    report = verify(spec, str(tmp_path))
    assert report.exact, report.text()
    assert len(report.failures_fired) == 5, report.text()
    kinds = {f.split(" ")[0] for f in report.failures_fired}
    assert kinds == {"operator", "commit", "restore", "snapshot"}
    assert report.checkpoints_completed >= 2
    assert report.records == spec.records * (2 if topology != "pipeline" else 1)


def test_verify_detects_loss(tmp_path: Path) -> None:
    """The comparison must be able to fail: drop committed rows and it says which."""
    from spillover.runtime.failures import FailureInjector
    from spillover.verify import compare, run_once

    spec = VerifySpec(records=4000, failures=0, rate_per_subtask=None)
    base = run_once(spec, str(tmp_path), "a", FailureInjector())
    other = run_once(spec, str(tmp_path), "b", FailureInjector())
    assert compare(spec, base, other).exact
    other.rows = np.concatenate([other.rows[10:], other.rows[10:13]])
    report = compare(spec, base, other)
    assert not report.exact
    assert len(report.lost) == 10 and len(report.duplicated) == 3
    assert "lost" in report.text() and "duplicated" in report.text()
