"""Scenarios one after the other for a given time, what they combined and survived,
and the shrinking of one that failed.

:func:`explore` draws scenario 0, 1, 2, ... of a seed until the time is up and
runs each (:func:`~spillover.chaos.runner.run_scenario`, or any runner);
:func:`shrink` takes a failing scenario and tries the scenarios one edit smaller
(:func:`~spillover.chaos.scenario.shrink_steps`), keeping the first that still
fails, until none does; then it replays the smallest a few times to say how often
it fails (timing can differ between replays).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shlex
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spillover.chaos.runner import Outcome, Runner, run_scenario
from spillover.chaos.scenario import VOCABULARY, Scenario, draw, shrink_steps

logger = logging.getLogger(__name__)

__all__ = [
    "ChaosReport",
    "Ran",
    "Shrunk",
    "explore",
    "regression_test",
    "replay_command",
    "run_one",
    "shrink",
]


@dataclass(frozen=True)
class Ran:
    """A scenario and how it ended."""

    scenario: Scenario
    outcome: Outcome

    def to_dict(self) -> dict[str, Any]:
        s = self.scenario
        return {
            "id": s.id,
            "topology": s.topology,
            "features": list(s.features),
            "actions": [a.describe() for a in s.actions],
            "settings": {
                "policy": s.settings.policy,
                "interval_ms": s.settings.interval_ms,
                "max_concurrent_checkpoints": s.settings.max_concurrent_checkpoints,
                "parallelism": s.settings.parallelism,
                "max_subtasks_per_channel_state_file": (
                    s.settings.max_subtasks_per_channel_state_file
                ),
                "records": s.settings.records,
            },
            "exact": self.outcome.exact,
            "seconds": round(self.outcome.seconds, 2),
            "error": self.outcome.error,
            "summary": self.outcome.summary,
            "failures_fired": list(self.outcome.failures_fired),
            "storage_faults": self.outcome.storage_faults,
            "tries": self.outcome.tries,
            # What went wrong in full (the comparison's report, or the traceback).
            "report": None if self.outcome.exact else self.outcome.report,
        }


@dataclass(frozen=True)
class Shrunk:
    """What shrinking a failing scenario found: the smallest still failing the same
    way, the ids tried on the way, and how often the smallest failed so when
    replayed."""

    original: Scenario
    smallest: Scenario
    kind: str  # how they fail (Outcome.kind)
    tried: tuple[tuple[str, bool], ...]  # (id, failed the same way)
    replays: int
    failed_replays: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.original.id,
            "smallest": self.smallest.id,
            "smallest_features": list(self.smallest.features),
            "kind": self.kind,
            "tried": [{"id": i, "failed": f} for i, f in self.tried],
            "replays": self.replays,
            "failed_replays": self.failed_replays,
        }


@dataclass
class ChaosReport:
    """What a chaos run drew, ran and found."""

    seed: int
    executor: str
    seconds: float = 0.0
    ran: list[Ran] = field(default_factory=list)
    shrunk: list[Shrunk] = field(default_factory=list)

    @property
    def all_exact(self) -> bool:
        return bool(self.ran) and all(r.outcome.exact for r in self.ran)

    @property
    def failed(self) -> list[Ran]:
        return [r for r in self.ran if not r.outcome.exact]

    def coverage(self) -> dict[str, int]:
        """Per feature of the vocabulary, how many scenarios used it (0 included)."""
        return {f: sum(f in r.scenario.features for r in self.ran) for f in VOCABULARY}

    def pairs(self) -> dict[str, int]:
        """Per pair of features used together (``a+b``), how many scenarios had both."""
        out: dict[str, int] = {}
        for r in self.ran:
            for a, b in itertools.combinations(r.scenario.features, 2):
                out[f"{a}+{b}"] = out.get(f"{a}+{b}", 0) + 1
        return dict(sorted(out.items()))

    def survived(self) -> dict[str, int]:
        """Per feature, how many of the scenarios that used it were exact."""
        return {
            f: sum(f in r.scenario.features and r.outcome.exact for r in self.ran)
            for f in VOCABULARY
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "executor": self.executor,
            "seconds": round(self.seconds, 1),
            "scenarios": [r.to_dict() for r in self.ran],
            "coverage": self.coverage(),
            "survived": self.survived(),
            "pairs": self.pairs(),
            "all_exact": self.all_exact,
            "shrunk": [s.to_dict() for s in self.shrunk],
        }

    def write_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)


def explore(
    seconds: float,
    *,
    seed: int = 1,
    executor: str = "local",
    runner: Runner = run_scenario,
    workdir: str | None = None,
    on_ran: Callable[[Ran, float], None] | None = None,
    min_scenarios: int = 1,
    first: int = 0,
) -> ChaosReport:
    """Runs scenarios ``first``, ``first + 1``, ... of ``seed`` until ``seconds`` are
    up (the last may end later), at least ``min_scenarios`` of them; ``on_ran(ran,
    elapsed)`` after each."""
    report = ChaosReport(seed, executor)
    started = time.monotonic()
    for index in itertools.count(first):
        elapsed = time.monotonic() - started
        if elapsed >= seconds and len(report.ran) >= min_scenarios:
            break
        ran = run_one(draw(seed, index, executor), runner, workdir)
        report.ran.append(ran)
        if on_ran is not None:
            on_ran(ran, time.monotonic() - started)
    report.seconds = time.monotonic() - started
    return report


#: Tries at removing a scenario's folder, the pause growing by this much each time.
REMOVE_TRIES = 5
REMOVE_PAUSE_S = 0.2


def run_one(s: Scenario, runner: Runner = run_scenario, workdir: str | None = None) -> Ran:
    """Runs ``s`` in a fresh folder under ``workdir`` (removed after)."""
    d = tempfile.mkdtemp(prefix="spillover-chaos-", dir=workdir)
    try:
        return Ran(s, runner(s, d))
    finally:
        remove_folder(d)


def remove_folder(d: str) -> None:
    """Removes a scenario's folder. A process of the scenario's cluster can still be
    writing into it when the run has ended (a Spark worker of a failed stage winding
    down), and one such file made ``rmtree`` fail the whole chaos run with "Directory
    not empty": it is tried again, and what cannot be removed is left with a warning,
    never an error (the scenario's outcome was decided before)."""
    for i in range(REMOVE_TRIES):
        try:
            shutil.rmtree(d)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(REMOVE_PAUSE_S * (i + 1))
    shutil.rmtree(d, ignore_errors=True)
    if os.path.exists(d):
        logger.warning("could not remove the scenario folder %s; left in place", d)


def shrink(
    failing: Scenario,
    *,
    runner: Runner = run_scenario,
    workdir: str | None = None,
    replays: int = 3,
    budget_s: float = 600.0,
    on_try: Callable[[Scenario, bool], None] | None = None,
    kind: str | None = None,
) -> Shrunk:
    """The smallest scenario found from ``failing`` by edits that keep it failing the
    same way (:attr:`Outcome.kind`: a smaller scenario that fails otherwise, say one
    too short to be stopped, is another problem): each round tries the scenarios one
    edit smaller in turn and takes the first that fails so; it ends when none does
    (or ``budget_s`` is spent). Then the smallest is replayed ``replays`` times.
    ``kind`` is how ``failing`` failed (default: it is run once to see)."""
    started = time.monotonic()
    if kind is None:
        kind = run_one(failing, runner, workdir).outcome.kind
    current = failing
    tried: list[tuple[str, bool]] = []
    progress = True
    while progress and time.monotonic() - started < budget_s and kind != "exact":
        progress = False
        for smaller in shrink_steps(current):
            failed = run_one(smaller, runner, workdir).outcome.kind == kind
            tried.append((smaller.id, failed))
            if on_try is not None:
                on_try(smaller, failed)
            if failed:
                current, progress = smaller, True
                break
            if time.monotonic() - started >= budget_s:
                break
    failed_replays = sum(
        run_one(current, runner, workdir).outcome.kind == kind != "exact" for _ in range(replays)
    )
    return Shrunk(failing, current, kind, tuple(tried), replays, failed_replays)


def replay_command(s: Scenario) -> str:
    """The command that runs ``s`` again."""
    parts = ["spillover", "chaos", "--replay", s.id]
    if s.executor != "local":
        parts += ["--executor", s.executor]
    return shlex.join(parts)


def regression_test(s: Scenario, why: str = "") -> str:
    """A pytest regression that replays ``s`` (to keep beside the fix)."""
    name = "test_chaos_" + s.id.replace("-", "_").replace("~", "__").replace(",", "_")
    name = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    return (
        f"def {name}(tmp_path):\n"
        f'    """{why or "Found by spillover chaos"}: {s.describe()}"""\n'
        f"    s = scenario_for({s.id!r}, {s.executor!r})\n"
        f"    outcome = run_scenario(s, str(tmp_path))\n"
        f"    assert outcome.exact, outcome.report or outcome.error\n"
    )
