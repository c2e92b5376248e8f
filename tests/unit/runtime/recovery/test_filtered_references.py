"""Checkpoints during a rescaled replay: each old channel's rest is referenced with
the filter the new subtask applies.

``StreamRecovery`` replays old channels' streams (input piece, then output piece)
through filtering retrievers; at any step, what is left of each stream is a
filtered reference cut at the first byte of the record its demultiplexer has
begun. Replaying those references, composed with the filter of yet another
parallelism, then referencing again and replaying to the end, must keep each
record that passes every filter exactly once, in order per old channel
(checked against brute force).
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
from spillover.errors import RescaleError
from spillover.keygroups import key_groups
from spillover.records import RecordReader, RecordWriter, partitioner_name
from spillover.rescale import (
    Filter,
    KeepAll,
    KeyGroupFilter,
    PartitionerChoice,
    PartitionerFilter,
    Piece,
    RecordStream,
    Reference,
    compose,
    filter_retriever,
)
from spillover.runtime.checkpointing.checkpoint_meta import (
    ChannelStateMeta,
    CheckpointMetadata,
    OperatorMeta,
    SubtaskMeta,
)
from spillover.runtime.checkpointing.metadata import referenced_checkpoints
from spillover.runtime.recovery.replay import StreamRecovery

MAX_P = 128


def modulo(keys: Any, n: int) -> Any:
    """The custom partitioner of these tests."""
    return keys % n


def _write_streams(
    root: Path, streams: int, records: int, cut: int, seed: int
) -> tuple[list[list[Piece]], list[np.ndarray]]:
    """Per stream: two pieces (in two files) holding records ``(key, stream, seq)``
    framed in ``cut``-byte buffers, split at a random buffer; and the keys."""
    rng = np.random.default_rng(seed)
    storage = spillover.open_storage(root)
    first, second = storage.create_storer(0), storage.create_storer(1)
    split, all_keys = [], []
    for s in range(streams):
        keys = rng.integers(-(10**6), 10**6, records)
        w = RecordWriter(cut)
        bufs = []
        for i, k in enumerate(keys.tolist()):
            pad = bytes(int(rng.integers(0, 40)))
            bufs += w.write(np.array([k, s, i], "<i8").tobytes() + pad)
        last = w.flush()
        bufs += [last] if last is not None else []
        at = int(rng.integers(0, len(bufs) + 1))
        for b in bufs[:at]:
            first.append(s, b)
        for b in bufs[at:]:
            second.append(s, b)
        split.append(at)
        all_keys.append(keys)
    h1, h2 = first.close(), second.close()
    return [[Piece(h1, s), Piece(h2, s)] for s in range(streams)], all_keys


class _Sink:
    """The operator: per stream, the sequence numbers it processed."""

    def __init__(self) -> None:
        self.readers: dict[tuple[int, int], RecordReader] = {}
        self.got: dict[int, list[int]] = {}

    def process(self, gate: int, buf: Any) -> None:
        reader = self.readers.setdefault((gate, buf.channel_id), RecordReader())
        for batch in reader.feed(buf):
            for r in batch:
                _, s, i = np.frombuffer(r[:24], "<i8").tolist()
                self.got.setdefault(s, []).append(i)


def _retriever(pieces: Any, flt: Filter) -> Any:
    stream = RecordStream.of(pieces, 0, 0, 0)
    return filter_retriever([stream], flt, partitioner=modulo, buffer_size=4096)


def _replay(
    refs: list[tuple[Any, Filter]], new: Filter | None, steps: int
) -> tuple[_Sink, list[Reference]]:
    sink = _Sink()
    parts = []
    for pieces, flt in refs:  # one retriever per stream: the tests name them apart
        both = compose(flt, new)
        if both is not None:
            parts.append((0, _retriever(pieces, both), both))
    sr = StreamRecovery(parts, sink.process)
    for _ in range(steps):
        if not sr.step():
            break
    out = sr.references()
    sr.close()
    return sink, out


def _keep(flt: Filter | None, keys: np.ndarray) -> np.ndarray:
    if flt is None or isinstance(flt, KeepAll):
        return np.ones(len(keys), bool)
    if isinstance(flt, KeyGroupFilter):
        kg = key_groups(keys, MAX_P)
        return (kg >= flt.start) & (kg <= flt.end)
    ok = np.ones(len(keys), bool)
    for p in flt.choices:
        ok &= modulo(keys, p.parallelism) == p.index
    return ok


def _filter(kind: str, index: int, n: int) -> Filter:
    if kind == "none":
        return KeepAll()
    if kind == "key_groups":
        start = index * MAX_P // n
        return KeyGroupFilter(start, (index + 1) * MAX_P // n - 1, MAX_P, 0)
    return PartitionerFilter((PartitionerChoice(partitioner_name(modulo), index, n, 0),))


def _filtered(refs: list[Reference]) -> list[tuple[Any, Filter]]:
    """What a restore reads of references written to the metadata and read back."""
    out = []
    for ref in refs:
        back = Reference.from_dict(ref.to_dict())
        assert back == ref and back.filter is not None
        out.append((back.pieces, back.filter))
    return out


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    kind=st.sampled_from(["key_groups", "partitioner", "none"]),
    streams=st.integers(1, 3),
    cut=st.integers(30, 300),
    p1=st.integers(1, 4),
    p2=st.integers(1, 4),
    first=st.integers(0, 6),
    second=st.integers(0, 6),
    seed=st.integers(0, 1000),
    data=st.data(),
)
def test_filtered_references_replay_every_kept_record_once(
    tmp_path_factory: pytest.TempPathFactory,
    kind: str,
    streams: int,
    cut: int,
    p1: int,
    p2: int,
    first: int,
    second: int,
    seed: int,
    data: st.DataObject,
) -> None:
    """Replay part at one parallelism, reference the rest, restore that at another
    (filters composed), replay part, reference again, replay to the end."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rec, "STEP_BYTES", 2048)  # small steps: cuts fall anywhere
        root = tmp_path_factory.mktemp("chk")
        pieces, keys = _write_streams(root, streams, 300, cut, seed)
        f1 = _filter(kind, data.draw(st.integers(0, p1 - 1)), p1)
        f2 = _filter(kind, data.draw(st.integers(0, p2 - 1)), p2)
        a, refs_a = _replay([(ps, f1) for ps in pieces], None, first)
        # Every piece points into the old files; nothing is rewritten.
        uris = {ps[0].handle.uri for ps in pieces} | {ps[1].handle.uri for ps in pieces}
        assert all(p.handle.uri in uris for r in refs_a for p in r.pieces)
        assert all(r.filter == f1 for r in refs_a)
        b, refs_b = _replay(_filtered(refs_a), f2, second)
        assert all(p.handle.uri in uris for r in refs_b for p in r.pieces)
        c, refs_c = _replay(_filtered(refs_b), None, 10**6)
        assert refs_c == []
        # Streams are numbered apart only in the first replay: collect by record.
        for s in range(streams):
            k1 = _keep(f1, keys[s])
            k12 = k1 & _keep(f2, keys[s])
            got_a = a.got.get(s, [])
            assert got_a == np.flatnonzero(k1)[: len(got_a)].tolist(), f"stream {s}"
            last = got_a[-1] if got_a else -1
            rest = b.got.get(s, []) + c.got.get(s, [])
            assert rest == [i for i in np.flatnonzero(k12).tolist() if i > last], f"stream {s}"


def test_a_reference_to_another_partitioner_is_refused(tmp_path: Path) -> None:
    pieces, _ = _write_streams(tmp_path, 1, 10, 64, 0)
    flt = PartitionerFilter((PartitionerChoice("elsewhere.other", 0, 2, 0),))
    with pytest.raises(RescaleError, match="another partitioner"):
        _retriever(pieces[0], flt)


def test_filtered_references_keep_their_checkpoints() -> None:
    """Retention: the checkpoints a filtered reference points into are listed."""
    uri = "/x/job/chk-3/src/0/channels"
    piece = Piece(
        spillover.GateStateHandle(uri, 0, spillover.GateKind.INPUT, 3, 0, "f", 64, 0, 0, 0), 0
    )
    cs = ChannelStateMeta(references=(Reference(0, 0, (piece,), KeepAll()),))
    op = OperatorMeta({0: SubtaskMeta(channel_state=cs)})
    meta = CheckpointMetadata(2, "j", 5, 0, 0, "f", {}, False, {"t": op})
    assert referenced_checkpoints(meta) == [3]


def test_inspect_says_which_records_a_filtered_reference_keeps() -> None:
    from spillover.runtime.checkpointing.inspect import render

    kg = {"kind": "key_groups", "start": 0, "end": 42, "max_parallelism": 128, "key_offset": 0}
    part = {"name": "mod", "index": 1, "parallelism": 3, "key_offset": 0}
    summary = {
        "checkpoint_id": 9,
        "job": "j",
        "path": "/c/chk-9",
        "final": False,
        "completed_ms": 5,
        "trigger_ms": 1,
        "settings": {},
        "graph_fingerprint": "f",
        "state_bytes": 0,
        "inflight_bytes": 0,
        "referenced_checkpoints": [7],
        "problems": [],
        "subtasks": [
            {
                "task": "op#0",
                "state_bytes": 0,
                "inflight_bytes": 0,
                "gates": [],
                "references": [
                    {
                        "gate": 0,
                        "channel": 1,
                        "pieces": [("/c/chk-7/in.spill", 1, 10)],
                        "filter": kg,
                    },
                    {
                        "gate": 0,
                        "channel": 2,
                        "pieces": [("/c/chk-7/out.spill", 2, 0)],
                        "filter": {"kind": "partitioner", "all": [{**part}, {**part, "index": 0}]},
                    },
                ],
            }
        ],
    }
    text = render(summary)
    assert "channel 1 from byte 10, keeping key groups 0-42" in text
    assert "keeping partition 1 of 3 by partitioner mod, keeping partition 0 of 3" in text
    assert "references files of checkpoints [7]" in text


def test_a_step_reads_at_most_one_block(tmp_path: Path) -> None:
    """A barrier waits for at most one step: a step takes one read block, even while
    the retriever's large output buffers fill over many blocks."""
    pieces, _ = _write_streams(tmp_path, 4, 300, 64, 1)
    streams = [RecordStream.of(ps, s, 0, s) for s, ps in enumerate(pieces)]
    r = filter_retriever(
        streams,
        KeepAll(),
        partitioner=None,
        buffer_size=1 << 20,
        read_block_bytes=4096,
        read_ahead_bytes=4096,
    )
    sink = _Sink()
    sr = StreamRecovery([(0, r, KeepAll())], sink.process)
    more = True
    while more:
        before = r.blocks_read
        more = sr.step()
        assert r.blocks_read - before <= 1
    assert r.blocks_read > 4
    assert sink.got == {s: list(range(300)) for s in range(4)}


class _HeldBack:
    """A replay held up by another part sharing its read: nothing ready, not finished,
    and its wait wakes at once every time (the others notify as they step)."""

    blocks_read = 0
    finished = False
    ready = False

    def __init__(self) -> None:
        self.waits = 0

    def poll_next(self) -> None:
        return None

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        if self.waits > 1:
            raise AssertionError("a step waited twice")
        return True


def test_a_step_held_up_by_a_shared_read_returns_after_one_wait() -> None:
    """A step waits once and returns, whatever woke it: the task takes its mail,
    barriers and cancel between steps even while a part sharing its read is stuck."""
    held = _HeldBack()
    recovery = rec.StreamRecovery([(0, held, None)], lambda gate, buf: None)  # type: ignore[list-item]
    assert recovery.step() is True
    assert held.waits == 1
