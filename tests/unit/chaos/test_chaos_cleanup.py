"""A scenario's folder that cannot be removed at once (a process of the scenario's
cluster still writing into it: a Spark worker of a failed stage winding down) does
not end the chaos run: the outcome stands, the removal is tried again, and what is
left stays with a warning. One such file once ended a half hour on Spark with
"Directory not empty"."""

from __future__ import annotations

import errno
import importlib
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from spillover.chaos.runner import Outcome
from spillover.chaos.scenario import draw

# The package exports a function named explore, which hides the module of that name.
explore = importlib.import_module("spillover.chaos.explore")


def _scenario() -> Any:
    return draw(1, 1)


def _failing_rmtree(times: int) -> Any:
    """shutil.rmtree failing ``times`` times as a late writer makes it fail."""
    real = shutil.rmtree
    left = [times]

    def rmtree(path: str, *args: Any, **kwargs: Any) -> None:
        if left[0] > 0:
            left[0] -= 1
            if kwargs.get("ignore_errors"):
                return  # what it could not remove stays
            raise OSError(errno.ENOTEMPTY, os.strerror(errno.ENOTEMPTY), "killed")
        real(path, *args, **kwargs)

    return rmtree


def test_a_late_writer_in_the_scenario_folder_does_not_end_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(explore, "REMOVE_PAUSE_S", 0.0)
    monkeypatch.setattr(explore.shutil, "rmtree", _failing_rmtree(2))
    seen: list[str] = []

    def runner(s: Any, d: str) -> Outcome:
        seen.append(d)
        Path(d, "killed").mkdir()
        Path(d, "killed", "late").write_bytes(b"x")
        return Outcome(exact=True, seconds=0.1, summary="ran")

    ran = explore.run_one(_scenario(), runner, str(tmp_path))
    assert ran.outcome.exact and ran.outcome.summary == "ran"
    assert not os.path.exists(seen[0])  # removed on a later try


def test_a_folder_that_stays_is_left_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(explore, "REMOVE_PAUSE_S", 0.0)
    monkeypatch.setattr(explore.shutil, "rmtree", _failing_rmtree(10**6))

    def runner(s: Any, d: str) -> Outcome:
        Path(d, "late").write_bytes(b"x")
        return Outcome(exact=False, seconds=0.1, error="Hang: it did not end")

    ran = explore.run_one(_scenario(), runner, str(tmp_path))
    assert ran.outcome.kind == "Hang"  # the scenario's own outcome, not the cleanup's
    assert "could not remove the scenario folder" in caplog.text
