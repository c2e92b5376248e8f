"""Real chaos scenarios, replayed by id: each pair of features below runs as a whole
job with its faults and is compared exactly with a failure-free run; and the
``spillover chaos`` command replays one, writes its report and exits by it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from spillover.chaos import explore, run_scenario, scenario_for
from spillover.chaos.runner import IsolatedRunner
from spillover.cli import main

# Shrunk ids: a drawn scenario with every other feature removed, so each runs the
# named pair alone (docs/chaos.md, "Replaying and shrinking").
PAIRS = {
    "stop+aborted-savepoint": "1-3~-event-time,-failure",
    # The storage fault strikes reads: inside the rescale's restore.
    "rescale+storage-fault": "1-207~-event-time,-concurrent-checkpoints",
    "loop+failure": "1-33~-storage-fault",
    "finishing+stop-drain": "1-8~-concurrent-checkpoints,-failure,-rescale,-storage-fault",
    "event-time+concurrent-checkpoints": "1-6~-stop-drain,-storage-fault",
    "batch+failure": "1-0~-event-time",
}
FAST = ("stop+aborted-savepoint", "batch+failure", "finishing+stop-drain")


@pytest.mark.parametrize(
    "pair",
    [p if p in FAST else pytest.param(p, marks=pytest.mark.slow) for p in PAIRS],
)
def test_a_pair_of_features_survives_exactly(pair: str, tmp_path: Path) -> None:
    s = scenario_for(PAIRS[pair])
    assert set(s.features) == set(pair.split("+"))
    outcome = run_scenario(s, str(tmp_path))
    assert outcome.exact, outcome.report or outcome.error
    if s.has("failure"):
        assert outcome.failures_fired
    if s.has("aborted-savepoint") or s.has("storage-fault"):
        assert outcome.storage_faults > 0, "the faults struck"


def test_chaos_replays_a_scenario_and_reports_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "chaos.json"
    code = main(["chaos", "--replay", "1-0~-event-time", "--replays", "1", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "0 of 1 replays failed" in printed
    got = json.loads(out.read_text())
    assert got["all_exact"] is True and got["seed"] == 1
    (only,) = got["scenarios"]
    assert only["id"] == "1-0~-event-time" and only["features"] == ["batch", "failure"]
    assert only["tries"] == 1
    assert got["coverage"]["batch"] == 1 and got["coverage"]["loop"] == 0


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--replay", "7-x"], "not a chaos scenario id"),
        (["--minutes", "0"], "--minutes must be positive"),
        (["--replay", "1-2~-rescale"], "no feature 'rescale'"),
        (["--replays", "0", "--replay", "1-2"], "--replays must be at least 1"),
    ],
)
def test_bad_chaos_flags_are_one_line_and_exit_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["chaos", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err


# Found by `spillover chaos --seed 1` (scenario 1-37), shrunk: an aligned stop whose
# savepoint export meets a failing listing (ENOSPC) of the stop's checkpoint.
EXPORT_FAULT = "1-37~-event-time,-concurrent-checkpoints,-aborted-savepoint"


def test_a_storage_fault_in_a_stops_savepoint_export_is_survived(tmp_path: Path) -> None:
    """Found by chaos: a storage fault while a stop's savepoint was copied ended the
    run with StorageError. The checkpoint is complete and kept; the copy is tried
    again, and the job resumed from the savepoint is exact."""
    s = scenario_for(EXPORT_FAULT)
    assert set(s.features) == {"stop", "storage-fault"}
    outcome = run_scenario(s, str(tmp_path))
    assert outcome.exact, outcome.error


def test_a_storage_fault_the_job_never_met_spares_the_check(tmp_path: Path) -> None:
    """Found by chaos (29-98): a read fault armed late in a run the job never met
    struck the check instead, as it read the job's final keyed state. Faults are
    disarmed once the job ended, before its output and state are read."""
    s = scenario_for("29-98")
    assert set(s.features) == {"storage-fault"}
    outcome = run_scenario(s, str(tmp_path))
    assert outcome.exact, outcome.report or outcome.error


def test_a_drain_after_a_restore_past_the_last_record_still_stops(tmp_path: Path) -> None:
    """Found by chaos (832849741-3, CI's drawn seed): both failures struck before the
    stop's bound (0.09 s), and the attempt restored after the sources' last record sent
    none, so a drain that waited for records never came and the run ended unstopped.
    Past its bound a drain no longer waits for records; the sources hold their end
    long enough for it."""
    s = scenario_for("832849741-3")
    assert {"failure", "stop-drain"} <= set(s.features)
    outcome = run_scenario(s, str(tmp_path))
    assert outcome.exact, outcome.report or outcome.error
    assert len(outcome.failures_fired) == 2


# Failures known and kept as xfails, until their fix lands.
KNOWN: tuple[str, ...] = ()


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, None], ids=["seed-1", "seed-drawn"])
def test_half_a_minute_of_chaos_is_exact(seed: int | None, tmp_path: Path) -> None:
    """CI's minute of chaos on the local executor, in two halves: a fixed seed and one
    drawn at random (printed, and named by a failure, so that it replays with
    ``spillover chaos --replay ID``)."""
    seed = random.randrange(1, 2**31) if seed is None else seed
    print(f"spillover chaos --seed {seed}")
    report = explore(30.0, seed=seed, workdir=str(tmp_path))
    assert report.ran
    failed = [
        f"{r.scenario.id}: {r.outcome.error or r.outcome.summary}"
        for r in report.failed
        if not (r.outcome.error or "").startswith(KNOWN)
    ]
    assert not failed, f"spillover chaos --seed {seed}: {failed}"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("scenario_id", "features"),
    [
        ("1-48", {"worker-kill"}),
        ("1-1", {"batch", "finishing", "driver-kill"}),
        ("1-120", {"loop", "concurrent-checkpoints", "network-fault"}),
    ],
    ids=["worker-kill", "batch+driver-kill", "loop+network-fault"],
)
def test_a_scenario_on_spark_survives_exactly(
    scenario_id: str, features: set[str], tmp_path: Path
) -> None:
    """On Spark: a worker's Python process SIGKILLed once a checkpoint completed, a
    batch job whose driver is SIGKILLed twice and started again, and a loop whose
    worker's control connection stalls (the job master hears nothing, fails the
    attempt over, and the job restarts from its checkpoint)."""
    pytest.importorskip("pyspark")
    s = scenario_for(scenario_id, "spark")
    assert set(s.features) == features
    outcome = run_scenario(s, str(tmp_path))
    assert outcome.exact, outcome.report or outcome.error


@pytest.mark.slow
def test_an_unaligned_stop_racing_the_end_of_the_data_ends(tmp_path: Path) -> None:
    """The data ended while the stop's savepoint was pending, with free checkpoint
    slots: the final checkpoint waits for the savepoint (it had been triggered beside
    it, and the job never ended in about half of the runs; docs/chaos.md)."""
    s = scenario_for("1-114")
    assert s.has("stop") and s.has("concurrent-checkpoints") and s.topology == "finishing"
    with IsolatedRunner(timeout_s=60.0) as runner:
        for i in range(6):
            outcome = runner(s, str(tmp_path / str(i)))
            assert outcome.exact, outcome.error
