"""Loops (FLIP-15) on whole jobs: exactly-once under induced failures for every
policy, locally and on Spark; rescaled restores; restored checkpoints that really
held the head's logged feedback; a feedback far larger than the network that
spills instead of deadlocking; and loops that end exactly when empty."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spillover.config import Config
from spillover.deploy.local import LocalExecutor
from spillover.runtime.checkpointing.metadata import CheckpointStorage
from spillover.runtime.connectors.collecting import CollectingSink
from spillover.runtime.failures import FailureInjector, FailureSpec
from spillover.runtime.iteration import feedback
from spillover.verify import VerifySpec, verify
from spillover.verify.loops import build_iteration
from support.loops import TINY_NETWORK, countdown_job, doubling_job

SUPPORT = Path(__file__).resolve().parents[1] / "support"
SPEC = VerifySpec(topology="iteration", records=20_000, failures=5, interval_ms=100)
# Flink's network buffers, for the runs stopped part way: a 20,000-record loop at
# 128 KiB holds much of its data in flight, and may end before an aligned checkpoint
# completes after its failures (the runs to the end take the defaults).
FLINK_NETWORK = {
    "taskmanager.memory.segment-size": "32 kb",
    "taskmanager.network.memory.buffer-debloat.enabled": False,
}


def _exact(spec: VerifySpec, tmp_path: Path) -> None:
    report = verify(spec, str(tmp_path))
    assert report.exact, report.text()
    assert report.attempts > spec.failures, "every induced failure restarted the job"


# --- exactly-once under failures ---------------------------------------------------------


@pytest.mark.parametrize("policy", ["aligned", "unaligned", "timeout", "max-inflight"])
def test_a_loop_is_exactly_once_under_failures_for_every_policy(
    policy: str, tmp_path: Path
) -> None:
    _exact(dataclasses.replace(SPEC, policy=policy), tmp_path)


@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 2), (1, 4), (4, 1)])
@pytest.mark.parametrize("policy", ["aligned", "unaligned"])
def test_a_loop_restored_at_another_parallelism_is_exact(
    policy: str, old: int, new: int, tmp_path: Path
) -> None:
    spec = dataclasses.replace(
        SPEC, policy=policy, parallelism=old, rescale_to=new, failures=2, options=FLINK_NETWORK
    )
    report = verify(spec, str(tmp_path))
    assert report.exact, report.text()


@pytest.mark.parametrize("stop", ["savepoint", "unaligned-savepoint"])
def test_a_loop_stopped_with_a_savepoint_resumes_exactly(stop: str, tmp_path: Path) -> None:
    spec = dataclasses.replace(SPEC, stop=stop, failures=1, records=40_000, options=FLINK_NETWORK)
    report = verify(spec, str(tmp_path))
    assert report.exact, report.text()


class _CommitOnceFeedbackLogged(FailureInjector):
    """The script's commit failure waits for a completed checkpoint in which the head
    logged feedback, whatever the machine's speed (the first ones may come before
    any record went round the loop): at least one restore is from such a one."""

    def __init__(self, storage: CheckpointStorage, specs: list[FailureSpec]) -> None:
        super().__init__(specs)
        self.storage = storage

    def ready(
        self, point: str, attempt: int, vertex_uid: str, subtask: int, checkpoint: int | None
    ) -> bool:
        if point == "commit" and vertex_uid == "loop-head" and checkpoint is not None:
            head = self.storage.read(checkpoint).operator("loop-head").subtasks.values()
            return any(s.channel_state and s.channel_state.bytes for s in head)
        return True


@pytest.mark.parametrize("policy", ["aligned", "unaligned"])
def test_restores_replay_the_feedback_the_head_logged(policy: str, tmp_path: Path) -> None:
    """The checkpoints the job restored from held the head's logged feedback (its
    feedback channels' input state, non-zero), and the restores replayed it."""
    spec = dataclasses.replace(SPEC, policy=policy, rate_per_subtask=20_000.0)
    env = build_iteration(spec, str(tmp_path / "out"), "logged", spec.parallelism)
    ckpt = tmp_path / "ckpt"
    cfg = Config.from_dict(
        {
            **spec.checkpoint_options(),
            "execution.checkpointing.interval": "100 ms",
            "state.checkpoints.dir": str(ckpt),
            "state.checkpoints.num-retained": 1000,  # keep every restored one to read
            "restart-strategy.type": "fixed-delay",
            "restart-strategy.fixed-delay.attempts": 10,
            "restart-strategy.fixed-delay.delay": "0 s",
            # Buffers of 32 KiB: feedback reaches the head between checkpoints (at
            # 128 KiB a 20,000-record loop fills few buffers, and the restored
            # checkpoints may hold none).
            **FLINK_NETWORK,
        }
    )
    per_subtask = spec.records // spec.parallelism
    storage = CheckpointStorage(str(ckpt), "logged")
    failures = _CommitOnceFeedbackLogged(
        storage,
        [
            FailureSpec("operator", "loop-head", 0, after_records=per_subtask // 2),
            FailureSpec("commit", "loop-head", 0),
            FailureSpec("operator", "loop-body", 1, after_records=per_subtask),
        ],
    )
    result = LocalExecutor(env, cfg, failures=failures).run(timeout=300)
    assert result.status == "finished", result
    restored = [c for c in result.restored_from if c is not None]
    assert restored, result.failures
    logged = {}
    for cid in restored:
        heads = storage.read_metadata(cid)["tasks"]["loop-head"]["subtasks"]
        logged[cid] = sum(int(s["channel_state"].get("bytes", 0)) for s in heads.values())
    assert any(b > 0 for b in logged.values()), logged
    replayed = sum(
        m["replayed_bytes"] for k, m in result.tasks.items() if k.startswith("loop-head")
    )
    assert replayed > 0


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["aligned", "unaligned"])
def test_a_loop_on_spark_is_exactly_once_under_failures(policy: str, tmp_path: Path) -> None:
    pytest.importorskip("pyspark")
    _exact(dataclasses.replace(SPEC, policy=policy, executor="spark"), tmp_path)


# --- backpressure: spill, never deadlock ---------------------------------------------------


def _spill_job(records: int, generations: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, str(SUPPORT / "loop_spill_job.py"), str(records), str(generations)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(SUPPORT), *sys.path])},
        timeout=900,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_a_feedback_far_larger_than_the_network_spills_and_finishes_in_bounded_memory() -> None:
    records, generations = 1000, 9
    small = _spill_job(records, 1)
    big = _spill_job(records, generations)
    assert big["status"] == "finished"
    # Exact: every record doubled every round and left the loop once per copy.
    ids = np.r_[np.arange(500), 1_000_000 + np.arange(500)]
    assert big["exits"] == records * 2**generations
    assert big["id_sum"] == int(ids.sum()) * 2**generations
    network = 4 * 4096  # a partition's buffers (TINY_NETWORK)
    assert big["spilled"] > 500 * network, big
    # The spill stayed on disk: the peak RSS grew by far less than was spilled.
    grown = (big["maxrss_kb"] - small["maxrss_kb"]) * 1024
    assert grown < big["spilled"] / 2, (small, big)


def test_without_spilling_the_same_loop_deadlocks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The test hook turns spilling off: the loop's feedback then waits for credit
    like any edge, and the loop, whose records double each round, locks up once its
    buffers are full, so it never finishes. The timeout names the stuck tasks and
    logs where their threads are."""
    monkeypatch.setattr(feedback, "SPILLING", False)
    cfg = Config.from_dict({**TINY_NETWORK, "io.tmp.dirs": str(tmp_path)})
    with caplog.at_level("WARNING", logger="spillover.deploy.local"):
        result = LocalExecutor(doubling_job("deadlock", 1000, 10), cfg).run(timeout=8)
    assert result.status != "finished"
    assert any("did not finish in time (running: " in f for f in result.failures), result
    assert "did not finish; its thread is at:" in caplog.text
    tasks = result.tasks.values()
    assert sum(m.get("exits", 0) for m in tasks) < 1000 * 2**10
    assert sum(m.get("feedback_spilled_bytes", 0) for m in tasks) == 0


# --- termination ---------------------------------------------------------------------------


@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    rounds=st.lists(st.integers(0, 12), min_size=1, max_size=20),
    feedback_kind=st.sampled_from(["key_by", "forward"]),
)
def test_a_loop_ends_exactly_when_its_last_record_left(
    rounds: list[int], feedback_kind: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """No timeout is configured: the job ends because the loop emptied, with every
    record out exactly once after exactly its rounds, and not before the last left."""
    name = f"countdown-{feedback_kind}-{'-'.join(map(str, rounds))}"
    CollectingSink.clear(name)
    tmp = tmp_path_factory.mktemp("countdown")
    cfg = Config.from_dict(
        {"execution.checkpointing.interval": "50 ms", "state.checkpoints.dir": str(tmp)}
    )
    env = countdown_job(name, rounds, feedback=feedback_kind)
    result = LocalExecutor(env, cfg).run(timeout=300)  # a guard only
    assert result.status == "finished", result
    rows = CollectingSink.records(name)
    got = sorted(zip(rows["partition"].tolist(), rows["seq"].tolist(), strict=True))
    assert got == [(p, s) for p in range(4) for s in range(200)]
    heads = [m for k, m in result.tasks.items() if k.startswith("head#")]
    assert all(m["loop_ended_at"] > 0 and m["loop_rounds_quiet"] >= 1 for m in heads)


def test_an_unbounded_input_keeps_the_loop_running_until_drained(tmp_path: Path) -> None:
    name = "countdown-unbounded"
    CollectingSink.clear(name)
    cfg = Config.from_dict(
        {"execution.checkpointing.interval": "100 ms", "state.checkpoints.dir": str(tmp_path)}
    )
    env = countdown_job(name, [0, 3, 7], records_per_partition=None, rate_per_subtask=2000.0)
    ex = LocalExecutor(env, cfg)
    box: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: box.setdefault("r", ex.run(timeout=300)))
    runner.start()
    # Output committed: the loop runs, with records in it.
    while runner.is_alive() and not (
        max(ex.completed_ids(), default=0) >= 3 and len(CollectingSink.records(name))
    ):
        time.sleep(0.05)
    assert runner.is_alive(), f"an unbounded loop does not end on its own: {box.get('r')}"
    ex.stop_with_savepoint(drain=True)
    runner.join(300)
    result = box["r"]
    assert result.status == "finished", result
    rows = CollectingSink.records(name)
    # Drained: every record the sources emitted left the loop, exactly once.
    for p in range(4):
        seqs = np.sort(rows["seq"][rows["partition"] == p])
        assert len(seqs) and (seqs == np.arange(len(seqs))).all(), p
