"""The runtime end to end: job graphs, barrier alignment, exactly-once with induced
failures, real backpressure, checkpoint metadata, retention and restore refusals."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from spillover.config import Config
from spillover.deploy.local import LocalExecutor
from spillover.errors import ConfigError
from spillover.runtime.api import Batch, Operator, OperatorSnapshot
from spillover.runtime.checkpointing.aligned import BarrierHandler
from spillover.runtime.checkpointing.metadata import CheckpointStorage
from spillover.runtime.connectors.sinks import CollectingSink, ParquetSink, ThrottledSink
from spillover.runtime.connectors.sources import GeneratorSource
from spillover.runtime.graph import StreamEnvironment
from spillover.runtime.network.events import CheckpointBarrier
from spillover.runtime.operators import KeyedSum
from spillover.verify import VerifySpec, verify


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


# --- the job graph --------------------------------------------------------------------------


def test_forward_operators_chain_and_other_edges_cross_the_network() -> None:
    env = StreamEnvironment("g", parallelism=2)
    s = env.from_source(_source(), uid="src").map(lambda b: b, uid="m")
    s.key_by("key").process(KeyedSum("key", "seq"), uid="sum").sink(CollectingSink("g"), uid="sink")
    g = env.build()
    assert [[n.uid for n in v.nodes] for v in g.vertices] == [["src", "m"], ["sum", "sink"]]
    assert [(e.source, e.target, e.kind.value) for e in g.edges] == [(0, 1, "key_by")]
    assert g.vertices[1].head.keyed


def test_bad_graphs_fail_when_built() -> None:
    env = StreamEnvironment("g", parallelism=2)
    s = env.from_source(_source(), uid="src")
    with pytest.raises(ConfigError, match="forward edge"):
        s.forward().map(lambda b: b, parallelism=3)
    with pytest.raises(ConfigError, match="used twice"):
        s.map(lambda b: b, uid="src")
    with pytest.raises(ConfigError, match="int64"):
        s.key_by("partition")
    with pytest.raises(ConfigError, match="no field"):
        s.key_by("nope")


def test_fingerprint_changes_with_parallelism_and_uids() -> None:
    def graph(p: int, uid: str) -> str:
        env = StreamEnvironment("g", parallelism=p, max_parallelism=128)
        env.from_source(_source(), uid=uid).sink(CollectingSink("x"), uid="sink")
        return env.build().fingerprint()

    assert graph(2, "a") == graph(2, "a")
    assert graph(2, "a") != graph(3, "a")
    assert graph(2, "a") != graph(2, "b")


# --- barrier alignment ------------------------------------------------------------------------


class FakeGate:
    def __init__(self) -> None:
        self.blocked: set[int] = set()

    def block(self, channel: int) -> None:
        self.blocked.add(channel)

    def unblock_all(self) -> None:
        self.blocked.clear()


def _handler(n: int) -> tuple[BarrierHandler, FakeGate, list[Any]]:
    gate = FakeGate()
    log: list[Any] = []
    h = BarrierHandler(
        gate,
        n,
        lambda b, s: log.append(("aligned", b.checkpoint_id)),
        lambda cid: log.append(("aborted", cid)),
    )
    return h, gate, log


def test_alignment_blocks_each_channel_until_all_delivered() -> None:
    h, gate, log = _handler(3)
    h.on_barrier(0, CheckpointBarrier(1, 0))
    h.record_bytes(100)
    h.on_barrier(2, CheckpointBarrier(1, 0))
    assert gate.blocked == {0, 2} and log == []
    assert h.stats is not None and h.stats.bytes_during_alignment == 100
    h.on_barrier(1, CheckpointBarrier(1, 0))
    assert log == [("aligned", 1)] and gate.blocked == set()


def test_newer_barrier_aborts_the_alignment_in_progress() -> None:
    h, gate, log = _handler(2)
    h.on_barrier(0, CheckpointBarrier(1, 0))
    h.on_barrier(1, CheckpointBarrier(2, 0))  # n+1 overtook n on another channel
    assert log == [("aborted", 1)] and gate.blocked == {1}
    h.on_barrier(1, CheckpointBarrier(1, 0))  # the straggler of the aborted one
    assert log == [("aborted", 1)]
    h.on_barrier(0, CheckpointBarrier(2, 0))
    assert log == [("aborted", 1), ("aligned", 2)]


def test_cancel_marker_aborts_and_late_barriers_are_ignored() -> None:
    h, gate, log = _handler(2)
    h.on_barrier(0, CheckpointBarrier(5, 0))
    h.on_cancel(5)
    assert log == [("aborted", 5)] and gate.blocked == set()
    h.on_barrier(1, CheckpointBarrier(5, 0))
    assert log == [("aborted", 5)] and not h.aligning


def test_ended_channels_no_longer_hold_up_alignment() -> None:
    h, _, log = _handler(3)
    h.on_end_of_partition(2)
    h.on_barrier(0, CheckpointBarrier(1, 0))
    h.on_barrier(1, CheckpointBarrier(1, 0))
    assert log == [("aligned", 1)]
    h2, _, log2 = _handler(2)
    h2.on_barrier(0, CheckpointBarrier(1, 0))
    h2.on_end_of_partition(1)  # the last missing channel ends while aligning
    assert log2 == [("aligned", 1)]


# --- exactly-once with induced failures ----------------------------------------------------------


@pytest.mark.parametrize("topology", ["pipeline", "multi-input", "union"])
def test_exactly_once_with_five_induced_failures(topology: str, tmp_path: Path) -> None:
    spec = VerifySpec(
        topology=topology,
        parallelism=2,
        records=60_000,
        failures=5,
        seed=7,
        rate_per_subtask=40_000,
        interval_ms=60,
    )
    report = verify(spec, str(tmp_path))
    assert report.exact, report.text()
    assert len(report.failures_fired) == 5, report.text()
    kinds = {f.split(" ")[0] for f in report.failures_fired}
    assert kinds == {"operator", "commit", "restore", "snapshot"}
    assert report.checkpoints_completed >= 2
    assert report.records == spec.records * (2 if topology != "pipeline" else 1)


def test_verify_detects_loss(tmp_path: Path) -> None:
    """The comparison must be able to fail: drop committed rows and it says which."""
    from spillover.runtime.failures import FailureInjector
    from spillover.verify import compare, run_once

    spec = VerifySpec(records=4000, failures=0, rate_per_subtask=None)
    base = run_once(spec, str(tmp_path), "a", FailureInjector())
    other = run_once(spec, str(tmp_path), "b", FailureInjector())
    assert compare(spec, base, other).exact
    other.rows = np.concatenate([other.rows[10:], other.rows[10:13]])
    report = compare(spec, base, other)
    assert not report.exact
    assert len(report.lost) == 10 and len(report.duplicated) == 3
    assert "lost" in report.text() and "duplicated" in report.text()


# --- backpressure ---------------------------------------------------------------------------------


def test_slow_sink_backpressures_the_source(tmp_path: Path) -> None:
    """An unthrottled source paces down to what the throttled sink takes; buffers stay bounded."""
    rate, p, records = 20_000, 2, 60_000
    env = StreamEnvironment("bp", parallelism=p)
    env.from_source(_source(records), uid="src").key_by("key").sink(ThrottledSink(rate), uid="sink")
    cfg = Config.from_dict({"taskmanager.network.memory.buffers-per-partition": 4})
    result = LocalExecutor(env, cfg).run(timeout=60)
    assert result.status == "finished", result.failures
    assert result.duration_s >= 0.8 * records / (rate * p)
    src = [m for name, m in result.tasks.items() if name.startswith("src#")]
    assert all(m["backpressured_share"] > 0.3 for m in src), src
    assert all(m["records_out"] == records / p for m in src)


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
    meta = storage.latest()
    assert meta is not None
    m = meta.metadata
    assert (m["format"], m["version"], m["final"]) == ("spillover-checkpoint", 1, True)
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


# --- custom partitioners --------------------------------------------------------------


def _mod3(keys: Any, n: int) -> Any:
    return np.asarray(keys) % n


def test_a_custom_partitioner_routes_each_record_to_its_pick_in_order() -> None:
    from spillover.records import read_records
    from spillover.runtime.api import EdgeKind
    from spillover.runtime.network.writers import PartitionWriter

    dtype = np.dtype([("key", "<i8"), ("seq", "<i8")])
    sent: dict[int, list[bytes]] = {0: [], 1: [], 2: []}
    writer = PartitionWriter(
        EdgeKind.CUSTOM,
        dtype,
        3,
        0,
        64,
        128,
        "key",
        send=lambda sub, buf: sent[sub].append(bytes(buf)),
        send_all=None,
        partitioner=_mod3,
    )
    batch = np.zeros(100, dtype)
    batch["key"] = np.arange(100) * 7 - 50
    batch["seq"] = np.arange(100)
    writer.emit(batch[:40])
    writer.emit(batch[40:])
    writer.flush()
    for sub, bufs in sent.items():
        got = np.frombuffer(b"".join(read_records(bufs)), dtype)
        want = batch[batch["key"] % 3 == sub]
        assert got.tolist() == want.tolist()  # every pick, in emission order


def test_a_custom_partitioner_that_answers_out_of_range_fails_naming_it() -> None:
    from spillover.runtime.api import EdgeKind
    from spillover.runtime.network.writers import PartitionWriter

    dtype = np.dtype([("key", "<i8")])
    writer = PartitionWriter(
        EdgeKind.CUSTOM,
        dtype,
        2,
        0,
        64,
        128,
        "key",
        send=None,
        send_all=None,
        partitioner=lambda k, n: k + n,
    )
    with pytest.raises(ConfigError, match=r"picked subtask 2, outside 0\.\.1"):
        writer.emit(np.zeros(3, dtype))


def test_partition_custom_refuses_a_bad_key_field_or_partitioner() -> None:
    env = StreamEnvironment("custom", parallelism=2)
    s = env.from_source(_source(), uid="src")
    with pytest.raises(ConfigError, match="no field"):
        s.partition_custom(_mod3, "nope")
    with pytest.raises(ConfigError, match="must be callable"):
        s.partition_custom("mod", "key")  # type: ignore[arg-type]


def test_a_copy_of_the_failure_script_reports_what_fires_and_it_plays_once() -> None:
    """A worker's copy reports a failure before raising it; the original records it
    once, so the next attempt goes on with the next failure of the script."""
    import pickle

    from spillover.runtime.failures import FailureInjector, FailureSpec, InducedFailure

    original = FailureInjector([FailureSpec("commit"), FailureSpec("restore")])
    original.on_fire = lambda i, a: None
    copy = pickle.loads(pickle.dumps(original))
    assert copy.on_fire is None  # a copy reports to whoever sets its own
    seen: list[tuple[int, int]] = []
    copy.on_fire = lambda index, attempt: seen.append((index, attempt))
    with pytest.raises(InducedFailure):
        copy.check("commit", 1, "sink", 0)
    assert seen == [(0, 1)] and original.pending == 2
    original.mark_fired(0, 1)
    original.mark_fired(0, 1)  # another worker's copy fired it too: counted once
    assert [s.fired_in for s in original.fired] == [1]
    original.check("restore", 1, "sink", 0)  # never twice in one attempt
    with pytest.raises(InducedFailure):
        original.check("restore", 2, "sink", 0)
