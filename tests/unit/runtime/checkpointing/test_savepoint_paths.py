"""Savepoints whose references are relative to their folder: a savepoint copied or
moved elsewhere restores the same files; a checkpoint whose references point into a
restored savepoint (not into the job's own checkpoints) exports those files; and
savepoints written with absolute paths still read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from spillover.rescale import Piece, Reference
from spillover.runtime.checkpointing.checkpoint_meta import (
    ChannelStateMeta,
    OperatorMeta,
    SubtaskMeta,
)
from spillover.runtime.checkpointing.metadata import (
    CheckpointStorage,
    new_metadata,
    read_checkpoint,
    relativize,
    resolve_relative,
)
from spillover.storage.handle import GateKind, GateStateHandle
from spillover.storage.location import Location


def _file(path: Path, data: bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return str(path)


def _handle(uri: str) -> GateStateHandle:
    return GateStateHandle(uri, 0, GateKind.INPUT, 0, 0, "f", 4, 0, 0, 0)


def _checkpoint(storage: CheckpointStorage, cid: int, own: str, refs: list[str]) -> None:
    """Checkpoint ``cid`` with one own input file and references to ``refs``."""
    channel_state = ChannelStateMeta(
        input=(_handle(own),),
        bytes=4,
        references=tuple(Reference(0, 0, (Piece(_handle(r), 0),)) for r in refs),
    )
    meta = new_metadata(
        job_name="j",
        checkpoint_id=cid,
        trigger_ms=1,
        fingerprint="f",
        settings={"max-parallelism": 128},
        tasks={"m": OperatorMeta({0: SubtaskMeta(channel_state=channel_state)}, 1)},
        final=False,
    )
    storage.write_metadata(cid, meta)


def _uris(meta: dict[str, Any]) -> list[str]:
    cs = meta["tasks"]["m"]["subtasks"]["0"]["channel_state"]
    refs = cs.get("references", [])
    return [cs["input"][0]["uri"]] + [r["pieces"][0]["handle"]["uri"] for r in refs]


def test_references_into_a_restored_savepoint_are_exported_with_it(tmp_path: Path) -> None:
    """The job restored savepoint 5 from another folder and its checkpoint 6 still
    references input state there. The job's own chk-5 (an older run's) is a decoy
    that a mapping by checkpoint id would copy instead."""
    storage = CheckpointStorage(str(tmp_path / "ckpt"), "j")
    restored = _file(tmp_path / "sp" / "savepoint-ab-5" / "chk-5" / "m-0" / "input-0", b"restored")
    _file(tmp_path / "ckpt" / "j" / "chk-5" / "m-0" / "input-0", b"decoy")
    own = _file(tmp_path / "ckpt" / "j" / "chk-6" / "m-0" / "input-0", b"own")
    _checkpoint(storage, 6, own, [restored])

    saved = storage.export(6, str(tmp_path / "out" / "savepoint-cd-6"))
    shutil.rmtree(tmp_path / "sp")
    shutil.rmtree(tmp_path / "ckpt")
    uris = _uris(read_checkpoint(saved))
    assert all(u.startswith(str(tmp_path / "out" / "savepoint-cd-6") + "/") for u in uris), uris
    assert [Path(u).read_bytes() for u in uris] == [b"own", b"restored"]


def test_a_moved_savepoint_reads_its_own_files(tmp_path: Path) -> None:
    storage = CheckpointStorage(str(tmp_path / "ckpt"), "j")
    old = _file(tmp_path / "ckpt" / "j" / "chk-3" / "m-0" / "input-0", b"older")
    own = _file(tmp_path / "ckpt" / "j" / "chk-4" / "m-0" / "input-0", b"own")
    _checkpoint(storage, 4, own, [old])
    saved = Path(storage.export(4, str(tmp_path / "sp" / "savepoint-ab-4")))
    raw = json.loads((saved / "_metadata").read_text())
    assert str(tmp_path) not in json.dumps(raw["tasks"]), "a savepoint names no absolute path"

    moved = tmp_path / "elsewhere" / "deeper" / "savepoint-ab-4"
    moved.parent.mkdir(parents=True)
    shutil.move(str(saved.parent), moved)
    shutil.rmtree(tmp_path / "ckpt")
    meta = read_checkpoint(str(moved / "chk-4"))
    uris = _uris(meta)
    assert all(u.startswith(str(moved) + "/") for u in uris), uris
    assert [Path(u).read_bytes() for u in uris] == [b"own", b"older"]
    assert meta["references"] == [3] and "paths" not in meta


def test_a_savepoint_with_absolute_paths_still_reads(tmp_path: Path) -> None:
    """Savepoints written before relative paths name their files absolutely."""
    folder = CheckpointStorage(str(tmp_path / "sp"), "savepoint-old-2")
    own = _file(tmp_path / "sp" / "savepoint-old-2" / "chk-2" / "m-0" / "input-0", b"own")
    _checkpoint(folder, 2, own, [])
    meta = read_checkpoint(str(tmp_path / "sp" / "savepoint-old-2" / "chk-2"))
    assert _uris(meta) == [own]


def test_references_into_a_savepoint_beside_the_checkpoints_are_exported(tmp_path: Path) -> None:
    """The default savepoint folder is ``savepoints`` inside the job's checkpoint
    folder: a savepoint there is not one of the job's checkpoints either."""
    storage = CheckpointStorage(str(tmp_path / "ckpt"), "j")
    beside = tmp_path / "ckpt" / "j" / "savepoints" / "savepoint-ab-5" / "chk-5" / "m-0" / "input-0"
    restored = _file(beside, b"restored")
    own = _file(tmp_path / "ckpt" / "j" / "chk-6" / "m-0" / "input-0", b"own")
    _checkpoint(storage, 6, own, [restored])
    saved = storage.export(6, str(tmp_path / "out" / "savepoint-cd-6"))
    shutil.rmtree(tmp_path / "ckpt")
    uris = _uris(read_checkpoint(saved))
    assert [Path(u).read_bytes() for u in uris] == [b"own", b"restored"]


paths = st.lists(st.text("abc-_.0123456789", min_size=1, max_size=5), min_size=1, max_size=4)
json_values = st.recursive(
    st.none() | st.integers() | st.text(max_size=8) | paths.map(lambda p: "@/" + "/".join(p)),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=12,
)


@given(
    json_values,
    st.sampled_from(["/a/sp", "/b/c/savepoint-x-1", "/tmp"]),
    st.sampled_from(["/moved", "/x/y"]),
)
def test_relative_paths_resolve_wherever_the_folder_went(value: Any, old: str, new: str) -> None:
    """Every string inside the folder becomes relative and resolves under the new
    folder; every other value comes back as it was."""
    meta = {"tasks": value, "other": "/elsewhere/chk-1/f"}
    written = _with_folder(meta, old)
    rel = relativize(written, Location.parse(old))
    assert old + "/" not in json.dumps(rel)
    assert resolve_relative(rel, Location.parse(new)) == _with_folder(meta, new)


def _with_folder(value: Any, folder: str) -> Any:
    if isinstance(value, str):
        return folder + value[1:] if value.startswith("@/") else value
    if isinstance(value, dict):
        return {k: _with_folder(v, folder) for k, v in value.items()}
    if isinstance(value, list):
        return [_with_folder(v, folder) for v in value]
    return value
