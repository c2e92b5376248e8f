"""Savepoints without a stop, on the local executor: a request is answered however
the job goes on (asked while it restarts, the next attempt takes it; asked once it
ended, it fails at once), and the export runs off the coordinator's thread while
the checkpoint it copies is kept."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from spillover.deploy.local import LocalExecutor
from spillover.runtime.checkpointing.savepoint_request import (
    SavepointFailedError,
    SavepointRequest,
)
from spillover.runtime.failures import FailureInjector, FailureSpec
from support.rest_jobs import backpressured, config


def _until(what: str, check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} never held"
        time.sleep(0.02)


def _running(ex: LocalExecutor) -> threading.Thread:
    runner = threading.Thread(target=lambda: ex.run(timeout=120), daemon=True)
    runner.start()
    return runner


def test_a_savepoint_asked_while_the_job_restarts_is_taken_by_the_next_attempt(
    tmp_path: Path,
) -> None:
    asked: list[SavepointRequest] = []
    between = threading.Event()

    def rescale(ex: Any, attempt: int, error: BaseException) -> None:
        # Between attempts: the failed one's coordinator has ended, the next has not begun.
        asked.append(ex.trigger_savepoint(str(tmp_path / "sp")))
        between.set()

    ex = LocalExecutor(
        backpressured(),
        config(tmp_path, **{"restart-strategy.fixed-delay.delay": "0 s"}),
        failures=FailureInjector([FailureSpec("operator", "sink", after_records=200)]),
        rescale=rescale,
    )
    runner = _running(ex)
    assert between.wait(60)
    path = asked[0].wait(60)
    assert Path(path, "_metadata").exists() and path.startswith(str(tmp_path / "sp"))
    ex.cancel()
    runner.join(60)
    assert not runner.is_alive()


def test_a_savepoint_asked_once_the_job_ended_fails_at_once(tmp_path: Path) -> None:
    ex = LocalExecutor(backpressured(), config(tmp_path))
    runner = _running(ex)
    _until("a checkpoint", lambda: ex.stats.snapshot().completed_count > 0)
    ex.cancel()
    runner.join(60)
    request = ex.trigger_savepoint(str(tmp_path / "sp"))
    assert request.done
    with pytest.raises(SavepointFailedError, match="the job has ended"):
        request.wait(0)


def test_the_export_runs_off_the_coordinator_which_keeps_its_checkpoint_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ex = LocalExecutor(backpressured(), config(tmp_path, **{"state.checkpoints.num-retained": 1}))
    storage = ex.storage
    assert storage is not None
    export, started, release = storage.export, threading.Event(), threading.Event()

    def held_export(cid: int, target: str) -> str:
        started.set()
        assert release.wait(60)
        return export(cid, target)

    monkeypatch.setattr(storage, "export", held_export)
    runner = _running(ex)
    _until("a checkpoint", lambda: ex.stats.snapshot().completed_count > 0)
    request = ex.trigger_savepoint(str(tmp_path / "sp"))
    assert started.wait(60)
    cid = request.exporting
    assert cid is not None
    # Checkpoints go on completing while the export is held (one retained only) ...
    _until("later checkpoints", lambda: ex.completed_ids()[-1:] > [cid + 2])
    # ... and none of them deletes the checkpoint being exported.
    assert Path(storage.checkpoint_dir(cid), "_metadata").exists()
    release.set()
    assert Path(request.wait(60), "_metadata").exists()
    # Exported, it is subsumed as any other.
    kept = Path(storage.checkpoint_dir(cid))
    _until("the exported checkpoint deleted", lambda: not kept.exists())
    ex.cancel()
    runner.join(60)
