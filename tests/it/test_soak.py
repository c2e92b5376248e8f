"""The soak's short version: a minute of whole jobs with checkpoints every 20 ms and
induced failures, every run exact, memory flat (``make soak`` runs ten minutes per
policy and executor)."""

from __future__ import annotations

from pathlib import Path

import pytest

from spillover.errors import ConfigError
from spillover.verify.soak import soak
from spillover.verify.topologies import POLICIES


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_a_short_soak_is_exact(policy: str, tmp_path: Path) -> None:
    # At least two runs however loaded the machine is: the count of runs is what the
    # test is about, not how many fit in the 15 s.
    report = soak(15.0, policy=policy, seed=7, records=10_000, workdir=str(tmp_path), min_runs=2)
    assert report.exact, report.text()
    assert report.runs >= 2 and report.failures_survived >= 4, report.text()
    assert report.checkpoints_completed > report.runs, report.text()


def test_a_soak_refuses_what_it_cannot_run() -> None:
    with pytest.raises(ConfigError, match="unknown policy"):
        soak(1.0, policy="sometimes")
    with pytest.raises(ConfigError, match="seconds > 0"):
        soak(0.0)
