"""Checkpoints during recovery: what is not replayed yet is referenced, not rewritten.

``InputRecovery`` replays recovered input state step by step; at any step the
remainder, cut at the start of the record in progress, is a list of referenced
pieces. Replaying the references (and, in a chain, references taken while
replaying references) must give exactly the records not yet processed, in order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spillover
import spillover.runtime.recovery.replay as rec
from spillover.errors import CorruptFrameError, CorruptHeaderError, ForeignFileError
from spillover.keygroups import KeyGroupRange
from spillover.records import RecordReader, RecordWriter
from spillover.rescale import FilteringRetriever, Piece, RecordStream, Reference
from spillover.runtime.checkpointing.checkpoint_meta import (
    ChannelStateMeta,
    CheckpointMetadata,
    OperatorMeta,
    SubtaskMeta,
)
from spillover.runtime.checkpointing.metadata import referenced_checkpoints
from spillover.runtime.recovery.replay import InputRecovery


def _write_gate(root: Path, channels: int, records: int, cut: int, seed: int) -> tuple[Any, Any]:
    """An input gate file whose channels hold records ``(channel, i)``, cut anywhere."""
    rng = np.random.default_rng(seed)
    storer = spillover.open_storage(root).create_storer(0)
    per_channel = []
    for ch in range(channels):
        w = RecordWriter(cut)
        bufs = []
        for i in range(records):
            bufs += w.write(np.array([ch, i], "<i8").tobytes() + bytes(int(rng.integers(0, 40))))
        last = w.flush()
        bufs += [last] if last is not None else []
        per_channel.append(bufs)
    order = [ch for ch in range(channels) for _ in per_channel[ch]]
    rng.shuffle(order)
    pos = [0] * channels
    for ch in order:
        storer.append(ch, per_channel[ch][pos[ch]])
        pos[ch] += 1
    return storer.close(), records


class _Sink:
    """A task's readers: per channel, the records processed, as ``(channel, i)``."""

    def __init__(self) -> None:
        self.readers: dict[int, RecordReader] = {}
        self.got: dict[int, list[int]] = {}

    def process(self, gate: int, ch: int, buf: Any) -> None:
        reader = self.readers.setdefault(ch, RecordReader())
        for batch in reader.feed(buf):
            for rec_ in batch:
                c, i = np.frombuffer(rec_[:16], "<i8")
                assert c == ch
                self.got.setdefault(ch, []).append(int(i))

    def pending(self, gate: int, ch: int) -> int:
        r = self.readers.get(ch)
        return r.pending_bytes if r is not None else 0


def _replay_partly(gates: Any, steps: int) -> tuple[_Sink, list[Reference]]:
    sink = _Sink()
    r = InputRecovery(gates, sink.process)
    for _ in range(steps):
        if not r.step():
            break
    r.flush()
    refs = r.references(sink.pending)
    r.close()
    return sink, refs


def _gates_from(refs: list[Reference]) -> dict[int, Any]:
    gates: dict[int, Any] = {}
    for ref in refs:
        assert ref.filter is None and Reference.from_dict(ref.to_dict()) == ref
        _, chans = gates.setdefault(ref.gate, (None, {}))
        chans.setdefault(ref.channel, []).extend(ref.pieces)
    return gates


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    channels=st.integers(1, 3),
    cut=st.integers(9, 200),
    first=st.integers(0, 30),
    second=st.integers(0, 30),
    seed=st.integers(0, 1000),
)
def test_a_chain_of_references_replays_every_record_once(
    tmp_path_factory: pytest.TempPathFactory,
    channels: int,
    cut: int,
    first: int,
    second: int,
    seed: int,
) -> None:
    """Replay part, reference the rest, replay part of that, reference again, then
    replay to the end: every record once, in order per channel."""
    with pytest.MonkeyPatch.context() as mp:  # small steps: cuts fall anywhere
        mp.setattr(rec, "STEP_BYTES", 4096)
        mp.setattr(rec, "JOIN_BYTES", 4096)
        root = tmp_path_factory.mktemp("chk")
        handle, n = _write_gate(root, channels, 300, cut, seed)
        a, refs_a = _replay_partly({0: (handle, {})}, first)
        # Every referenced piece points into the old file; nothing is rewritten.
        assert all(p.handle.uri == handle.uri for r in refs_a for p in r.pieces)
        b, refs_b = _replay_partly(_gates_from(refs_a), second)
        c, refs_c = _replay_partly(_gates_from(refs_b), 10**6)
        assert refs_c == []
        for ch in range(channels):
            seen = a.got.get(ch, []) + b.got.get(ch, []) + c.got.get(ch, [])
            assert seen == list(range(n)), f"channel {ch}"


def test_a_record_cut_between_reference_and_own_file_joins(tmp_path: Path) -> None:
    """A referenced piece may end inside a record whose tail is in the checkpoint's own
    file (the network brought it after the restore): one reader joins them."""
    w = RecordWriter(64)
    bufs = []
    for i in range(50):
        bufs += w.write(np.array([0, i], "<i8").tobytes() + b"x" * 30)
    last = w.flush()
    bufs += [last] if last is not None else []
    old = spillover.open_storage(tmp_path / "a").create_storer(0)
    for b in bufs[:20]:
        old.append(0, b)
    old_h = old.close()
    own = spillover.open_storage(tmp_path / "b").create_storer(0)
    for b in bufs[20:]:
        own.append(0, b)
    own_h = own.close()
    sink = _Sink()
    r = InputRecovery({0: (own_h, {0: [Piece(old_h, 0, 100)]})}, sink.process)
    while r.step():
        pass
    # 50-byte framed records: skipping 100 bytes skips two; the record cut at the end
    # of the referenced piece ends in the own file.
    assert sink.got[0] == list(range(2, 50))


def test_an_own_file_may_end_inside_a_record(tmp_path: Path) -> None:
    """At unchanged parallelism a channel's own input file may end inside a record:
    its tail is in the upstream's output state and comes over the network. The replay
    hands the head on to the task's reader, which joins the tail that follows."""
    w = RecordWriter(64)
    bufs = []
    for i in range(50):
        bufs += w.write(np.array([0, i], "<i8").tobytes() + b"x" * 30)
    last = w.flush()
    bufs += [last] if last is not None else []
    own = spillover.open_storage(tmp_path).create_storer(0)
    for b in bufs[:21]:  # 21 * 64 bytes: the file ends inside record 26
        own.append(0, b)
    sink = _Sink()
    r = InputRecovery({0: (own.close(), {})}, sink.process)
    while r.step():
        pass
    r.close()
    assert sink.got[0] == list(range(26))
    assert sink.pending(0, 0) == 21 * 64 - 26 * 50
    for b in bufs[21:]:  # the upstream's output state, over the network
        sink.process(0, 0, b)
    assert sink.got[0] == list(range(50))


def test_an_event_in_own_input_state_is_named(tmp_path: Path) -> None:
    """Input state holds data buffers only: an event buffer there is a corrupt file."""
    storer = spillover.open_storage(tmp_path).create_storer(0)
    storer.append(0, np.array([0, 0], "<i8").tobytes())
    storer.append(0, b"barrier", spillover.DataType.EVENT)
    handle = storer.close()
    r = InputRecovery({0: (handle, {})}, lambda *a: None)
    with pytest.raises(CorruptFrameError, match="input state holds an event buffer") as e:
        while r.step():
            pass
    assert e.value.path == handle.uri


def test_a_rescaled_stream_skips_referenced_bytes(tmp_path: Path) -> None:
    """The filtering retriever reads referenced pieces with their skip first."""
    handle, n = _write_gate(tmp_path, 1, 200, 50, 3)
    part = _Sink()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rec, "STEP_BYTES", 4096)
        mp.setattr(rec, "JOIN_BYTES", 4096)
        r = InputRecovery({0: (handle, {})}, part.process)
        r.step()
        r.flush()
        refs = r.references(part.pending)
    (ref,) = refs
    stream = RecordStream.of(ref.pieces, 0, 0, channel=0)
    fr = FilteringRetriever(
        [stream], max_parallelism=128, key_group_table=KeyGroupRange(0, 127), buffer_size=4096
    )
    rest = _Sink()
    for buf in fr:
        rest.process(0, 0, buf)
    assert part.got[0] + rest.got[0] == list(range(n))


def test_a_replaced_referenced_file_is_named(tmp_path: Path) -> None:
    handle, _ = _write_gate(tmp_path / "a", 1, 50, 40, 1)
    other, _ = _write_gate(tmp_path / "b", 1, 50, 40, 2)
    Path(handle.uri).write_bytes(Path(other.uri).read_bytes())
    r = InputRecovery({0: (None, {0: [Piece(handle, 0, 0)]})}, lambda *a: None)
    with pytest.raises(ForeignFileError) as e:
        while r.step():
            pass
    assert e.value.path == handle.uri


def test_missing_frames_are_one_error_for_both_replays(tmp_path: Path) -> None:
    """A handle counting more frames than its file holds is the same error whether a
    restored task's own replay or a rescale's filtering retriever meets it."""
    handle, _ = _write_gate(tmp_path, 2, 50, 40, 3)
    d = handle.to_dict()
    start = d["channel_ranges"]["0"][0]
    d["channel_ranges"]["0"] = [start, start + 2 * (24 + 40)]  # its first two frames only
    lying = spillover.GateStateHandle.from_dict(d)
    replay = InputRecovery({0: (None, {0: [Piece(lying, 0, 0)]})}, lambda *a: None)
    with pytest.raises(CorruptHeaderError, match="fewer frames") as e:
        while replay.step():
            pass
    assert e.value.path == handle.uri
    stream = FilteringRetriever(
        [RecordStream(((lying, 0),), 0, 0, channel=0)], pass_through=True, coalesce=True
    )
    with pytest.raises(CorruptHeaderError, match="fewer frames"):
        list(stream)


def test_metadata_lists_the_checkpoints_it_references() -> None:
    uri = "/ck/job/chk-4/op-0/channels/in-00000.spill"
    piece = Piece(
        spillover.GateStateHandle(uri, 0, spillover.GateKind.INPUT, 4, 0, "f", 64, 0, 0, 0), 0
    )
    cs = ChannelStateMeta(references=(Reference(0, 0, (piece, piece)),))
    op = OperatorMeta({0: SubtaskMeta(channel_state=cs)})
    meta = CheckpointMetadata(2, "j", 9, 0, 0, "f", {}, False, {"op": op})
    assert referenced_checkpoints(meta) == [4]


def test_references_into_two_sections_of_one_shared_file(tmp_path: Path) -> None:
    """Two channels' references point into the sections of two old subtasks that
    shared a file: each channel is read from its own section, not the first one's."""
    from spillover.storage import GateKind, Storage, StorageOptions
    from spillover.storage.handle import state_file_name
    from spillover.storage.location import Location
    from spillover.storage.shared import SharedFile, StagingBackend

    shared = SharedFile(Location.parse(str(tmp_path / "chk-1" / "channels")), "a-0.spill")
    handles = []
    for subtask, ch in ((0, 0), (1, 1)):  # old subtask 0 held channel 0, subtask 1 channel 1
        staging = StagingBackend(str(tmp_path))
        storer = Storage(staging, StorageOptions(), 1, subtask).create_storer(0)
        w = RecordWriter(64)
        for i in range(40):
            for b in w.write(np.array([ch, i], "<i8").tobytes() + b"y" * 20):
                storer.append(ch, b)
        last = w.flush()
        if last is not None:
            storer.append(ch, last)
        h = storer.close()
        staged = staging.take(state_file_name(0, GateKind.INPUT))
        try:
            handles.append(shared.append(staged, h))
        finally:
            staged.close()
    assert handles[0].uri == handles[1].uri and handles[1].offset
    sink = _Sink()
    r = InputRecovery(
        {0: (None, {0: [Piece(handles[0], 0)], 1: [Piece(handles[1], 1)]})}, sink.process
    )
    while r.step():
        pass
    assert sink.got == {0: list(range(40)), 1: list(range(40))}
