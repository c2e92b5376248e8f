"""Stop-with-savepoint, with and without drain (FLIP-147): a job stopped under
backpressure resumes exactly from its savepoint; a drained one finishes for good."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spillover.cli import main
from spillover.config import Config
from spillover.deploy.local import LocalExecutor
from spillover.errors import ConfigError
from spillover.runtime.checkpointing.metadata import read_checkpoint
from spillover.runtime.connectors.collecting import CollectingSink
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.connectors.throttled import ThrottledSink
from spillover.runtime.graph import StreamEnvironment
from spillover.verify import VerifySpec, verify
from support.operators import DecliningSnapshots, SummaryOnFinish

RECORDS = 12_000  # per partition, two partitions: 6 s at the sink's pace


def _job(name: str) -> StreamEnvironment:
    """A source (4 s of records), an operator that emits its count in ``finish()``,
    and a slower exactly-once sink (6 s): backpressure builds up in the channels."""
    env = StreamEnvironment(name, parallelism=2, max_parallelism=128)
    env.from_source(
        GeneratorSource(
            partitions=2, records_per_partition=RECORDS, payload_bytes=16, rate_per_subtask=3_000
        ),
        uid="source",
    ).process(SummaryOnFinish(name), uid="summary").rebalance().sink(
        ThrottledSink(2_000, inner=CollectingSink(name)), uid="sink"
    )
    return env


def _config(tmp: Path, **extra: Any) -> Config:
    return Config.from_dict(
        {
            "execution.checkpointing.interval": "100 ms",
            "state.checkpoints.dir": str(tmp / "ckpt"),
            "state.checkpoints.num-retained": 3,
            **extra,
        }
    )


def _stop_once_checkpointed(ex: LocalExecutor, drain: bool, **how: Any) -> threading.Thread:
    """Asks for the stop once the running attempt completed a checkpoint."""

    def stop() -> None:
        while not ex.completed_ids():
            threading.Event().wait(0.01)
        ex.stop_with_savepoint(drain=drain, **how)

    thread = threading.Thread(target=stop, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("unaligned", [False, True])
def test_a_stop_without_drain_resumes_exactly_from_its_savepoint(
    unaligned: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = f"stop-{unaligned}"
    SummaryOnFinish.opened.pop(name, None)
    cfg = _config(tmp_path, **{"execution.checkpointing.unaligned.enabled": unaligned})
    ex = LocalExecutor(_job(name), cfg)
    stopper = _stop_once_checkpointed(ex, drain=False)
    result = ex.run(timeout=120)
    stopper.join()
    assert result.status == "stopped" and result.savepoint is not None, result
    first = CollectingSink.records(name)
    assert 0 < len(first) < 2 * RECORDS, "stopped while the job ran"
    assert not (first["partition"] < 0).any(), "finish() ran although nothing drained"
    meta = read_checkpoint(result.savepoint)
    assert all(t["finished"] == "running" for t in meta["tasks"].values())
    # Kept beside the checkpoints by default, where inspect lists it after them.
    job_dir = tmp_path / "ckpt" / name
    assert result.savepoint.startswith(str(job_dir / "savepoints" / "savepoint-"))
    assert main(["inspect", str(job_dir), "--no-verify"]) == 0
    assert f"savepoint {meta['checkpoint_id']} of job {name!r}" in capsys.readouterr().out
    # Everything up to the savepoint is committed, nothing after it is.
    assert CollectingSink.staged_records(name) == 0

    _resume_exactly(name, cfg, result.savepoint)


def _resume_exactly(name: str, cfg: Config, savepoint: str) -> None:
    """The job restored from ``savepoint`` ends with every record committed once and
    ``finish()`` run once per subtask, over all of them."""
    resumed = LocalExecutor(_job(name), cfg, restore_checkpoint=savepoint).run(timeout=120)
    assert resumed.status == "finished", resumed
    rows = CollectingSink.records(name)
    data = rows[rows["partition"] >= 0]
    ids = data["partition"].astype(np.int64) * 1_000_000 + data["seq"]
    assert len(ids) == len(np.unique(ids)) == 2 * RECORDS
    summaries = rows[rows["partition"] < 0]
    assert sorted(summaries["partition"].tolist()) == [-2, -1]
    assert summaries["seq"].sum() == 2 * RECORDS


@pytest.mark.parametrize(
    "checkpoints",
    [
        {"execution.checkpointing.unaligned.enabled": True},
        {
            "execution.checkpointing.unaligned.enabled": True,
            "execution.checkpointing.aligned-checkpoint-timeout": "20 ms",
        },
        {},  # aligned periodic checkpoints: a pending one is superseded
    ],
    ids=["unaligned", "timeout", "aligned"],
)
def test_an_unaligned_stop_puts_what_is_in_flight_into_the_savepoint(
    checkpoints: dict[str, Any], tmp_path: Path
) -> None:
    """Under backpressure the savepoint is taken at once, whatever the periodic
    checkpoints' policy: the buffered records go into it rather than through the
    sink, and the job resumes exactly from it, from a savepoint that outlives its
    checkpoint directory."""
    name = f"stop-unaligned-savepoint-{len(checkpoints)}"
    SummaryOnFinish.opened.pop(name, None)
    cfg = _config(tmp_path, **checkpoints)
    ex = LocalExecutor(_job(name), cfg)
    stopper = _stop_once_checkpointed(
        ex, drain=False, unaligned=True, savepoint_dir=str(tmp_path / "sp")
    )
    result = ex.run(timeout=120)
    stopper.join()
    assert result.status == "stopped" and result.savepoint is not None, result
    assert result.savepoint.startswith(str(tmp_path / "sp" / "savepoint-"))
    stop = [c for c in result.checkpoints if c["savepoint"]]
    assert len(stop) == 1 and stop[0]["status"] == "completed"
    assert stop[0]["inflight_bytes"] > 0, "nothing was in flight: no backpressure"
    first = CollectingSink.records(name)
    assert not (first["partition"] < 0).any(), "finish() ran although nothing drained"
    assert CollectingSink.staged_records(name) == 0
    meta = read_checkpoint(result.savepoint)
    assert meta["savepoint"] and all(t["finished"] == "running" for t in meta["tasks"].values())
    shutil.rmtree(tmp_path / "ckpt")  # the savepoint is self-contained
    _resume_exactly(name, cfg, result.savepoint)


def _declining_job(name: str, payload: int = 1_000) -> StreamEnvironment:
    """The issue's job: two sources of 12,000 records of 1,000 bytes at 3,000/s per
    subtask, key_by, a sink paced at 2,000/s whose snapshots can be made to fail."""
    dtype = GeneratorSource.dtype(payload)
    env = StreamEnvironment(name, parallelism=2, max_parallelism=128)
    env.from_source(
        GeneratorSource(
            partitions=2,
            records_per_partition=RECORDS,
            payload_bytes=payload,
            rate_per_subtask=3_000,
        ),
        uid="source",
    ).key_by("key").process(DecliningSnapshots(name, dtype), uid="declining").sink(
        ThrottledSink(2_000, inner=CollectingSink(name)), uid="sink"
    )
    return env


@pytest.mark.parametrize("unaligned", [True, False])
@pytest.mark.parametrize("aborted", [1, 2])
def test_a_stop_whose_savepoint_attempts_are_aborted_loses_nothing(
    unaligned: bool, aborted: int, tmp_path: Path
) -> None:
    """The first ``aborted`` attempts at the stop's savepoint fail on storage after
    some subtasks took them: those subtasks go on exactly as before (nothing they
    held back for the savepoint is dropped), a later attempt completes, and the job
    resumed from it ends with every record committed exactly once. No periodic
    checkpoint comes before the stop (the interval is longer than the job), so every
    checkpoint after it is an attempt at the stop's savepoint."""
    name = f"stop-aborted-{unaligned}-{aborted}"
    cfg = _config(
        tmp_path,
        **{
            "execution.checkpointing.interval": "1 h",
            "execution.checkpointing.unaligned.enabled": True,
            "execution.checkpointing.tolerable-failed-checkpoints": 100,
        },
    )

    def stop() -> None:
        # Under way and backpressured: the sink took a second's worth at its pace.
        while ex.live_metric("declining") < 2_000:
            threading.Event().wait(0.01)
        DecliningSnapshots.arm(name, aborted)
        ex.stop_with_savepoint(drain=False, unaligned=unaligned)

    ex = LocalExecutor(_declining_job(name), cfg)
    stopper = threading.Thread(target=stop, daemon=True)
    stopper.start()
    result = ex.run(timeout=120)
    stopper.join()
    assert result.status == "stopped" and result.savepoint is not None, result
    failed = [c["checkpoint_id"] for c in result.checkpoints if c["status"] != "completed"]
    assert failed == DecliningSnapshots.declined[name] and len(failed) == aborted
    assert CollectingSink.staged_records(name) == 0
    resumed = LocalExecutor(_declining_job(name), cfg, restore_checkpoint=result.savepoint).run(
        timeout=120
    )
    assert resumed.status == "finished", resumed
    rows = CollectingSink.records(name)
    ids = rows["partition"].astype(np.int64) * 1_000_000 + rows["seq"]
    assert len(np.unique(ids)) == len(ids), "duplicates"
    assert len(ids) == 2 * RECORDS, f"{2 * RECORDS - len(ids)} records lost"


@pytest.mark.parametrize("unaligned", [True, False])
def test_a_stop_whose_savepoint_fails_leaves_the_job_running_as_before(
    unaligned: bool, tmp_path: Path
) -> None:
    """As Flink: a stop whose savepoint fails (here beyond the tolerated failures,
    which are none) is answered with the reason, and the job goes on exactly as it
    was, to its normal end: every record committed once, no restart, no failure."""
    name = f"stop-fails-{unaligned}"
    cfg = _config(
        tmp_path,
        **{
            "execution.checkpointing.interval": "1 h",
            "execution.checkpointing.unaligned.enabled": True,
            "execution.checkpointing.tolerable-failed-checkpoints": 0,
        },
    )
    answer: list[Any] = []

    def stop() -> None:
        while ex.live_metric("declining") < 2_000:
            threading.Event().wait(0.01)
        DecliningSnapshots.arm(name, 1)
        answer.append(ex.stop_with_savepoint(drain=False, unaligned=unaligned))

    ex = LocalExecutor(_declining_job(name), cfg)
    stopper = threading.Thread(target=stop, daemon=True)
    stopper.start()
    result = ex.run(timeout=120)
    stopper.join()
    assert result.status == "finished" and result.savepoint is None, result
    assert result.attempts == 1 and not result.failures, result
    (request,) = answer
    assert request.done and request.error and "savepoint failed" in request.error
    assert DecliningSnapshots.declined[name] == [
        c["checkpoint_id"] for c in result.checkpoints if c["status"] != "completed"
    ]
    rows = CollectingSink.records(name)
    ids = rows["partition"].astype(np.int64) * 1_000_000 + rows["seq"]
    assert len(np.unique(ids)) == len(ids), "duplicates"
    assert len(ids) == 2 * RECORDS, f"{2 * RECORDS - len(ids)} records lost"


def test_a_drained_stop_refuses_an_unaligned_savepoint(tmp_path: Path) -> None:
    ex = LocalExecutor(_job("drain-unaligned"), _config(tmp_path))
    with pytest.raises(ConfigError, match="unaligned savepoint"):
        ex.stop_with_savepoint(drain=True, unaligned=True)


def test_a_stop_with_drain_finishes_the_job_for_good(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = "stop-drain"
    SummaryOnFinish.opened.pop(name, None)
    ex = LocalExecutor(_job(name), _config(tmp_path))
    stopper = _stop_once_checkpointed(ex, drain=True)
    result = ex.run(timeout=120)
    stopper.join()
    assert result.status == "finished" and result.savepoint is not None, result
    rows = CollectingSink.records(name)
    data = rows[rows["partition"] >= 0]
    assert 0 < len(data) < 2 * RECORDS, "stopped while the job ran"
    summaries = rows[rows["partition"] < 0]
    # finish() ran on every subtask, over exactly what the sources had emitted.
    assert sorted(summaries["partition"].tolist()) == [-2, -1]
    assert summaries["seq"].sum() == len(data)
    meta = read_checkpoint(result.savepoint)
    assert meta["final"] and all(t["finished"] == "fully" for t in meta["tasks"].values())
    assert main(["inspect", result.savepoint, "--no-verify"]) == 0
    assert "finished operators: sink (fully), source (fully)" in capsys.readouterr().out


def test_a_stop_needs_checkpoint_storage() -> None:
    ex = LocalExecutor(_job("no-storage"), Config())
    with pytest.raises(ConfigError, match="checkpoint storage"):
        ex.stop_with_savepoint()


# --- spillover verify --stop-with-savepoint [--drain] ---------------------------------------


@pytest.mark.parametrize(
    ("stop", "policy", "rescale_to"),
    [
        ("savepoint", "aligned", None),
        ("unaligned-savepoint", "unaligned", None),
        ("unaligned-savepoint", "unaligned", 3),
        ("drain", "aligned", None),
    ],
)
def test_verify_stops_with_a_savepoint_and_resumes_exactly(
    stop: str, policy: str, rescale_to: int | None, tmp_path: Path
) -> None:
    """The finishing topology stopped part way (after its short branch finished) and
    restored from the savepoint commits what a failure-free run does; a drained one
    commits everything its sources emitted before the stop, once."""
    spec = VerifySpec(
        topology="finishing",
        policy=policy,
        stop=stop,
        rescale_to=rescale_to,
        failures=0,
        records=100_000,
        rate_per_subtask=10_000,
    )
    report = verify(spec, str(tmp_path))
    assert report.exact, report.text()
    assert "restored from the savepoint" in report.text()
    if stop == "drain":
        assert 0 < report.records < 100_000  # stopped before the end
