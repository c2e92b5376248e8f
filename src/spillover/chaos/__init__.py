"""``spillover chaos``: whole-job scenarios that combine every feature with every
fault, drawn at random, replayable by id, and shrunk when one fails.

- :mod:`~spillover.chaos.scenario`: what a scenario is, the vocabulary of
  features, the draw from a seed and the rebuild from an id;
- :mod:`~spillover.chaos.runner`: one scenario as a verification, with its
  storage faults and aborted savepoints around it;
- :mod:`~spillover.chaos.explore`: scenarios for a given time, coverage, shrinking;
- :mod:`~spillover.chaos.faults`: the fault-injecting filesystem.

docs/chaos.md says what a scenario is and how to replay and shrink one.
"""

from __future__ import annotations

from spillover.chaos.explore import (
    ChaosReport,
    Ran,
    Shrunk,
    explore,
    regression_test,
    replay_command,
    run_one,
    shrink,
)
from spillover.chaos.runner import Outcome, Runner, run_scenario, spec_of
from spillover.chaos.scenario import (
    FEATURES,
    VOCABULARY,
    Action,
    Feature,
    Scenario,
    Settings,
    draw,
    parse_id,
    scenario_for,
    shrink_steps,
)

__all__ = [
    "FEATURES",
    "VOCABULARY",
    "Action",
    "ChaosReport",
    "Feature",
    "Outcome",
    "Ran",
    "Runner",
    "Scenario",
    "Settings",
    "Shrunk",
    "draw",
    "explore",
    "parse_id",
    "regression_test",
    "replay_command",
    "run_one",
    "run_scenario",
    "scenario_for",
    "shrink",
    "shrink_steps",
    "spec_of",
]
