"""``CheckpointStorage`` is checkpoint metadata's one JSON boundary: any
:class:`CheckpointMetadata` written reads back equal, with its acknowledged gates'
channel maps moved into the channel index unchanged or kept inline; and a cut or
damaged ``_metadata`` or ``_channel_index`` is one ``SpilloverError``, never a
traceback."""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spillover.errors import CorruptIndexError, FormatError, SpilloverError
from spillover.runtime.checkpointing.checkpoint_meta import (
    ChannelStateMeta,
    CheckpointMetadata,
    OperatorMeta,
    SubtaskMeta,
)
from spillover.runtime.checkpointing.metadata import METADATA_FILE, CheckpointStorage
from spillover.storage.channel_index import INDEX_FILE, encode_entry, resolve_all
from spillover.storage.handle import GateKind, GateStateHandle
from support.checkpoint_golden import carried_entry, inlined

_ids = itertools.count(1)


@st.composite
def _handle(draw: st.DrawFn, encoded: bool) -> GateStateHandle:
    """A closed gate's handle; ``encoded``: as a version 2 acknowledgement carried it
    (its maps one encoded entry), else with its maps inline."""
    chans = draw(st.lists(st.integers(0, 2**20), unique=True, max_size=8))
    channels = {c: (draw(st.integers(0, 9)), draw(st.integers(0, 2**40))) for c in chans}
    ranges = {c: (64 + c, 64 + 2 * c) for c in chans} if draw(st.booleans()) else {}
    gate = draw(st.integers(0, 3))
    h = GateStateHandle(
        f"/x/chk-1/channels/g-{gate}.spill",
        gate,
        draw(st.sampled_from(GateKind)),
        1,
        draw(st.integers(0, 7)),
        f"{gate:032x}",
        draw(st.integers(64, 2**40)),
        sum(f for f, _ in channels.values()),
        draw(st.integers(0, 2**40)),
        draw(st.integers(0, 2**40)),
        channels=channels,
        channel_ranges=ranges,
        offset=draw(st.none() | st.integers(0, 2**40)),
    )
    if encoded:  # what the coordinator got: the handle carried_entry gives, parsed
        return GateStateHandle.from_dict(carried_entry(h))
    return h


names = st.text("abcxyz-", min_size=1, max_size=6)


def _channel_state(encoded: bool) -> st.SearchStrategy[ChannelStateMeta]:
    gates = st.lists(_handle(encoded), max_size=2).map(tuple)
    return st.builds(ChannelStateMeta, gates, gates, bytes=st.integers(0, 10**9))


def _metadata(encoded: bool) -> st.SearchStrategy[CheckpointMetadata]:
    subtasks = st.builds(
        SubtaskMeta,
        st.dictionaries(names, st.integers(), max_size=2),
        st.dictionaries(names, st.dictionaries(names, st.integers(), max_size=2), max_size=2),
        st.dictionaries(names, st.integers(), max_size=2),
        st.none() | _channel_state(encoded),
        st.dictionaries(names, st.floats(allow_nan=False), max_size=2),
        st.booleans(),
    )
    operators = st.builds(
        OperatorMeta,
        st.dictionaries(st.integers(0, 4), subtasks, max_size=3),
        st.none() | st.integers(1, 8),
        st.sampled_from(["fully", "partially", "running"]),
    )
    return st.builds(
        CheckpointMetadata,
        version=st.sampled_from([1, 2, 3]),
        job=names,
        checkpoint_id=st.integers(1, 10**6),
        trigger_ms=st.integers(0, 2**40),
        completed_ms=st.integers(0, 2**40),
        graph_fingerprint=names,
        settings=st.dictionaries(names, st.integers(), max_size=2),
        final=st.booleans(),
        tasks=st.dictionaries(names, operators, max_size=3),
        references=st.lists(st.integers(1, 100), max_size=3).map(tuple),
        savepoint_from=st.none() | names,
    )


def _gates(meta: CheckpointMetadata) -> list[GateStateHandle]:
    return [
        h
        for op in meta.tasks.values()
        for s in op.subtasks.values()
        if s.channel_state is not None
        for h in (*s.channel_state.input, *s.channel_state.output)
    ]


def _write(meta: CheckpointMetadata) -> tuple[CheckpointStorage, int]:
    storage = CheckpointStorage(tempfile.mkdtemp(prefix="boundary-"), "j")
    cid = next(_ids)
    storage.write_metadata(cid, meta)
    return storage, cid


@settings(max_examples=60, deadline=None)
@given(_metadata(encoded=False))
def test_metadata_with_its_maps_inline_reads_back_equal(meta: CheckpointMetadata) -> None:
    storage, cid = _write(meta)
    assert storage.read(cid) == meta
    assert not (storage.location.child(f"chk-{cid}", INDEX_FILE).exists())


@settings(max_examples=60, deadline=None)
@given(_metadata(encoded=True))
def test_acknowledged_maps_go_into_the_index_unchanged_and_read_back_equal(
    meta: CheckpointMetadata,
) -> None:
    storage, cid = _write(meta)
    back = storage.read(cid)
    gates = _gates(meta)
    index = Path(storage.location.child(f"chk-{cid}", INDEX_FILE).path)
    if gates:
        assert back.channel_index is not None and back.channel_index.size == index.stat().st_size
        # the bytes the tasks encoded, as they were, one after another
        assert index.read_bytes() == b"".join(h.entry or b"" for h in gates)
        assert all(h.index is not None and not h.channels for h in _gates(back))
    else:
        assert back.channel_index is None and not index.exists()
    assert inlined(back) == inlined(meta)


def test_a_handle_from_an_acknowledgement_decodes_only_when_asked() -> None:
    h = GateStateHandle(
        "/x/chk-1/g.spill", 0, GateKind.INPUT, 1, 0, "f", 200, 3, 9, 9, channels={4: (3, 9)}
    )
    acked = GateStateHandle.from_dict(carried_entry(h))
    assert acked.entry == encode_entry(h) and acked.channels == {}
    assert resolve_all([acked]) == [h]
    assert acked.to_dict() == h.to_dict()  # written alone: its maps inline, as ever


def _checkpoint(tmp_path: Path) -> tuple[CheckpointStorage, int]:
    gates = [
        GateStateHandle(
            f"/x/chk-1/g-{g}.spill",
            g,
            GateKind.INPUT,
            1,
            0,
            "f",
            4096,
            2 * (g + 1),
            100,
            100,
            channels={c: (2, 50) for c in range(g + 1)},
            channel_ranges={c: (64 + 100 * c, 164 + 100 * c) for c in range(g + 1)},
        )
        for g in range(3)
    ]
    cs = ChannelStateMeta(tuple(GateStateHandle.from_dict(carried_entry(h)) for h in gates))
    meta = CheckpointMetadata(
        2, "j", 3, 0, 0, "f", {}, False, {"m": OperatorMeta({0: SubtaskMeta(channel_state=cs)})}
    )
    storage = CheckpointStorage(str(tmp_path), "j")
    storage.write_metadata(3, meta)
    return storage, 3


def _read_all(storage: CheckpointStorage, cid: int) -> None:
    """What a restore reads: the metadata, then every gate's channel maps."""
    for op in storage.read(cid).tasks.values():
        for s in op.subtasks.values():
            if s.channel_state is not None:
                resolve_all(s.channel_state.input)


@pytest.mark.parametrize("name", [METADATA_FILE, INDEX_FILE])
@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cut=st.floats(0, 1, exclude_max=True), flip=st.none() | st.floats(0, 1, exclude_max=True))
def test_a_cut_or_damaged_file_is_one_spillover_error(
    tmp_path: Path, name: str, cut: float, flip: float | None
) -> None:
    """Cut at any length (or one byte flipped, the length kept): reading the
    checkpoint fails with a SpilloverError, or reads what it holds."""
    storage, cid = _checkpoint(tmp_path / f"{name}-{cut}-{flip}")
    path = Path(storage.location.child(f"chk-{cid}", name).path)
    data = bytearray(path.read_bytes())
    if flip is None:
        path.write_bytes(bytes(data[: int(cut * len(data))]))
    else:
        data[int(flip * len(data))] ^= 1 + int(cut * 255)
        path.write_bytes(bytes(data))
    try:
        _read_all(storage, cid)
    except SpilloverError as e:
        if flip is None:  # a cut one is never read as if whole
            assert isinstance(e, FormatError | CorruptIndexError)
        return
    assert flip is not None, "a cut file read as if whole"
