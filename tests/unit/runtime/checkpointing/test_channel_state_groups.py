"""Channel-state groups: which subtasks share a file, and what their writers return."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

import spillover.storage.shared as shared_mod
from spillover.errors import StorageError
from spillover.runtime.checkpointing.channel_state import (
    ChannelStateGroup,
    ChannelStateWriter,
    channel_state_groups,
    open_channel_state,
)
from spillover.storage import GateStateHandle, open_retriever
from spillover.storage.channel_index import INDEX_OBJECT, resolve_all
from spillover.storage.location import Location, register_filesystem
from spillover.storage.shared_objects import SharedObjects

TASKS = [(uid, i) for uid in ("src", "map", "sink") for i in range(4)]


def _names(per_file: int) -> list[list[tuple[str, int]]]:
    groups = channel_state_groups(TASKS, per_file, lambda cid: f"/x/chk-{cid}")
    seen: dict[int, ChannelStateGroup] = {id(g): g for g in groups.values()}
    return [list(g.members) for g in seen.values()]


def test_one_per_file_shares_nothing() -> None:
    groups = _names(1)
    assert groups == [[t] for t in TASKS]


def test_five_per_file_groups_in_order() -> None:
    groups = _names(5)
    assert [len(g) for g in groups] == [5, 5, 2]
    assert [t for g in groups for t in g] == TASKS


def test_all_per_file_is_one_file_per_process() -> None:
    assert _names(len(TASKS)) == [TASKS]
    assert _names(1000) == [TASKS]


def test_per_file_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        channel_state_groups(TASKS, 0, lambda cid: "")


def _dirs(root: Path) -> tuple[object, object]:
    def subtask_dir(cid: int, uid: str, i: int) -> str:
        return str(root / f"chk-{cid}" / f"{uid}-{i}")

    def checkpoint_dir(cid: int) -> str:
        return str(root / f"chk-{cid}")

    return subtask_dir, checkpoint_dir


def test_writers_of_a_group_share_one_file(tmp_path: Path) -> None:
    subtask_dir, checkpoint_dir = _dirs(tmp_path)
    groups = channel_state_groups(TASKS[:3], 5, checkpoint_dir, str(tmp_path / "tmp"))  # type: ignore[arg-type]
    writers = [
        open_channel_state(subtask_dir, 4, uid, i, None, groups[(uid, i)])  # type: ignore[arg-type]
        for uid, i in TASKS[:3]
    ]
    for k, w in enumerate(writers):
        w.add_input(0, 0, b"in-%d" % k)
        w.add_input(0, 1, b"more-%d" % k)
        w.add_output(0, 2, b"out-%d" % k)
    results = [w.close() for w in reversed(writers)][::-1]  # closed in another order
    shared = tmp_path / "chk-4" / "channels" / "src-0.spill"
    assert sorted(os.listdir(tmp_path / "chk-4" / "channels")) == ["src-0.spill"]
    assert not (tmp_path / "chk-4" / "src-0").exists()
    handles = [GateStateHandle.from_dict(h) for r in results for h in r["input"] + r["output"]]
    assert {h.uri for h in handles} == {str(shared)}
    # each gate's section, then its index section (its channel maps, metadata v3)
    assert all(h.index is not None and h.index.uri == str(shared) for h in handles)
    assert sum(h.size + h.index.length for h in handles if h.index) == shared.stat().st_size
    assert all(h.index and h.index.offset == (h.offset or 0) + h.size for h in handles)
    resolved = resolve_all(handles)
    assert [sorted(h.channels) for h in resolved] == [[0, 1], [2]] * 3
    for k, r in enumerate(results):
        with open_retriever(GateStateHandle.from_dict(r["input"][0])) as rd:
            assert [(b.channel_id, bytes(b)) for b in rd] == [
                (0, b"in-%d" % k),
                (1, b"more-%d" % k),
            ]
        with open_retriever(GateStateHandle.from_dict(r["output"][0])) as rd:
            assert [bytes(b) for b in rd] == [b"out-%d" % k]
    # Staged in memory, or in unlinked files: nothing left in the staging directory.
    assert not (tmp_path / "tmp").exists() or os.listdir(tmp_path / "tmp") == []


def test_group_of_one_keeps_todays_layout(tmp_path: Path) -> None:
    subtask_dir, checkpoint_dir = _dirs(tmp_path)
    groups = channel_state_groups(TASKS[:1], 5, checkpoint_dir)  # type: ignore[arg-type]
    w = open_channel_state(subtask_dir, 2, "src", 0, None, groups[("src", 0)])  # type: ignore[arg-type]
    w.add_input(1, 0, b"abc")
    h = w.close()["input"][0]
    channels = tmp_path / "chk-2" / "src-0" / "channels"
    assert h["uri"] == str(channels / "in-00001.spill")
    assert "offset" not in h
    # its channel maps: in the subtask's index object (metadata v3), not in the ack
    assert "channels" not in h and h["index"]["uri"] == str(channels / INDEX_OBJECT)
    (back,) = resolve_all([GateStateHandle.from_dict(h)])
    assert back.channels == {0: (1, 3)}


def test_a_failing_shared_file_fails_only_that_subtasks_part(tmp_path: Path) -> None:
    """The group's file cannot be written: close raises (the task declines the
    checkpoint), the staged gate is gone, and another checkpoint works again."""
    subtask_dir, checkpoint_dir = _dirs(tmp_path)
    groups = channel_state_groups(TASKS[:2], 5, checkpoint_dir)  # type: ignore[arg-type]
    (tmp_path / "chk-1").mkdir()
    (tmp_path / "chk-1" / "channels").write_bytes(b"not a directory")
    w = open_channel_state(subtask_dir, 1, "src", 0, None, groups[("src", 0)])  # type: ignore[arg-type]
    assert isinstance(w, ChannelStateWriter)
    w.add_input(0, 0, b"abc")
    with pytest.raises(StorageError):
        w.close()
    w.discard()
    ok = open_channel_state(subtask_dir, 2, "src", 1, None, groups[("src", 1)])  # type: ignore[arg-type]
    ok.add_input(0, 0, b"def")
    h = GateStateHandle.from_dict(ok.close()["input"][0])
    with open_retriever(h) as rd:
        assert [bytes(b) for b in rd] == [b"def"]


class HeldBuffer(bytearray):
    """A network buffer's stand-in: counts the references the writer holds."""

    held = 0

    def retain(self) -> None:
        self.held += 1

    def release(self) -> None:
        self.held -= 1


def _open_in(directory: Path) -> list[str]:
    """This process's descriptors open on files in ``directory`` (unlinked ones too)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith(str(directory)):
                found.append(fd)
    return found


def test_a_failed_close_lets_go_of_every_gate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first gate's append fails: close raises and, without a discard, the other
    gates' writers are gone too (no staged file or descriptor left open, every
    network buffer given back)."""
    # Staging files made ahead of need are no writer's (storage/shared.py): none here.
    monkeypatch.setattr(shared_mod._Spares, "AHEAD", 0)
    subtask_dir, checkpoint_dir = _dirs(tmp_path)
    staging = tmp_path / "tmp"
    groups = channel_state_groups(TASKS[:2], 5, checkpoint_dir, str(staging))  # type: ignore[arg-type]
    (tmp_path / "chk-1").mkdir()
    (tmp_path / "chk-1" / "channels").write_bytes(b"not a directory")
    w = open_channel_state(subtask_dir, 1, "src", 0, None, groups[("src", 0)])  # type: ignore[arg-type]
    buffers = [HeldBuffer(b"x" * 100) for _ in range(3)]
    for gate, b in enumerate(buffers):
        w.add_input(gate, 0, b)
    with pytest.raises(StorageError):
        w.close()
    assert _open_in(staging) == []
    assert [b.held for b in buffers] == [0, 0, 0]


def test_a_group_on_a_filesystem_without_appends_publishes_one_object() -> None:
    """Any pyarrow filesystem (here pyarrow's in-memory one, which needs its
    directories made): the group's gates become sections of one object, published
    when the last member closed, each read back exactly."""
    register_filesystem("memgroup", pafs._MockFileSystem())
    try:
        root = Location.parse("memgroup:///root")
        groups = channel_state_groups(TASKS[:3], 5, lambda cid: root.child(f"chk-{cid}").uri)
        assert isinstance(groups[TASKS[0]].file(1), SharedObjects)
        writers = [
            open_channel_state(
                lambda cid, uid, i: root.child(f"chk-{cid}", f"{uid}-{i}").uri,
                1,
                uid,
                i,
                None,
                groups[(uid, i)],
            )
            for uid, i in TASKS[:3]
        ]
        for k, w in enumerate(writers):
            w.add_input(0, k, b"in-%d" % k)
        # Each close waits for the group's publish: one thread per member.
        results: dict[int, Any] = {}
        threads = [
            threading.Thread(target=lambda k=k, w=w: results.__setitem__(k, w.close()))
            for k, w in enumerate(writers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        handles = [GateStateHandle.from_dict(results[k]["input"][0]) for k in range(3)]
        assert {h.uri for h in handles} == {root.child("chk-1", "channels", "src-0.spill").uri}
        assert root.child("chk-1", "channels").list() == ["src-0.spill"]
        for k, h in enumerate(handles):
            with open_retriever(h) as rd:
                assert [(b.channel_id, bytes(b)) for b in rd] == [(k, b"in-%d" % k)]
    finally:
        register_filesystem("memgroup", None)
