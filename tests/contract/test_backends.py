"""One storage contract, every backend, both engines: what the engine promises about
files holds on a local path, a file:// URI, pyarrow's local and in-memory
filesystems and S3 (moto on loopback), written and read natively and by the
pure-Python twin."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest

import spillover
from spillover.errors import (
    CorruptFrameError,
    ForeignFileError,
    StateFileExistsError,
    StateFileNotFoundError,
    TruncatedFileError,
)
from spillover.keygroups import key_groups
from spillover.runtime.api import StateDescriptor
from spillover.runtime.checkpointing.metadata import (
    METADATA_FORMAT,
    CheckpointStorage,
)
from spillover.runtime.state import HeapKeyedStateBackend
from support.checkpoint_golden import empty_metadata
from support.stores import Store

PAYLOADS = [os.urandom(n) for n in (0, 1, 4096, 70000, 1 << 20)]


def write(store: Store, frames: list[tuple[int, bytes]], gate: int = 0, **opts: Any) -> Any:
    storage = spillover.open_storage(store.uri, **store.options, **opts)
    with storage.create_storer(gate) as st:
        for channel, payload in frames:
            st.append(channel, payload)
    return st.close()


def read(store: Store, source: Any, **opts: Any) -> list[tuple[int, bytes]]:
    with spillover.open_retriever(source, **store.reopen, **opts) as r:
        return [(b.channel_id, bytes(b)) for b in r]


def test_gates_round_trip_and_name_their_files(store: Store) -> None:
    storage = spillover.open_storage(store.uri, checkpoint_id=42, subtask_index=3, **store.options)
    with storage.create_storer(1, kind="output") as st:
        for i, p in enumerate(PAYLOADS):
            st.append(i, p)
    handle = st.close()
    with storage.create_storer(0) as st2:
        st2.append(7, b"input side", spillover.DataType.EVENT)
    assert storage.gates() == [(spillover.GateKind.INPUT, 0), (spillover.GateKind.OUTPUT, 1)]
    with storage.create_retriever(1, kind="output") as r:
        assert [bytes(b) for b in r] == PAYLOADS
        assert r.header["checkpoint_id"] == 42 and r.header["subtask_index"] == 3
    assert read(store, handle) == list(enumerate(PAYLOADS))
    again = spillover.GateStateHandle.from_dict(json.loads(json.dumps(handle.to_dict())))
    assert read(store, again) == list(enumerate(PAYLOADS))
    with pytest.raises(StateFileExistsError):
        storage.create_storer(1, kind="output")
    with pytest.raises(StateFileNotFoundError) as ei:
        storage.create_retriever(5)
    assert ei.value.errno == 2


@pytest.mark.parametrize("codec", [None, "lz4"])
@pytest.mark.parametrize("blocking", [True, False])
def test_modes_and_codecs_read_back_exactly(
    store: Store, codec: str | None, blocking: bool
) -> None:
    frames = [(i % 3, (b"abc" * 5000)[: 100 * i] + os.urandom(i)) for i in range(40)]
    handle = write(store, frames, compression=codec, blocking=blocking, pool_bytes=64 * 1024)
    assert read(store, handle, read_block_bytes=8192, read_ahead_bytes=16384) == frames
    assert handle.frame_count == 40 and handle.raw_bytes == sum(len(p) for _, p in frames)


def test_channel_ranges_read_only_their_bytes(store: Store) -> None:
    frames = [(0, b"a" * 100)] * 3 + [(1, b"b" * 200)] * 2 + [(2, b"c" * 50)]
    handle = write(store, frames)
    assert handle.byte_range([1]) is not None
    assert read(store, handle, channels=[1]) == [(1, b"b" * 200)] * 2
    assert read(store, handle, channels=[2, 0]) == frames  # one span from 0's to 2's
    assert read(store, handle, channels=[9]) == []


def test_a_cut_file_is_refused_before_any_buffer(store: Store) -> None:
    handle = write(store, [(0, os.urandom(5000)), (1, b"tail")])
    data = store.read_bytes(handle.uri)
    store.write_bytes(handle.uri, data[: len(data) - 10])
    with pytest.raises(TruncatedFileError) as ei:
        spillover.open_retriever(handle.uri, **store.reopen)
    assert ei.value.path is not None and handle.uri.partition("?")[0] in ei.value.path


def test_a_damaged_payload_is_named_when_read(store: Store) -> None:
    handle = write(store, [(0, b"x" * 1000), (1, b"y" * 1000)])
    data = bytearray(store.read_bytes(handle.uri))
    data[64 + 24 + 500] ^= 0xFF  # inside the first frame's payload
    store.write_bytes(handle.uri, bytes(data))
    with pytest.raises(CorruptFrameError) as ei:
        read(store, handle.uri)
    assert ei.value.offset == 64


def test_a_replaced_file_is_foreign_to_its_handle(store: Store) -> None:
    first = write(store, [(0, b"one")], gate=0)
    second = write(store, [(0, b"two")], gate=1)
    store.write_bytes(first.uri, store.read_bytes(second.uri))
    with pytest.raises(ForeignFileError):
        spillover.open_retriever(first, **store.reopen)


def test_discard_and_an_error_in_the_with_block_leave_no_file(store: Store) -> None:
    storage = spillover.open_storage(store.uri, **store.options)
    st = storage.create_storer(0)
    st.append(0, b"x" * 10_000)
    st.discard()
    with pytest.raises(KeyError), storage.create_storer(1) as st2:
        st2.append(0, b"y")
        raise KeyError("boom")
    assert storage.gates() == []
    with pytest.raises(StateFileNotFoundError):
        storage.create_retriever(0)


def test_keyed_state_files_round_trip(store: Store) -> None:
    if store.filesystem is not None:
        pytest.skip("keyed-state handles name their files by URI; a filesystem object has none")
    b = HeapKeyedStateBackend.for_subtask(128, 2, 1, name="op")
    keys = np.arange(-300, 300, dtype=np.int64)
    keys = keys[key_groups(keys, 128) >= 64]
    state = b.state(spillover_state_descriptor())
    state.put(keys, keys * 2)
    handle = json.loads(json.dumps(b.snapshot()(store.uri)))
    restored = HeapKeyedStateBackend.for_subtask(128, 2, 1)
    restored.restore([handle])
    values, found = restored.state(spillover_state_descriptor()).get(keys)
    assert found.all() and (values == keys * 2).all()
    with pytest.raises(StateFileExistsError):
        b.snapshot()(store.uri)


def test_checkpoint_metadata_round_trips_and_names_the_latest(store: Store) -> None:
    if store.filesystem is not None:
        pytest.skip("checkpoint storage is named by URI; a filesystem object has none")
    cs = CheckpointStorage(store.uri, "job/with odd name")
    assert cs.latest() is None and cs.highest_id() == 0
    for cid in (1, 2):
        meta = empty_metadata(cid)
        cs.write_metadata(cid, meta)
    latest = cs.latest()
    assert latest is not None and latest.checkpoint_id == 2 and latest.metadata == meta
    assert cs.read_metadata(1)["format"] == METADATA_FORMAT and cs.read(1).checkpoint_id == 1
    assert cs.completed_ids() == [1, 2]
    assert cs.subtask_dir(3, "op", 0).partition("?")[0].endswith("/chk-3/op-0")


def spillover_state_descriptor() -> StateDescriptor:
    return StateDescriptor("v", "value", np.dtype(np.int64))
