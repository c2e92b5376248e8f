"""Shrinking keeps a failing scenario failing and ends at what makes it fail; a chaos
run reports what it combined and survived (against a runner that fails on purpose
when two given features meet)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillover.chaos import (
    VOCABULARY,
    Outcome,
    Scenario,
    draw,
    explore,
    regression_test,
    replay_command,
    scenario_for,
    shrink,
)
from spillover.chaos.runner import Runner


def fails_when(a: str, b: str) -> Runner:
    """A runner whose scenario "fails" exactly when it combines features ``a`` and ``b``."""

    def run(s: Scenario, workdir: str) -> Outcome:
        return Outcome(exact=not (s.has(a) and s.has(b)), seconds=0.0)

    return run


def _with_both(a: str, b: str, seed: int) -> Scenario | None:
    """The first scenario of ``seed`` that has ``a``, ``b`` and at least one more."""
    for i in range(400):
        s = draw(seed, i)
        if s.has(a) and s.has(b) and len(s.features) > 2:
            return s
    return None


PAIRS = [
    (a, b)
    for a, b in itertools.combinations(VOCABULARY, 2)
    if _with_both(a, b, 1) is not None and "worker-kill" not in (a, b)
]


def test_there_are_pairs_to_shrink_to() -> None:
    assert len(PAIRS) >= 20


@settings(max_examples=40)
@given(st.sampled_from(PAIRS), st.integers(min_value=1, max_value=5))
def test_shrinking_ends_with_exactly_the_pair_that_fails(pair: tuple[str, str], seed: int) -> None:
    a, b = pair
    failing = _with_both(a, b, seed) or _with_both(a, b, 1)
    assert failing is not None
    found = shrink(failing, runner=fails_when(a, b), replays=2)
    assert set(found.smallest.features) == {a, b} or (
        # what needs a stop keeps the stop it needs
        "aborted-savepoint" in (a, b)
        and len(set(found.smallest.features) - {a, b} & {"stop", "stop-drain"}) == 1
        and len(found.smallest.features) == 3
    )
    # Every step taken on the way still failed, and the smallest replays from its id.
    assert found.tried and all(f for i, f in found.tried if i == found.smallest.id)
    assert scenario_for(found.smallest.id) == found.smallest
    assert found.failed_replays == found.replays == 2
    # Simpler in every other way too: least parallelism and records it can take.
    assert found.smallest.settings.parallelism == 1 or found.smallest.has("rescale")


def test_a_scenario_that_does_not_fail_stays_as_it_was() -> None:
    s = draw(1, 8)
    found = shrink(s, runner=fails_when("loop", "batch"), replays=1)
    assert found.smallest == s and found.failed_replays == 0


def test_a_chaos_run_counts_features_and_pairs_and_writes_its_report(tmp_path: Path) -> None:
    report = explore(0.0, seed=3, runner=fails_when("failure", "stop"), min_scenarios=60)
    assert len(report.ran) == 60
    coverage = report.coverage()
    assert set(coverage) == set(VOCABULARY)
    for name, n in coverage.items():
        assert n == sum(name in r.scenario.features for r in report.ran)
    both = sum(r.scenario.has("failure") and r.scenario.has("stop") for r in report.ran)
    assert both and len(report.failed) == both and not report.all_exact
    assert report.pairs()["failure+stop"] == both
    path = tmp_path / "chaos.json"
    report.write_json(str(path))
    got = json.loads(path.read_text())
    assert got["seed"] == 3 and got["all_exact"] is False
    assert got["coverage"] == coverage
    first = got["scenarios"][0]
    assert set(first) >= {"id", "topology", "features", "actions", "exact", "seconds"}
    assert scenario_for(first["id"]) == report.ran[0].scenario


def test_a_failing_scenario_prints_as_a_command_and_a_test() -> None:
    s = scenario_for("1-8~-rescale,p1")
    assert replay_command(s) == "spillover chaos --replay '1-8~-rescale,p1'"
    code = regression_test(s)
    compile(code, "<regression>", "exec")
    assert "scenario_for('1-8~-rescale,p1', 'local')" in code


@pytest.mark.parametrize("seed", [1, 2])
def test_explore_draws_scenarios_in_order_from_the_seed(seed: int) -> None:
    report = explore(0.0, seed=seed, runner=fails_when("loop", "batch"), min_scenarios=5)
    assert [r.scenario for r in report.ran] == [draw(seed, i) for i in range(5)]
    assert report.all_exact


def test_shrinking_keeps_the_way_a_scenario_fails() -> None:
    """A smaller scenario that fails otherwise (here: one too small to be stopped)
    is another problem, not a smaller one of this."""
    s = scenario_for("1-8~-rescale")

    def run(t: Scenario, workdir: str) -> Outcome:
        if t.settings.parallelism < s.settings.parallelism:
            return Outcome(False, 0.0, error="ConfigError: the run ended before it was stopped")
        bad = t.has("storage-fault") and t.has("stop-drain")
        return Outcome(not bad, 0.0, error="StorageError: induced" if bad else None)

    found = shrink(s, runner=run, replays=1)
    assert found.kind == "StorageError"
    assert set(found.smallest.features) == {"storage-fault", "stop-drain"}
    assert found.smallest.settings.parallelism == s.settings.parallelism
    assert found.failed_replays == 1
