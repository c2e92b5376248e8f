"""Block-at-a-time reading: ``Retriever.poll_frames``, the channel index in state
handles, ``FrameJoiner`` and ``KeyGroupDemux.push_frames``.

Each batch API must give exactly what the per-buffer API gives, whatever the block
size, the codec or the channel layout.
"""

from __future__ import annotations

import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spillover
from spillover._native import _records
from spillover.errors import CorruptFrameError, CorruptHeaderError
from spillover.records import FieldKey, FrameJoiner, KeyGroupDemux, RecordReader, RecordWriter
from spillover.rescale import FilteringRetriever, RecordStream
from spillover.storage import GateStateHandle

BLOCK = 4096

frames_strategy = st.lists(
    st.tuples(st.integers(0, 5), st.binary(min_size=0, max_size=3000)), max_size=40
)


def _write(root: Path, frames: list[tuple[int, bytes]], compression: str | None = None) -> Any:
    storer = spillover.open_storage(root, compression=compression).create_storer(0)
    for ch, payload in frames:
        storer.append(ch, payload)
    return storer.close()


def _by_frames(handle: Any, **kw: Any) -> list[tuple[int, bytes]]:
    out = []
    with spillover.open_retriever(
        handle, read_block_bytes=BLOCK, read_ahead_bytes=BLOCK, **kw
    ) as r:
        for fa in r.iter_frames():
            for i in range(len(fa)):
                o, n = int(fa.offsets[i]), int(fa.lengths[i])
                out.append((int(fa.channel_ids[i]), bytes(fa.data[o : o + n])))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=frames_strategy, compression=st.sampled_from([None, "lz4"]))
def test_poll_frames_gives_what_poll_next_gives(frames: Any, compression: Any) -> None:
    with tempfile.TemporaryDirectory() as d:
        handle = _write(Path(d), frames, compression)
        assert _by_frames(handle) == [(c, bytes(p)) for c, p in frames]


@settings(max_examples=40, deadline=None)
@given(frames=frames_strategy, pattern=st.lists(st.booleans(), min_size=1, max_size=8))
def test_poll_next_and_poll_frames_mix(frames: Any, pattern: list[bool]) -> None:
    """Each frame comes out once, in order, whichever call takes it."""
    with tempfile.TemporaryDirectory() as d:
        handle = _write(Path(d), frames)
        got: list[tuple[int, bytes]] = []
        with spillover.open_retriever(handle, read_block_bytes=BLOCK, read_ahead_bytes=BLOCK) as r:
            k = 0
            while not r.finished:
                if pattern[k % len(pattern)]:
                    b = r.poll_next()
                    if b is not None:
                        got.append((b.channel_id, b.tobytes()))
                else:
                    fa = r.poll_frames()
                    if fa is not None:
                        for i in range(len(fa)):
                            o, n = int(fa.offsets[i]), int(fa.lengths[i])
                            got.append((int(fa.channel_ids[i]), bytes(fa.data[o : o + n])))
                r.wait()
                k += 1
        assert got == [(c, bytes(p)) for c, p in frames]


@settings(max_examples=60, deadline=None)
@given(frames=frames_strategy, wanted=st.sets(st.integers(0, 6), max_size=3))
def test_channel_index_covers_exactly_the_channels(frames: Any, wanted: set[int]) -> None:
    with tempfile.TemporaryDirectory() as d:
        handle = _write(Path(d), frames)
        assert set(handle.channel_ranges) == set(handle.channels)
        again = GateStateHandle.from_dict(handle.to_dict())
        assert again == handle
        got = [f for f in _by_frames(handle, channels=wanted) if f[0] in wanted]
        assert got == [(c, bytes(p)) for c, p in frames if c in wanted]
        # The range starts at a wanted channel's first frame and ends after its last.
        lo, hi = handle.byte_range(wanted)
        if any(c in wanted for c, _ in frames):
            assert lo == min(handle.channel_ranges[c][0] for c in wanted if c in handle.channels)
            assert hi == max(handle.channel_ranges[c][1] for c in wanted if c in handle.channels)


def test_handle_without_channel_index_reads_whole_file(tmp_path: Path) -> None:
    """Handles written before the index existed have no ``channel_ranges``."""
    handle = _write(tmp_path, [(0, b"a" * 100), (1, b"b" * 100), (0, b"c" * 10)])
    old = handle.to_dict()
    del old["channel_ranges"]
    h = GateStateHandle.from_dict(old)
    assert h.channel_ranges == {} and h.byte_range([1]) is None
    assert _by_frames(h, channels=[1]) == [(0, b"a" * 100), (1, b"b" * 100), (0, b"c" * 10)]


def test_poll_frames_names_a_damaged_frame(tmp_path: Path) -> None:
    handle = _write(tmp_path, [(0, b"x" * 500), (1, b"y" * 500)])
    with open(handle.uri, "r+b") as f:
        f.seek(64 + 24 + 500 + 24 + 10)
        f.write(b"Z")
    with pytest.raises(CorruptFrameError) as e:
        _by_frames(handle)
    assert e.value.path == handle.uri and e.value.offset == 64 + 24 + 500


def test_poll_frames_names_an_lz4_frame_that_does_not_decode(tmp_path: Path) -> None:
    """Checksums off, a damaged compressed payload is caught by decoding, named by
    its frame's offset; the frames before it come out intact."""
    handle = _write(tmp_path, [(0, b"x" * 500), (1, b"y" * 500)], "lz4")
    with open(handle.uri, "r+b") as f:
        f.seek(64 + 8)
        (stored,) = struct.unpack("<I", f.read(4))
        second = 64 + 24 + stored
        f.seek(second + 8)
        (stored2,) = struct.unpack("<I", f.read(4))
        assert stored2 < 500  # compressed
        f.seek(second + 24)
        f.write(b"\xff" * stored2)  # literal runs reaching past the payload
    assert _by_frames(handle, verify_checksums=False, channels=[0]) == [(0, b"x" * 500)]
    with pytest.raises(CorruptFrameError, match="lz4") as e:
        _by_frames(handle, verify_checksums=False)
    assert e.value.path == handle.uri and e.value.offset == second


def test_missing_frames_of_a_ranged_read_are_named(tmp_path: Path) -> None:
    """A channel index whose range holds fewer frames than the handle counts is an
    error, not a silent loss (a filtering retriever counts the frames it wants)."""
    handle = _write(tmp_path, [(0, b"\0\0\0\0")] * 3 + [(1, b"\0\0\0\0")])
    d = handle.to_dict()
    d["channel_ranges"]["0"] = [64, 64 + 28]  # only the first of its three frames
    lying = GateStateHandle.from_dict(d)
    r = FilteringRetriever(
        [RecordStream(((lying, 0),), 0, 0, channel=0)], pass_through=True, coalesce=True
    )
    with pytest.raises(CorruptHeaderError) as e:
        list(r)
    assert e.value.path == handle.uri


@settings(max_examples=60, deadline=None)
@given(
    frames=st.lists(st.tuples(st.integers(0, 3), st.binary(max_size=700)), max_size=30),
    size=st.integers(1, 2000),
)
def test_frame_joiner_joins_each_channel(frames: Any, size: int) -> None:
    data = b"".join(p for _, p in frames)
    lengths = np.array([len(p) for _, p in frames], np.int64)
    offsets = (np.cumsum(lengths) - lengths).astype(np.int64)
    outputs = np.array([c for c, _ in frames], np.int32)
    joiner = FrameJoiner(4, size)
    out = joiner.put_frames(np.frombuffer(data, np.uint8), offsets, lengths, outputs)
    assert all(len(b) == size for _, b in out)
    # Every buffer handed out as soon as it is full, the rest held until the flush.
    per_channel = [sum(len(p) for c, p in frames if c == ch) for ch in range(4)]
    assert [[o for o, _ in out].count(ch) for ch in range(4)] == [n // size for n in per_channel]
    assert joiner.pending_bytes == sum(n % size for n in per_channel)
    out += joiner.flush()
    for ch in range(4):
        joined = b"".join(bytes(b) for o, b in out if o == ch)
        assert joined == b"".join(p for c, p in frames if c == ch)


@settings(max_examples=40, deadline=None)
@given(
    keys=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=300),
    cut=st.integers(7, 400),
    n_channels=st.integers(1, 3),
    keep_all=st.booleans(),
    rnd=st.randoms(use_true_random=False),
)
def test_push_frames_is_push_one_by_one(
    keys: list[int], cut: int, n_channels: int, keep_all: bool, rnd: Any
) -> None:
    """Frames of several channels, interleaved, records cut anywhere."""
    buffers: list[tuple[int, bytes]] = []
    for ch in range(n_channels):
        w = RecordWriter(cut)
        out = []
        for k in keys:
            out += w.write(np.int64(k).tobytes() + bytes(ch + 3))
        last = w.flush()
        out += [last] if last is not None else []
        buffers += [(ch, bytes(b)) for b in out]
    # Interleave the channels at random, each channel's own order kept.
    queues: dict[int, list[bytes]] = {}
    for ch, b in buffers:
        queues.setdefault(ch, []).append(b)
    seq: list[tuple[int, bytes]] = []
    while any(queues.values()):
        ch = rnd.choice([c for c, q in queues.items() if q])
        seq.append((ch, queues[ch].pop(0)))
    table = np.where(np.arange(128) * 2 // 128 == 1, 0, -1)

    def demux() -> KeyGroupDemux:
        d = KeyGroupDemux(
            128, table if not keep_all else np.zeros(128), 1, FieldKey(0, "int64"), buffer_size=256
        )
        if keep_all:
            d.keep_all()
        return d

    one = demux()
    expect = []
    for ch, b in seq:
        expect += one.push(b, ("c", ch))
    expect += one.finish()
    data = b"".join(b for _, b in seq)
    lengths = np.array([len(b) for _, b in seq], np.int64)
    offsets = (np.cumsum(lengths) - lengths).astype(np.int64)
    slots = np.array([ch for ch, _ in seq], np.int32)
    many = demux()
    got = many.push_frames(
        np.frombuffer(data, np.uint8), offsets, lengths, slots, [("c", c) for c in range(3)]
    )
    got += many.finish()
    assert [(o, bytes(b)) for o, b in got] == [(o, bytes(b)) for o, b in expect]
    assert many.routed == one.routed and many.dropped == one.dropped


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(8, 700), max_size=200),
    cut=st.integers(5, 900),
    buffer_size=st.integers(16, 1024),
    per_call=st.integers(1, 8),
    rnd=st.randoms(use_true_random=False),
)
def test_keep_all_packs_the_same_buffers_as_routing_every_record_to_one_output(
    sizes: list[int], cut: int, buffer_size: int, per_call: int, rnd: Any
) -> None:
    """Keep-all copies runs of whole records at once; its buffers are byte for byte
    those of the per-record loop (a table sending every key group to output 0),
    records larger than a buffer and records cut between input buffers included."""
    w = RecordWriter(cut)
    bufs = [bytes(b) for n in sizes for b in w.write(rnd.randbytes(n))]
    last = w.flush()
    bufs += [bytes(last)] if last is not None else []

    def run(keep_all: bool) -> list[tuple[int, bytes]]:
        d = KeyGroupDemux(1, np.zeros(1), 1, FieldKey(0, "int32"), buffer_size=buffer_size)
        if keep_all:
            d.keep_all()
        out = []
        for i in range(0, len(bufs), per_call):
            group = bufs[i : i + per_call]
            lengths = np.array([len(b) for b in group], np.int64)
            offsets = (np.cumsum(lengths) - lengths).astype(np.int64)
            data = np.frombuffer(b"".join(group), np.uint8)
            out += d.push_frames(data, offsets, lengths, np.zeros(len(group), np.int32), ["c"])
        out += d.finish()
        assert d.routed == len(sizes) and d.dropped == 0
        return [(o, bytes(b)) for o, b in out]

    assert run(keep_all=True) == run(keep_all=False)


def test_coalesced_pass_through_keeps_every_record(tmp_path: Path) -> None:
    """pass_through + coalesce: the same records, per stream in order, in large buffers
    (the runtime's replay path), also when a record is cut between two pieces."""
    w = RecordWriter(100)
    bufs = []
    for i in range(500):
        bufs += w.write(np.int64(i).tobytes() * 3)
    last = w.flush()
    bufs += [last] if last is not None else []
    head, tail = bufs[: len(bufs) // 2], bufs[len(bufs) // 2 :]
    s_in = spillover.open_storage(tmp_path / "in").create_storer(0)
    for b in head:
        s_in.append(1, b)
        s_in.append(0, b"\0\0\0\0")  # another channel, interleaved
    s_out = spillover.open_storage(tmp_path / "out").create_storer(0, kind="output")
    for b in tail:
        s_out.append(4, b)
    stream = RecordStream(((s_in.close(), 1), (s_out.close(), 4)), 1, 4, channel=0)
    r = FilteringRetriever([stream], pass_through=True, coalesce=True, buffer_size=1 << 16)
    reader = RecordReader()
    got = [bytes(rec) for buf in r for batch in reader.feed(buf) for rec in batch]
    reader.finish()
    assert got == [np.int64(i).tobytes() * 3 for i in range(500)]


@given(
    frames=st.lists(
        st.tuples(st.integers(0, 9), st.integers(0, 1 << 20), st.integers(0, 1)), max_size=60
    ),
    lut=st.lists(st.integers(-3, 4), max_size=8),
)
def test_route_frames_is_the_per_channel_bookkeeping(
    frames: list[tuple[int, int, int]], lut: list[int]
) -> None:
    """One native call per block gives each frame's stream and each stream's bytes and
    frames as the per-channel numpy masks did: a channel past the table, or mapped
    below 0, feeds no stream; an event only counts when a stream reads it."""
    n_streams = 5
    ids = np.array([f[0] for f in frames], np.uint32)
    lengths = np.array([f[1] for f in frames], np.int64)
    types = np.array([f[2] for f in frames], np.uint8)
    table = np.array(lut, np.int32)
    slots, wanted, fed, present, events = _records.route_frames(
        ids, lengths, types, table, n_streams
    )
    expect = np.array([lut[c] if c < len(lut) and lut[c] >= 0 else -1 for c in ids], np.int32)
    mask = expect >= 0
    assert slots.tolist() == expect.tolist()
    assert wanted == int(mask.sum())
    assert fed.tolist() == [int(lengths[expect == s].sum()) for s in range(n_streams)]
    assert present.tolist() == [int((expect == s).sum()) for s in range(n_streams)]
    assert events == bool(types[mask].any())


def test_route_frames_refuses_a_table_beyond_its_streams() -> None:
    one = np.zeros(1, np.uint32), np.zeros(1, np.int64), np.zeros(1, np.uint8)
    with pytest.raises(ValueError, match="stream 2 of 2"):
        _records.route_frames(*one, np.array([2], np.int32), 2)
    with pytest.raises(ValueError, match="differ in length"):
        _records.route_frames(one[0], np.zeros(2, np.int64), one[2], np.array([0], np.int32), 1)
