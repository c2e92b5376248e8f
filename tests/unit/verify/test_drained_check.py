"""The check of a drained stop: it holds the drained run's committed output against
what its sources emitted (their positions in the savepoint), not against the
output itself, so a drain that commits less than its sources emitted is a loss."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from spillover.errors import ConfigError
from spillover.runtime.jobmaster import JobResult
from spillover.verify import VerifySpec
from spillover.verify.compare import compare
from spillover.verify.output import DrainedSources, RunOutput
from spillover.verify.run import drained_part
from spillover.verify.topologies import OUT_DTYPE

SPEC = VerifySpec(topology="pipeline", parallelism=1, records=200, stop="drain")


def _rows(ends: dict[int, int]) -> np.ndarray[Any, Any]:
    """Each partition's records ``0 .. end - 1`` with their running totals."""
    parts = [np.full(n, p, np.int64) for p, n in ends.items()] or [np.empty(0, np.int64)]
    seqs = [np.arange(n, dtype=np.int64) for n in ends.values()] or [np.empty(0, np.int64)]
    rows = np.zeros(sum(ends.values()), OUT_DTYPE)
    rows["partition"] = np.concatenate(parts)
    rows["seq"] = np.concatenate(seqs)
    rows["key"] = rows["partition"]
    rows["total"] = np.concatenate([np.cumsum(s + 1) for s in seqs])
    return rows


def _output(rows: np.ndarray[Any, Any]) -> RunOutput:
    return RunOutput(JobResult("job", "finished", 1, 1.0), rows, {})


def _verdict(committed: dict[int, int], emitted: dict[int, int]) -> Any:
    baseline = _output(_rows({0: 100, 1: 100}))
    sources = DrainedSources("savepoint", emitted)
    return compare(SPEC, drained_part(baseline, sources), _output(_rows(committed)))


def test_a_drain_that_commits_everything_its_sources_emitted_is_exact() -> None:
    assert _verdict({0: 60, 1: 40}, {0: 60, 1: 40}).exact


def test_a_drain_that_loses_the_tail_of_what_its_sources_emitted_is_a_loss() -> None:
    # Committing a prefix of each partition looks whole to a check that stops at the
    # last committed record; the sources' positions say 10 more were emitted.
    report = _verdict({0: 50, 1: 40}, {0: 60, 1: 40})
    assert not report.exact
    assert report.lost == [(0, s) for s in range(50, 60)]


def test_a_drain_that_commits_nothing_of_what_its_sources_emitted_loses_it_all() -> None:
    report = _verdict({}, {0: 60, 1: 40})
    assert not report.exact and len(report.lost) == 100
    assert "NOT EXACT" in report.text()


def test_records_committed_beyond_what_the_sources_emitted_are_unexpected() -> None:
    report = _verdict({0: 61, 1: 40}, {0: 60, 1: 40})
    assert not report.exact and report.unexpected == [(0, 60)]


def test_a_partition_the_savepoint_holds_no_position_of_is_refused() -> None:
    with pytest.raises(ConfigError, match="no position"):
        _verdict({0: 60}, {0: 60})


def test_a_drain_whose_sources_emitted_nothing_says_so_plainly() -> None:
    """Chaos 29-60: a drain asked while the job restarted, to a checkpoint taken
    before the first record, ended the sources at position 0. Nothing was lost;
    the verdict says so instead of "nothing committed"."""
    report = _verdict({}, {0: 0, 1: 0})
    report.drain_emitted = 0
    assert report.exact and not report.lost
    (why,) = report.vacuous()
    assert why.startswith("Vacuous: the drain ended the sources before they emitted a record")


def test_a_run_that_committed_something_or_failed_is_not_vacuous() -> None:
    report = _verdict({0: 60, 1: 40}, {0: 60, 1: 40})
    assert report.vacuous() == []
    empty = _verdict({}, {0: 0, 1: 0})
    assert empty.vacuous() == ["Vacuous: nothing was committed, so the comparison proved nothing"]
    empty.errors = ["the run with failures failed: out of restarts"]
    assert empty.vacuous() == []
