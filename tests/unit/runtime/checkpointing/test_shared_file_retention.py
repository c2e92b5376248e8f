"""A shared channel-state file lives in its checkpoint's directory: references into it
keep that checkpoint, and a savepoint copies it with handles that still read."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from spillover.rescale import Piece, Reference
from spillover.runtime.checkpointing.channel_state import channel_state_groups, open_channel_state
from spillover.runtime.checkpointing.checkpoint_meta import (
    ChannelStateMeta,
    CheckpointMetadata,
    OperatorMeta,
    SubtaskMeta,
)
from spillover.runtime.checkpointing.metadata import (
    CheckpointStorage,
    new_metadata,
    read_checkpoint,
)
from spillover.storage import open_retriever
from spillover.storage.channel_index import resolve


def _checkpoint(
    storage: CheckpointStorage, cid: int, references: list[Reference]
) -> CheckpointMetadata:
    groups = channel_state_groups([("a", 0), ("a", 1)], 5, storage.checkpoint_dir)
    subtasks = {}
    for i in range(2):
        w = open_channel_state(storage.subtask_dir, cid, "a", i, None, groups[("a", i)])
        w.add_input(0, 0, b"chk-%d-subtask-%d" % (cid, i))
        cs = ChannelStateMeta.from_json(w.close())
        subtasks[i] = SubtaskMeta(channel_state=replace(cs, references=tuple(references)))
    meta = new_metadata(
        job_name="j",
        checkpoint_id=cid,
        trigger_ms=0,
        fingerprint="f",
        settings={},
        tasks={"a": OperatorMeta(subtasks)},
        final=False,
    )
    storage.write_metadata(cid, meta)
    return meta


def test_a_reference_into_a_shared_file_keeps_its_checkpoint(tmp_path: Path) -> None:
    storage = CheckpointStorage(str(tmp_path), "j")
    one = _checkpoint(storage, 1, [])
    cs = one.operator("a").subtask(1).channel_state
    assert cs is not None
    handle = resolve(cs.input[0])
    assert handle.offset  # the second section of chk-1's shared file
    two = _checkpoint(storage, 2, [Reference(0, 0, (Piece(handle, 0),))])
    assert two.references == (1,)


def test_a_savepoint_copies_shared_files_and_its_handles_read(tmp_path: Path) -> None:
    storage = CheckpointStorage(str(tmp_path / "ckpt"), "j")
    _checkpoint(storage, 3, [])
    saved = storage.export(3, str(tmp_path / "sp"))
    meta = CheckpointMetadata.from_json(read_checkpoint(saved))
    storage.delete(3)  # self-contained: the checkpoint's files are gone
    for i in range(2):
        cs = meta.operator("a").subtask(i).channel_state
        assert cs is not None
        h = resolve(cs.input[0])  # its channel maps from the savepoint's own index
        assert str(tmp_path / "sp") in h.uri and h.offset is not None
        with open_retriever(h) as r:
            assert [bytes(b) for b in r] == [b"chk-3-subtask-%d" % i]
