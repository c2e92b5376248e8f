"""Counting the Spark stages (barrier stages) a job's attempts start, for the tests of
restart in place (the processes executor runs the same runner)."""

from __future__ import annotations

from typing import Any

import pytest

from spillover.deploy.spark import runner


def count_stages(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[bool]]:
    """Records the generation of every stage started, and whether each attempt ran in
    place."""
    stages: list[int] = []
    in_place: list[bool] = []
    start, run = runner._SparkAttempt._start, runner._SparkAttempt.run

    def counted_start(self: Any, sc: Any) -> Any:
        stages.append(self.generation)
        return start(self, sc)

    def counted_run(self: Any, *a: Any, **kw: Any) -> Any:
        try:
            return run(self, *a, **kw)
        finally:
            in_place.append(self.in_place)

    monkeypatch.setattr(runner._SparkAttempt, "_start", counted_start)
    monkeypatch.setattr(runner._SparkAttempt, "run", counted_run)
    return stages, in_place
