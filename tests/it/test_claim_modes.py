"""Claim modes and moved savepoints, whole jobs on the local executor: a savepoint
moved to another folder (a tmpfs where there is one) restores exactly at another
parallelism; under NO_CLAIM the restored savepoint is never deleted and no checkpoint
after it points into it, so a savepoint taken from the restored job restores with the
first one gone; under CLAIM retention deletes it; a savepoint naming its files
absolutely (written before relative paths) still restores."""

from __future__ import annotations

import json
import os
import shutil
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from spillover.deploy.local import LocalExecutor
from spillover.runtime.checkpointing.metadata import CheckpointStorage, read_checkpoint
from spillover.runtime.connectors.collecting import CollectingSink
from support.keyed_jobs import assert_exact, keyed_config, keyed_job, start


@pytest.fixture
def elsewhere(tmp_path: Path) -> Iterator[Path]:
    """Another folder to move a savepoint to: on a tmpfs where there is one."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
    folder = base / f"spillover-moved-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _stopped_savepoint(ex: LocalExecutor, savepoint_dir: Path) -> str:
    """Runs ``ex`` until under way, stops it with an unaligned savepoint: its path."""
    runner, out = start(ex)
    ex.stop_with_savepoint(unaligned=True, savepoint_dir=str(savepoint_dir))
    runner.join(120)
    (result,) = out
    assert result.status == "stopped" and result.savepoint, result.failures
    return result.savepoint


def _checkpoint_texts(ckpt: Path) -> list[str]:
    return [p.read_text() for p in ckpt.rglob("chk-*/_metadata")]


def test_a_moved_savepoint_restores_exactly_and_no_claim_leaves_it_alone(
    tmp_path: Path, elsewhere: Path
) -> None:
    name = f"claim-none-{tmp_path.name}"
    CollectingSink.clear(name)
    first = _stopped_savepoint(
        LocalExecutor(keyed_job(name), keyed_config(tmp_path)), tmp_path / "sp"
    )
    folder = Path(first).parent
    moved = elsewhere / folder.name
    shutil.move(str(folder), moved)
    shutil.rmtree(tmp_path / "ckpt")

    # Restored at 3 from the moved folder, NO_CLAIM (the default), one retained.
    cfg = keyed_config(tmp_path, **{"state.checkpoints.num-retained": 1})
    ex = LocalExecutor(keyed_job(name, 3), cfg, restore_checkpoint=str(moved / Path(first).name))
    runner, out = start(ex)
    while len([c for c in ex.stats.snapshot().history if c.status == "COMPLETED"]) < 3:
        threading.Event().wait(0.01)
    ex.stop_with_savepoint(unaligned=True, savepoint_dir=str(tmp_path / "sp2"))
    runner.join(120)
    (result,) = out
    assert result.status == "stopped" and result.savepoint, result.failures
    assert result.replayed_bytes > 0, "the moved savepoint's in-flight data was replayed"
    assert (moved / Path(first).name / "_metadata").exists(), "NO_CLAIM deleted it"
    texts = _checkpoint_texts(tmp_path / "ckpt") + _checkpoint_texts(tmp_path / "sp2")
    assert texts and not any(str(moved) in t for t in texts), "a checkpoint points into it"

    shutil.rmtree(moved)  # what the second savepoint needs, it holds
    shutil.rmtree(tmp_path / "ckpt")
    last = LocalExecutor(keyed_job(name, 2), cfg, restore_checkpoint=result.savepoint)
    assert last.run(timeout=180).status == "finished"
    assert_exact(name)
    CollectingSink.clear(name)


@pytest.mark.parametrize("where", ["savepoint", "own checkpoint"])
def test_claim_lets_retention_delete_the_restored_checkpoint(tmp_path: Path, where: str) -> None:
    name = f"claim-{where.replace(' ', '-')}-{tmp_path.name}"
    CollectingSink.clear(name)
    cfg = keyed_config(tmp_path, **{"state.checkpoints.num-retained": 1})
    ex = LocalExecutor(keyed_job(name), cfg)
    restored = _stopped_savepoint(ex, tmp_path / "sp")
    if where == "own checkpoint":
        assert ex.storage is not None
        restored = ex.storage.checkpoint_dir(int(Path(restored).name[4:]))
    assert Path(restored, "_metadata").exists()

    claiming = cfg.with_options({"execution.state-recovery.claim-mode": "CLAIM"})
    again = LocalExecutor(keyed_job(name), claiming, restore_checkpoint=restored)
    result = again.run(timeout=180)
    assert result.status == "finished", result.failures
    assert len(result.completed_checkpoints()) >= 2
    assert not Path(restored).exists(), "CLAIM kept the restored checkpoint"
    if where == "savepoint":
        assert not Path(restored).parent.exists(), "its savepoint folder stayed"
    storage = CheckpointStorage(str(tmp_path / "ckpt"), name)
    last = result.completed_checkpoints()[-1]["checkpoint_id"]
    assert storage.completed_ids()[-1] == last and len(storage.completed_ids()) <= 2
    assert_exact(name)

    # The same without CLAIM: the checkpoint restored stays.
    CollectingSink.clear(name)
    cfg = keyed_config(tmp_path / "again", **{"state.checkpoints.num-retained": 1})
    kept = _stopped_savepoint(LocalExecutor(keyed_job(name), cfg), tmp_path / "sp3")
    resumed = LocalExecutor(keyed_job(name), cfg, restore_checkpoint=kept).run(timeout=180)
    assert resumed.status == "finished"
    assert Path(kept, "_metadata").exists()
    CollectingSink.clear(name)


def test_a_savepoint_naming_its_files_absolutely_still_restores(tmp_path: Path) -> None:
    """Savepoints written before relative paths: the same metadata with absolute
    paths and no ``relative_paths`` restores as before."""
    name = f"absolute-{tmp_path.name}"
    CollectingSink.clear(name)
    cfg = keyed_config(tmp_path)
    saved = _stopped_savepoint(LocalExecutor(keyed_job(name), cfg), tmp_path / "sp")
    meta_file = Path(saved, "_metadata")
    assert json.loads(meta_file.read_text())["relative_paths"] is True
    absolute = read_checkpoint(saved)  # resolved where it is
    meta_file.write_text(json.dumps(absolute))
    assert str(tmp_path / "sp") in meta_file.read_text()
    cfg = keyed_config(tmp_path / "again")
    resumed = LocalExecutor(keyed_job(name, 3), cfg, restore_checkpoint=saved).run(timeout=180)
    assert resumed.status == "finished" and resumed.replayed_bytes > 0, resumed.failures
    assert_exact(name)
    CollectingSink.clear(name)
