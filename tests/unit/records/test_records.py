"""Record framing, reassembly, serializers, keys and the key-group demultiplexer."""

from __future__ import annotations

import itertools
import struct
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillover.errors import ConfigError, CorruptRecordError
from spillover.keygroups import (
    assign_to_key_group,
    key_group_range_for_operator,
    key_group_table,
)
from spillover.records import (
    MAX_RECORD_SIZE,
    BytesSerializer,
    FieldKey,
    FixedWidthSerializer,
    KeyGroupDemux,
    PickleSerializer,
    RecordReader,
    RecordWriter,
    SelectorKey,
    key_groups_of,
    read_records,
    write_records,
)

BUFFER_SIZES = st.one_of(st.integers(1, 16), st.sampled_from([31, 100, 1000, 4096, 65536]))
# Mostly small records, some empty, some several buffers long.
RECORDS = st.lists(
    st.one_of(
        st.binary(max_size=12),
        st.just(b""),
        st.integers(100, 70_000).map(lambda n: bytes(range(256)) * (n // 256) + b"x" * (n % 256)),
    ),
    max_size=40,
)


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    bounds = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


# ---- writer and reader ----


@settings(max_examples=150, deadline=None)
@given(RECORDS, BUFFER_SIZES)
def test_writer_then_reader_gives_back_the_records(records: list[bytes], size: int) -> None:
    buffers = write_records(records, size)
    assert all(len(b) == size for b in buffers[:-1])
    assert 0 < len(buffers[-1]) <= size if buffers else not records
    total = sum(4 + len(r) for r in records)
    assert sum(len(b) for b in buffers) == total
    assert read_records(buffers) == records


@settings(max_examples=100, deadline=None)
@given(RECORDS, st.lists(st.integers(0, 10**6), max_size=30))
def test_reader_accepts_any_cut_of_the_stream(records: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(bytes(b) for b in write_records(records, 1 << 20))
    assert read_records(split_at(stream, cuts)) == records


@settings(max_examples=60, deadline=None)
@given(RECORDS, BUFFER_SIZES)
def test_write_batch_equals_one_by_one(records: list[bytes], size: int) -> None:
    data, offsets = BytesSerializer().serialize_batch(records)
    w = RecordWriter(size)
    out = w.write_batch(data, offsets)
    last = w.flush()
    batched = b"".join(bytes(b) for b in [*out, *([last] if last is not None else [])])
    assert batched == b"".join(bytes(b) for b in write_records(records, size))


def whole_frames(buffer: bytes) -> list[bytes] | None:
    """The records of one buffer if it holds whole frames only, else None."""
    out, p = [], 0
    while p < len(buffer):
        if p + 4 > len(buffer):
            return None
        n = struct.unpack_from("<I", buffer, p)[0]
        if p + 4 + n > len(buffer):
            return None
        out.append(buffer[p + 4 : p + 4 + n])
        p += 4 + n
    return out


def check_whole_cuts(buffers: list[bytes], frames: list[int], size: int) -> None:
    """Buffers of a whole-records stream of frames (prefix + payload lengths): a frame
    is split only if it is longer than a buffer or more than an eighth of one was
    left; a buffer before the last is short only where the next frame did not fit
    and at most an eighth was left."""
    ends = list(itertools.accumulate(len(b) for b in buffers))
    starts = [0, *itertools.accumulate(frames)]
    for k, end in enumerate(ends[:-1]):
        left = size - len(buffers[k])
        if left:  # cut short: the frame starting here did not fit
            nxt = starts.index(end)
            assert frames[nxt] > left and left <= size // 8
    for start, frame in zip(starts, frames, strict=False):
        boundary = next((e for e in ends if e > start), None)
        if boundary is not None and start + frame > boundary:  # split
            assert frame > size or boundary - start > size // 8


@settings(max_examples=150, deadline=None)
@given(RECORDS, BUFFER_SIZES)
def test_whole_records_writer_cuts_short_rather_than_split(records: list[bytes], size: int) -> None:
    """With ``whole_records`` a record that does not fit in what is left of a buffer
    starts the next one when at most an eighth of the buffer is left (never more
    waste), and the stream reads back the same records."""
    w = RecordWriter(size, whole_records=True)
    out = [bytes(b) for r in records for b in w.write(r)]
    last = w.flush()
    buffers = [*out, *([bytes(last)] if last is not None else [])]
    assert read_records(buffers) == records
    assert sum(len(b) for b in buffers) == sum(4 + len(r) for r in records)
    assert all(len(b) >= size - size // 8 for b in buffers[:-1])
    check_whole_cuts(buffers, [4 + len(r) for r in records], size)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.integers(0, 4096))
def test_small_records_are_never_split(width: int, extra: int) -> None:
    """Records of at most an eighth of a buffer each lie whole in one buffer."""
    frame = 4 + width
    size = 8 * frame + extra  # every example a record of at most an eighth
    w = RecordWriter(size, whole_records=True)
    data = np.arange(50 * width, dtype=np.uint8)
    buffers = [bytes(b) for b in [*w.write_fixed(data, width), w.flush()] if b is not None]
    assert all(len(b) % frame == 0 for b in buffers)
    assert [r for b in buffers for r in whole_frames(b) or [b"?"]] == [
        bytes(data[i * width : (i + 1) * width]) for i in range(50)
    ]


@settings(max_examples=100, deadline=None)
@given(
    st.integers(0, 200),
    st.integers(1, 40),
    st.one_of(BUFFER_SIZES, st.integers(20, 300)),
    st.booleans(),
)
def test_write_fixed_equals_write_batch(n: int, width: int, size: int, whole: bool) -> None:
    """Records of one width back to back frame exactly as the same records with offsets."""
    data = np.frombuffer(bytes(range(256)) * (n * width // 256 + 1), np.uint8)[: n * width]

    def stream(write: Any) -> list[bytes]:
        w = RecordWriter(size, whole_records=whole)
        last = [*write(w), w.flush()]
        return [bytes(b) for b in last if b is not None]

    fixed = stream(lambda w: w.write_fixed(data, width))
    assert fixed == stream(lambda w: w.write_batch(data, np.arange(n + 1) * width))
    assert read_records(fixed) == [bytes(data[i * width : (i + 1) * width]) for i in range(n)]
    with pytest.raises(ValueError, match="not records of"):
        RecordWriter(size).write_fixed(data, 0)
    if n * width > 1 and width > 1:
        with pytest.raises(ValueError, match="not records of"):
            RecordWriter(size).write_fixed(data[: n * width - 1], width)


def test_reader_views_are_zero_copy_and_spanning_records_are_copied() -> None:
    records = [b"a" * 10, b"b" * 50, b"c" * 3]
    buffers = write_records(records, 32)
    reader = RecordReader()
    batches = [reader.feed(b) for b in buffers]
    first = batches[0][0]
    assert not first.copied and np.shares_memory(first.data, buffers[0])
    assert first.to_list() == [b"a" * 10]
    spanning = [b for bs in batches for b in bs if b.copied]
    assert [b.to_list() for b in spanning] == [[b"b" * 50]]
    assert not any(np.shares_memory(spanning[0].data, b) for b in buffers)


def test_truncated_stream_and_huge_length_are_errors() -> None:
    buffers = write_records([b"x" * 100], 16)
    reader = RecordReader()
    for b in buffers[:-1]:
        reader.feed(b)
    with pytest.raises(CorruptRecordError):
        reader.finish()
    with pytest.raises(CorruptRecordError):
        RecordReader(max_record_size=99).feed(buffers[0])
    with pytest.raises(CorruptRecordError):
        RecordReader().feed(b"\xff\xff\xff\xff")  # 2**32 - 1 exceeds any Java int


# ---- serializers ----

DT = np.dtype([("key", "<i8"), ("value", "<f4"), ("tag", "S3")])


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(-(2**63), 2**63 - 1), st.floats(width=32), st.binary(max_size=3)),
        max_size=50,
    ),
    BUFFER_SIZES,
)
def test_fixed_width_round_trip(rows: list[tuple[int, float, bytes]], size: int) -> None:
    ser: FixedWidthSerializer = FixedWidthSerializer(DT)
    arr = np.array(rows, dtype=DT)
    data, offsets = ser.serialize_batch(arr)
    w = RecordWriter(size)
    buffers = w.write_batch(data, offsets)
    last = w.flush()
    buffers += [last] if last is not None else []
    reader = RecordReader()
    parts = [ser.deserialize_batch(b) for buf in buffers for b in reader.feed(buf)]
    got = np.concatenate(parts) if parts else np.empty(0, DT)
    assert got.tobytes() == arr.tobytes()


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 60), BUFFER_SIZES)
def test_read_buffer_matches_feed_then_deserialize(n: int, size: int) -> None:
    """The task's path (one strided view per buffer) gives, buffer by buffer, exactly
    what the general path gives joined, whatever cuts records across buffers."""
    ser: FixedWidthSerializer = FixedWidthSerializer(DT)
    arr = np.array([(i * 7 - 3, i / 3, bytes([i % 256])) for i in range(n)], dtype=DT)
    data, offsets = ser.serialize_batch(arr)
    w = RecordWriter(size)
    buffers = w.write_batch(data, offsets)
    last = w.flush()
    buffers += [last] if last is not None else []
    fast, general = RecordReader(), RecordReader()
    for buf in buffers:
        got = ser.read_buffer(fast, buf)
        parts = [ser.deserialize_batch(b) for b in general.feed(buf)]
        want = np.concatenate(parts) if parts else np.empty(0, DT)
        assert got.dtype == DT and got.tobytes() == want.tobytes()
    fast.finish()


def test_read_buffer_views_the_buffer_and_refuses_other_widths() -> None:
    ser: FixedWidthSerializer = FixedWidthSerializer(DT)
    arr = np.array([(i, i / 2, b"ab") for i in range(100)], dtype=DT)
    (buf,) = write_records([ser.serialize(x) for x in arr], 1 << 16)
    view = ser.read_buffer(RecordReader(), buf)
    assert np.shares_memory(view, buf)
    assert (view["key"] == np.arange(100)).all()
    with pytest.raises(CorruptRecordError):
        ser.read_buffer(RecordReader(), write_records([b"short"], 64)[0])
    # A header of another width is refused as soon as it is read, even before its
    # record is whole; a carried record of the wrong width (its header cut) too.
    pieces = write_records([b"x" * 40], 16)
    with pytest.raises(CorruptRecordError):
        ser.read_buffer(RecordReader(), pieces[0])
    stream = b"".join(bytes(b) for b in pieces)
    reader = RecordReader()
    assert len(ser.read_buffer(reader, stream[:2])) == 0
    with pytest.raises(CorruptRecordError):
        ser.read_buffer(reader, stream[2:])


def test_fixed_width_batch_is_a_view_of_the_buffer() -> None:
    ser: FixedWidthSerializer = FixedWidthSerializer(DT)
    arr = np.array([(i, i / 2, b"ab") for i in range(100)], dtype=DT)
    (buf,) = write_records([ser.serialize(x) for x in arr], 1 << 16)
    (batch,) = RecordReader().feed(buf)
    view = ser.deserialize_batch(batch)
    assert np.shares_memory(view, buf)
    assert (view["key"] == np.arange(100)).all()
    with pytest.raises(CorruptRecordError):
        ser.deserialize_batch(RecordReader().feed(write_records([b"short"], 64)[0])[0])


def test_pickle_refuses_without_opt_in() -> None:
    with pytest.raises(ConfigError):
        PickleSerializer()
    ser = PickleSerializer(allow_unsafe=True)
    values = [{"a": 1}, (2, "b"), None]
    data, offsets = ser.serialize_batch(values)
    w = RecordWriter(7)
    bufs = [*w.write_batch(data, offsets), w.flush()]
    reader = RecordReader()
    assert [v for b in bufs for bt in reader.feed(b) for v in ser.deserialize_batch(bt)] == values


# ---- native keys ----

KEYED = st.one_of(
    st.tuples(st.just("int32"), st.lists(st.integers(-(2**31), 2**31 - 1), max_size=80)),
    st.tuples(st.just("int64"), st.lists(st.integers(-(2**63), 2**63 - 1), max_size=80)),
    st.tuples(st.just("str"), st.lists(st.text(max_size=20), max_size=80)),
)


def encode_key(kind: str, k: object) -> bytes:
    if kind == "int32":
        return struct.pack("<i", k)
    if kind == "int64":
        return struct.pack("<q", k)
    assert isinstance(k, str)
    raw = k.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


@settings(max_examples=100, deadline=None)
@given(KEYED, st.integers(0, 7), st.integers(1, 32768))
def test_native_record_key_groups_equal_scalar(
    keyed: tuple[str, list[object]], pad: int, maxp: int
) -> None:
    kind, keys = keyed
    recs = [b"p" * pad + encode_key(kind, k) + b"rest" for k in keys]
    buf = b"".join(bytes(b) for b in write_records(recs, 1 << 20))
    got = key_groups_of(buf, maxp, FieldKey(pad, kind))  # type: ignore[arg-type]
    assert got.tolist() == [assign_to_key_group(k, maxp, kind) for k in keys]  # type: ignore[arg-type]


def test_key_field_variants_and_errors() -> None:
    recs = [b"\x00" + "k€😀".encode(), b"\x00"]
    (buf,) = write_records(recs, 1024)
    got = key_groups_of(buf, 128, FieldKey(1, "str", length_prefixed=False))
    assert got.tolist() == [assign_to_key_group("k€😀", 128), assign_to_key_group("", 128)]
    got = key_groups_of(buf, 128, FieldKey(1, "bytes", length_prefixed=False))
    assert got.tolist() == [
        assign_to_key_group("k€😀".encode(), 128),
        assign_to_key_group(b"", 128),
    ]
    with pytest.raises(CorruptRecordError):
        key_groups_of(buf, 128, FieldKey(0, "int64"))  # records too short for the key
    with pytest.raises(CorruptRecordError):
        key_groups_of(buf[:-1], 128, FieldKey(0, "bytes", length_prefixed=False))
    with pytest.raises(ConfigError):
        FieldKey(0, "float")  # type: ignore[arg-type]


# ---- the demultiplexer ----


@st.composite
def demux_cases(draw: st.DrawFn) -> dict[str, object]:
    maxp = draw(st.sampled_from([1, 7, 128, 1000]))
    n_out = draw(st.integers(1, 6))
    table = draw(st.lists(st.integers(-1, n_out - 1), min_size=maxp, max_size=maxp))
    n_channels = draw(st.integers(1, 3))
    channels = []
    for c in range(n_channels):
        keys = draw(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=60))
        sizes = draw(
            st.lists(
                st.sampled_from([0, 1, 5, 40, 300, 5000]), min_size=len(keys), max_size=len(keys)
            )
        )
        # Payload: int64 key, channel, sequence number, filler; identifies every record.
        recs = [
            struct.pack("<qHI", k, c, i) + b"f" * s
            for i, (k, s) in enumerate(zip(keys, sizes, strict=True))
        ]
        in_size = draw(BUFFER_SIZES)
        channels.append((keys, recs, write_records(recs, in_size)))
    # Interleave the channels' buffers in a random order that keeps each channel's order.
    order = draw(st.permutations([c for c, ch in enumerate(channels) for _ in ch[2]]))
    return {
        "maxp": maxp,
        "n_out": n_out,
        "table": table,
        "channels": channels,
        "order": order,
        "out_size": draw(BUFFER_SIZES),
    }


@settings(max_examples=80, deadline=None)
@given(demux_cases(), st.booleans())
def test_demux_routes_every_record_to_its_key_groups_output(
    case: dict[str, Any], selector: bool
) -> None:
    maxp, n_out, table, channels = case["maxp"], case["n_out"], case["table"], case["channels"]
    key = (
        SelectorKey(lambda b: struct.unpack_from("<q", b)[0], "int64")
        if selector
        else FieldKey(0, "int64")
    )
    demux = KeyGroupDemux(maxp, table, n_out, key=key, buffer_size=case["out_size"])
    outs: dict[int, list[np.ndarray]] = {o: [] for o in range(n_out)}
    cursor = [0] * len(channels)
    for c in case["order"]:
        buf = channels[c][2][cursor[c]]
        cursor[c] += 1
        for o, b in demux.push(buf, channel=c):
            outs[o].append(b)
    for o, b in demux.finish():
        outs[o].append(b)

    expected_out = {}
    for keys, recs, _ in channels:
        for k, r in zip(keys, recs, strict=True):
            expected_out[r] = table[assign_to_key_group(k, maxp, "int64")]
    got_all: list[bytes] = []
    for o, bufs in outs.items():
        assert all(len(b) == case["out_size"] for b in bufs[:-1])  # valid fixed-size buffers
        got = read_records(bufs)
        got_all += got
        assert all(expected_out[r] == o for r in got)  # each record in its key group's output
        for c, (_, recs, _) in enumerate(channels):  # input order kept per channel
            mine = [r for r in got if struct.unpack_from("<H", r, 8)[0] == c]
            assert mine == [r for r in recs if expected_out[r] == o]
    kept = Counter(r for r, o in expected_out.items() if o >= 0)
    assert Counter(got_all) == kept  # nothing lost, nothing duplicated, outputs disjoint
    assert demux.routed == len(got_all)
    assert demux.dropped == len(expected_out) - len(got_all)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2600), st.booleans()), min_size=1, max_size=4),
    st.integers(0, 2**32),
    st.sampled_from([4096, 65536, 1 << 20]),
)
def test_demux_routes_runs_that_drop_nothing_as_runs_that_drop(
    runs: list[tuple[int, bool]], seed: int, in_size: int
) -> None:
    """Runs of thousands of records whose key groups the table all keeps (as in a shared
    read's old channel) between runs that mix in dropped ones: the native loop walks
    each chunk of records as the chunk before suggests; every kept record still reaches
    its output in order, and every other is counted as dropped."""
    maxp, n_out = 128, 3
    table = [kg % n_out if kg < 64 else -1 for kg in range(maxp)]
    out_of = {k: table[assign_to_key_group(k, maxp, "int64")] for k in range(2000)}
    kept_keys = [k for k, o in out_of.items() if o >= 0]
    rnd = np.random.default_rng(seed)
    keys: list[int] = []
    for n, keep_only in runs:
        keys += [int(k) for k in rnd.choice(kept_keys if keep_only else 2000, n)]
    recs = [struct.pack("<qI", k, i) for i, k in enumerate(keys)]
    demux = KeyGroupDemux(maxp, table, n_out, key=FieldKey(0, "int64"), buffer_size=1 << 16)
    outs: dict[int, list[np.ndarray]] = {o: [] for o in range(n_out)}
    for buf in write_records(recs, in_size):
        for o, b in demux.push(buf, channel=0):
            outs[o].append(b)
    for o, b in demux.finish():
        outs[o].append(b)
    for o in range(n_out):
        assert read_records(outs[o]) == [
            r for r, k in zip(recs, keys, strict=True) if out_of[k] == o
        ]
    assert demux.dropped == sum(out_of[k] < 0 for k in keys)
    assert demux.routed == len(keys) - demux.dropped


@settings(max_examples=80, deadline=None)
@given(
    st.integers(0, 300),
    st.sampled_from(["int64", "int32", "bytes"]),
    st.integers(0, 24),
    st.one_of(st.integers(1, 64), st.sampled_from([100, 1000, 4096, 65536])),
    st.integers(1, 5),
    st.integers(0, 2**32),
    st.booleans(),
)
def test_demux_push_rows_routes_a_batch_as_push_routes_it_framed(
    n: int, kind: str, extra: int, out_size: int, n_out: int, seed: int, selector: bool
) -> None:
    """A record batch routed in place (the source's key_by) gives the same output
    buffers, byte for byte, as the same rows framed and pushed; rows of dropped key
    groups are dropped alike."""
    rng = np.random.default_rng(seed)
    width = {"int64": 8, "int32": 4, "bytes": 4}[kind] + extra
    rows = rng.integers(0, 256, size=(n, width), dtype=np.uint8)
    if kind == "bytes":  # a length-prefixed key: mostly one that fits its row
        rows[:, :4] = 0
        rows[:, 0] = rng.integers(0, extra + 1 + (seed % 3 == 0), size=n)
    maxp = 128
    table = rng.integers(-1, n_out, size=maxp)
    field = FieldKey(0, kind)
    key = (
        SelectorKey(lambda b: int.from_bytes(b[:8], "little", signed=True), "int64")
        if selector and kind == "int64"
        else field
    )

    def route(push: Any) -> object:
        demux = KeyGroupDemux(maxp, table, n_out, key=key, buffer_size=out_size)
        try:
            got = [(o, bytes(b)) for o, b in [*push(demux), *demux.finish()]]
        except CorruptRecordError as e:  # a bytes key longer than its row: both refuse
            return e.message
        return got, demux.routed, demux.dropped

    framed = np.empty((n, 4 + width), np.uint8)
    framed[:, :4] = np.frombuffer(np.uint32(width).tobytes(), np.uint8)
    framed[:, 4:] = rows
    assert route(lambda d: d.push_rows(rows)) == route(lambda d: d.push(framed.reshape(-1)))


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 300),
    st.integers(0, 24),
    st.one_of(st.integers(12, 64), st.sampled_from([100, 1000, 4096])),
    st.integers(1, 4),
    st.integers(0, 2**32),
)
def test_demux_whole_records_routes_the_same_records_unsplit(
    n: int, extra: int, out_size: int, n_out: int, seed: int
) -> None:
    """A demux packing whole records sends each output the same records in the same
    order as one that splits them, and every buffer holds whole records."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 256, size=(n, 8 + extra), dtype=np.uint8)
    table = rng.integers(-1, n_out, size=128)

    def route(whole: bool) -> dict[int, list[bytes]]:
        demux = KeyGroupDemux(
            128,
            table,
            n_out,
            key=FieldKey(0, "int64"),
            buffer_size=out_size,
            whole_records=whole,
        )
        by_out: dict[int, list[bytes]] = {o: [] for o in range(n_out)}
        for o, b in [*demux.push_rows(rows), *demux.finish()]:
            by_out[o].append(bytes(b))
        return by_out

    whole, split = route(True), route(False)
    assert {o: read_records(bs) for o, bs in whole.items()} == {
        o: read_records(bs) for o, bs in split.items()
    }
    for bs in whole.values():
        check_whole_cuts(bs, [12 + extra] * len(read_records(bs)), out_size)


def test_rows_past_the_gil_bound_are_routed_and_framed_as_in_pieces() -> None:
    """A batch past NOGIL_MIN_BYTES (the demultiplexer's and the packer's loops let
    the GIL go) gives the same buffers as the same rows pushed in pieces below it
    (the loops keep the GIL)."""
    from spillover._native._records import NOGIL_MIN_BYTES

    width = 24
    rng = np.random.default_rng(11)
    rows = rng.integers(0, 256, size=(NOGIL_MIN_BYTES // width + 7, width), dtype=np.uint8)
    table = rng.integers(0, 3, size=128)

    def route(pieces: int) -> list[tuple[int, bytes]]:
        demux = KeyGroupDemux(128, table, 3, key=FieldKey(0, "int64"), buffer_size=1 << 17)
        got = [
            (o, bytes(b)) for part in np.array_split(rows, pieces) for o, b in demux.push_rows(part)
        ]
        return got + [(o, bytes(b)) for o, b in demux.finish()]

    def frame(pieces: int) -> list[bytes]:
        writer = RecordWriter(1 << 17, whole_records=True)
        out = [
            bytes(b)
            for part in np.array_split(rows, pieces)
            for b in writer.write_fixed(part.reshape(-1), width)
        ]
        last = writer.flush()
        return out if last is None else [*out, bytes(last)]

    assert route(1) == route(64)
    assert frame(1) == frame(64)


def test_demux_push_rows_refuses_rows_too_short_for_their_key() -> None:
    demux = KeyGroupDemux(4, [0, 0, 0, 0], 1, key=FieldKey(0, "int64"))
    with pytest.raises(CorruptRecordError):
        demux.push_rows(np.zeros((3, 4), np.uint8))
    with pytest.raises(RuntimeError):  # the demux failed: its state is lost
        demux.push_rows(np.zeros((3, 8), np.uint8))


def test_demux_by_str_key_field_and_pending_records() -> None:
    maxp, p = 128, 4
    table = key_group_table(maxp, [key_group_range_for_operator(maxp, p, i) for i in range(p)])
    words = ["alpha", "β", "😀", "", "delta"] * 20
    recs = [encode_key("str", w) + b"!" for w in words]
    demux = KeyGroupDemux(maxp, table, p, key=FieldKey(0, "str"), buffer_size=64)
    bufs = write_records(recs, 13)
    outs: dict[int, list[np.ndarray]] = {o: [] for o in range(p)}
    for b in bufs[:-1]:
        for o, ob in demux.push(b, channel="in"):
            outs[o].append(ob)
    assert demux.pending() == {"in": 4 + len(recs[-1]) - len(bufs[-1])}
    with pytest.raises(CorruptRecordError):
        demux.finish()
    for o, ob in [*demux.push(bufs[-1], channel="in"), *demux.finish()]:
        outs[o].append(ob)
    for o in range(p):
        owner = [table[assign_to_key_group(w, maxp)] for w in words]
        assert read_records(outs[o]) == [r for r, ow in zip(recs, owner, strict=True) if ow == o]


def test_demux_rejects_bad_tables_and_fails_stickily() -> None:
    with pytest.raises(ConfigError):
        KeyGroupDemux(128, np.zeros(127), 1)
    with pytest.raises(ConfigError):
        KeyGroupDemux(128, np.full(128, 2), 2)
    demux = KeyGroupDemux(4, [0, 0, 0, 0], 1, key=FieldKey(0, "int64"))
    with pytest.raises(CorruptRecordError):
        demux.push(write_records([b"abc"], 64)[0])
    with pytest.raises(RuntimeError):
        demux.push(write_records([b"12345678"], 64)[0])


def test_any_contiguous_buffer_is_accepted() -> None:
    import pyarrow as pa

    recs = [struct.pack("<q", 7) + b"abc", struct.pack("<q", -7), struct.pack("<q", 1) + b"x" * 40]
    (buf,) = write_records(recs, 1024)
    raw = bytes(buf)
    kinds = [raw, bytearray(raw), memoryview(raw), np.frombuffer(raw, np.int8), pa.py_buffer(raw)]
    for view in kinds:
        assert read_records([view]) == recs
        demux = KeyGroupDemux(128, np.zeros(128), 1)
        assert read_records([b for _, b in [*demux.push(view), *demux.flush()]]) == recs
        assert len(key_groups_of(view, 128)) == 3
    w = RecordWriter(16)
    out: list[object] = [*w.write(pa.py_buffer(b"hello")), *w.write(np.arange(3, dtype=np.int32))]
    out.append(w.flush())
    assert read_records(out) == [b"hello", np.arange(3, dtype=np.int32).tobytes()]
    with pytest.raises((TypeError, ValueError)):
        RecordReader().feed(np.zeros(16, np.uint8)[::2])  # not contiguous


@pytest.mark.parametrize("big", [False, True])
def test_a_scan_with_or_without_the_gil_reads_the_same_records(big: bool) -> None:
    """Below NOGIL_MIN_SCAN_BYTES the scan keeps the GIL, from it on it lets it go:
    the records read are the same, a carried record included."""
    from spillover._native._records import NOGIL_MIN_SCAN_BYTES

    width = 12
    n = (NOGIL_MIN_SCAN_BYTES if big else 4096) // (width + 4) + 3
    records = [i.to_bytes(4, "little") * 3 for i in range(n)]
    stream = b"".join(struct.pack("<I", width) + r for r in records)
    cut = len(stream) - 6  # the last record spans two buffers
    reader = RecordReader()
    got: list[bytes] = []
    for buf in (stream[:cut], stream[cut:]):
        carried, start, count = reader.feed_fixed(buf, width)
        if carried is not None:
            got.append(bytes(carried))
        got += [
            buf[start + i * (width + 4) : start + i * (width + 4) + width] for i in range(count)
        ]
    assert got == records


def _read_fixed(bufs: list[bytes], width: int, max_len: int) -> list[bytes]:
    reader, got = RecordReader(max_len), []
    for buf in bufs:
        carried, start, count = reader.feed_fixed(buf, width)
        if carried is not None:
            got.append(bytes(carried))
        step = width + 4
        got += [buf[start + i * step : start + i * step + width] for i in range(count)]
    assert reader.pending_bytes == 0, "a record was left incomplete"
    return got


@settings(max_examples=300, deadline=None)
@given(
    width=st.integers(0, 40),
    n=st.integers(0, 60),
    odd=st.one_of(st.none(), st.tuples(st.integers(0, 59), st.integers(0, 80))),
    cuts=st.lists(st.integers(0, 3000), max_size=6),
    max_len=st.sampled_from([MAX_RECORD_SIZE, 24]),
)
def test_a_fixed_width_read_is_the_general_read_and_refuses_any_other_length(
    width: int, n: int, odd: tuple[int, int] | None, cuts: list[int], max_len: int
) -> None:
    """The fixed-width read (one pass that only compares headers) gives the records
    the general read gives, however the stream is cut into buffers (empty ones
    too); a record of any other length, whole or cut, or above the reader's
    largest record (the width's own included), is refused rather than read at
    another stride."""
    records = [bytes([i % 251]) * width for i in range(n)]
    if odd is not None and odd[0] < n and odd[1] != width:
        records[odd[0]] = b"x" * odd[1]
    stream = b"".join(struct.pack("<I", len(r)) + r for r in records)
    bounds = sorted([0, len(stream), *(c for c in cuts if c <= len(stream))])
    bufs = [stream[a:b] for a, b in itertools.pairwise(bounds)]
    if all(len(r) == width <= max_len for r in records):
        assert _read_fixed(bufs, width, max_len) == records == read_records(bufs, max_len)
    else:
        with pytest.raises(CorruptRecordError):
            _read_fixed(bufs, width, max_len)
