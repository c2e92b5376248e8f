"""Scenarios are drawn from their seed alone: an id rebuilds exactly the scenario it
names (shrunk ones too), every feature and fault of the vocabulary is drawn by
some seed, and no draw combines features that do not go together."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spillover.chaos import FEATURES, VOCABULARY, draw, parse_id, scenario_for, shrink_steps
from spillover.chaos.runner import spec_of
from spillover.chaos.scenario import STORAGE_ERRORS, STORAGE_OPS, _valid
from spillover.errors import ConfigError
from spillover.runtime.network.tcp.faults import NetworkFault

seeds = st.integers(min_value=0, max_value=2**31)
indices = st.integers(min_value=0, max_value=10_000)
executors = st.sampled_from(["local", "spark"])


@given(seeds, indices, executors)
def test_an_id_round_trips_and_rebuilds_the_same_draws(seed: int, index: int, ex: str) -> None:
    s = draw(seed, index, ex)
    assert parse_id(s.id) == (seed, index, ())
    assert scenario_for(s.id, ex) == s
    assert draw(seed, index, ex) == s  # a replay draws the same again


@given(seeds, indices)
def test_every_shrink_step_is_rebuilt_from_its_id(seed: int, index: int) -> None:
    s = draw(seed, index)
    for smaller in shrink_steps(s):
        assert scenario_for(smaller.id) == smaller
        assert smaller.id.startswith(s.id + "~")
        for smallest in shrink_steps(smaller)[:3]:  # edits compose
            assert scenario_for(smallest.id) == smallest


@given(seeds, indices, executors)
def test_a_draw_combines_only_what_goes_together(seed: int, index: int, ex: str) -> None:
    s = draw(seed, index, ex)
    assert _valid(s.features, ex)
    assert {a.name for a in s.actions} <= set(s.features)
    assert [a.at for a in s.actions] == sorted(a.at for a in s.actions)
    for name in s.features:  # a feature with a script has its actions in it
        if name in ("failure", "rescale", "stop", "stop-drain", "storage-fault"):
            assert s.actions_of(name)
    if s.has("concurrent-checkpoints"):
        assert s.settings.policy == "aligned" and s.settings.max_concurrent_checkpoints > 1
    if ex == "local":
        spec_of(s).check()  # the verification it is would not be refused


def test_every_feature_and_fault_is_drawn_by_some_seed() -> None:
    local = [draw(1, i) for i in range(300)]
    spark = [draw(1, i, "spark") for i in range(300)]
    drawn = {f for s in local + spark for f in s.features}
    assert drawn == set(VOCABULARY)
    assert {f for s in spark for f in s.features} == {
        n for n, f in FEATURES.items() if "spark" in f.executors
    }
    faults = [a.detail for s in local for a in s.actions_of("storage-fault")]
    assert {d.split()[0] for d in faults} == set(STORAGE_OPS)
    assert {d.split()[1] for d in faults} == set(STORAGE_ERRORS)
    assert {a.detail for s in local for a in s.actions_of("stop")} == {"aligned", "unaligned"}
    assert {s.topology for s in local} >= {"iteration", "finishing", "pipeline", "broadcast"}
    assert any(s.has("event-time") and s.topology != "finishing" for s in local)


@pytest.mark.parametrize(
    "bad", ["", "7", "7-x", "7-3~", "7-3~-", "7-3~q1", "7-3~-rescale,,p1", "seed 7"]
)
def test_a_malformed_id_is_refused_naming_it(bad: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(repr(bad))):
        scenario_for(bad)


def test_an_edit_the_scenario_cannot_take_is_refused() -> None:
    s = draw(1, 2)  # finishing, without a rescale
    with pytest.raises(ConfigError, match="no feature 'rescale'"):
        scenario_for(f"{s.id}~-rescale")
    with pytest.raises(ConfigError, match="cannot take topology"):
        scenario_for(f"{s.id}~tbroadcast")


def test_a_network_fault_is_drawn_on_spark_between_workers_and_disturbs_no_earlier_draw() -> None:
    spark = [draw(1, i, "spark") for i in range(300)]
    faulted = [s for s in spark if s.has("network-fault")]
    assert len(faulted) >= 10
    for s in faulted:
        (action,) = s.actions_of("network-fault")
        connection, kind, _, after, _, _, _, worker = action.detail.split()
        fault = NetworkFault(connection, kind, int(after), worker=int(worker))
        assert fault.describe() == action.detail
        assert s.settings.parallelism >= 2 and fault.worker < s.settings.parallelism
    assert {s.actions_of("network-fault")[0].detail.split()[:2][0] for s in faulted} == {
        "data",
        "control",
    }
    # Drawn from a stream of its own: ids found before it existed replay as they were.
    assert draw(1, 48, "spark").features == ("worker-kill",)
    assert draw(1, 98).topology == "union" and draw(1, 98).settings.policy == "timeout"
