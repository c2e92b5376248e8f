"""Checkpoint metadata version 3: each task writes its gates' channel index entries
beside their state and acknowledges only where they are, so the coordinator writes
``_metadata`` alone. Whatever the gates, the maps read back exactly; a cut or
damaged entry is one ``SpilloverError`` (docs/format.md, "Channel index")."""

from __future__ import annotations

import dataclasses
import json
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spillover.errors import CorruptIndexError, SpilloverError, StateFileNotFoundError
from spillover.runtime.checkpointing.channel_state import (
    channel_state_groups,
    gate_entry,
    open_channel_state,
)
from spillover.runtime.checkpointing.checkpoint_meta import (
    ChannelStateMeta,
    CheckpointMetadata,
    OperatorMeta,
    SubtaskMeta,
)
from spillover.runtime.checkpointing.metadata import METADATA_VERSION, CheckpointStorage
from spillover.storage.channel_index import INDEX_FILE, check_index, encode_entry, resolve_all
from spillover.storage.handle import GateKind, GateStateHandle, IndexRef
from spillover.storage.shared import write_at

_SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@st.composite
def _gates(draw: st.DrawFn, root: Path) -> list[GateStateHandle]:
    """Closed gates, some sections of one shared file (their entries right after
    them), some files of their own (their entries in one index object)."""
    shared = root / "shared.spill"
    alone_index = root / "_index"
    out, at, alone_at = [], 0, 0
    for gate in range(draw(st.integers(0, 4))):
        chans = draw(st.lists(st.integers(0, 2**20), unique=True, max_size=12))
        channels = {c: (draw(st.integers(0, 9)), draw(st.integers(0, 2**40))) for c in chans}
        ranges = {c: (64 + c, 64 + 2 * c) for c in chans} if draw(st.booleans()) else {}
        in_shared = draw(st.booleans())
        size = draw(st.integers(128, 4096))
        h = GateStateHandle(
            str(shared) if in_shared else str(root / f"in-{gate:05d}.spill"),
            gate,
            GateKind.INPUT,
            1,
            0,
            f"{gate:032x}",
            size,
            sum(f for f, _ in channels.values()),
            0,
            0,
            channels=channels,
            channel_ranges=ranges,
            offset=at if in_shared else None,
        )
        entry = encode_entry(h)
        if in_shared:  # the section (not written: a sparse file), then its entry
            ref = IndexRef(str(shared), at + size, len(entry))
            at += size + len(entry)
        else:
            ref = IndexRef(str(alone_index), alone_at, len(entry))
            alone_at += len(entry)
        write_at(ref.uri, ref.offset, entry, create=True)
        out.append(dataclasses.replace(h, index=ref))
    return out


@_SETTINGS
@given(data=st.data())
def test_entries_the_tasks_wrote_read_back_exactly(tmp_path: Path, data: st.DataObject) -> None:
    """Acknowledged as references only, written as ``_metadata`` alone, read back:
    every gate's maps are what the task had."""
    root = tmp_path / uuid.uuid4().hex
    root.mkdir()
    subtasks = [data.draw(_gates(root / str(i))) if _mkdir(root / str(i)) else [] for i in range(3)]
    acks = [{"input": [gate_entry(h) for h in gates]} for gates in subtasks]
    assert all("channels" not in g and "index_entry" not in g for a in acks for g in a["input"])
    tasks = {
        "op": OperatorMeta(
            {
                i: SubtaskMeta(channel_state=ChannelStateMeta.from_json(a))
                for i, a in enumerate(acks)
            }
        )
    }
    meta = CheckpointMetadata(METADATA_VERSION, "j", 1, 0, 0, "f", {}, False, tasks)
    storage = CheckpointStorage(str(root / "ckpt"), "j")
    storage.write_metadata(1, meta)
    assert not Path(storage.location.child("chk-1", INDEX_FILE).path).exists()
    raw = storage.read_metadata(1)
    assert raw["version"] == 3 and "channel_index" not in raw
    back = CheckpointMetadata.from_json(json.loads(json.dumps(raw)))
    for i, gates in enumerate(subtasks):
        cs = back.operator("op").subtask(i).channel_state
        assert cs is not None
        check_index(cs.input)
        expected = [dataclasses.replace(h, index=None) for h in gates]
        assert resolve_all(cs.input) == expected


def _mkdir(p: Path) -> bool:
    p.mkdir(parents=True, exist_ok=True)
    return True


def _written(tmp_path: Path) -> list[GateStateHandle]:
    """The gates of two subtasks of a group sharing one file, as the real writer
    writes them and acknowledges them."""
    tasks = [("src", 0), ("src", 1)]

    def subtask_dir(cid: int, uid: str, i: int) -> str:
        return str(tmp_path / f"chk-{cid}" / f"{uid}-{i}")

    groups = channel_state_groups(tasks, 5, lambda cid: str(tmp_path / f"chk-{cid}"))
    writers = [open_channel_state(subtask_dir, 1, u, i, None, groups[(u, i)]) for u, i in tasks]
    for k, w in enumerate(writers):
        w.add_input(0, k, b"in-%d" % k)
        w.add_output(0, 3, b"out")
    handles = []
    for w in writers:
        r = w.close()
        assert r is not None
        handles += [GateStateHandle.from_dict(h) for h in r["input"] + r["output"]]
    return handles


def test_a_missing_file_of_entries_refuses_the_checkpoint_whole(tmp_path: Path) -> None:
    handles = _written(tmp_path)
    Path(handles[0].uri).unlink()
    with pytest.raises(StateFileNotFoundError):
        check_index(handles)


@_SETTINGS
@given(cut=st.floats(0, 1, exclude_max=True), flip=st.none() | st.floats(0, 1, exclude_max=True))
def test_a_cut_or_flipped_entry_is_one_spillover_error(
    tmp_path: Path, cut: float, flip: float | None
) -> None:
    """The shared file cut anywhere in its last index section, or one byte of an
    index section flipped: the check before a restore or the gate's read fails
    with one SpilloverError (CorruptIndexError), never a traceback, never other maps."""
    root = tmp_path / uuid.uuid4().hex
    handles = _written(root)
    maps = [h.channels for h in resolve_all(handles)]
    assert maps == [{0: (1, 4)}, {3: (1, 3)}, {1: (1, 4)}, {3: (1, 3)}]
    path = Path(handles[0].uri)
    data = bytearray(path.read_bytes())
    refs = [h.index for h in handles if h.index is not None]
    last = max(refs, key=lambda r: r.offset)
    if flip is None:
        path.write_bytes(bytes(data[: last.offset + int(cut * last.length)]))
        with pytest.raises(CorruptIndexError):
            check_index(handles)
    else:
        ref = refs[int(flip * len(refs))]
        data[ref.offset + int(cut * ref.length)] ^= 1 + int(flip * 254)
        path.write_bytes(bytes(data))
    with pytest.raises(SpilloverError) as e:  # a CRC32C misses no flipped byte
        resolve_all(handles)
    assert isinstance(e.value, CorruptIndexError) and e.value.path == str(path)
