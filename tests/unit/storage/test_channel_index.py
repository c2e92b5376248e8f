"""The channel index entry (docs/format.md, "Channel index"): what a gate's handle
holds per channel survives encoding exactly, and a cut, damaged or foreign entry is
a CorruptIndexError naming the index and the offset, never another exception."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillover.errors import CorruptIndexError, StateFileNotFoundError, UnsupportedVersionError
from spillover.storage.channel_index import (
    ENTRY_OVERHEAD,
    INDEX_MAGIC,
    ReadEntries,
    check_index,
    decode_entry,
    encode_entry,
    resolve,
    resolve_all,
)
from spillover.storage.handle import GateKind, GateStateHandle, IndexRef
from spillover.storage.reference import crc32c

U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)


@st.composite
def handles(draw: st.DrawFn) -> GateStateHandle:
    chans = draw(st.lists(U32, unique=True, max_size=40))
    channels = {c: (draw(st.integers(0, 2**40)), draw(U64)) for c in chans}
    ranges: dict[int, tuple[int, int]] = {}
    if draw(st.booleans()):
        for c in chans:
            start = draw(st.integers(0, 2**63))
            ranges[c] = (start, start + draw(st.integers(0, 2**32)))
    return GateStateHandle(
        uri="/x/chk-1/channels/a-0.spill",
        gate_id=0,
        gate_kind=GateKind.INPUT,
        checkpoint_id=1,
        subtask_index=0,
        file_id="00" * 16,
        size=128,
        frame_count=sum(f for f, _ in channels.values()),
        raw_bytes=0,
        stored_bytes=0,
        channels=channels,
        channel_ranges=ranges,
    )


@given(handles())
def test_an_entry_gives_back_the_handles_maps(h: GateStateHandle) -> None:
    channels, ranges = decode_entry(encode_entry(h))
    assert channels == h.channels
    assert ranges == h.channel_ranges


@given(handles(), st.data())
def test_a_cut_entry_is_a_corrupt_index(h: GateStateHandle, data: st.DataObject) -> None:
    entry = encode_entry(h)
    cut = data.draw(st.integers(0, len(entry) - 1))
    with pytest.raises(CorruptIndexError) as e:
        decode_entry(entry[:cut], "idx", 40)
    assert (e.value.path, e.value.offset) == ("idx", 40)


@given(handles(), st.data())
def test_a_damaged_entry_is_a_corrupt_index(h: GateStateHandle, data: st.DataObject) -> None:
    entry = bytearray(encode_entry(h))
    at = data.draw(st.integers(0, len(entry) - 1))
    entry[at] ^= data.draw(st.integers(1, 255))
    with pytest.raises(CorruptIndexError):
        decode_entry(bytes(entry))


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_are_a_corrupt_index(raw: bytes) -> None:
    with pytest.raises(CorruptIndexError):
        decode_entry(raw)


def _with_crc(body: bytes) -> bytes:
    return body + crc32c(body).to_bytes(4, "little")


def test_an_intact_entry_of_a_newer_version_is_refused_as_such() -> None:
    entry = encode_entry(dataclasses.replace(_handle(), channels={0: (1, 5)}, frame_count=1))
    body = bytearray(entry[:-4])
    body[4:6] = (2).to_bytes(2, "little")
    with pytest.raises(UnsupportedVersionError):
        decode_entry(_with_crc(bytes(body)))


@pytest.mark.parametrize(
    "mangle",
    [
        lambda b: INDEX_MAGIC[:3] + b"X" + b[4:],  # magic
        lambda b: b[:6] + b"\x02\x00" + b[8:],  # unknown flag
        lambda b: b[:12] + b"\x03" + b[13:],  # a width that is not 1, 2, 4, 8
        lambda b: b[:8] + (5).to_bytes(4, "little") + b[12:],  # count does not fit
    ],
)
def test_a_checksummed_entry_is_still_checked(mangle: object) -> None:
    h = dataclasses.replace(_handle(), channels={0: (1, 5), 3: (2, 7)}, frame_count=3)
    body = encode_entry(h)[:-4]
    with pytest.raises(CorruptIndexError):
        decode_entry(_with_crc(mangle(body)))  # type: ignore[operator]


def test_channel_ids_must_ascend() -> None:
    h = dataclasses.replace(_handle(), channels={1: (1, 5), 2: (1, 5)}, frame_count=2)
    body = bytearray(encode_entry(h)[:-4])
    body[20], body[21] = body[21], body[20]  # the channel column (width 1): 2, 1
    with pytest.raises(CorruptIndexError):
        decode_entry(_with_crc(bytes(body)))


def _handle() -> GateStateHandle:
    return GateStateHandle("/x/f.spill", 0, GateKind.OUTPUT, 1, 0, "00" * 16, 128, 0, 0, 0)


def test_resolve_reads_only_the_named_entries(tmp_path: Path) -> None:
    a = dataclasses.replace(_handle(), channels={0: (1, 5)}, frame_count=1)
    b = dataclasses.replace(_handle(), channels={1: (2, 9)}, channel_ranges={1: (64, 200)})
    b = dataclasses.replace(b, frame_count=2)
    ea, eb = encode_entry(a), encode_entry(b)
    index = tmp_path / "_channel_index"
    index.write_bytes(ea + eb)
    refs = [IndexRef(str(index), 0, len(ea)), IndexRef(str(index), len(ea), len(eb))]
    bare = [
        dataclasses.replace(h, channels={}, channel_ranges={}, index=r)
        for h, r in zip([a, b], refs, strict=True)
    ]
    assert resolve_all(bare) == [a, b]
    assert resolve(a) is a  # its maps are in it already


def test_an_entry_of_another_gate_or_beyond_the_index_is_refused(tmp_path: Path) -> None:
    a = dataclasses.replace(_handle(), channels={0: (1, 5)}, frame_count=1)
    entry = encode_entry(a)
    index = tmp_path / "_channel_index"
    index.write_bytes(entry)
    other = dataclasses.replace(
        a, channels={}, frame_count=7, index=IndexRef(str(index), 0, len(entry))
    )
    with pytest.raises(CorruptIndexError, match="does not match"):
        resolve(other)
    beyond = dataclasses.replace(a, channels={}, index=IndexRef(str(index), 4, len(entry)))
    with pytest.raises(CorruptIndexError) as e:
        resolve(beyond)
    assert e.value.path == str(index) and e.value.offset == 4


def test_a_restore_checks_the_index_is_there_and_long_enough(tmp_path: Path) -> None:
    a = dataclasses.replace(_handle(), channels={0: (1, 5)}, frame_count=1)
    entry = encode_entry(a)
    index = tmp_path / "_channel_index"
    named = dataclasses.replace(a, channels={}, index=IndexRef(str(index), 0, len(entry)))
    with pytest.raises(StateFileNotFoundError):
        check_index([named])
    index.write_bytes(entry[:-1])
    with pytest.raises(CorruptIndexError):
        check_index([named, a])
    index.write_bytes(entry)
    check_index([named, a])  # a's maps are in it: nothing to check


@given(handles(), st.none() | st.integers(0, 2**40))
def test_an_acknowledged_handle_keeps_its_entry_until_asked(
    h: GateStateHandle, offset: int | None
) -> None:
    """The acknowledgement's form (``index_entry``) parses without decoding: the
    handle carries the task's bytes, every field set, and gives its maps when a
    reader resolves it."""
    h = dataclasses.replace(h, offset=offset)
    d = dataclasses.replace(h, channels={}, channel_ranges={}).to_dict()
    del d["channels"]
    d["index_entry"] = encode_entry(h)
    acked = GateStateHandle.from_dict(d)
    assert acked.entry == d["index_entry"] and not acked.channels and not acked.channel_ranges
    assert set(vars(acked)) == {f.name for f in dataclasses.fields(GateStateHandle)}
    assert resolve(acked) == h
    placed = acked.to_dict("/idx", lambda entry: 40)
    assert placed["index"] == [40, len(d["index_entry"])] and "channels" not in placed
    assert GateStateHandle.from_dict(placed, "/idx").index == IndexRef("/idx", 40, len(acked.entry))


def test_a_damaged_acknowledged_entry_is_refused_when_read() -> None:
    h = GateStateHandle("/x/chk-1/g.spill", 0, GateKind.INPUT, 1, 0, "f", 99, 1, 4, 4)
    d = dataclasses.replace(h, channels={}).to_dict()
    d["index_entry"] = encode_entry(dataclasses.replace(h, channels={2: (1, 4)}))[:-1]
    with pytest.raises(CorruptIndexError):
        resolve(GateStateHandle.from_dict(d))


def test_an_entry_is_read_once_per_attempt_and_checked_at_every_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New subtasks of one worker replaying the same old gates read each entry once
    between them (the attempt's ReadEntries); a damaged copy kept by mistake would
    still be refused; without one, nothing is kept between two resolves."""
    import spillover.storage.channel_index as ci

    entries = ReadEntries(1 << 20)
    a = dataclasses.replace(_handle(), channels={0: (1, 5)}, frame_count=1)
    entry = encode_entry(a)
    index = tmp_path / "_index"
    index.write_bytes(entry)
    bare = dataclasses.replace(a, channels={}, index=IndexRef(str(index), 0, len(entry)))
    opened: list[str] = []
    real = ci.Location.open_input

    def counting(self: ci.Location, what: str = "file") -> object:
        opened.append(what)
        return real(self, what)

    monkeypatch.setattr(ci.Location, "open_input", counting)
    assert resolve_all([bare, bare], entries) == [a, a]
    assert resolve(bare, entries) == a  # another subtask: from the attempt's entries
    assert opened == ["channel index"]
    # another job's gate at the same path and offset: not this gate's entry
    assert resolve(dataclasses.replace(bare, file_id="11" * 16), entries) == dataclasses.replace(
        a, file_id="11" * 16
    )
    assert opened == ["channel index"] * 2
    assert resolve(bare) == a and resolve(bare) == a  # no attempt's entries: read anew
    assert opened == ["channel index"] * 4
    entries.put((str(index), 0, len(entry), a.file_id), entry[:-1] + bytes([entry[-1] ^ 1]))
    with pytest.raises(CorruptIndexError):
        resolve(bare, entries)


def test_the_read_entries_are_bounded_with_their_keys_counted() -> None:
    uri = "u" * 50
    one = 30 + len(uri) + ENTRY_OVERHEAD
    entries = ReadEntries(3 * one + one // 2)
    for i in range(10):
        entries.put((uri, i, 30, ""), bytes(30))
    assert entries.get((uri, 9, 30, "")) is not None and entries.get((uri, 0, 30, "")) is None
    assert sum(entries.get((uri, i, 30, "")) is not None for i in range(10)) == 3
    assert len(entries) == 3 and entries.kept_bytes == 3 * one
    entries.put((uri, 99, 1000, ""), bytes(1000))  # larger than the whole bound: not kept
    assert entries.get((uri, 99, 1000, "")) is None and entries.kept_bytes == 3 * one
