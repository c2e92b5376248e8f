"""Checkpoints of whole jobs: metadata, retention, the final checkpoint, restore
refusals and the cleanup of failed checkpoints."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from spillover.config import Config
from spillover.deploy.local import LocalExecutor
from spillover.errors import ConfigError
from spillover.runtime.api import Batch, Operator, OperatorSnapshot
from spillover.runtime.checkpointing.metadata import CheckpointStorage
from spillover.runtime.connectors.collecting import CollectingSink
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.connectors.parquet import ParquetSink
from spillover.runtime.graph import StreamEnvironment
from spillover.runtime.operators import KeyedSum


def _source(records: int = 4000, **kw: Any) -> GeneratorSource:
    return GeneratorSource(partitions=4, records_per_partition=records // 4, payload_bytes=16, **kw)


def _config(tmp: Path, **extra: Any) -> Config:
    return Config.from_dict(
        {
            "execution.checkpointing.interval": "50 ms",
            "state.checkpoints.dir": str(tmp / "ckpt"),
            **extra,
        }
    )


# --- checkpoints: metadata, retention, cleanup, restore -------------------------------------


def _keyed_job(name: str, sink_dir: Path, records: int = 20_000, p: int = 2) -> StreamEnvironment:
    env = StreamEnvironment(name, parallelism=p, max_parallelism=128)
    env.from_source(_source(records, rate_per_subtask=20_000), uid="src").key_by("key").process(
        KeyedSum("key", "seq", out="none"), uid="sum"
    )
    env.from_source(_source(records), uid="src2").sink(ParquetSink(str(sink_dir)), uid="pq")
    return env


def test_checkpoints_are_retained_described_and_measured(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    cfg = _config(tmp_path, **{"state.checkpoints.num-retained": 2})
    result = LocalExecutor(
        _keyed_job("meta", tmp_path / "out"), cfg, metrics_path=str(metrics)
    ).run(timeout=60)
    assert result.status == "finished"
    done = result.completed_checkpoints()
    assert len(done) >= 3 and done[-1]["final"]
    storage = CheckpointStorage(str(tmp_path / "ckpt"), "meta")
    assert storage.completed_ids() == [c["checkpoint_id"] for c in done[-2:]]
    latest = storage.latest()
    assert latest is not None
    m = storage.read_metadata(latest.checkpoint_id)  # the file's JSON
    assert (m["format"], m["version"], m["final"]) == ("spillover-checkpoint", 3, True)
    assert m["settings"]["max-parallelism"] == 128 and m["settings"]["format-version"] == 1
    assert set(m["tasks"]) == {"src", "sum", "src2"}
    keyed = m["tasks"]["sum"]["subtasks"]["0"]["keyed"]["sum"]
    assert keyed["key_group_range"] == [0, 63] or keyed.get("key_groups") is not None or keyed
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert {x["checkpoint_id"] for x in lines if x["status"] == "completed"} >= {
        c["checkpoint_id"] for c in done
    }
    assert all(x["inflight_bytes"] == 0 for x in lines)  # aligned checkpoints persist none
    assert pq.read_table(tmp_path / "out").num_rows == 20_000


def test_final_checkpoint_commits_bounded_jobs(tmp_path: Path) -> None:
    """With an interval far longer than the job, only the final checkpoint commits the sink."""
    cfg = _config(tmp_path, **{"execution.checkpointing.interval": "1 h"})
    result = LocalExecutor(_keyed_job("final", tmp_path / "out"), cfg).run(timeout=60)
    done = result.completed_checkpoints()
    assert [c["final"] for c in done] == [True]
    assert pq.read_table(tmp_path / "out").num_rows == 20_000


def test_restore_refuses_lost_state_or_a_changed_max_parallelism(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    assert LocalExecutor(_keyed_job("r", tmp_path / "o1"), cfg).run(timeout=60).status == "finished"
    cid = CheckpointStorage(str(tmp_path / "ckpt"), "r").completed_ids()[-1]
    env = StreamEnvironment("r", parallelism=2, max_parallelism=128)
    env.from_source(_source(), uid="src").sink(CollectingSink("r"), uid="s")  # "sum" is gone
    with pytest.raises(ConfigError, match="no longer has"):
        LocalExecutor(env, cfg, restore_checkpoint=cid).run(timeout=60)
    env = StreamEnvironment("r", parallelism=2, max_parallelism=256)
    env.from_source(_source(), uid="src").sink(CollectingSink("r"), uid="s")
    with pytest.raises(ConfigError, match="max parallelism changed"):
        LocalExecutor(env, cfg, restore_checkpoint=cid).run(timeout=60)


class FlakySnapshot(Operator):
    """Passes batches on; its snapshot's asynchronous part fails for checkpoint 2."""

    def process(self, batch: Batch, input_index: int = 0) -> None:
        self.ctx.output.emit(batch)

    def snapshot(self, checkpoint_id: int) -> OperatorSnapshot:
        def finalize(directory: str) -> None:
            if checkpoint_id == 2:
                raise OSError("disk went away")

        return OperatorSnapshot({"ok": True}, finalize)


def test_failed_checkpoint_is_aborted_and_cleaned_up(tmp_path: Path) -> None:
    env = StreamEnvironment("flaky", parallelism=1)
    op = FlakySnapshot()
    op.out_dtype = GeneratorSource.dtype(16)
    env.from_source(_source(8000, rate_per_subtask=20_000), uid="src").process(
        op, uid="flaky"
    ).sink(CollectingSink("flaky"), uid="sink")
    cfg = _config(tmp_path, **{"execution.checkpointing.tolerable-failed-checkpoints": 3})
    result = LocalExecutor(env, cfg).run(timeout=60)
    assert result.status == "finished" and result.attempts == 1
    c2 = next(c for c in result.checkpoints if c["checkpoint_id"] == 2)
    assert c2["status"] == "aborted" and "disk went away" in c2["reason"]
    assert not os.path.exists(tmp_path / "ckpt" / "flaky" / "chk-2")
    assert any(c["status"] == "completed" for c in result.checkpoints)


def test_retention_counts_the_checkpoints_of_earlier_attempts(tmp_path: Path) -> None:
    """state.checkpoints.num-retained holds over restarts: after a run with induced
    failures only the newest checkpoints are left, not one per restored attempt, with
    the older ones whose files they point into (the state of subtasks that had
    finished before them: when a subtask ends before the last checkpoint depends on
    the run's timing)."""
    from spillover.runtime.checkpointing.metadata import load_checkpoint, referenced_checkpoints
    from spillover.runtime.failures import FailureInjector
    from spillover.verify import VerifySpec, run_once

    for retained in (1, 2):
        spec = VerifySpec(records=20_000, failures=3, interval_ms=50, num_retained=retained)
        failures = FailureInjector.random(
            3, [("running-total", 2)], seed=3, records_per_subtask=10_000
        )
        out = run_once(spec, str(tmp_path), f"kept-{retained}", failures)
        assert out.result.status == "finished" and len(out.result.restored_from) >= 2
        job = Path(str(out.result.checkpoint_dir))
        left = sorted(int(d.name[4:]) for d in job.glob("chk-*"))
        done = [c["checkpoint_id"] for c in out.result.completed_checkpoints()]
        kept = set(done[-retained:])
        for c in done[-retained:]:
            kept.update(referenced_checkpoints(load_checkpoint(str(job / f"chk-{c}"))))
        assert left == sorted(kept), (left, done, out.result.restored_from)


def test_every_sink_subtask_of_a_run_names_its_files_for_that_run(tmp_path: Path) -> None:
    """Without checkpoints each sink subtask commits at its own end: one that starts
    writing after another committed must see that output as its own run's (not
    another run's, which it would refuse). The files of one run carry one tag."""
    out = tmp_path / "out"
    env = StreamEnvironment("run-tagged", parallelism=3)
    env.from_source(_source(6_000), uid="src").rebalance().sink(ParquetSink(str(out)), uid="pq")
    result = LocalExecutor(env, Config.from_dict({})).run(timeout=60)
    assert result.status == "finished", result.failures
    tags = {p.name.rpartition("-")[2][:6] for p in out.glob("part-*.parquet")}
    assert len(tags) == 1 and len(list(out.glob("part-*.parquet"))) >= 3
    assert pq.read_table(out).num_rows == 6_000


def test_a_storage_fault_of_the_moment_does_not_refuse_a_whole_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checking a restore point's files meets a storage fault once (no space, a
    reset connection): the check is tried again and the job restores; a missing
    file still refuses the checkpoint at once."""
    import errno

    import spillover.runtime.jobmaster as jm
    from spillover.errors import StateFileNotFoundError, StorageError

    cfg = _config(tmp_path)
    assert LocalExecutor(_keyed_job("f", tmp_path / "o1"), cfg).run(timeout=60).status == "finished"
    cid = CheckpointStorage(str(tmp_path / "ckpt"), "f").completed_ids()[-1]
    real = jm.plan_restore
    calls: list[int] = []

    def flaky(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise StorageError("cannot open channel index", errno=errno.ENOSPC)
        return real(*a, **kw)

    monkeypatch.setattr(jm, "plan_restore", flaky)
    monkeypatch.setattr(jm, "RESTORE_CHECK_BACKOFF_S", 0.0)
    # The restore continues the first run, into its output: the checkpoint's pending
    # files are that run's, published already or still staged there.
    result = LocalExecutor(_keyed_job("f", tmp_path / "o1"), cfg, restore_checkpoint=cid).run(
        timeout=60
    )
    assert result.status == "finished" and result.restored_from[:1] == [cid], result.failures
    assert len(calls) >= 2

    def missing(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        raise StateFileNotFoundError("a state file is missing", errno=errno.ENOENT)

    monkeypatch.setattr(jm, "plan_restore", missing)
    calls.clear()
    with pytest.raises(StateFileNotFoundError):
        LocalExecutor(_keyed_job("f", tmp_path / "o3"), cfg, restore_checkpoint=cid).run(timeout=60)
    assert len(calls) == 1
