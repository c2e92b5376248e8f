"""Checkpoint metadata and the job event log survive the machine's loss by default
(they are fsynced, file and directory); ``state.checkpoints.fsync-metadata: false``
turns that off for both."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from spillover.config import Config
from spillover.runtime.jobrecovery import JobRecovery
from spillover.runtime.wiring import checkpoint_storage
from spillover.storage import location
from support.checkpoint_golden import empty_metadata


def _synced(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every fsync asked: ``os.fsync``'s descriptors, and a local publish's (one native
    call, which fsyncs the file and its directory when asked)."""
    calls: list[int] = []
    real, publish = os.fsync, location.publish_file
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(fd) or real(fd))

    def published(tmp: str, path: str, data: Any, flags: int) -> tuple[int, str]:
        if flags & location.PUBLISH_FSYNC:
            calls.append(-1)
        return publish(tmp, path, data, flags)

    monkeypatch.setattr(location, "publish_file", published)
    return calls


@pytest.mark.parametrize("fsync", [None, "false"], ids=["default", "off"])
def test_metadata_and_the_event_log_are_fsynced_unless_turned_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: str | None
) -> None:
    options = {"state.checkpoints.dir": str(tmp_path), "execution.checkpointing.interval": "1 s"}
    if fsync is not None:
        options["state.checkpoints.fsync-metadata"] = fsync
    storage = checkpoint_storage(Config.from_dict(options), "job")
    assert storage is not None
    calls = _synced(monkeypatch)
    storage.write_metadata(1, empty_metadata(1))
    assert bool(calls) is (fsync is None)
    calls.clear()
    rec = JobRecovery(storage, enabled=True, explicit_restore=None, lease_ttl_s=30.0)
    rec.begin(job_name="job", fingerprint="f", parallelism=1, configuration={})
    try:
        assert rec.log is not None and rec.log.fsync is (fsync is None)
        assert bool(calls) is (fsync is None)  # the run's first event, flushed
    finally:
        rec.close()


def test_a_completion_publishes_its_metadata_then_its_record_in_one_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The master's record of a completed checkpoint goes out with the checkpoint's
    metadata in one ordered group, the metadata first: the record is never visible
    without it, and their data is synced together (one native call)."""
    options = {"state.checkpoints.dir": str(tmp_path), "execution.checkpointing.interval": "1 s"}
    storage = checkpoint_storage(Config.from_dict(options), "job")
    assert storage is not None
    rec = JobRecovery(storage, enabled=True, explicit_restore=None, lease_ttl_s=30.0)
    rec.begin(job_name="job", fingerprint="f", parallelism=1, configuration={})
    groups: list[list[str]] = []
    real = location.publish_files

    def grouped(files: list[tuple[str, str, Any, int]]) -> tuple[int, int, str]:
        groups.append([os.path.basename(path) for _, path, _, _ in files])
        return real(files)

    monkeypatch.setattr(location, "publish_files", grouped)
    try:
        rec.checkpoint_completed(1, storage.metadata_file(1, empty_metadata(1)))
        assert len(groups) == 1 and groups[0][0] == "_metadata"
        assert groups[0][1].startswith("events-")
        assert storage.read(1).checkpoint_id == 1
        cp = rec.state().checkpoint
        assert cp is not None and cp.checkpoint_id == 1
    finally:
        rec.close()
