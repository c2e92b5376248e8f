"""Checkpoints during recovery, whole jobs: a checkpoint triggered while a restored
task still replays its recovered input state completes, references the old files
instead of writing the unreplayed bytes again, and restores exactly.

The job: source -> (a source subtask that stalls now and then) -> key_by ->
running total -> throttled Parquet sink, chained. While source 0 stalls, the
barrier of its channel is late, so the keyed task keeps processing what that
channel had queued and persists it as input state: checkpoints hold a large
recovered input state. Replaying it is paced by the sink, one small step
(``STEP_BYTES``) at a time, so checkpoints are triggered during the replay.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import spillover.runtime.recovery.replay as recovery
from spillover.config import Config
from spillover.deploy.local import LocalExecutor
from spillover.runtime.api import Batch, Operator
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.connectors.parquet import ParquetSink
from spillover.runtime.connectors.throttled import ThrottledSink
from spillover.runtime.graph import StreamEnvironment
from spillover.runtime.jobmaster import JobResult
from spillover.verify import RunningTotal, VerifySpec, compare, output_of, per_partition_keys

PARTITIONS = 4
RECORDS = 20_000  # per partition
RATE = 6_000  # records/s per keyed subtask
SLOW = 1_500  # while a checkpoint during replay is awaited: the replay lasts
KEYED = "running-total"
# Whole runs a case may begin before one holds a checkpoint of large input: 3 ran out
# once in three full quiet runs of the suite (two cases of one run), so 6.
TRIES = 6


class _Stall(Operator):
    """Passes batches on; subtask 0 sleeps now and then, so its barriers come late."""

    def __init__(self, dtype: Any) -> None:
        self.out_dtype = dtype
        self.calls = 0

    def process(self, batch: Batch, input_index: int = 0) -> None:
        self.calls += 1
        if self.ctx.subtask_index == 0 and self.calls % 20 == 0:
            time.sleep(0.5)
        self.ctx.output.emit(batch)


def make_job(out_dir: str, name: str, parallelism: int, rate: float = RATE) -> StreamEnvironment:
    env = StreamEnvironment(name, parallelism=parallelism, max_parallelism=128)
    gen = GeneratorSource(
        partitions=PARTITIONS,
        records_per_partition=RECORDS,
        payload_bytes=100,
        keys=10_000,
        batch_size=256,
        seed=5,
    )
    src = env.from_source(gen, uid="source")
    keyed = src.process(_Stall(src.dtype), uid="stall").map(per_partition_keys(0), uid="keys")
    totals = keyed.key_by("key").process(RunningTotal(), uid=KEYED)
    totals.sink(ThrottledSink(rate, inner=ParquetSink(out_dir)), uid="sink")
    return env


def _config(ckpt: Path) -> Config:
    return Config.from_dict(
        {
            "execution.checkpointing.interval": "60 ms",
            "execution.checkpointing.unaligned.enabled": True,
            "state.checkpoints.dir": str(ckpt),
            "state.checkpoints.num-retained": 1,
            # Deep channels: a stalled source's queue holds much for the keyed task to
            # process before that source's barrier comes.
            "taskmanager.network.memory.buffers-per-channel": 16,
            # The volumes below are counted in 32 KiB buffers, which stay that size.
            "taskmanager.memory.segment-size": "32 kb",
            "taskmanager.network.memory.buffer-debloat.enabled": False,
        }
    )


def _metadata(ckpt: Path, cid: int) -> dict[str, Any]:
    return json.loads((ckpt / "job" / f"chk-{cid}" / "_metadata").read_text())  # type: ignore[no-any-return]


def _keyed_subtasks(meta: dict[str, Any]) -> list[dict[str, Any]]:
    return list(meta["tasks"][KEYED]["subtasks"].values())


def _input_bytes(meta: dict[str, Any]) -> int:
    """Bytes of the keyed operator's own input-state files."""
    return sum(
        h["raw_bytes"]
        for st in _keyed_subtasks(meta)
        for h in (st.get("channel_state") or {}).get("input", [])
    )


def _latest(history: list[dict[str, Any]]) -> dict[str, Any] | None:
    done = [c for c in history if c["status"] == "completed" and not c["final"]]
    return done[-1] if done else None


def _run(
    ckpt: Path,
    out_dir: str,
    parallelism: int,
    stop_when: Callable[[list[dict[str, Any]]], bool] | None,
    restore: int | None = None,
    rate: float = RATE,
    may_finish: bool = False,
) -> JobResult:
    env = make_job(out_dir, "job", parallelism, rate)
    ex = LocalExecutor(env, _config(ckpt), restore_checkpoint=restore)
    r = ex.run(timeout=120, stop_when=stop_when)
    if may_finish and r.status == "finished":
        return r
    assert r.status == ("stopped" if stop_when else "finished"), (
        r.failures,
        [c["reason"] for c in r.checkpoints if c["status"] != "completed"],
    )
    return r


class _Finished(Exception):
    """A run reached the end of its input before a checkpoint of the kind wanted."""


def _until(
    ckpt: Path,
    out_dir: str,
    restore: int | None,
    good: Callable[[dict[str, Any]], bool],
    rate: float = RATE,
    parallelism: int = 2,
    may_finish: bool = False,
) -> tuple[list[JobResult], int]:
    """Runs (restoring ``restore``) until the latest completed checkpoint is ``good``.

    A stop is not instant: another checkpoint may complete before it takes hold.
    Then the latest one is restored and the run goes on, as after any stop. With
    ``may_finish``, a run that reaches the end of its input first raises _Finished."""
    runs = []
    for _ in range(8):
        floor = restore or 0

        def ready(history: list[dict[str, Any]], floor: int = floor) -> bool:
            c = _latest(history)
            return c is not None and c["checkpoint_id"] > floor and good(c)

        r = _run(ckpt, out_dir, parallelism, ready, restore, rate, may_finish)
        if r.status == "finished":
            raise _Finished
        runs.append(r)
        done = [c for c in r.completed_checkpoints() if not c["final"]]
        if done and good(done[-1]):
            return runs, int(done[-1]["checkpoint_id"])
        restore = int(done[-1]["checkpoint_id"]) if done else restore
    raise AssertionError("no run stopped on a checkpoint of the kind wanted")


class _Case:
    """A failure-free run's output, then a run stopped at a checkpoint ``c1`` that holds
    a large input state at the keyed operator (replay takes many small steps, each a
    chance for a barrier).

    How much input state a checkpoint holds depends on timing. On a loaded machine
    a whole run can end before one holds enough; the case then begins again in a
    fresh directory."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(recovery, "STEP_BYTES", 8192)
        monkeypatch.setattr(recovery, "JOIN_BYTES", 8192)
        self.spec = VerifySpec(job=make_job, parallelism=2, state_uid=KEYED, state="total")
        base_out = str(tmp_path / "baseline")
        baseline = _run(tmp_path / "ckpt-baseline", base_out, 2, None)
        self.expected = output_of(self.spec, baseline, base_out, 128)
        for attempt in range(TRIES):
            self.ckpt = tmp_path / f"ckpt-{attempt}"
            self.out_dir = str(tmp_path / f"out-{attempt}")
            try:
                self.runs, self.c1 = _until(
                    self.ckpt, self.out_dir, None, self._large_input, may_finish=True
                )
                return
            except _Finished:
                continue
        raise AssertionError(f"{TRIES} whole runs ended without a checkpoint of large input")

    def _large_input(self, c: dict[str, Any]) -> bool:
        try:
            meta = _metadata(self.ckpt, c["checkpoint_id"])
        except FileNotFoundError:
            # Subsumed and deleted (one checkpoint is retained) while the run went on:
            # a newer one completed, which the next look judges.
            return False
        return _input_bytes(meta) > 160 << 10

    def points_back(self, cid: int, pieces: list[dict[str, Any]]) -> None:
        """Checkpoint ``cid`` references only older checkpoints, which stay on disk."""
        meta = _metadata(self.ckpt, cid)
        assert meta["references"] and all(r < cid for r in meta["references"])
        for old in meta["references"]:
            assert (self.ckpt / "job" / f"chk-{old}" / "_metadata").exists()
        for piece in pieces:
            assert f"/chk-{cid}/" not in piece["handle"]["uri"]

    def finish_exactly(self, restore: int, parallelism: int) -> None:
        """Restores ``restore`` at ``parallelism``, runs to the end: exact output."""
        env = make_job(self.out_dir, "job", parallelism)
        r = LocalExecutor(env, _config(self.ckpt), restore_checkpoint=restore).run(timeout=180)
        assert r.status == "finished", r.failures
        assert r.replayed_bytes > 0
        r.checkpoints = [c for run in self.runs for c in run.checkpoints] + r.checkpoints
        actual = output_of(self.spec, r, self.out_dir, 128)
        report = compare(self.spec, self.expected, actual)
        assert report.exact, report.text()


@pytest.mark.parametrize("new", [2, 3])
def test_checkpoint_during_replay_restores_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, new: int
) -> None:
    case = _Case(tmp_path, monkeypatch)
    ckpt, out_dir, c1, runs = case.ckpt, case.out_dir, case.c1, case.runs
    recovered = _input_bytes(_metadata(ckpt, c1))

    # 2. Restore it, replaying slowly, until a checkpoint completed during the replay.
    more, c2 = _until(ckpt, out_dir, c1, lambda c: c["referenced_bytes"] >= 96 << 10, SLOW)
    runs += more
    meta2 = _metadata(ckpt, c2)
    during = [st for st in _keyed_subtasks(meta2) if st["metrics"].get("referenced_bytes", 0) > 0]
    assert during, "no keyed subtask referenced recovered data"
    assert all(st["metrics"]["recovering"] == 1.0 for st in during)
    referenced = sum(int(st["metrics"]["referenced_bytes"]) for st in during)
    if len(more) == 1:  # it restored c1 itself
        assert 0 < referenced <= recovered
        assert meta2["references"] == [c1]
    # Referenced, not rewritten: its own input files hold less than what it had left.
    own = sum(
        h["raw_bytes"] for st in during for h in (st.get("channel_state") or {}).get("input", [])
    )
    assert own < referenced
    # Pointing into older checkpoints, which stay on disk for it, out of retention.
    case.points_back(
        c2, [p for st in during for r in st["channel_state"]["references"] for p in r["pieces"]]
    )

    # 3. A chain: a checkpoint taken while replaying c2, whose input state references
    # older files, references those files directly (never c2's references).
    more, c3 = _until(ckpt, out_dir, c2, lambda c: c["referenced_bytes"] > 0, SLOW)
    runs += more
    pieces3 = [
        p
        for st in _keyed_subtasks(_metadata(ckpt, c3))
        for r in (st.get("channel_state") or {}).get("references", [])
        for p in r["pieces"]
    ]
    assert pieces3, "c3 referenced no recovered data"
    case.points_back(c3, pieces3)

    # 4. Restore the chained checkpoint at ``new`` and run to the end.
    case.finish_exactly(c3, new)


def test_checkpoint_during_rescaled_replay_restores_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Restored 2 -> 3, the keyed task replays the old channels through the filtering
    retriever; a checkpoint completes during that replay, referencing each old
    channel's rest with its key-group filter; restored at 2 it runs to the end."""
    case = _Case(tmp_path, monkeypatch)
    ckpt, out_dir, c1, runs = case.ckpt, case.out_dir, case.c1, case.runs

    def filtered(meta: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            r
            for st in _keyed_subtasks(meta)
            for r in (st.get("channel_state") or {}).get("references", [])
            if "filter" in r
        ]

    # Restored at 3, slowly, until a checkpoint completed during the rescaled replay.
    more, c2 = _until(
        ckpt,
        out_dir,
        c1,
        lambda c: c["referenced_bytes"] > 0,
        SLOW,
        parallelism=3,
    )
    runs += more
    meta2 = _metadata(ckpt, c2)
    assert len(meta2["tasks"][KEYED]["subtasks"]) == 3
    refs = filtered(meta2)
    assert refs, "no filtered reference"
    assert all(r["filter"]["kind"] == "key_groups" for r in refs)
    during = [st for st in _keyed_subtasks(meta2) if st["metrics"].get("referenced_bytes", 0) > 0]
    assert during and all(st["metrics"]["recovering"] == 1.0 for st in during)
    # Pieces point into the old files (never into c2 itself), and those stay on disk.
    case.points_back(c2, [p for r in refs for p in r["pieces"]])

    # Restored again at 2 (filters composed) and run to the end: exact output.
    case.finish_exactly(c2, 2)
