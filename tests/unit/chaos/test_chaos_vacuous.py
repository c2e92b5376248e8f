"""A scenario whose run proved nothing (``Report.vacuous``: a failure during a drain
restored positions 0) runs again on fresh storage; only three such runs in a row
count as not exact, and a run that found something wrong is never run again."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import spillover.chaos.runner as runner
from spillover.chaos import scenario_for

_VACUOUS = "Vacuous: nothing was committed, so the comparison proved nothing"


@dataclass
class _Report:
    """What run_scenario reads of a verify report."""

    vacuous_reasons: list[str]
    errors: list[str] = field(default_factory=list)
    exact: bool = True
    records: int = 0
    attempts: int = 1
    checkpoints_completed: int = 1
    failures_fired: list[str] = field(default_factory=list)
    lost: list[Any] = field(default_factory=list)
    duplicated: list[Any] = field(default_factory=list)
    reordered: list[Any] = field(default_factory=list)
    unexpected: list[Any] = field(default_factory=list)
    state_mismatch: list[Any] = field(default_factory=list)
    keyed_state_mismatch: list[Any] = field(default_factory=list)
    windows_wrong: list[Any] = field(default_factory=list)

    def vacuous(self) -> list[str]:
        return self.vacuous_reasons

    def text(self) -> str:
        return "report"


def _scenario() -> Any:
    """A local scenario without Spark-only faults (run_scenario takes verify's path)."""
    return next(
        s
        for i in range(1, 200)
        if not (s := scenario_for(f"7-{i}")).has("worker-kill") and not s.has("network-fault")
    )


def _running(monkeypatch: pytest.MonkeyPatch, reports: list[_Report]) -> list[str]:
    dirs: list[str] = []

    def fake_verify(spec: Any, workdir: str, **_: Any) -> _Report:
        dirs.append(workdir)
        return reports[len(dirs) - 1]

    monkeypatch.setattr(runner, "verify", fake_verify)
    return dirs


def test_a_vacuous_run_runs_again_on_fresh_storage_until_it_proves_something(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = _Report([], records=1_000)
    dirs = _running(monkeypatch, [_Report([_VACUOUS]), good])
    outcome = runner.run_scenario(_scenario(), str(tmp_path))
    assert outcome.exact and outcome.error is None
    assert len(dirs) == 2 and len(set(dirs)) == 2  # each try on storage of its own
    assert outcome.tries == 2  # what a soak counts as a near miss


def test_three_vacuous_runs_in_a_row_are_not_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dirs = _running(monkeypatch, [_Report([_VACUOUS]) for _ in range(runner.VACUOUS_TRIES)])
    outcome = runner.run_scenario(_scenario(), str(tmp_path))
    assert not outcome.exact and outcome.error == _VACUOUS
    assert len(dirs) == outcome.tries == runner.VACUOUS_TRIES


def test_a_run_that_found_something_wrong_is_not_run_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrong = _Report([_VACUOUS], errors=["2 records lost"], exact=False)
    dirs = _running(monkeypatch, [wrong])
    outcome = runner.run_scenario(_scenario(), str(tmp_path))
    assert not outcome.exact and outcome.error is not None and "lost" in outcome.error
    assert len(dirs) == outcome.tries == 1
