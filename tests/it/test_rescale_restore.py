"""Restoring checkpoints with in-flight data at another parallelism, end to end.

Each case runs a built-in topology at N under backpressure with induced failures,
stops it part way (as a crash would), restores the latest checkpoint, which must
hold in-flight data, at M, runs it to the end and compares the committed output
and the final keyed state with a run that never failed: nothing lost, nothing
duplicated, order kept per key and source partition, every key in its key group.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spillover.config import Config
from spillover.deploy import local
from spillover.deploy.local import LocalExecutor
from spillover.errors import ConfigError, RescaleError, StorageError
from spillover.runtime import wiring
from spillover.runtime.api import Batch, Operator
from spillover.runtime.connectors.collecting import CollectingSink
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.failures import FailureInjector, FailureSpec
from spillover.runtime.operators import KeyedCount
from spillover.runtime.recovery.shared_reads import SharedReads
from spillover.storage.channel_index import ReadEntries
from spillover.streaming import StreamEnvironment
from spillover.verify import VerifySpec, build, compare, config_for, output_of, run_once
from support.checkpointed import checkpointed

PAIRS = [(1, 2), (2, 3), (3, 7), (4, 8), (5, 2), (3, 5), (7, 2)]
PAIRS += [(b, a) for a, b in PAIRS]
SLOW_PAIRS = [(20, 21), (21, 20), (12, 7), (7, 12)]


@pytest.mark.parametrize(("old", "new"), PAIRS)
def test_rescale_pipeline(old: int, new: int, rescale_exact: Callable[..., None]) -> None:
    rescale_exact("pipeline", old, new)


@pytest.mark.parametrize("topology", ["multi-input", "union"])
@pytest.mark.parametrize(("old", "new"), [(1, 2), (2, 3), (3, 2), (4, 2), (2, 5)])
def test_rescale_multi_input_and_union(
    topology: str, old: int, new: int, rescale_exact: Callable[..., None]
) -> None:
    rescale_exact(topology, old, new)


def test_rescale_with_bounded_inflight_data(rescale_exact: Callable[..., None]) -> None:
    rescale_exact("pipeline", 3, 2, policy="max-inflight")


def test_restore_without_rescaling(rescale_exact: Callable[..., None]) -> None:
    rescale_exact("union", 2, 2)


def test_a_scale_up_reads_each_old_channel_once_per_process(
    rescale_exact: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Restored 2 -> 4 on the local executor (one process), the new subtasks that split
    an old channel's key groups share one read of it, and the run stays exact."""
    real = wiring.share_reads
    shared: list[SharedReads] = []

    def recording_share_reads(*args: Any, **kwargs: Any) -> SharedReads:
        out = real(*args, **kwargs)
        shared.append(out)
        return out

    monkeypatch.setattr(wiring, "share_reads", recording_share_reads)
    rescale_exact("pipeline", 2, 4)
    parts = [p for s in shared for gates in s.values() for p in gates.values()]
    assert parts, "no restored attempt shared a read"
    by_read: dict[int, set[int]] = {}
    for p in parts:
        by_read.setdefault(id(p._shared), set()).add(p.subtask)
    # new 0 and 1 split old 0's key groups, new 2 and 3 old 1's: one read per pair
    assert {frozenset(s) for s in by_read.values()} == {frozenset({0, 1}), frozenset({2, 3})}


def test_the_entries_a_restore_reads_go_with_its_attempt(
    rescale_exact: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The channel index entries a restored attempt reads are kept for its subtasks
    only until they have resolved their replays: nothing of them stays in the process,
    not even while its tasks are still referenced."""
    real = wiring.share_reads
    kept: list[tuple[weakref.ref[ReadEntries], int]] = []
    built: list[Any] = []  # every attempt's tasks, kept alive past their run
    real_build = local.build_tasks

    def recording_build_tasks(*args: Any, **kwargs: Any) -> Any:
        tasks = real_build(*args, **kwargs)
        built.append(tasks)
        return tasks

    def recording_share_reads(*args: Any, **kwargs: Any) -> SharedReads:
        out = real(*args, **kwargs)
        entries = args[2]
        if entries is not None:
            kept.append((weakref.ref(entries), len(entries)))
        return out

    monkeypatch.setattr(wiring, "share_reads", recording_share_reads)
    monkeypatch.setattr(local, "build_tasks", recording_build_tasks)
    rescale_exact("pipeline", 2, 4)
    assert built and kept and any(n > 0 for _, n in kept), "no restored attempt shared its entries"
    gc.collect()
    assert all(ref() is None for ref, _ in kept)


@pytest.mark.slow
@pytest.mark.parametrize(("old", "new"), SLOW_PAIRS)
def test_rescale_wide(old: int, new: int, rescale_exact: Callable[..., None]) -> None:
    rescale_exact("pipeline", old, new)


# --- refusals ---------------------------------------------------------------------------------


def test_forward_edge_refuses_to_rescale_unless_forced(tmp_path: Path) -> None:
    from spillover.runtime.connectors.throttled import ThrottledSink
    from spillover.runtime.graph import StreamEnvironment

    def job(p: int) -> StreamEnvironment:
        env = StreamEnvironment("fwd", parallelism=p, max_parallelism=128)
        src = env.from_source(GeneratorSource(partitions=4, payload_bytes=16), uid="src")
        m = src.key_by("key").map(lambda b: b, uid="m")
        # Two consumers: the forward edge is a network edge, not a chain.
        m.forward().process(_Pass(), uid="fwd").sink(ThrottledSink(5_000), uid="sink")
        m.sink(ThrottledSink(5_000), uid="other")
        return env

    cfg = Config.from_dict(
        {
            "execution.checkpointing.interval": "50 ms",
            "state.checkpoints.dir": str(tmp_path / "ckpt"),
            "execution.checkpointing.unaligned.enabled": True,
        }
    )
    r = LocalExecutor(job(2), cfg).run(stop_after=1.0)
    cid = r.completed_checkpoints()[-1]["checkpoint_id"]
    with pytest.raises(RescaleError) as e:
        LocalExecutor(job(3), cfg, restore_checkpoint=cid).run(stop_after=2.0)
    assert "forward-rescale.forced" in str(e.value)
    forced = cfg.with_options({"execution.checkpointing.unaligned.forward-rescale.forced": True})
    r = LocalExecutor(job(3), forced, restore_checkpoint=cid).run(stop_after=1.0)
    assert r.status == "stopped" and r.replayed_bytes > 0


@pytest.mark.parametrize("new", [1, 3])
def test_a_forced_forward_rescale_replays_every_upstreams_inflight_output(
    tmp_path: Path, new: int
) -> None:
    """The runtime sends a forward edge's data from upstream ``u`` on subpartition
    ``u``; the forced rescale must read every old upstream's queued output there (it
    once read subpartition 0 only, losing upstream 1's: 25-33 records a run)."""
    from spillover.runtime.connectors.collecting import CollectingSink
    from spillover.runtime.graph import StreamEnvironment

    name = f"forced-forward-{new}"

    def job(p: int) -> StreamEnvironment:
        env = StreamEnvironment(name, parallelism=p, max_parallelism=128)
        paced = GeneratorSource(
            partitions=2,
            records_per_partition=5_000,
            payload_bytes=16,
            rate_per_subtask=2_500,
            batch_size=64,
            seed=1,
        )
        short = GeneratorSource(partitions=2, records_per_partition=200, payload_bytes=16)
        a = env.from_source(paced, uid="long")
        b = env.from_source(short, uid="short")
        b.union(a).sink(CollectingSink(name), uid="sink")  # forward edges into the sink
        return env

    cfg = Config.from_dict(
        {
            "execution.checkpointing.interval": "100 ms",
            "state.checkpoints.dir": str(tmp_path / "ckpt"),
            "state.checkpoints.num-retained": 20,
            "restart-strategy.fixed-delay.attempts": 3,
            "restart-strategy.fixed-delay.delay": "0 ms",
            "execution.checkpointing.unaligned.enabled": True,
            "execution.checkpointing.unaligned.forward-rescale.forced": True,
        }
    )
    failures = FailureInjector([FailureSpec("operator", "long", 0, after_records=2_500)])
    result = LocalExecutor(job(2), cfg, failures=failures, rescale=lambda *_: job(new)).run(
        timeout=120
    )
    assert result.status == "finished" and len(failures.fired) == 1, result
    rows = CollectingSink.records(name)
    ids = rows[["partition", "seq", "key"]]  # the two sources differ in their keys
    assert len(ids) == len(np.unique(ids)) == 2 * 5_000 + 2 * 200


def test_missing_inflight_file_refuses_the_whole_restore(tmp_path: Path) -> None:
    spec = VerifySpec(policy="unaligned", parallelism=2, records=10**9, rate_per_subtask=20_000)
    cfg, cid = checkpointed(tmp_path, spec)
    files = sorted((tmp_path / "ckpt" / "job" / f"chk-{cid}").rglob("*.spill"))
    assert files
    files[0].unlink()
    env = build(spec, str(tmp_path / "out"), "job", 3)
    with pytest.raises(StorageError) as e:
        LocalExecutor(env, cfg, restore_checkpoint=cid).run(timeout=60)
    assert e.value.path is not None and files[0].name in e.value.path


def test_escape_hatch_restores_without_inflight_data(tmp_path: Path) -> None:
    spec = VerifySpec(policy="unaligned", parallelism=2, records=40_000, rate_per_subtask=20_000)
    cfg, cid = checkpointed(tmp_path, spec)
    for f in (tmp_path / "ckpt" / "job" / f"chk-{cid}").rglob("*.spill"):
        f.unlink()  # in-flight data unreadable
    hatch = cfg.with_options(
        {"execution.checkpointing.recover-without-channel-state.checkpoint-id": cid}
    )
    result = LocalExecutor(
        build(spec, str(tmp_path / "out"), "job", 3), hatch, restore_checkpoint=cid
    ).run(timeout=120)
    assert result.status == "finished"
    assert result.replayed_bytes == 0  # dropped, as documented


def test_changed_max_parallelism_is_refused(tmp_path: Path) -> None:
    from spillover.runtime.connectors.collecting import CollectingSink
    from spillover.runtime.graph import StreamEnvironment

    spec = VerifySpec(policy="unaligned", parallelism=2, records=10**9, rate_per_subtask=20_000)
    cfg, cid = checkpointed(tmp_path, spec)
    env = StreamEnvironment("job", parallelism=2, max_parallelism=256)
    env.from_source(GeneratorSource(partitions=4), uid="source").sink(CollectingSink("x"), uid="s")
    with pytest.raises(ConfigError, match="max parallelism"):
        LocalExecutor(env, cfg, restore_checkpoint=cid).run(timeout=60)


class _Pass(Operator):
    """Passes batches on (a stateless operator behind a forward edge)."""

    out_dtype = GeneratorSource.dtype(16)

    def process(self, batch: Batch, input_index: int = 0) -> None:
        self.ctx.output.emit(batch)


def test_a_restart_may_change_the_parallelism(tmp_path: Path) -> None:
    """A rescale policy answers a failure with the job at parallelism 2 instead of 3:
    the next attempt restores the latest checkpoint rescaled (state and in-flight
    data), and the output is exactly the failure-free run's."""

    spec = VerifySpec(
        topology="pipeline",
        parallelism=3,
        records=60_000,
        rate_per_subtask=20_000.0,
        policy="unaligned",
    )
    baseline = run_once(spec, str(tmp_path), "baseline", FailureInjector())
    out_dir = str(tmp_path / "rescaled" / "output")
    make = spec.factory()
    asked: list[tuple[int, str]] = []

    def to_two(ex: object, attempt: int, error: BaseException) -> object:
        asked.append((attempt, type(error).__name__))
        return make(out_dir, "rescaled", 2)

    failures = FailureInjector([FailureSpec("operator", "running-total", 1, after_records=8_000)])
    ex = LocalExecutor(
        make(out_dir, "rescaled", 3),
        config_for(spec, str(tmp_path / "rescaled" / "ckpt")),
        failures=failures,
        rescale=to_two,  # type: ignore[arg-type]
    )
    result = ex.run(timeout=300)
    assert result.status == "finished" and result.attempts == 2, result.failures
    assert asked == [(0, "InducedFailure")]
    assert result.restored_from, "the second attempt restored a checkpoint"
    assert max(v.parallelism for v in ex.graph.vertices) == 2
    report = compare(spec, baseline, output_of(spec, result, out_dir, ex.graph.max_parallelism))
    assert report.exact, report.text()


def test_a_rescale_policy_must_keep_the_job_name_and_max_parallelism(tmp_path: Path) -> None:

    spec = VerifySpec(topology="pipeline", parallelism=2, records=5_000)
    make = spec.factory()
    ex = LocalExecutor(
        make(str(tmp_path / "o"), "job-a", 2),
        config_for(spec, str(tmp_path / "ckpt")),
        failures=FailureInjector([FailureSpec("operator", "running-total", 0, after_records=10)]),
        rescale=lambda ex, a, e: make(str(tmp_path / "o"), "job-b", 2),
    )
    with pytest.raises(ConfigError, match="keep the job's name"):
        ex.run(timeout=120)


@pytest.mark.parametrize("new", [2, 3])
def test_references_filtered_by_another_partitioner_are_refused_up_front(
    tmp_path: Path, new: int
) -> None:
    """A checkpoint taken while replaying a custom-partitioner edge references old
    channels with that partitioner's filter; restoring into a job whose edge has
    another partitioner is refused before anything runs (same and other parallelism)."""
    import json

    spec = VerifySpec(
        topology="custom-partitioner",
        policy="unaligned",
        parallelism=2,
        records=10**9,
        rate_per_subtask=20_000,
    )
    cfg, cid = checkpointed(tmp_path, spec)
    meta_path = tmp_path / "ckpt" / "job" / f"chk-{cid}" / "_metadata"
    meta = json.loads(meta_path.read_text())
    st = meta["tasks"]["custom-routed"]["subtasks"]["0"]
    st["channel_state"] = st.get("channel_state") or {}
    part = {"name": "elsewhere.other", "index": 0, "parallelism": 3, "key_offset": 0}
    st["channel_state"].setdefault("references", []).append(
        {"gate": 0, "channel": 0, "pieces": [], "filter": {"kind": "partitioner", **part}}
    )
    meta_path.write_text(json.dumps(meta))
    out = tmp_path / "out-restored"
    with pytest.raises(ConfigError, match="another partitioner") as e:
        LocalExecutor(build(spec, str(out), "job", new), cfg, restore_checkpoint=cid).run(
            timeout=60
        )
    assert "elsewhere.other" in str(e.value) and "key_modulo" in str(e.value)
    assert not out.exists() or not any(out.iterdir())  # nothing ran


@pytest.mark.parametrize("new", [1, 3, 4])
def test_pass_through_references_go_where_their_old_subtask_goes(tmp_path: Path, new: int) -> None:
    """A checkpoint taken while a rebalance edge replayed after a rescale references the
    unreplayed rest of each old subtask's streams, unfiltered. Restored at yet another
    parallelism, each such reference is replayed by the new subtasks the edge's mapping
    gives that old subtask's input state to (exactly one for rebalance), never by all."""
    import json

    from spillover.rescale import EdgeType, Side, map_edge
    from spillover.runtime.checkpointing.checkpoint_meta import CheckpointMetadata
    from spillover.runtime.graph import JobGraph
    from spillover.runtime.recovery.plan import plan_restore

    spec = VerifySpec(policy="unaligned", parallelism=2, records=10**9, rate_per_subtask=20_000)
    _cfg, cid = checkpointed(tmp_path, spec)
    meta = json.loads((tmp_path / "ckpt" / "job" / f"chk-{cid}" / "_metadata").read_text())
    sink = meta["tasks"]["parquet-sink"]["subtasks"]
    handle = next(  # any stored handle, as the shape of the pieces' handles
        h
        for task in meta["tasks"].values()
        for st in task["subtasks"].values()
        for side in ("input", "output")
        for h in (st.get("channel_state") or {}).get(side, [])
    )
    for d in ("0", "1"):
        piece = {"handle": {**handle, "uri": f"old-{d}"}, "channel": 0, "skip": 0}
        state = sink[d]["channel_state"] = sink[d].get("channel_state") or {}
        state.setdefault("references", []).append(
            {"gate": 0, "channel": 0, "pieces": [piece], "filter": {"kind": "none"}}
        )
    graph = JobGraph.build(build(spec, str(tmp_path / "out"), "job", new))
    plans = plan_restore(CheckpointMetadata.from_json(meta), graph, validate=False)
    replayed_by: dict[str, list[int]] = {"old-0": [], "old-1": []}
    for i in range(new):
        (edge,) = plans[("parquet-sink", i)].channel_state.rescaled
        for ref in edge.filtered_references:
            for p in ref.pieces:
                replayed_by[p.handle.uri].append(i)
    m = map_edge(
        EdgeType.REBALANCE,
        old_upstream=2,
        old_downstream=2,
        new_upstream=new,
        new_downstream=new,
        max_parallelism=128,
    )
    for old in (0, 1):
        expected = [i for i in range(new) if old in m.side(Side.INPUT).old_subtasks(i)]
        assert replayed_by[f"old-{old}"] == expected
        assert len(expected) == 1


def test_keyed_count_survives_a_failure_and_a_rescale(tmp_path: Path) -> None:
    """The bench job's keyed count (its sums in the native aggregate) fails at
    parallelism 2 and restarts at 3 from the last checkpoint: every key's committed
    counts are distinct and end at the number of records of that key."""
    name = f"keyed-count-{tmp_path.name}"
    partitions, per_partition, keys = 4, 6_000, 300

    def make(parallelism: int) -> StreamEnvironment:
        env = StreamEnvironment("keyed-count", parallelism=parallelism, max_parallelism=128)
        gen = GeneratorSource(
            partitions=partitions,
            records_per_partition=per_partition,
            rate_per_subtask=20_000.0,
            payload_bytes=16,
            keys=keys,
            batch_size=128,
        )
        (
            env.from_source(gen, uid="src")
            .key_by("key")
            .process(KeyedCount("key"), uid="count")
            .sink(CollectingSink(name), uid="sink")
        )
        return env

    config = Config.from_dict(
        {
            "execution.checkpointing.interval": "50 ms",
            "state.checkpoints.dir": str(tmp_path / "ckpt"),
            "restart-strategy.type": "fixed-delay",
            "restart-strategy.fixed-delay.attempts": 2,
            "restart-strategy.fixed-delay.delay": "10 ms",
            "execution.checkpointing.unaligned.enabled": True,
        }
    )
    failures = FailureInjector([FailureSpec("operator", "count", 1, after_records=4_000)])
    CollectingSink.clear(name)
    try:
        ex = LocalExecutor(make(2), config, failures=failures, rescale=lambda *_: make(3))
        result = ex.run(timeout=300)
        assert result.status == "finished" and result.attempts == 2, result.failures
        assert result.restored_from, "the second attempt restored a checkpoint"
        assert max(v.parallelism for v in ex.graph.vertices) == 3
        rows = CollectingSink.records(name)
    finally:
        CollectingSink.clear(name)
    # Every record the generator made: its key, counted.
    gen = GeneratorSource(partitions=partitions, records_per_partition=per_partition, keys=keys)
    seq = np.tile(np.arange(per_partition), partitions)
    part = np.repeat(np.arange(partitions), per_partition)
    uniq, counts = np.unique(gen.keys_of(part, seq), return_counts=True)
    expected = dict(zip(uniq.tolist(), counts.tolist(), strict=True))
    seen: dict[int, list[int]] = {}
    for k, c in zip(rows["key"].tolist(), rows["count"].tolist(), strict=True):
        seen.setdefault(k, []).append(c)
    assert {k: max(v) for k, v in seen.items()} == expected
    assert all(len(set(v)) == len(v) for v in seen.values()), "a count was committed twice"
