"""The parts the job master composes, against recording coordinators: savepoint
requests reach the attempt that can take them (or fail, never hang), and at most one
live rescale is under way, completed by the first record at the new parallelism."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from spillover.errors import ConfigError, StateFileNotFoundError, StorageError
from spillover.runtime.checkpointing.checkpoint_meta import CheckpointMetadata
from spillover.runtime.checkpointing.metadata import CheckpointStorage, new_metadata
from spillover.runtime.checkpointing.savepoint_request import SavepointRequest
from spillover.runtime.connectors.collecting import CollectingSink
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.graph import JobGraph, StreamEnvironment
from spillover.runtime.live_rescale import LiveRescale, rescaled_graph
from spillover.runtime.savepoints import EXPORT_ATTEMPTS, Savepoints


class RecordingCoordinator:
    """Takes savepoint requests while ``accepting``; records what it was told."""

    def __init__(self, accepting: bool = True) -> None:
        self.accepting = accepting
        self.triggered: list[SavepointRequest] = []
        self.kept: list[SavepointRequest] = []
        self.closed: list[str] = []
        self.stops = 0

    def trigger_savepoint(self, request: SavepointRequest) -> bool:
        if self.accepting:
            self.triggered.append(request)
        return self.accepting

    def keep_exporting(self, requests: Sequence[SavepointRequest]) -> None:
        self.kept += requests

    def close_savepoints(self, reason: str = "the job attempt ended") -> None:
        self.closed.append(reason)

    def request_stop(self, kind: int = 1, on_failed: object = None) -> None:
        self.stops += 1


class NoStats:
    def exported(self, checkpoint_id: int, path: str) -> None:
        raise AssertionError("nothing is exported here")


def _savepoints(tmp_path: Path, savepoints_dir: str | None = None) -> Savepoints:
    storage = CheckpointStorage(str(tmp_path), "job")
    sp = Savepoints(storage, NoStats(), "0123456789", savepoints_dir)
    sp.open(None)
    return sp


def test_a_savepoint_asked_between_attempts_is_triggered_by_the_next(tmp_path: Path) -> None:
    sp = _savepoints(tmp_path)
    asked = sp.trigger(None, unaligned=True)
    first = RecordingCoordinator()
    sp.attempt_started(first)
    assert first.triggered == [asked] and not asked.done
    assert sp.trigger("/elsewhere", unaligned=False) is first.triggered[-1]
    second = RecordingCoordinator()
    sp.attempt_started(second)
    assert first.closed, "the previous attempt takes no more savepoints"


def test_a_stop_whose_savepoint_storage_never_copies_names_its_own_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by chaos (1-8): storage failing every copy of a stop's savepoint ended
    the run with nothing to restore. The checkpoint is complete: it is the restore
    point, and the note says why; every copy was tried first."""
    sp = _savepoints(tmp_path)
    tries: list[str] = []

    def export(cid: int, target: str) -> str:
        tries.append(target)
        raise StorageError("cannot copy the checkpoint into the savepoint", path=target)

    monkeypatch.setattr(sp._storage, "export", export)  # type: ignore[union-attr]
    monkeypatch.setattr("spillover.runtime.savepoints.EXPORT_BACKOFF_S", 0.0)
    path, note = sp.export_stop(7, str(tmp_path / "sp"))
    assert path == str(tmp_path / "job" / "chk-7")
    assert note is not None and "restore its checkpoint" in note and path in note
    assert len(tries) == EXPORT_ATTEMPTS


def test_a_savepoint_no_attempt_takes_fails_and_one_asked_after_the_run_fails_at_once(
    tmp_path: Path,
) -> None:
    sp = _savepoints(tmp_path)
    refused = sp.trigger(None, unaligned=False)
    sp.attempt_started(RecordingCoordinator(accepting=False))
    assert refused.done and refused.error == "the job attempt ended"
    waiting = sp.trigger(None, unaligned=False)  # the attempt refuses it: it waits
    sp.close()
    assert waiting.done and "before its savepoint was triggered" in str(waiting.error)
    late = sp.trigger(None, unaligned=False)
    assert late.done and late.error == "the job has ended"
    sp.open(None)
    coordinator = RecordingCoordinator()
    sp.attempt_started(coordinator)
    assert not sp.trigger(None, unaligned=False).done and len(coordinator.triggered) == 1


def test_savepoints_go_to_the_configured_directory_else_beside_the_checkpoints(
    tmp_path: Path,
) -> None:
    assert _savepoints(tmp_path, "/savepoints").default_dir() == "/savepoints"
    assert Path(_savepoints(tmp_path).default_dir()) == tmp_path / "job" / "savepoints"


class CountingAttempt:
    """An attempt whose subtasks processed ``records`` so far."""

    def __init__(self) -> None:
        self.running_at: float | None = None
        self.records = 0.0

    def task_metrics(self) -> Mapping[str, Mapping[str, float]]:
        return {"m#0": {"records_in": self.records}}


def _graph() -> JobGraph:
    env = StreamEnvironment("g", parallelism=2, max_parallelism=16)
    env.from_source(GeneratorSource(partitions=2), uid="src").key_by("key").sink(
        CollectingSink("g"), uid="sink"
    )
    return env.build()


def test_one_rescale_at_a_time_completed_by_the_first_record() -> None:
    old = _graph()
    new = rescaled_graph(old, {"src": 3, "sink": 3})
    rescales = LiveRescale(None)
    coordinator = RecordingCoordinator()
    request = rescales.start(old, new, coordinator)
    assert coordinator.stops == 1, "the running attempt takes the stop's savepoint"
    assert rescales.under_way is request and rescales.last is request
    with pytest.raises(ConfigError, match="rescaling already"):
        rescales.start(old, new, coordinator)
    request.restarted(7)
    attempt = CountingAttempt()
    ended = rescales.watch_first_record(attempt, request)
    attempt.running_at, attempt.records = 1.0, 1.0
    status = request.wait(30)
    ended.set()
    assert status.status == "COMPLETED" and status.savepoint_id == 7
    assert (status.from_parallelism, status.to_parallelism) == (2, 3)
    assert rescales.under_way is None and rescales.last is request


def test_a_failed_rescale_leaves_room_for_the_next() -> None:
    old = _graph()
    new = rescaled_graph(old, {"src": 3, "sink": 3})
    rescales = LiveRescale(None)
    rescales.fail("nothing under way")  # no rescale: nothing happens
    first = rescales.start(old, new, RecordingCoordinator())
    rescales.fail("the savepoint failed", first)
    assert first.status().status == "FAILED" and first.status().failure == "the savepoint failed"
    second = rescales.start(old, new, RecordingCoordinator())
    assert rescales.under_way is second and rescales.last is second


def _metadata(storage: CheckpointStorage, cid: int) -> None:
    storage.write_metadata(
        cid,
        new_metadata(
            job_name="job",
            checkpoint_id=cid,
            trigger_ms=1,
            fingerprint="f",
            settings={"max-parallelism": 128},
            tasks={},
            final=False,
        ),
    )


def test_a_rescale_checks_the_newer_checkpoint_when_retention_removed_the_latest(
    tmp_path: Path,
) -> None:
    """Found by the rescale benchmark on Spark: the checkpoint being checked was
    subsumed and deleted meanwhile, and the rescale was refused."""
    storage = CheckpointStorage(str(tmp_path), "job")
    _metadata(storage, 2)
    checked: list[int] = []

    def plan(meta: CheckpointMetadata) -> None:
        checked.append(meta.checkpoint_id)
        if meta.checkpoint_id == 2:  # checkpoint 3 completes, retention removes 2
            _metadata(storage, 3)
            storage.delete(2)
            raise StateFileNotFoundError("state file not found", path="chk-2/x.spill")

    LiveRescale(storage).check_restorable(plan)
    assert checked == [2, 3]


def test_a_rescale_no_checkpoint_restores_is_refused_before_its_savepoint(
    tmp_path: Path,
) -> None:
    storage = CheckpointStorage(str(tmp_path), "job")
    _metadata(storage, 2)

    def plan(meta: CheckpointMetadata) -> None:
        raise StateFileNotFoundError("state file not found", path="chk-2/x.spill")

    with pytest.raises(StateFileNotFoundError):
        LiveRescale(storage).check_restorable(plan)
