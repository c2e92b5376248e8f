"""A master resuming a run takes over its dead master's retention: the run's own
complete checkpoints, never an earlier run's, whatever version wrote the log."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillover.runtime.checkpointing.metadata import CheckpointStorage
from spillover.runtime.jobevents import JobEventLog, JobSubmitted
from spillover.runtime.jobrecovery import JobRecovery
from support.checkpoint_golden import empty_metadata


def _master(storage: CheckpointStorage) -> JobRecovery:
    rec = JobRecovery(storage, enabled=True, explicit_restore=None, lease_ttl_s=30.0)
    rec.begin(job_name="job", fingerprint="f", parallelism=1, configuration={})
    return rec


def _complete(storage: CheckpointStorage, rec: JobRecovery, ids: range) -> None:
    for cid in ids:
        storage.write_metadata(cid, empty_metadata(cid))
        rec.checkpoint_completed(cid)


@settings(max_examples=15, deadline=None)
@given(earlier=st.integers(0, 3), own=st.integers(1, 4), unlogged=st.booleans())
def test_a_resumed_run_owns_its_checkpoints_and_no_earlier_runs(
    tmp_path_factory: object, earlier: int, own: int, unlogged: bool
) -> None:
    """An earlier run left ``earlier`` complete checkpoints; this run completed ``own``
    more and its master died (its lease given up): the next master owns exactly those
    ``own``, and none the dead master wrote after its last logged one."""
    root = Path(tmp_path_factory.mktemp("job"))  # type: ignore[attr-defined]
    storage = CheckpointStorage(str(root), "job", fsync=False)
    for cid in range(1, earlier + 1):
        storage.write_metadata(cid, empty_metadata(cid))
    first = _master(storage)
    assert first.resume is not None and first.resume.fresh
    start = first.resume.first_checkpoint_id
    assert start == earlier + 1
    first.generation_started(0, 1, "submitted", None, start)
    _complete(storage, first, range(start, start + own))
    if unlogged:  # written, never logged: deleted on resume
        storage.write_metadata(start + own, empty_metadata(start + own))
    first.close()  # the run is not over: the next master resumes it
    second = _master(storage)
    try:
        assert second.resume is not None and not second.resume.fresh
        last = start + own - 1
        assert second.own_checkpoints(last) == list(range(start, last + 1))
        assert storage.completed_ids() == list(range(1, last + 1))
    finally:
        second.close()


@pytest.mark.parametrize("generation_first", [3, 7])
def test_a_log_of_an_earlier_version_owns_from_its_newest_generation(
    tmp_path: Path, generation_first: int
) -> None:
    """A run submitted without its first id (an earlier version's log): only what its
    newest generation made is known to be its own, and the checkpoint it resumes
    from, even when that generation started after it (a restart that completed no
    checkpoint yet): nothing older is deleted, and the resumed one is retained."""
    storage = CheckpointStorage(str(tmp_path), "job", fsync=False)
    first = _master(storage)
    assert first.log is not None
    submitted = next(e for e in first.log.events() if isinstance(e, JobSubmitted))
    assert submitted.first_checkpoint_id == 1  # what this version records
    first.close()
    log = JobEventLog.open(first.directory)
    log.append(JobSubmitted("job", "f", 1, {}, run_id="r"))  # as an earlier version did
    log.flush()
    second = _master(storage)
    second.generation_started(0, 1, "submitted", None, min(generation_first, 3))
    _complete(storage, second, range(1, 6))
    second.generation_started(1, 1, "restarted", None, generation_first)
    second.close()
    third = _master(storage)
    try:
        assert third.own_checkpoints(5) == list(range(min(generation_first, 5), 6))
    finally:
        third.close()


def test_a_resumed_run_deletes_its_own_aborted_leftovers_only(tmp_path: Path) -> None:
    """An aborted checkpoint's directory that a late write made again (no metadata)
    below the dead master's last logged one is deleted on resume, as its next
    completion would have swept it; an earlier run's leftover stays."""
    storage = CheckpointStorage(str(tmp_path), "job", fsync=False)
    (tmp_path / "job" / "chk-1" / "channels").mkdir(parents=True)  # an earlier run's
    storage.write_metadata(2, empty_metadata(2))
    first = _master(storage)
    assert first.resume is not None and first.resume.first_checkpoint_id == 3
    first.generation_started(0, 1, "submitted", None, 3)
    _complete(storage, first, range(3, 4))
    (tmp_path / "job" / "chk-4" / "channels").mkdir(parents=True)  # aborted, written late
    _complete(storage, first, range(5, 6))
    first.close()
    second = _master(storage)
    try:
        assert storage.all_ids() == [1, 2, 3, 5]
        assert second.own_checkpoints(5) == [3, 5]
    finally:
        second.close()
