"""Checkpoints after tasks finish (FLIP-147), on whole jobs: tasks that end free
their thread while checkpoints go on, the metadata says which operators finished,
and a restore never runs a finished operator again."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spillover.config import Config
from spillover.deploy.local import LocalExecutor
from spillover.runtime.checkpointing.metadata import CheckpointStorage
from spillover.runtime.connectors.collecting import CollectingSink
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.failures import FailureInjector, FailureSpec
from spillover.runtime.graph import StreamEnvironment
from spillover.verify import VerifySpec, compare, run_once
from spillover.verify.run import run_rescaled
from spillover.verify.topologies import SUMMARY_PARTITION
from support.operators import FailAtFinalCommit, FinalCheckpointSink, SummaryOnFinish

POLICIES = {
    "aligned": {},
    "unaligned": {"execution.checkpointing.unaligned.enabled": True},
    "timeout": {
        "execution.checkpointing.unaligned.enabled": True,
        "execution.checkpointing.aligned-checkpoint-timeout": "20 ms",
    },
}
SHORT, LONG = 200, 5000  # records per partition of the short and the long branch


def _job(
    name: str, parallelism: int = 2, short: GeneratorSource | None = None
) -> StreamEnvironment:
    """A short branch (a bounded source and an operator emitting in ``finish()``)
    beside a long one (a paced source), both into one exactly-once sink."""
    env = StreamEnvironment(name, parallelism=parallelism, max_parallelism=128)
    if short is None:
        short = GeneratorSource(partitions=2, records_per_partition=SHORT, payload_bytes=16)
    branch = env.from_source(short, uid="short").process(SummaryOnFinish(name), uid="summary")
    long = env.from_source(
        GeneratorSource(
            partitions=2,
            records_per_partition=LONG,
            payload_bytes=16,
            rate_per_subtask=2500,
            batch_size=64,
            seed=1,
        ),
        uid="long",
    )
    branch.union(long).sink(CollectingSink(name), uid="sink")
    return env


def _config(tmp: Path, policy: str) -> Config:
    return Config.from_dict(
        {
            "execution.checkpointing.interval": "100 ms",
            "state.checkpoints.dir": str(tmp / "ckpt"),
            # The restored checkpoints stay to be read afterwards.
            "state.checkpoints.num-retained": 1000,
            "restart-strategy.fixed-delay.attempts": 3,
            "restart-strategy.fixed-delay.delay": "0 ms",
            **POLICIES[policy],
        }
    )


@pytest.mark.parametrize(
    ("policy", "rescale_to"), [(p, None) for p in POLICIES] + [("aligned", 3), ("unaligned", 1)]
)
def test_finish_output_is_committed_once_after_a_failure_past_a_finished_branch(
    policy: str, rescale_to: int | None, tmp_path: Path
) -> None:
    """The probe of FLIP-147: the long branch fails after the short one finished
    and a checkpoint recorded that; the restore (at the same parallelism, or at
    another one) does not run the short branch's operators again, so its summary
    is committed exactly once."""
    name = f"finish-once-{policy}-{rescale_to}"
    SummaryOnFinish.opened.pop(name, None)
    env = _job(name)
    # 2,500 records/s per subtask: a second in, long after the short branch ended.
    failures = FailureInjector([FailureSpec("operator", "long", 0, after_records=2500)])
    rescale = None if rescale_to is None else (lambda *_: _job(name, parallelism=rescale_to))
    # The union into the sink is a forward edge: rescaling it is asked for.
    ex = LocalExecutor(
        env,
        _config(tmp_path, policy),
        failures=failures,
        rescale=rescale,
        force_forward_rescale=True,
    )
    result = ex.run(timeout=120)
    assert result.status == "finished", result
    assert len(failures.fired) == 1
    rows = CollectingSink.records(name)
    summaries = rows[rows["partition"] < 0]
    assert sorted(summaries["partition"].tolist()) == [-2, -1]  # once per subtask
    assert summaries["seq"].sum() == 2 * SHORT
    data = rows[rows["partition"] >= 0]
    ids = data[["partition", "seq", "key"]]  # the branches differ in their keys (seeds)
    assert len(ids) == len(np.unique(ids)) == 2 * SHORT + 2 * LONG
    # The restored attempt never opened the finished operator.
    assert SummaryOnFinish.opened[name] == 2
    storage = CheckpointStorage(str(tmp_path / "ckpt"), name)
    assert result.restored_from, "the failure restored a checkpoint"
    meta = storage.read_metadata(result.restored_from[0])
    assert meta["tasks"]["short"]["finished"] == "fully"


def test_a_partially_finished_operator_restores_its_finished_subtask_finished(
    tmp_path: Path,
) -> None:
    """One subtask of the short branch has nothing to read and finishes at once, the
    other reads for seconds and fails; the restore starts the finished subtask
    finished (its summary is not emitted again) and the running one from its state."""
    name = "partially-finished"
    SummaryOnFinish.opened.pop(name, None)
    # One partition at parallelism 2: subtask 1 owns none.
    short = GeneratorSource(
        partitions=1, records_per_partition=4000, payload_bytes=16, rate_per_subtask=1000
    )
    env = _job(name, short=short)
    failures = FailureInjector([FailureSpec("operator", "short", 0, after_records=3000)])
    result = LocalExecutor(env, _config(tmp_path, "unaligned"), failures=failures).run(timeout=120)
    assert result.status == "finished", result
    assert len(failures.fired) == 1
    rows = CollectingSink.records(name)
    summaries = rows[rows["partition"] < 0]
    assert sorted(summaries["partition"].tolist()) == [-2, -1]
    assert sorted(summaries["seq"].tolist()) == [0, 4000]
    data = rows[rows["partition"] >= 0]
    ids = data[["partition", "seq", "key"]]
    assert len(ids) == len(np.unique(ids)) == 4000 + 2 * LONG
    meta = CheckpointStorage(str(tmp_path / "ckpt"), name).read_metadata(result.restored_from[0])
    assert meta["tasks"]["short"]["finished"] == "partially"
    assert [meta["tasks"]["short"]["subtasks"][i]["finished"] for i in "01"] == [False, True]
    # Subtask 0 opened twice (before and after the failure), subtask 1 once.
    assert SummaryOnFinish.opened[name] == 3


@pytest.mark.parametrize("rescale_to", [None, 3])
def test_a_sink_restored_finished_commits_what_its_final_checkpoint_left_pending(
    rescale_to: int | None, tmp_path: Path
) -> None:
    """The short branch's two-phase-commit sink finishes, its final checkpoint
    completes, and the attempt fails before the sink hears of it (as a crash or a
    stop right after a completion does). The restore starts the sink finished; the
    records that checkpoint pre-committed are committed all the same, once (at the
    same parallelism, and at another one)."""
    name = f"final-commit-{rescale_to}"
    CollectingSink.clear(name)
    CollectingSink.clear(name + "-short")

    def job(parallelism: int = 2) -> StreamEnvironment:
        env = StreamEnvironment(name, parallelism=parallelism, max_parallelism=128)
        short = GeneratorSource(partitions=2, records_per_partition=SHORT, payload_bytes=16)
        env.from_source(short, uid="short").sink(
            FinalCheckpointSink(name + "-short"), uid="short-sink"
        )
        long = GeneratorSource(
            partitions=2, records_per_partition=LONG, payload_bytes=16, rate_per_subtask=2500
        )
        env.from_source(long, uid="long").sink(CollectingSink(name), uid="long-sink")
        return env

    # The short source's last batch reaches the sink in the call that exhausts it, so
    # the final checkpoint always has records to commit.
    failures = FailAtFinalCommit("short", 0, name + "-short")
    rescale = None if rescale_to is None else (lambda *_: job(rescale_to))
    ex = LocalExecutor(job(), _config(tmp_path, "aligned"), failures=failures, rescale=rescale)
    result = ex.run(timeout=120)
    assert result.status == "finished", result
    assert len(failures.fired) == 1, "the final checkpoint's commit failed"
    meta = CheckpointStorage(str(tmp_path / "ckpt"), name).read_metadata(result.restored_from[0])
    sink = meta["tasks"]["short"]["subtasks"]["0"]
    assert sink["finished"], "the sink was restored finished"
    assert sink["operators"]["short-sink"]["pending"], "its final checkpoint pre-committed"
    rows = CollectingSink.records(name + "-short")
    ids = rows[["partition", "seq"]]
    assert len(ids) == len(np.unique(ids)) == 2 * SHORT
    assert len(CollectingSink.records(name)) == 2 * LONG


def test_a_bounded_branch_ends_while_checkpoints_go_on(tmp_path: Path) -> None:
    """Its tasks end (threads gone) after the checkpoint that covers them, while the
    long branch runs; later checkpoints complete without them and record the
    branch as finished."""
    name = "bounded-beside-unbounded"
    env = _job(name)
    ex = LocalExecutor(env, _config(tmp_path, "aligned"))
    seen: dict[str, Any] = {}
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.01):
            run = ex._current
            if run is None:
                continue
            tasks = run.tasks
            if all(tasks[("short", i)].finished_at > 0 for i in range(2)):  # ended
                seen["completed"] = list(run.coordinator.completed_ids)
                seen["long_alive"] = all(tasks[("long", i)].finished_at == 0 for i in range(2))
                return

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = ex.run(timeout=120)
    finally:
        stop.set()
        watcher.join()
    assert result.status == "finished"
    assert seen.get("long_alive"), "the short branch's tasks ended while the long one ran"
    ended_after = max(seen["completed"])
    later = [
        c["checkpoint_id"]
        for c in result.completed_checkpoints()
        if c["checkpoint_id"] > ended_after
    ]
    assert len(later) >= 2, "checkpoints went on after the short branch ended"
    storage = CheckpointStorage(str(tmp_path / "ckpt"), name)
    kept = [cid for cid in later if cid in storage.completed_ids()]  # not subsumed
    meta = storage.read_metadata(kept[0])
    assert meta["tasks"]["short"]["finished"] == "fully"
    assert meta["tasks"]["long"]["finished"] == "running"
    assert all(s["finished"] for s in meta["tasks"]["short"]["subtasks"].values())


def finishing_failure(spec: VerifySpec) -> FailureInjector:
    """A failure of the paced main source halfway through its records: the short
    branch has finished (and been checkpointed as finished) long before."""
    per_subtask = spec.records // spec.parallelism
    return FailureInjector([FailureSpec("operator", "source", 0, after_records=per_subtask // 2)])


@pytest.mark.parametrize(("policy", "rescale_to"), [("aligned", None), ("unaligned", 3)])
def test_verify_finishing_is_exact_after_a_failure_past_the_finished_branch(
    policy: str, rescale_to: int | None, tmp_path: Path
) -> None:
    """``spillover verify --topology finishing``'s job: committed output equals a
    failure-free run's, summaries (finish() output) included, at the same and at
    another parallelism."""
    spec = VerifySpec(
        topology="finishing",
        policy=policy,
        parallelism=2,
        records=20_000,
        rate_per_subtask=10_000,
        failures=1,
        interval_ms=100,
    )
    base = run_once(spec, str(tmp_path), "base", FailureInjector())
    summaries = base.rows[base.rows["partition"] >= SUMMARY_PARTITION]
    assert len(summaries) == 4  # one per short partition
    failures = finishing_failure(spec)
    if rescale_to is None:
        other = run_once(spec, str(tmp_path), "failing", failures)
    else:  # stopped as a crash would once the failure happened, restored at 3
        rescaled = dataclasses.replace(spec, rescale_to=rescale_to)
        other = run_rescaled(rescaled, str(tmp_path), "failing", failures, stop_after=60)
    assert len(failures.fired) == 1
    report = compare(spec, base, other)
    assert report.exact, report.text()


def test_a_window_committed_twice_is_named(tmp_path: Path) -> None:
    """The finishing topology's event-time windows are compared too: a window
    committed twice (or never) makes the run inexact, and the report names it."""
    import os
    import shutil

    from spillover.verify.topologies import WINDOW_VIEW_DIR

    spec = VerifySpec(topology="finishing", records=8_000, rate_per_subtask=None, failures=0)
    run = run_once(spec, str(tmp_path), "run", FailureInjector())
    assert compare(spec, run, run).exact
    assert run.out_dir is not None
    view = os.path.join(run.out_dir, WINDOW_VIEW_DIR)
    part = sorted(f for f in os.listdir(view) if f.endswith(".parquet"))[0]
    shutil.copy(os.path.join(view, part), os.path.join(view, "part-9-a0-c0-0.parquet"))
    again = run_once(spec, str(tmp_path), "again", FailureInjector())
    report = compare(spec, again, run)
    assert not report.exact and report.windows_wrong, report.text()
    assert "event-time windows differ" in report.text()


def test_a_finished_keyed_operator_keeps_its_state_in_checkpoints_after_a_restore(
    tmp_path: Path,
) -> None:
    """A keyed operator that finished is restored finished and never runs again, but
    its keyed state stays in every checkpoint after the restore (FLIP-147 keeps a
    finished operator's state)."""
    from spillover.verify.topologies import RunningTotal

    name = "finished-keyed"
    env = StreamEnvironment(name, parallelism=2, max_parallelism=128)
    short = GeneratorSource(partitions=2, records_per_partition=SHORT, payload_bytes=100)
    env.from_source(short, uid="short").key_by("key").process(RunningTotal(), uid="totals").sink(
        CollectingSink(name + "-short"), uid="short-sink"
    )
    long = GeneratorSource(
        partitions=2, records_per_partition=LONG, payload_bytes=16, rate_per_subtask=2500
    )
    env.from_source(long, uid="long").rebalance().sink(CollectingSink(name), uid="long-sink")
    failures = FailureInjector([FailureSpec("operator", "long", 0, after_records=LONG // 2)])
    result = LocalExecutor(env, _config(tmp_path, "aligned"), failures=failures).run(timeout=120)
    assert result.status == "finished" and len(failures.fired) == 1, result
    restored = result.restored_from[0]
    storage = CheckpointStorage(str(tmp_path / "ckpt"), name)
    assert storage.read_metadata(restored)["tasks"]["totals"]["finished"] == "fully"
    after = [cid for cid in storage.completed_ids() if cid > restored]
    assert after, "no checkpoint completed after the restore"
    for cid in after:
        subtasks = storage.read_metadata(cid)["tasks"]["totals"]["subtasks"]
        assert all(s["keyed"] for s in subtasks.values()), (cid, subtasks)
    assert len(CollectingSink.records(name + "-short")) == 2 * SHORT  # not run again
