"""The filtering retriever against real state files of a rescaled key_by edge.

Each old channel ``u -> d`` is one record stream, written into small buffers
and cut at a random buffer (often inside a record) into the old downstream's
input piece and the old upstream's output piece. Every new subtask then
replays what the mapping gives it, and the records that come out are checked
against where Flink's key-group assignment says they belong.
"""

from __future__ import annotations

import random
import struct
import tempfile
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import spillover
from spillover.errors import ClosedError, ConfigError, CorruptRecordError, RescaleError
from spillover.keygroups import (
    KeyGroupRange,
    assign_to_key_group,
    operator_index_for_key_group,
)
from spillover.records import FieldKey, RecordReader, RecordWriter, read_records
from spillover.rescale import (
    EdgeMapping,
    EdgeType,
    FilteringRetriever,
    RecordStream,
    ReplayBuffer,
    SharedReplay,
    Side,
    broadcast_source,
    filter_retriever,
    map_edge,
    replay_owner,
    rescaled_retriever,
    rescaled_retrievers,
)

KEY = FieldKey(0, "int64")


def record(key: int, rid: int, payload: bytes) -> bytes:
    """int64 key, then a record id (to follow it around), then the payload."""
    return struct.pack("<qI", key, rid) + payload


def rid_of(rec: bytes) -> int:
    return int(struct.unpack_from("<I", rec, 8)[0])


def key_of(rec: bytes) -> int:
    return int(struct.unpack_from("<q", rec, 0)[0])


def record_ends(records: list[bytes]) -> set[int]:
    return set(np.cumsum([4 + len(r) for r in records]).tolist())


@dataclass
class OldChannel:
    """One old channel's records, its buffers and where they were cut into two pieces."""

    records: list[bytes] = field(default_factory=list)
    buffers: list[bytes] = field(default_factory=list)
    split: int = 0


def write(records: list[bytes], buffer_size: int) -> list[bytes]:
    w = RecordWriter(buffer_size)
    out = [bytes(b) for r in records for b in w.write(r)]
    last = w.flush()
    return [*out, bytes(last)] if last is not None else out


def cut(ch: OldChannel, rng: random.Random, inside_record: bool) -> int:
    """A buffer index to split at; inside a record when asked and possible."""
    n = len(ch.buffers)
    ends = record_ends(ch.records)
    offsets = np.cumsum([0, *(len(b) for b in ch.buffers)]).tolist()
    inside = [k for k in range(1, n) if offsets[k] not in ends]
    split = rng.choice(inside) if inside_record and inside else rng.randint(0, n)
    if currently_in_test_context():
        event("a piece boundary cuts a record" if split in inside else "pieces end on records")
    return split


def persist(
    root: Path,
    kind: str,
    parts: dict[int, dict[int, list[bytes]]],
    rng: random.Random,
) -> dict[int, spillover.GateStateHandle | None]:
    """One gate file per old subtask; its channels' buffers interleaved as they arrived."""
    handles: dict[int, spillover.GateStateHandle | None] = {}
    for subtask, channels in parts.items():
        if not any(channels.values()) and rng.random() < 0.5:
            handles[subtask] = None  # stored nothing at all
            continue
        storage = spillover.open_storage(root / f"{kind}-{subtask}", subtask_index=subtask)
        storer = storage.create_storer(0, kind=kind)
        order = [c for c, bufs in channels.items() for _ in bufs]
        rng.shuffle(order)
        queues = {c: iter(bufs) for c, bufs in channels.items()}
        for c in order:
            storer.append(c, next(queues[c]))
        handles[subtask] = storer.close()
    return handles


@dataclass
class OldState:
    """An old job's in-flight state on one edge, written to state files."""

    channels: dict[tuple[int, int], OldChannel]
    inputs: dict[int, spillover.GateStateHandle | None]
    outputs: dict[int, spillover.GateStateHandle | None]

    @property
    def records(self) -> list[bytes]:
        return [r for ch in self.channels.values() for r in ch.records]

    def old_channel_by_rid(self) -> dict[int, tuple[int, int]]:
        return {rid_of(r): uv for uv, ch in self.channels.items() for r in ch.records}


def old_state(
    root: Path,
    placed: dict[tuple[int, int], list[bytes]],
    up_old: int,
    down_old: int,
    rng: random.Random,
    buffer_size: int,
    inside_record: float = 0.7,
    pointwise: bool = False,
) -> OldState:
    """Write each old channel (u, d): first part to d's input gate, the rest to u's output gate."""
    channels: dict[tuple[int, int], OldChannel] = {}
    ins: dict[int, dict[int, list[bytes]]] = {d: {} for d in range(down_old)}
    outs: dict[int, dict[int, list[bytes]]] = {u: {} for u in range(up_old)}
    for (u, d), recs in sorted(placed.items()):
        ch = OldChannel(recs, write(recs, buffer_size))
        ch.split = cut(ch, rng, rng.random() < inside_record)
        channels[u, d] = ch
        ins[d][0 if pointwise else u] = ch.buffers[: ch.split]
        outs[u][0 if pointwise else d] = ch.buffers[ch.split :]
    return OldState(channels, persist(root, "input", ins, rng), persist(root, "output", outs, rng))


def collect(buffers: Iterable[ReplayBuffer]) -> tuple[dict[int, list[bytes]], dict[int, list[int]]]:
    """Records per new channel, decoded with RecordReader, and the buffer sizes per channel."""
    readers: dict[int, RecordReader] = defaultdict(RecordReader)
    records: dict[int, list[bytes]] = defaultdict(list)
    sizes: dict[int, list[int]] = defaultdict(list)
    for buf in buffers:
        assert not buf.is_event
        sizes[buf.channel_id].append(len(buf))
        for batch in readers[buf.channel_id].feed(buf):
            records[buf.channel_id] += batch.to_list()
    for r in readers.values():
        r.finish()
    return records, sizes


def assert_old_channel_order(
    per_channel: dict[int, list[bytes]], old_channel: dict[int, tuple[int, int]]
) -> None:
    """Within each new channel, each old channel's records keep their order."""
    for recs in per_channel.values():
        last: dict[tuple[int, int], int] = {}
        for r in recs:
            uv, rid = old_channel[rid_of(r)], rid_of(r)
            assert rid > last.get(uv, -1), f"record {rid} of old channel {uv} overtook another"
            last[uv] = rid


def key_by_mapping(
    up_old: int, down_old: int, up_new: int, down_new: int, max_p: int
) -> EdgeMapping:
    return map_edge(
        EdgeType.KEY_BY,
        old_upstream=up_old,
        old_downstream=down_old,
        new_upstream=up_new,
        new_downstream=down_new,
        max_parallelism=max_p,
    )


Replayed = dict[int, tuple[FilteringRetriever, dict[int, list[bytes]], dict[int, list[int]]]]


def replay_every_subtask(
    m: EdgeMapping, state: OldState, down_new: int, out_size: int, **kw: Any
) -> Replayed:
    """Per new downstream subtask: its retriever (closed), records and buffer sizes per
    new channel; each old channel's records must come in their order."""
    got: Replayed = {}
    for new in range(down_new):
        with rescaled_retriever(
            m,
            Side.INPUT,
            new,
            input_handles=state.inputs,
            output_handles=state.outputs,
            key=KEY,
            buffer_size=out_size,
            **kw,
        ) as r:
            per_channel, sizes = collect(r)
        assert_old_channel_order(per_channel, state.old_channel_by_rid())
        got[new] = (r, per_channel, sizes)
    return got


def records_once_each(got: Replayed, state: OldState) -> dict[int, list[bytes]]:
    """The records each new subtask replayed, after checking that together they are
    every old record exactly once."""
    per_subtask = {
        new: [x for recs in pc.values() for x in recs] for new, (_, pc, _) in got.items()
    }
    union = [x for recs in per_subtask.values() for x in recs]
    assert Counter(union) == Counter(state.records)
    assert len(union) == len(set(union)) == len(state.records)  # disjoint
    return per_subtask


def any_key(rng: random.Random) -> int:
    return rng.randrange(-(2**63), 2**63)


def keyed_records(
    rng: random.Random,
    n: int,
    up_old: int,
    down_old: int,
    max_p: int,
    draw_key: Callable[[random.Random], int],
) -> tuple[dict[tuple[int, int], list[bytes]], dict[int, int]]:
    """``n`` records of keys from ``draw_key`` and payloads of up to 40 or up to 200
    bytes, each on a random old upstream's channel to its key group's old downstream:
    the records per old channel, and each record's key group by its id."""
    placed: dict[tuple[int, int], list[bytes]] = defaultdict(list)
    kg_of: dict[int, int] = {}
    for rid in range(n):
        key = draw_key(rng)
        rec = record(key, rid, rng.randbytes(rng.choice([rng.randint(0, 40), rng.randint(0, 200)])))
        kg_of[rid] = assign_to_key_group(key, max_p, key_type="int64")
        d = operator_index_for_key_group(max_p, down_old, kg_of[rid])
        placed[rng.randrange(up_old), d].append(rec)
    return placed, kg_of


@st.composite
def rescales(draw: st.DrawFn) -> tuple[int, int, int, int, int]:
    up_old, down_old, up_new, down_new = (draw(st.integers(1, 8)) for _ in range(4))
    max_p = draw(st.integers(max(up_old, down_old, up_new, down_new), 128))
    return up_old, down_old, up_new, down_new, max_p


@settings(max_examples=50, deadline=None)
@given(
    par=rescales(),
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 160),
    buffer_size=st.integers(5, 64),
    out_size=st.integers(8, 300),
)
def test_every_record_reaches_its_key_group_owner_exactly_once_and_in_order(
    par: tuple[int, int, int, int, int], seed: int, n: int, buffer_size: int, out_size: int
) -> None:
    up_old, down_old, up_new, down_new, max_p = par
    rng = random.Random(seed)
    placed, kg_of = keyed_records(rng, n, up_old, down_old, max_p, any_key)
    m = key_by_mapping(up_old, down_old, up_new, down_new, max_p)
    with tempfile.TemporaryDirectory() as tmp:
        state = old_state(Path(tmp), placed, up_old, down_old, rng, buffer_size)
        got = replay_every_subtask(m, state, down_new, out_size)
        old_channel = state.old_channel_by_rid()
        for r, per_channel, sizes in got.values():
            for channel, recs in per_channel.items():
                # Each old channel comes in on the channel fed by its upstream's heir.
                assert {replay_owner(old_channel[rid_of(x)][0], up_new) for x in recs} == {channel}
                if not r.pass_through:  # repacked: full buffers but the last of each channel
                    assert all(s == out_size for s in sizes[channel][:-1]), sizes[channel]
        for new in range(up_new):
            with rescaled_retriever(
                m, Side.OUTPUT, new, input_handles=state.inputs, output_handles=state.outputs
            ) as r:
                assert list(r) == []  # the downstream reads output pieces with their channel
    for new, recs in records_once_each(got, state).items():
        for x in recs:
            assert operator_index_for_key_group(max_p, down_new, kg_of[rid_of(x)]) == new


def mixing_partitioner(keys: Any, n: int) -> Any:
    """A user partitioner unrelated to key groups (vectorised, deterministic)."""
    keys = np.asarray(keys, dtype=np.int64)
    return (keys ^ (keys >> 7)) % n


@settings(max_examples=40, deadline=None)
@given(
    par=rescales(),
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 120),
    buffer_size=st.integers(5, 64),
    out_size=st.integers(16, 300),
)
def test_custom_partitioner_edges_reach_the_partitioners_pick_exactly_once_and_in_order(
    par: tuple[int, int, int, int, int], seed: int, n: int, buffer_size: int, out_size: int
) -> None:
    up_old, down_old, up_new, down_new, max_p = par
    rng = random.Random(seed)
    placed: dict[tuple[int, int], list[bytes]] = defaultdict(list)
    key_of_rid: dict[int, int] = {}
    for rid in range(n):
        key = rng.randrange(-(2**63), 2**63)
        rec = record(key, rid, rng.randbytes(rng.randint(0, 60)))
        key_of_rid[rid] = key
        d = int(mixing_partitioner([key], down_old)[0])
        placed[rng.randrange(up_old), d].append(rec)
    m = map_edge(
        EdgeType.CUSTOM,
        old_upstream=up_old,
        old_downstream=down_old,
        new_upstream=up_new,
        new_downstream=down_new,
        max_parallelism=max_p,
    )
    with tempfile.TemporaryDirectory() as tmp:
        state = old_state(Path(tmp), placed, up_old, down_old, rng, buffer_size)
        got = replay_every_subtask(m, state, down_new, out_size, partitioner=mixing_partitioner)
    for new, recs in records_once_each(got, state).items():
        for x in recs:
            assert int(mixing_partitioner([key_of_rid[rid_of(x)]], down_new)[0]) == new


def test_a_custom_partitioner_that_answers_badly_is_refused(tmp_path: Path) -> None:
    from spillover.records import PartitionerDemux

    buf = write([record(5, 0, b"x"), record(6, 1, b"y")], 64)[0]
    for bad in (lambda k, n: k * 0 + n, lambda k, n: np.zeros(1, np.int64), lambda k, n: k / 2):
        demux = PartitionerDemux(bad, [0, -1], 1, key=KEY)
        with pytest.raises(ConfigError, match="partitioner"):
            demux.push(buf)
    short = PartitionerDemux(mixing_partitioner, [0], 1, key=KEY)
    with pytest.raises(CorruptRecordError, match="too short"):
        short.push(write([b"abc"], 64)[0])


@settings(max_examples=30, deadline=None)
@given(
    et=st.sampled_from([EdgeType.REBALANCE, EdgeType.FORWARD, EdgeType.BROADCAST]),
    olds=st.tuples(st.integers(1, 5), st.integers(1, 5)),
    news=st.tuples(st.integers(1, 5), st.integers(1, 5)),
    seed=st.integers(0, 2**32 - 1),
)
def test_unkeyed_edges_replay_whole_old_channels_unparsed(
    et: EdgeType, olds: tuple[int, int], news: tuple[int, int], seed: int
) -> None:
    rng = random.Random(seed)
    up_old, down_old = olds
    up_new, down_new = news
    if et is EdgeType.FORWARD:
        down_old, down_new = up_old, up_new
    m = map_edge(
        et,
        old_upstream=up_old,
        old_downstream=down_old,
        new_upstream=up_new,
        new_downstream=down_new,
        max_parallelism=128,
        force=True,
    )
    pairs = [(i, i) for i in range(up_old)] if et is EdgeType.FORWARD else None
    placed: dict[tuple[int, int], list[bytes]] = defaultdict(list)
    for rid in range(120):
        u, d = rng.choice(pairs) if pairs else (rng.randrange(up_old), rng.randrange(down_old))
        placed[u, d].append(record(rid, rid, rng.randbytes(rng.randint(0, 90))))
    with tempfile.TemporaryDirectory() as tmp:
        state = old_state(
            Path(tmp), placed, up_old, down_old, rng, 16, pointwise=et is EdgeType.FORWARD
        )
        old_channel = state.old_channel_by_rid()
        got: dict[int, list[bytes]] = {}
        for new in range(down_new):
            r = rescaled_retriever(
                m, "input", new, input_handles=state.inputs, output_handles=state.outputs
            )
            assert r.pass_through
            per_channel, sizes = collect(r)
            assert_old_channel_order(per_channel, old_channel)
            for channel, recs in per_channel.items():
                ups = {old_channel[rid_of(x)][0] for x in recs}
                fed_by = {0} if et is EdgeType.FORWARD else {replay_owner(u, up_new) for u in ups}
                assert fed_by == {channel}
            got[new] = [x for recs in per_channel.values() for x in recs]
            # Unparsed: the old 16-byte buffers, not repacked into 32 KiB ones.
            assert all(s <= 16 for ss in sizes.values() for s in ss)
            assert r.routed == 0
    for new, recs in got.items():
        if et is EdgeType.BROADCAST:
            heir_of = broadcast_source(new, down_old)
            want = [x for (u, d), ch in state.channels.items() if d == heir_of for x in ch.records]
        else:
            want = [
                x
                for (u, d), ch in state.channels.items()
                if d % down_new == new
                for x in ch.records
            ]
        assert Counter(recs) == Counter(want)


# ---- targeted cases ----


def one_channel(
    root: Path, buffers: list[bytes], split: int, channel_in: int = 3, channel_out: int = 5
) -> RecordStream:
    """An old channel: its first ``split`` buffers in an input piece, the others in an output."""
    inp = spillover.open_storage(root / "down").create_storer(0, kind="input")
    out = spillover.open_storage(root / "up").create_storer(0, kind="output")
    for b in buffers[:split]:
        inp.append(channel_in, b)
        inp.append(channel_in + 1, b"noise of another channel")
    for b in buffers[split:]:
        out.append(channel_in + 1, b"noise")
        out.append(channel_out, b)
    return RecordStream(((inp.close(), channel_in), (out.close(), channel_out)), 3, 5)


def test_a_record_cut_between_input_and_output_state_comes_out_whole(tmp_path: Path) -> None:
    recs = [record(k, k, bytes([k]) * 90) for k in range(6)]
    buffers = write(recs, 64)  # the first record ends at byte 106: buffer 1 cuts it
    with pytest.raises(CorruptRecordError):
        read_records(buffers[:1])  # the input piece alone ends inside a record
    stream = one_channel(tmp_path, buffers, split=1)
    r = FilteringRetriever(
        [stream], max_parallelism=128, key_group_table=KeyGroupRange(0, 127), buffer_size=64
    )
    out = list(r)
    assert read_records(out) == recs
    assert all(b.channel_id == 0 for b in out)
    assert [len(b) for b in out[:-1]] == [64] * (len(out) - 1)
    assert r.routed == len(recs) and r.dropped == 0


def test_the_key_group_table_routes_records_to_outputs_and_drops_the_rest(
    tmp_path: Path,
) -> None:
    max_p = 16
    recs = [record(k, k, b"p" * (k % 50)) for k in range(300)]
    stream = one_channel(tmp_path, write(recs, 40), split=4)
    table = np.array([kg % 3 - 1 for kg in range(max_p)], dtype=np.int32)  # -1, 0, 1, -1, ...
    r = FilteringRetriever(
        [stream], max_parallelism=max_p, key_group_table=table, n_outputs=2, buffer_size=100
    )
    per_channel, _ = collect(r)
    for out in (0, 1):
        want = [x for x in recs if table[assign_to_key_group(key_of(x), max_p, "int64")] == out]
        assert per_channel.get(out, []) == want
    assert r.routed + r.dropped == len(recs) and r.dropped > 0


def test_a_stream_cut_inside_a_record_is_refused_naming_it(tmp_path: Path) -> None:
    recs = [record(k, k, b"x" * 70) for k in range(5)]
    buffers = write(recs, 32)
    stream = one_channel(tmp_path, buffers[:-2], split=3)  # the last buffers were lost
    r = FilteringRetriever([stream], max_parallelism=128, key_group_table=KeyGroupRange(0, 127))
    with pytest.raises(CorruptRecordError) as info:
        list(r)
    err = info.value
    assert "old channel 3 -> 5" in str(err)
    assert all(h.uri in (err.detail or "") for h, _ in stream.pieces)
    assert isinstance(err, ValueError)
    with pytest.raises(CorruptRecordError):  # sticky: the retriever cannot go on
        r.poll_next()


def test_pass_through_hands_out_the_stored_buffers_unchanged_and_zero_copy(
    tmp_path: Path,
) -> None:
    buffers = write([record(k, k, b"y" * 33) for k in range(40)], 50)
    stream = one_channel(tmp_path, buffers, split=2)
    r = FilteringRetriever(
        [RecordStream(stream.pieces, 3, 5, channel=2)], n_outputs=4, pass_through=True
    )
    out = list(r)
    assert [bytes(b) for b in out] == buffers
    assert {b.channel_id for b in out} == {2}
    base: object = out[0]
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, memoryview) and isinstance(base.obj, spillover.RetrievedBuffer)
    assert not out[0].flags.writeable


def test_poll_next_and_wait_give_what_iteration_gives(tmp_path: Path) -> None:
    recs = [record(k, k, b"z" * (k % 70)) for k in range(400)]
    buffers = write(recs, 48)
    args: dict[str, Any] = {
        "max_parallelism": 64,
        "key_group_table": KeyGroupRange(10, 40),
        "buffer_size": 256,
    }
    stream = one_channel(tmp_path, buffers, split=len(buffers) // 2)
    by_iter = [bytes(b) for b in FilteringRetriever([stream], **args)]
    r = FilteringRetriever([stream], **args)
    by_poll = []
    while not r.finished:
        buf = r.poll_next()
        if buf is None:
            assert r.wait(timeout=10)
        else:
            by_poll.append(bytes(buf))
    assert by_poll == by_iter and read_records(by_poll) == [
        x for x in recs if 10 <= assign_to_key_group(key_of(x), 64, "int64") <= 40
    ]
    r.close()
    with pytest.raises(spillover.errors.ClosedError):
        r.poll_next()


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads RSS from /proc")
def test_memory_stays_bounded_whatever_the_input_size(tmp_path: Path) -> None:
    def growth(megabytes: int, where: Path) -> int:
        # Written 1 MB at a time, so no large freed heap can hide what the retriever holds.
        inp = spillover.open_storage(where / "down").create_storer(0, kind="input")
        out = spillover.open_storage(where / "up").create_storer(0, kind="output")
        w, rng, n = RecordWriter(32768), np.random.default_rng(1), 10_000
        for i in range(megabytes):
            data = np.frombuffer(rng.bytes(n * 100), np.uint8)
            for b in w.write_batch(data, np.arange(n + 1, dtype=np.int64) * 100):
                (inp if 2 * i < megabytes else out).append(0, b)
        out.append(0, w.flush())
        stream = RecordStream(((inp.close(), 0), (out.close(), 0)), 0, 0)
        r = FilteringRetriever(
            [stream],
            max_parallelism=128,
            key_group_table=KeyGroupRange(0, 127),
            read_ahead_bytes=256 * 1024,
            read_block_bytes=64 * 1024,
        )
        base = highest = rss()
        total = 0
        for i, buf in enumerate(r):  # each buffer is dropped once counted
            total += len(buf)
            if i % 16 == 0:
                highest = max(highest, rss())
        assert total == megabytes * n * 104
        return highest - base

    growth(4, tmp_path / "warm-up")
    small = growth(4, tmp_path / "small")
    large = growth(48, tmp_path / "large")
    # Holding on to what was read would cost 48 MB more; allow allocator noise.
    assert large < small + 12 * 2**20, (small, large)


def test_events_are_refused_by_default_and_forwarded_in_place_on_request(
    tmp_path: Path,
) -> None:
    recs = [record(k, k, b"e" * 20) for k in range(10)]
    first, second = write(recs[:5], 1000), write(recs[5:], 1000)
    storer = spillover.open_storage(tmp_path).create_storer(0, kind="input")
    for b in first:
        storer.append(0, b)
    storer.append(0, b"\x07event", spillover.DataType.EVENT)
    for b in second:
        storer.append(0, b)
    stream = RecordStream(((storer.close(), 0),), 0, 0)
    filtering: dict[str, Any] = {"max_parallelism": 128, "key_group_table": KeyGroupRange(0, 127)}
    with pytest.raises(RescaleError) as info:
        list(FilteringRetriever([stream], **filtering))
    assert info.value.offset is not None and info.value.path == stream.pieces[0][0].uri
    for kw in (filtering, {"pass_through": True}):
        out = list(FilteringRetriever([stream], on_event="forward", **kw))
        kinds = [b.is_event for b in out]
        assert kinds.count(True) == 1
        at = kinds.index(True)
        assert bytes(out[at]) == b"\x07event"
        assert read_records(out[:at]) == recs[:5] and read_records(out[at + 1 :]) == recs[5:]


def test_glue_refuses_what_it_cannot_replay_faithfully(tmp_path: Path) -> None:
    m = key_by_mapping(2, 2, 2, 3, 128)
    storer = spillover.open_storage(tmp_path).create_storer(0, kind="input")
    handle = storer.close()
    with pytest.raises(RescaleError):  # old upstream 1's output handle is missing
        rescaled_retriever(
            m, Side.INPUT, 0, input_handles={0: handle, 1: None}, output_handles={0: None}
        )
    with pytest.raises(ConfigError):  # input and output handles mixed up
        rescaled_retriever(
            m, Side.INPUT, 0, input_handles={0: None, 1: None}, output_handles={0: handle, 1: None}
        )
    custom = map_edge(
        "custom",
        old_upstream=1,
        old_downstream=2,
        new_upstream=1,
        new_downstream=3,
        max_parallelism=128,
    )
    with pytest.raises(RescaleError):
        rescaled_retriever(
            custom, Side.INPUT, 0, input_handles={0: None, 1: None}, output_handles={0: None}
        )
    with pytest.raises(ConfigError):
        FilteringRetriever([], max_parallelism=128)  # filtering without a table
    with pytest.raises(ConfigError):
        FilteringRetriever([RecordStream((), 0, 0), RecordStream((), 0, 0)], pass_through=True)


def test_a_record_too_short_for_its_key_is_refused_with_its_file_and_offset(
    tmp_path: Path,
) -> None:
    buffers = write([record(1, 1, b"ok"), b"short"], 64)
    stream = one_channel(tmp_path, buffers, split=1)
    r = FilteringRetriever([stream], max_parallelism=128, key_group_table=KeyGroupRange(0, 127))
    with pytest.raises(CorruptRecordError) as info:
        list(r)
    assert info.value.path == stream.pieces[0][0].uri and info.value.offset is not None
    assert "old channel 3 -> 5" in (info.value.detail or "")


# -- one read for several new subtasks (rescaled_retrievers) ---------------------------


def drain_in_turn(parts: dict[int, Any]) -> dict[int, list[ReplayBuffer]]:
    """Every part's buffers, the parts polled in turn on one thread."""
    got: dict[int, list[ReplayBuffer]] = {i: [] for i in parts}
    while not all(p.finished for p in parts.values()):
        moved = False
        for i, p in parts.items():
            while (buf := p.poll_next()) is not None:
                got[i].append(buf)
                moved = True
        waiting = [p for p in parts.values() if not p.finished]
        if not moved and waiting:
            waiting[0].wait(0.05)
    return got


def per_old_channel(
    buffers: Iterable[ReplayBuffer], old_channel: dict[int, tuple[int, int]]
) -> dict[tuple[int, tuple[int, int]], list[bytes]]:
    """Records by (new channel, old channel), in the order they came."""
    records, _ = collect(buffers)
    out: dict[tuple[int, tuple[int, int]], list[bytes]] = defaultdict(list)
    for channel, recs in records.items():
        for x in recs:
            out[channel, old_channel[rid_of(x)]].append(x)
    return dict(out)


@st.composite
def key_pools(draw: st.DrawFn) -> list[int]:
    """Keys to draw records from: a few hot ones, or many."""
    n = draw(st.sampled_from([1, 3, 40, 1000]))
    return [draw(st.integers(-(2**63), 2**63 - 1)) for _ in range(min(n, 40))]


@settings(max_examples=50, deadline=None)
@given(
    par=rescales(),
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 200),
    pool=key_pools(),
    buffer_size=st.integers(5, 64),
    out_size=st.integers(8, 300),
    queued=st.sampled_from([None, 1, 64, 4096]),
    threads=st.booleans(),
)
def test_one_shared_read_gives_each_new_subtask_exactly_its_records_in_order(
    par: tuple[int, int, int, int, int],
    seed: int,
    n: int,
    pool: list[int],
    buffer_size: int,
    out_size: int,
    queued: int | None,
    threads: bool,
) -> None:
    up_old, down_old, up_new, down_new, max_p = par
    rng = random.Random(seed)
    placed, kg_of = keyed_records(
        rng,
        n,
        up_old,
        down_old,
        max_p,
        lambda rng: rng.choice(pool) if rng.random() < 0.5 else any_key(rng),
    )
    m = key_by_mapping(up_old, down_old, up_new, down_new, max_p)
    with tempfile.TemporaryDirectory() as tmp:
        state = old_state(Path(tmp), placed, up_old, down_old, rng, buffer_size)
        old_channel = state.old_channel_by_rid()
        alone = replay_every_subtask(m, state, down_new, out_size, coalesce=True)
        parts = rescaled_retrievers(
            m,
            Side.INPUT,
            range(down_new),
            input_handles=state.inputs,
            output_handles=state.outputs,
            key=KEY,
            buffer_size=out_size,
            max_queued_bytes=queued,
            read_block_bytes=4096,
        )
        if threads:
            with ThreadPoolExecutor(len(parts)) as pool_:
                futures = {i: pool_.submit(lambda p=p: list(p)) for i, p in parts.items()}
                got = {i: f.result(timeout=60) for i, f in futures.items()}
        else:
            got = drain_in_turn(parts)
        for p in parts.values():
            p.close()
        shared = {type(p).__name__ for p in parts.values()}
        event(f"parts: {sorted(shared)}")
    for new, buffers in got.items():
        mine = per_old_channel(buffers, old_channel)
        # The same records, in the same order per old channel and new channel, as the
        # subtask's own retriever replays (itself checked against the key groups above).
        assert mine == per_old_channel_of(alone[new][1], old_channel)
        for recs in mine.values():
            for x in recs:
                assert operator_index_for_key_group(max_p, down_new, kg_of[rid_of(x)]) == new
        sizes = defaultdict(list)
        for b in buffers:
            sizes[b.channel_id].append(len(b))
        for ss in sizes.values():  # repacked: full buffers but the last of each channel
            assert all(s == out_size for s in ss[:-1]), ss
    records_once_each({i: (None, rec, {}) for i, (_, rec, _) in alone.items()}, state)  # type: ignore[misc]


def per_old_channel_of(
    per_channel: dict[int, list[bytes]], old_channel: dict[int, tuple[int, int]]
) -> dict[tuple[int, tuple[int, int]], list[bytes]]:
    out: dict[tuple[int, tuple[int, int]], list[bytes]] = defaultdict(list)
    for channel, recs in per_channel.items():
        for x in recs:
            out[channel, old_channel[rid_of(x)]].append(x)
    return dict(out)


def split_state(tmp: Path, n: int = 400) -> tuple[EdgeMapping, OldState, dict[int, int]]:
    """2 -> 4 on a key_by edge: every old channel split between two new subtasks."""
    rng = random.Random(5)
    placed: dict[tuple[int, int], list[bytes]] = defaultdict(list)
    owner: dict[int, int] = {}
    for rid in range(n):
        key = rng.randrange(-(2**63), 2**63)
        kg = assign_to_key_group(key, 128, key_type="int64")
        owner[rid] = operator_index_for_key_group(128, 4, kg)
        placed[rng.randrange(2), operator_index_for_key_group(128, 2, kg)].append(
            record(key, rid, rng.randbytes(60))
        )
    state = old_state(tmp, placed, 2, 2, rng, 64)
    return key_by_mapping(2, 2, 4, 4, 128), state, owner


def read_bytes() -> int:
    """Bytes this process has read through read/pread calls so far (its reader threads too)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def test_a_shared_read_reads_each_old_channel_once_for_every_subtask(tmp_path: Path) -> None:
    m, state, _ = split_state(tmp_path, 4000)
    kw: dict[str, Any] = {"input_handles": state.inputs, "output_handles": state.outputs}

    def alone() -> int:
        before = read_bytes()
        for new in range(4):
            with rescaled_retriever(m, "input", new, coalesce=True, **kw) as r:
                list(r)
        return read_bytes() - before

    alone()  # the first replay also reads the modules it imports
    twice = alone()
    parts = rescaled_retrievers(m, "input", range(4), **kw)
    shared = {id(p._shared): p._shared for p in parts.values()}  # type: ignore[union-attr]
    assert len(shared) == 2  # new 0 and 1 share old channels, as do new 2 and 3
    before = read_bytes()
    drain_in_turn(parts)
    once = read_bytes() - before
    files = sum(h.size for h in [*state.inputs.values(), *state.outputs.values()] if h)
    # Each subtask pair's state once, where one retriever per subtask read it twice
    # (the output files here interleave their subpartitions, so both pairs read them).
    assert files <= once <= 0.55 * twice


def test_a_part_not_drained_holds_the_others_back_until_it_is_drained_or_closed(
    tmp_path: Path,
) -> None:
    m, state, owner = split_state(tmp_path, 2000)
    kw: dict[str, Any] = {"input_handles": state.inputs, "output_handles": state.outputs}

    def parts() -> dict[int, Any]:
        return rescaled_retrievers(
            m,
            "input",
            range(4),
            buffer_size=256,
            max_queued_bytes=1024,
            read_block_bytes=4096,
            **kw,
        )

    ps = parts()
    first: list[ReplayBuffer] = []
    while True:
        if (buf := ps[0].poll_next()) is not None:
            first.append(buf)
        elif not ps[0].wait(0.2):
            break
    assert not ps[0].finished  # held back by the parts nobody drains
    assert max(ps[0]._shared._queued) <= 1024 + 4096  # bounded, whatever the file size
    got = drain_in_turn(ps)  # draining them all lets it finish
    got[0][:0] = first
    for i, bufs in got.items():
        records, _ = collect(bufs)
        assert sorted(rid_of(x) for r in records.values() for x in r) == sorted(
            rid for rid, o in owner.items() if o == i
        )
    ps = parts()
    for i in (1, 2, 3):
        ps[i].close()  # closed parts take nothing and hold nobody back
    records, _ = collect(ps[0])
    assert sorted(rid_of(x) for r in records.values() for x in r) == sorted(
        rid for rid, o in owner.items() if o == 0
    )
    ps[0].close()
    with pytest.raises(ClosedError):
        ps[0].poll_next()


def test_a_corrupt_stream_fails_every_part_of_its_shared_read(tmp_path: Path) -> None:
    m, state, _ = split_state(tmp_path)
    # Without the old upstreams' output state, old channels end inside a record.
    outputs = dict.fromkeys(state.outputs)
    parts = rescaled_retrievers(
        m, "input", range(4), input_handles=state.inputs, output_handles=outputs
    )
    failed = None
    for p in parts.values():
        try:
            list(p)
        except CorruptRecordError:
            failed = p._shared  # type: ignore[union-attr]
            break
    assert failed is not None
    for p in failed.parts.values():
        with pytest.raises(CorruptRecordError):
            p.poll_next()


@settings(max_examples=25, deadline=None)
@given(
    cut_after=st.lists(st.integers(0, 40), min_size=4, max_size=4),
    queued=st.sampled_from([256, 1024, 1 << 20]),
)
def test_a_part_cut_mid_read_hands_out_then_references_exactly_its_records(
    cut_after: list[int], queued: int
) -> None:
    """A checkpoint during a shared read: each part, cut after its ``cut_after``-th
    buffer while the others read on, has handed out some records; replaying the rest
    it references with its own filter gives exactly the others, in order per old
    channel, as a checkpoint taken then must restore."""
    with tempfile.TemporaryDirectory() as tmp:
        m, state, owner = split_state(Path(tmp), 1500)
        parts = rescaled_retrievers(
            m,
            "input",
            range(4),
            input_handles=state.inputs,
            output_handles=state.outputs,
            buffer_size=256,
            max_queued_bytes=queued,
            read_block_bytes=4096,
        )
        old_channel = state.old_channel_by_rid()
        before: dict[int, list[ReplayBuffer]] = {i: [] for i in parts}
        rest: dict[int, list[Any]] = {}
        polls = dict.fromkeys(parts, 0)
        while len(rest) < len(parts):
            moved = False
            for i, p in parts.items():
                if i in rest:
                    if p.poll_next() is not None:  # read on after the cut, as a task does
                        moved = True
                    continue
                if polls[i] >= cut_after[i] or p.finished:
                    before[i] += p.cut()
                    rest[i] = p.remainder()
                    moved = True
                elif (buf := p.poll_next()) is not None:
                    before[i].append(buf)
                    polls[i] += 1
                    moved = True
            if not moved:
                next(p for i, p in parts.items() if i not in rest).wait(0.05)
        for i, p in parts.items():
            streams = [
                RecordStream.of(pieces, s.old_upstream, s.old_downstream, s.channel)
                for s, pieces in rest[i]
            ]
            with filter_retriever(streams, p.filter, partitioner=None, buffer_size=256) as r:
                after = list(r)
            p.close()
            got = per_old_channel(before[i], old_channel)
            for k, recs in per_old_channel(after, old_channel).items():
                got.setdefault(k, []).extend(recs)
            mine = sorted(rid for rid, o in owner.items() if o == i)
            assert sorted(rid_of(x) for recs in got.values() for x in recs) == mine
            for recs in got.values():  # in the order each old channel holds them
                assert [rid_of(x) for x in recs] == sorted(rid_of(x) for x in recs)


def test_no_part_of_a_shared_read_is_finished_before_its_last_buffers_are_queued(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read ends together with its last buffers: a part that saw it ended first
    would close, and the buffers queued for it after would be dropped (records lost)."""
    m, state, owner = split_state(tmp_path, 2000)
    kw: dict[str, Any] = {"input_handles": state.inputs, "output_handles": state.outputs}
    parts = rescaled_retrievers(m, "input", range(4), **kw)
    seen: list[bool] = []
    original = SharedReplay._queue

    def queue(self: SharedReplay, bufs: Any, done: bool = False) -> None:
        # What another task thread would see at this moment, between two steps.
        seen.extend(p.finished for p in parts.values() if p._shared is self)  # type: ignore[union-attr]
        original(self, bufs, done)

    monkeypatch.setattr(SharedReplay, "_queue", queue)
    got = drain_in_turn(parts)
    assert seen and not any(seen)
    for i, bufs in got.items():
        records, _ = collect(bufs)
        assert sorted(rid_of(x) for r in records.values() for x in r) == sorted(
            rid for rid, o in owner.items() if o == i
        )


class SharedReadSchedule(RuleBasedStateMachine):
    """A shared read driven in random order: parts polled, waited on, cut (then closed,
    as a task checkpointed and restored elsewhere) or closed; each part's records stay
    its own and in order per old channel, and a part cut hands out, with what its rest
    replays, exactly its records."""

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        self.m, self.state, self.owner = split_state(Path(self.tmp.name), 900)
        self.old_channel = self.state.old_channel_by_rid()
        self.parts: dict[int, Any] = {}
        self.got: dict[int, list[ReplayBuffer]] = {i: [] for i in range(4)}
        self.rest: dict[int, list[Any]] = {}
        self.dropped: set[int] = set()

    @initialize(queued=st.sampled_from([256, 1024, 1 << 20]))
    def start(self, queued: int) -> None:
        self.parts = rescaled_retrievers(
            self.m,
            "input",
            range(4),
            input_handles=self.state.inputs,
            output_handles=self.state.outputs,
            buffer_size=256,
            max_queued_bytes=queued,
            read_block_bytes=4096,
        )

    def open_parts(self) -> list[int]:
        return [i for i in self.parts if i not in self.rest and i not in self.dropped]

    @rule(data=st.data(), n=st.integers(1, 6))
    def poll(self, data: st.DataObject, n: int) -> None:
        if not (open_ := self.open_parts()):
            return
        i = data.draw(st.sampled_from(open_))
        for _ in range(n):
            if (buf := self.parts[i].poll_next()) is not None:
                self.got[i].append(buf)

    @rule(data=st.data())
    def wait(self, data: st.DataObject) -> None:
        if open_ := self.open_parts():
            self.parts[data.draw(st.sampled_from(open_))].wait(0.002)

    @rule(data=st.data())
    def cut(self, data: st.DataObject) -> None:
        if not (open_ := self.open_parts()):
            return
        i = data.draw(st.sampled_from(open_))
        self.got[i] += self.parts[i].cut()
        self.rest[i] = self.parts[i].remainder()
        self.parts[i].close()

    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        open_ = self.open_parts()
        if len(open_) > 1:  # one part left open drains the read to its end
            i = data.draw(st.sampled_from(open_))
            self.parts[i].close()
            self.dropped.add(i)

    @invariant()
    def each_part_gets_its_own_records_in_order(self) -> None:
        for i, bufs in self.got.items():
            readers: dict[int, RecordReader] = defaultdict(RecordReader)
            rids: dict[tuple[int, tuple[int, int]], list[int]] = defaultdict(list)
            for buf in bufs:  # records so far: the last may go on in the next buffer
                for batch in readers[buf.channel_id].feed(buf):
                    for x in batch.to_list():
                        rids[buf.channel_id, self.old_channel[rid_of(x)]].append(rid_of(x))
            for got in rids.values():
                assert got == sorted(got)
                assert all(self.owner[r] == i for r in got)

    def teardown(self) -> None:
        try:
            if not self.parts:
                return
            open_ = {i: self.parts[i] for i in self.open_parts()}
            for i, bufs in drain_in_turn(open_).items():
                self.got[i] += bufs
            for p in self.parts.values():
                p.close()
            for i, p in self.parts.items():
                if i in self.dropped:
                    continue
                after: list[ReplayBuffer] = []
                if i in self.rest:
                    streams = [
                        RecordStream.of(pieces, s.old_upstream, s.old_downstream, s.channel)
                        for s, pieces in self.rest[i]
                    ]
                    with filter_retriever(
                        streams, p.filter, partitioner=None, buffer_size=256
                    ) as r:
                        after = list(r)
                got = per_old_channel(self.got[i], self.old_channel)
                for k, recs in per_old_channel(after, self.old_channel).items():
                    got.setdefault(k, []).extend(recs)
                rids = [rid_of(x) for recs in got.values() for x in recs]
                assert sorted(rids) == sorted(r for r, o in self.owner.items() if o == i)
                for recs in got.values():
                    assert [rid_of(x) for x in recs] == sorted(rid_of(x) for x in recs)
        finally:
            self.tmp.cleanup()


TestSharedReadSchedule = SharedReadSchedule.TestCase
TestSharedReadSchedule.settings = settings(max_examples=30, stateful_step_count=25, deadline=None)


def test_a_shared_read_reads_nothing_before_a_part_is_polled(tmp_path: Path) -> None:
    m, state, owner = split_state(tmp_path, 2000)
    kw: dict[str, Any] = {"input_handles": state.inputs, "output_handles": state.outputs}
    parts = rescaled_retrievers(m, "input", range(4), read_block_bytes=4096, **kw)
    assert all(p.blocks_read == 0 for p in parts.values())  # built, not polled
    got = drain_in_turn(parts)
    for i, bufs in got.items():
        records, _ = collect(bufs)
        assert sorted(rid_of(x) for r in records.values() for x in r) == sorted(
            rid for rid, o in owner.items() if o == i
        )
    for p in parts.values():
        p.close()
