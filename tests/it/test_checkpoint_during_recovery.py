"""Checkpoints during recovery, whole jobs: a checkpoint triggered while a restored
task still replays its recovered input state completes, references the old files
instead of writing the unreplayed bytes again, and restores exactly.

The job: source -> (an operator that can hold a source subtask) -> key_by ->
running total -> throttled Parquet sink, chained. The first run holds source
subtask 0 in the middle of a batch, so a checkpoint's barrier cannot leave it,
until the keyed subtasks have processed ``HELD_RECORDS`` of its records behind
that checkpoint's first barrier: each one is input state, so the checkpoint holds
a large recovered input state however fast the machine runs (:class:`_Hold`).
Replaying it is paced by the sink, one small step (``STEP_BYTES``) at a time; a
restored run that awaits a checkpoint during its replay pauses it after
``PAUSE_AFTER`` records, so every checkpoint it completes references the rest.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import spillover.runtime.recovery.replay as recovery
from spillover.config import Config
from spillover.deploy.local import LocalExecutor
from spillover.runtime.api import Batch, Operator, OperatorSnapshot
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.connectors.parquet import ParquetSink
from spillover.runtime.connectors.throttled import ThrottledSink
from spillover.runtime.graph import StreamEnvironment
from spillover.runtime.jobmaster import JobResult
from spillover.runtime.task import TaskCancelled
from spillover.verify import (
    RunningTotal,
    RunOutput,
    VerifySpec,
    compare,
    output_of,
    per_partition_keys,
)

PARTITIONS = 4
RECORDS = 20_000  # per partition
RATE = 6_000  # records/s per keyed subtask
SLOW = 1_500  # while a checkpoint during replay is awaited: the replay lasts
# A restored run that awaits a checkpoint during its replay: each keyed subtask takes
# no more input after this many records (about 31 KiB of the >= 240 KiB it replays),
# so every checkpoint it completes references the rest, however late it comes.
PAUSE_AFTER = 256
KEYED = "running-total"
LARGE_INPUT = 160 << 10  # bytes of input state at the keyed operator that make c1 large
# Records of source subtask 0 the keyed subtasks process behind c1's first barrier:
# each is a 120-byte record of input state, so c1 holds >= 240 KiB (> LARGE_INPUT).
# Source 0 has about 5,000 in flight when it is held (32 buffers, backpressured).
HELD_RECORDS = 2_048
HOLD_AT = 40  # source subtask 0 is held in its 40th batch, backpressured by then
HOLD_TIMEOUT = 60.0  # s: a hold that waits longer fails the test, naming what it awaited


class _Hold:
    """Makes the first run's checkpoint ``cid`` hold a large input state, by events,
    not timing.

    1. Source subtask 0 stops in its ``HOLD_AT``-th batch (``floor``: the newest
       checkpoint it took). No barrier of a newer checkpoint leaves it meanwhile.
    2. Source subtask 1 takes the next checkpoint's barrier; the keyed subtasks take
       it from that channel and snapshot (``cid``). Every record of source 0 they
       process from then on comes before its barrier: input state of ``cid``.
    3. Source subtask 1 stops in its next batch, so no checkpoint after ``cid``
       can complete; once the keyed subtasks counted ``records`` of source 0's
       records, source 0 goes on, takes ``cid`` and ``cid`` completes.
    4. The run is stopped on ``cid`` (:meth:`stop_when`): source 1 ends as a
       cancelled task does, so ``cid`` stays the newest completed checkpoint.

    Shared by every subtask's copy of the operators (a deep copy is itself). Each
    wait is bounded: past ``HOLD_TIMEOUT`` the hold fails, saying what it awaited,
    and holds nothing more."""

    def __init__(self, records: int) -> None:
        self.records = records
        self.floor: int | None = None
        self.cid: int | None = None
        self.partitions: set[int] = set()  # source subtask 0's
        self.counted: dict[int, int] = {}  # per keyed subtask, behind cid's barrier
        self.failure: str | None = None
        self._enough = threading.Event()
        self._parked = threading.Event()
        self._released = threading.Event()  # source subtask 0 goes on
        self._stopping = threading.Event()
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: dict[int, Any]) -> _Hold:
        return self

    def _fail(self, what: str) -> None:
        self.failure = f"{what} within {HOLD_TIMEOUT:.0f} s (counted {self.counted})"
        raise AssertionError(self.failure)

    def source_batch(self, subtask: int, calls: int, taken: int, batch: Batch) -> None:
        """A source subtask's batch, before it goes out (``taken``: the newest
        checkpoint that subtask took)."""
        if self.failure is not None:
            return
        if subtask == 0 and self.floor is None:
            self.partitions.update(np.unique(batch["partition"]).tolist())
            if calls == HOLD_AT:
                self.floor = taken
                try:
                    if not self._enough.wait(HOLD_TIMEOUT):
                        self._fail(f"the keyed subtasks did not process {self.records} records")
                    if not self._parked.wait(HOLD_TIMEOUT):
                        self._fail("source subtask 1 did not take a checkpoint")
                finally:
                    self._released.set()
        elif subtask == 1 and self.floor is not None and taken > self.floor:
            with self._lock:
                if self.cid is None:
                    self.cid = taken
            if taken != self.cid:
                return
            self._parked.set()
            if not self._stopping.wait(HOLD_TIMEOUT):
                self._fail(f"checkpoint {self.cid} did not complete")
            raise TaskCancelled("source subtask 1, held while the run stops")

    def keyed_batch(self, subtask: int, taken: int, batch: Batch) -> None:
        """A batch the keyed subtask ``subtask`` processed, ``taken`` its newest
        snapshot: source 0's records behind a barrier it holds back are counted."""
        floor = self.floor
        if floor is None or taken <= floor or self._enough.is_set():
            return
        mine = np.isin(batch["partition"], list(self.partitions))
        with self._lock:
            self.counted[subtask] = self.counted.get(subtask, 0) + int(np.count_nonzero(mine))
            if sum(self.counted.values()) >= self.records:
                self._enough.set()

    def waits_for_barrier(self, taken: int) -> bool:
        """Whether a keyed subtask whose newest snapshot is ``taken`` waits for the
        held checkpoint's barrier before it takes more input."""
        floor = self.floor
        return floor is not None and taken <= floor and not self._released.is_set()

    def stop_when(self, history: list[dict[str, Any]]) -> bool:
        """Stops the run once ``cid`` completed."""
        done = any(c["checkpoint_id"] == self.cid and c["status"] == "completed" for c in history)
        if done:
            self._stopping.set()
        return done


class _Stall(Operator):
    """Passes batches on; with a hold, may stop a source subtask in a batch."""

    def __init__(self, dtype: Any, hold: _Hold | None) -> None:
        self.out_dtype = dtype
        self.hold = hold
        self.calls = 0
        self.taken = 0

    def snapshot(self, checkpoint_id: int) -> OperatorSnapshot:
        self.taken = checkpoint_id
        return super().snapshot(checkpoint_id)

    def process(self, batch: Batch, input_index: int = 0) -> None:
        self.calls += 1
        if self.hold is not None:
            self.hold.source_batch(self.ctx.subtask_index, self.calls, self.taken, batch)
        self.ctx.output.emit(batch)


class _WatchedSink(ThrottledSink):
    """The throttled Parquet sink, telling a hold what its keyed subtask processed.

    While source subtask 0 is held and this subtask has not taken the held checkpoint
    yet, it takes no input (:meth:`ready_at`; the task still takes unaligned
    barriers): source 0's records in flight wait for that checkpoint, whenever the
    checkpoint is triggered. With ``pause_after``, it takes no input once it
    processed that many records, until the run stops (its replay paused)."""

    def __init__(
        self, out_dir: str, rate: float, hold: _Hold | None, pause_after: int | None
    ) -> None:
        super().__init__(rate, inner=ParquetSink(out_dir))
        self.hold = hold
        self.pause_after = pause_after
        self.taken = 0
        self.processed = 0

    def snapshot(self, checkpoint_id: int) -> OperatorSnapshot:
        self.taken = checkpoint_id
        return super().snapshot(checkpoint_id)

    def process(self, batch: Batch, input_index: int = 0) -> None:
        super().process(batch, input_index)
        self.processed += len(batch)
        if self.hold is not None:
            self.hold.keyed_batch(self.ctx.subtask_index, self.taken, batch)

    def ready_at(self) -> float:
        if self.hold is not None and self.hold.waits_for_barrier(self.taken):
            return float("inf")
        if self.pause_after is not None and self.processed >= self.pause_after:
            return float("inf")
        return super().ready_at()


def make_job(
    out_dir: str,
    name: str,
    parallelism: int,
    rate: float = RATE,
    hold: _Hold | None = None,
    pause_after: int | None = None,
) -> StreamEnvironment:
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
    stall = _Stall(src.dtype, hold)
    keyed = src.process(stall, uid="stall").map(per_partition_keys(0), uid="keys")
    totals = keyed.key_by("key").process(RunningTotal(), uid=KEYED)
    totals.sink(_WatchedSink(out_dir, rate, hold, pause_after), uid="sink")
    return env


def _config(ckpt: Path) -> Config:
    return Config.from_dict(
        {
            "execution.checkpointing.interval": "60 ms",
            "execution.checkpointing.unaligned.enabled": True,
            "state.checkpoints.dir": str(ckpt),
            "state.checkpoints.num-retained": 1,
            # Deep channels: a held source's records in flight, which the keyed task
            # processes before that source's barrier comes, are up to 32 buffers.
            "taskmanager.network.memory.buffers-per-channel": 16,
            "taskmanager.network.memory.buffers-per-partition": 32,
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
    hold: _Hold | None = None,
    pause_after: int | None = None,
) -> JobResult:
    env = make_job(out_dir, "job", parallelism, rate, hold, pause_after)
    ex = LocalExecutor(env, _config(ckpt), restore_checkpoint=restore)
    r = ex.run(timeout=120, stop_when=stop_when)
    assert hold is None or hold.failure is None, hold.failure
    assert r.status == ("stopped" if stop_when else "finished"), (
        r.failures,
        [c["reason"] for c in r.checkpoints if c["status"] != "completed"],
    )
    return r


def _until(
    ckpt: Path,
    out_dir: str,
    restore: int,
    good: Callable[[dict[str, Any]], bool],
    rate: float = RATE,
    parallelism: int = 2,
) -> tuple[list[JobResult], int]:
    """Runs (restoring ``restore``, each keyed subtask paused after ``PAUSE_AFTER``
    records) until the latest completed checkpoint is ``good``.

    Paused, a run cannot end, and the checkpoints it completes after the pause all
    reference the same rest of its replay. Should one not be ``good``, the latest one
    is restored and the run goes on, as after any stop."""
    runs = []
    for _ in range(8):
        floor = restore

        def ready(history: list[dict[str, Any]], floor: int = floor) -> bool:
            c = _latest(history)
            return c is not None and c["checkpoint_id"] > floor and good(c)

        r = _run(ckpt, out_dir, parallelism, ready, restore, rate, pause_after=PAUSE_AFTER)
        runs.append(r)
        done = [c for c in r.completed_checkpoints() if not c["final"]]
        if done and good(done[-1]):
            return runs, int(done[-1]["checkpoint_id"])
        restore = int(done[-1]["checkpoint_id"]) if done else restore
    raise AssertionError("no run stopped on a checkpoint of the kind wanted")


SPEC = VerifySpec(job=make_job, parallelism=2, state_uid=KEYED, state="total")


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory) -> RunOutput:
    """A failure-free run's output: the same for every case, so run once for all."""
    d = tmp_path_factory.mktemp("baseline")
    baseline = _run(d / "ckpt", str(d / "out"), 2, None)
    return output_of(SPEC, baseline, str(d / "out"), 128)


class _Case:
    """A run stopped at a checkpoint ``c1`` that holds a large input state at the keyed
    operator (replay takes many small steps, each a chance for a barrier): the first
    run's :class:`_Hold` makes it so. ``expected``: the failure-free run's output."""

    def __init__(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, expected: RunOutput
    ) -> None:
        monkeypatch.setattr(recovery, "STEP_BYTES", 8192)
        monkeypatch.setattr(recovery, "JOIN_BYTES", 8192)
        self.spec, self.expected = SPEC, expected
        self.ckpt = tmp_path / "ckpt"
        self.out_dir = str(tmp_path / "out")
        hold = _Hold(HELD_RECORDS)
        first = _run(self.ckpt, self.out_dir, 2, hold.stop_when, hold=hold)
        done = [c["checkpoint_id"] for c in first.completed_checkpoints() if not c["final"]]
        assert hold.cid is not None and done and done[-1] == hold.cid, (hold.cid, done)
        self.runs, self.c1 = [first], hold.cid
        held = _input_bytes(_metadata(self.ckpt, self.c1))
        assert held > LARGE_INPUT, (held, hold.counted)

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
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, expected: RunOutput, new: int
) -> None:
    case = _Case(tmp_path, monkeypatch, expected)
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
    # Paused, the restored run cannot end before a checkpoint references its rest:
    # one run, restored from c1 itself.
    assert len(more) == 1, f"{len(more)} runs before a checkpoint during the replay"
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
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, expected: RunOutput
) -> None:
    """Restored 2 -> 3, the keyed task replays the old channels through the filtering
    retriever; a checkpoint completes during that replay, referencing each old
    channel's rest with its key-group filter; restored at 2 it runs to the end."""
    case = _Case(tmp_path, monkeypatch, expected)
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
