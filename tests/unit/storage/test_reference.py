"""The pure-Python reference reader/writer of state-file format v1 against docs/format.md."""

from __future__ import annotations

import io
import mmap
import os
import struct
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lz4.block
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spillover.errors import (
    BadMagicError,
    ClosedError,
    CorruptFrameError,
    CorruptHeaderError,
    SpilloverError,
    StorageError,
    TruncatedFileError,
    UnsupportedVersionError,
)
from spillover.storage import reference as ref
from spillover.storage.reference import (
    Frame,
    ReferenceWriter,
    StateHeader,
    crc32c,
    iter_frames,
    read_state_file,
)
from support.format_fuzz import (
    FrameTuple,
    check_every_cut_truncated,
    check_golden,
    frame_lists,
    fuzz_reader,
    load_golden,
)

PATH = "/checkpoints/chk-7/in-00003.spill"
FILE_ID = bytes(range(16))
SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def read_whole(data: bytes, path: str) -> list[FrameTuple]:
    _, frames = read_state_file(data, path=path)
    return [(f.channel_id, f.data_type, f.data) for f in frames]


def read_streaming(data: bytes, path: str) -> list[FrameTuple]:
    return [(f.channel_id, f.data_type, f.data) for f in iter_frames(io.BytesIO(data), path=path)]


def write(frames: Sequence[tuple[int, int, Any]], codec: int = 0, **header: int) -> bytes:
    out = io.BytesIO()
    with ReferenceWriter(out, codec=codec, file_id=FILE_ID, **header) as writer:
        for channel_id, data_type, payload in frames:
            writer.append(channel_id, payload, data_type)
    return out.getvalue()


def expect(error_class: type[SpilloverError], data: bytes, offset: int | None = None) -> Exception:
    """Both readers refuse ``data`` with ``error_class`` naming the file and ``offset``."""
    for read in (read_whole, read_streaming):
        with pytest.raises(error_class) as info:
            read(data, PATH)
        assert info.value.path == PATH
        assert info.value.offset is not None
        if offset is not None:
            assert info.value.offset == offset, str(info.value)
    return info.value


# ---------------------------------------------------------------------- crafting


def frame_bytes(
    channel_id: int,
    data_type: int,
    codec: int,
    payload: bytes,
    raw_length: int | None = None,
    flags: int = 0,
    stored_length: int | None = None,
) -> bytes:
    """A frame with valid checksums and whatever fields the test wants."""
    stored = len(payload) if stored_length is None else stored_length
    raw = len(payload) if raw_length is None else raw_length
    head = struct.pack(
        "<IBBHIII", channel_id, data_type, codec, flags, stored, raw, crc32c(payload)
    )
    return head + struct.pack("<I", crc32c(head)) + payload


def trailer_bytes(count: int, raw: int, stored: int, file_id: bytes = FILE_ID) -> bytes:
    body = struct.pack("<QQQ16s", count, raw, stored, file_id)
    return frame_bytes(0xFFFFFFFF, 255, 0, body)


def state_file(frames: list[bytes], *, counts: tuple[int, int, int] | None = None) -> bytes:
    """A file of hand-made frames; the trailer's counts are computed unless given."""
    if counts is None:
        lengths = [struct.unpack_from("<II", f, 8) for f in frames]
        counts = (len(frames), sum(r for _, r in lengths), sum(s for s, _ in lengths))
    header = StateHeader(0, 0, 0, 0, 0, FILE_ID).pack()
    return header + b"".join(frames) + trailer_bytes(*counts)


def patch(data: bytes, offset: int, new: bytes, *, fix_header_crc: bool = True) -> bytes:
    out = bytearray(data)
    out[offset : offset + len(new)] = new
    if fix_header_crc:
        out[60:64] = struct.pack("<I", crc32c(bytes(out[:60])))
    return bytes(out)


def flip(data: bytes, offset: int, mask: int = 0x01) -> bytes:
    out = bytearray(data)
    out[offset] ^= mask
    return bytes(out)


# --------------------------------------------------------------------------- CRC


def test_crc32c_check_value() -> None:
    assert crc32c(b"123456789") == 0xE3069283
    assert ref._crc32c_pure(b"123456789") == 0xE3069283
    assert ref._crc32c_pure(b"6789", ref._crc32c_pure(b"12345")) == 0xE3069283
    assert crc32c(b"") == ref._crc32c_pure(b"") == 0


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=4096), value=st.integers(0, 2**32 - 1))
def test_crc_implementations_agree(data: bytes, value: int) -> None:
    library = pytest.importorskip("crc32c")
    assert ref._crc32c_pure(data, value) == library.crc32c(data, value)
    assert ref._crc32c_pure(memoryview(data)) == crc32c(data)


@pytest.mark.parametrize(("env", "expected"), [("1", "pure"), ("0", "crc32c")])
def test_pure_crc_forced_by_env(env: str, expected: str) -> None:
    pytest.importorskip("crc32c")
    code = "from spillover.storage import reference as r; print(r.CRC_IMPLEMENTATION)"
    environ = {**os.environ, "SPILLOVER_PURE_CRC": env}
    environ["PYTHONPATH"] = os.pathsep.join([str(Path(ref.__file__).parents[2])])
    out = subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == expected


# ------------------------------------------------------------------ golden bytes

# empty.spill derived by hand from docs/format.md: all integers little-endian.
EMPTY_SPILL_HEX = "".join(
    [
        # state header
        "89 53 50 4c 0d 0a 1a 0a",  # magic
        "01 00",  # format_version 1
        "40 00",  # header_length 64
        "00 00 00 00",  # flags
        "07 00 00 00 00 00 00 00",  # checkpoint_id 7
        "02 00 00 00",  # subtask_index 2
        "03 00 00 00",  # gate_id 3
        "00",  # gate_kind: input gate
        "00",  # codec: none
        "00 00 00 00 00 00",  # reserved
        "00 11 22 33 44 55 66 77 88 99 aa bb cc dd ee ff",  # file_id
        "00 00 00 00",  # reserved
        "24 1d 76 76",  # header_crc = CRC32C(bytes 0-59)
        # trailer: frame header
        "ff ff ff ff",  # channel_id
        "ff",  # data_type: trailer
        "00",  # codec
        "00 00",  # flags
        "28 00 00 00",  # stored_length 40
        "28 00 00 00",  # raw_length 40
        "b5 c4 f0 53",  # payload_crc = CRC32C(body)
        "0a 27 da 9d",  # header_crc = CRC32C(frame-header bytes 0-19)
        # trailer: body
        "00 00 00 00 00 00 00 00",  # frame_count
        "00 00 00 00 00 00 00 00",  # raw_bytes
        "00 00 00 00 00 00 00 00",  # stored_bytes
        "00 11 22 33 44 55 66 77 88 99 aa bb cc dd ee ff",  # file_id
    ]
)
EMPTY_SPILL = bytes.fromhex(EMPTY_SPILL_HEX)
GOLDEN = load_golden()


def test_empty_file_bytes_follow_the_spec() -> None:
    golden_dir = Path(GOLDEN[0].path).parent
    assert len(EMPTY_SPILL) == 128
    assert (golden_dir / "empty.spill").read_bytes() == EMPTY_SPILL

    out = io.BytesIO()
    file_id = bytes.fromhex("00112233445566778899aabbccddeeff")
    writer = ReferenceWriter(
        out, checkpoint_id=7, subtask_index=2, gate_id=3, gate_kind=0, file_id=file_id
    )
    summary = writer.close()
    assert out.getvalue() == EMPTY_SPILL
    assert summary == {
        "frame_count": 0,
        "raw_bytes": 0,
        "stored_bytes": 0,
        "file_id": file_id.hex(),
        "size": 128,
        "channels": {},
    }
    assert read_state_file(EMPTY_SPILL) == (StateHeader(7, 2, 3, 0, 0, file_id), [])


def test_golden_files_read_back_exactly() -> None:
    check_golden(read_whole)
    check_golden(read_streaming)
    for case in GOLDEN:
        with open(case.path, "rb") as f:
            header, frames = read_state_file(f)
        assert header == StateHeader(**case.header)
        assert [f.codec for f in frames] == [g.codec for g in case.frames]
        assert sum(len(f.data) for f in frames) == case.raw_bytes
        assert len(frames) == case.frame_count


def test_golden_files_are_what_the_writer_writes() -> None:
    for case in GOLDEN:
        out = io.BytesIO()
        writer = ReferenceWriter(out, **case.header)
        for frame in case.frames:
            writer.append(frame.channel_id, frame.payload, frame.data_type)
        summary = writer.close()
        assert out.getvalue() == case.path.read_bytes(), case.name
        assert (summary["frame_count"], summary["raw_bytes"], summary["stored_bytes"]) == (
            case.frame_count,
            case.raw_bytes,
            case.stored_bytes,
        )


def test_golden_lz4_falls_back_unless_strictly_smaller() -> None:
    (case,) = [c for c in GOLDEN if c.name == "lz4.spill"]
    codecs = {f.codec for f in case.frames}
    assert codecs == {0, 1}
    for frame in case.frames:
        block = lz4.block.compress(frame.payload, store_size=False)
        assert frame.codec == (1 if len(block) < len(frame.payload) else 0)
    assert any(
        len(lz4.block.compress(f.payload, store_size=False)) == len(f.payload) for f in case.frames
    ), "the golden file should pin the equal-length case"


# -------------------------------------------------------------------- round trip

headers = st.fixed_dictionaries(
    {
        "checkpoint_id": st.integers(0, 2**64 - 1),
        "subtask_index": st.integers(0, 2**32 - 1),
        "gate_id": st.integers(0, 2**32 - 1),
        "gate_kind": st.sampled_from([0, 1]),
        "codec": st.sampled_from([0, 1]),
    }
)


@SETTINGS
@given(fields=headers, frames=frame_lists(max_frames=8))
def test_round_trip(fields: dict[str, int], frames: list[FrameTuple]) -> None:
    out = io.BytesIO()
    writer = ReferenceWriter(out, file_id=FILE_ID, **fields)
    for channel_id, data_type, payload in frames:
        writer.append(channel_id, payload, data_type)
    summary = writer.close()
    data = out.getvalue()

    header, read = read_state_file(data, path=PATH)
    assert header == StateHeader(file_id=FILE_ID, **fields)
    assert [(f.channel_id, f.data_type, f.data) for f in read] == frames
    assert list(iter_frames(io.BytesIO(data))) == read

    offset = ref.HEADER_SIZE
    stored_total = 0
    for frame in read:
        assert frame.offset == offset
        block_len = len(lz4.block.compress(frame.data, store_size=False))
        compresses = fields["codec"] == 1 and block_len < len(frame.data)
        assert frame.codec == (1 if compresses else 0)
        stored = block_len if compresses else len(frame.data)
        stored_total += stored
        offset += ref.FRAME_HEADER_SIZE + stored
    assert offset + ref.TRAILER_SIZE == len(data) == summary["size"]

    channels: dict[int, list[int]] = {}
    for channel_id, _, payload in frames:
        stats = channels.setdefault(channel_id, [0, 0])
        stats[0] += 1
        stats[1] += len(payload)
    assert summary == {
        "frame_count": len(frames),
        "raw_bytes": sum(len(p) for _, _, p in frames),
        "stored_bytes": stored_total,
        "file_id": FILE_ID.hex(),
        "size": len(data),
        "channels": channels,
    }


def test_append_accepts_any_bytes_like() -> None:
    matrix = np.arange(12, dtype=np.int32).reshape(3, 4)
    buffers = [
        b"bytes",
        bytearray(b"bytearray"),
        memoryview(b"--memoryview--")[2:-2],
        matrix,
        pa.py_buffer(b"pyarrow"),
        np.float64(1.5),
    ]
    data = write([(7, 0, buf) for buf in buffers])
    expected = [(7, 0, memoryview(buf).tobytes()) for buf in buffers]
    assert read_whole(data, PATH) == expected
    with pytest.raises(ValueError):
        write([(7, 0, matrix[:, ::2])])


def test_writer_refuses_bad_arguments() -> None:
    out = io.BytesIO()
    writer = ReferenceWriter(out, file_id=FILE_ID)
    for channel_id, data_type in [(-1, 0), (2**32, 0), (0, 2), (0, 255)]:
        with pytest.raises(ValueError):
            writer.append(channel_id, b"x", data_type)
    assert len(out.getvalue()) == ref.HEADER_SIZE, "a refused append wrote bytes"
    bad_headers = [
        {"checkpoint_id": 2**64},
        {"subtask_index": -1},
        {"gate_id": 2**32},
        {"gate_kind": 2},
        {"codec": 2},
        {"file_id": b"short"},
    ]
    for fields in bad_headers:
        with pytest.raises(ValueError):
            ReferenceWriter(io.BytesIO(), **fields)  # type: ignore[arg-type]


def test_buffer_above_frame_limit_is_refused_before_writing() -> None:
    try:
        # An untouched anonymous mapping costs no memory.
        huge = mmap.mmap(-1, 2**31)
    except (OSError, OverflowError, MemoryError):
        pytest.skip("cannot map 2 GiB of address space")
    out = io.BytesIO()
    writer = ReferenceWriter(out, codec=1, file_id=FILE_ID)
    with pytest.raises(ValueError):
        writer.append(0, huge)
    huge.close()
    assert len(out.getvalue()) == ref.HEADER_SIZE, "a refused append wrote bytes"
    writer.append(0, b"after")
    writer.close()
    assert read_whole(out.getvalue(), PATH) == [(0, 0, b"after")]


def test_closed_writer_refuses_appends() -> None:
    out = io.BytesIO()
    writer = ReferenceWriter(out, file_id=FILE_ID)
    writer.append(1, b"a")
    summary = writer.close()
    assert writer.close() is summary
    with pytest.raises(ClosedError):
        writer.append(1, b"b")
    assert read_whole(out.getvalue(), PATH) == [(1, 0, b"a")]


def test_exception_in_context_leaves_file_unclosed() -> None:
    out = io.BytesIO()
    with pytest.raises(KeyError), ReferenceWriter(out, file_id=FILE_ID) as writer:
        writer.append(1, b"persisted")
        raise KeyError("operator failed")
    with pytest.raises(ClosedError):
        writer.append(1, b"b")
    expect(TruncatedFileError, out.getvalue())


# -------------------------------------------------------------------------- fuzz


def test_fuzzed_files_read_back_or_are_refused() -> None:
    fuzz_reader(read_whole, max_examples=250)


def test_fuzzed_files_streaming() -> None:
    fuzz_reader(read_streaming, max_examples=60)


@pytest.mark.parametrize("name", ["three_channels.spill", "lz4.spill", "output_gate.spill"])
def test_every_cut_is_truncated(name: str) -> None:
    (case,) = [c for c in GOLDEN if c.name == name]
    check_every_cut_truncated(read_whole, case.path.read_bytes())


# ------------------------------------------------------------------ state header

THREE = next(c for c in GOLDEN if c.name == "three_channels.spill")
VALID = THREE.path.read_bytes()
VALID_FRAMES = read_state_file(VALID)[1]


def test_bad_magic() -> None:
    expect(BadMagicError, b"GIF89a" + VALID[6:], offset=0)
    expect(BadMagicError, b"hello", offset=0)
    expect(BadMagicError, b"PK\x03\x04" + bytes(200), offset=0)


def test_text_mode_transfer_breaks_the_magic() -> None:
    expect(BadMagicError, VALID.replace(b"\r\n", b"\n"), offset=0)
    expect(BadMagicError, VALID.replace(b"\n", b"\r\n"), offset=0)


def test_unsupported_version_names_both_versions() -> None:
    for data in (patch(VALID, 8, b"\x02\x00"), patch(VALID, 8, b"\x02\x00", fix_header_crc=False)):
        error = expect(UnsupportedVersionError, data, offset=8)
        assert "version 2" in str(error) and "version 1" in str(error)
    # Checked before the length, as a future header may be shorter.
    expect(UnsupportedVersionError, VALID[:8] + b"\x02\x00", offset=8)
    expect(UnsupportedVersionError, patch(VALID, 8, b"\x00\x00"), offset=8)


@pytest.mark.parametrize(
    ("offset", "new", "error_offset"),
    [
        (10, b"\x41\x00", 10),  # header_length 65
        (12, b"\x01", 12),  # unknown flag
        (15, b"\x80", 12),  # unknown flag, high bit
        (32, b"\x02", 32),  # gate_kind
        (33, b"\x02", 33),  # codec
        (34, b"\x01", 34),  # reserved
        (39, b"\xff", 39),  # reserved
        (56, b"\x01", 56),  # reserved
        (59, b"\x01", 59),  # reserved
    ],
)
def test_header_field_refused(offset: int, new: bytes, error_offset: int) -> None:
    """Each field is refused even when the header CRC was recomputed to match."""
    expect(CorruptHeaderError, patch(VALID, offset, new), offset=error_offset)


def test_header_crc_mismatch() -> None:
    expect(CorruptHeaderError, flip(VALID, 60), offset=60)
    # A changed checkpoint id with a stale CRC.
    expect(CorruptHeaderError, patch(VALID, 16, b"\x2b", fix_header_crc=False), offset=60)


def test_header_unpack_alone() -> None:
    assert StateHeader.unpack(VALID) == StateHeader(**THREE.header)
    with pytest.raises(TruncatedFileError) as info:
        StateHeader.unpack(VALID[:40], path=PATH)
    assert (info.value.path, info.value.offset) == (PATH, 40)


# ------------------------------------------------------------------------ frames


def test_payload_flip_names_the_frame() -> None:
    for frame, golden in zip(VALID_FRAMES, THREE.frames, strict=True):
        if not golden.payload:
            continue
        payload_at = frame.offset + ref.FRAME_HEADER_SIZE
        last = payload_at + len(golden.payload) - 1
        for where in (payload_at, last):
            expect(CorruptFrameError, flip(VALID, where, 0x40), offset=frame.offset)


def test_frame_header_flip_names_the_frame() -> None:
    frame = VALID_FRAMES[2]
    for where in range(frame.offset, frame.offset + ref.FRAME_HEADER_SIZE):
        expect(CorruptHeaderError, flip(VALID, where), offset=frame.offset)


@pytest.mark.parametrize(
    "bad",
    [
        frame_bytes(1, 2, 0, b"abc"),  # unknown data type
        frame_bytes(1, 255, 0, b"abc"),  # trailer before the end
        frame_bytes(1, 0, 2, b"abc"),  # unknown codec
        frame_bytes(1, 0, 0, b"abc", flags=1),  # unknown flag
        frame_bytes(1, 0, 0, b"abc", flags=0x8000),  # unknown flag
        frame_bytes(1, 0, 0, b"abc", raw_length=4),  # codec none, raw != stored
        frame_bytes(1, 0, 1, b"\x20abc", raw_length=3),  # lz4, stored > raw
        frame_bytes(1, 0, 1, b"\x20abc", raw_length=2**31),  # above the limit
        frame_bytes(1, 0, 0, b"abc", stored_length=10, raw_length=10),  # runs into trailer
    ],
)
def test_bad_frame_header_refused(bad: bytes) -> None:
    # The trailer agrees with the bad frame's lengths, so only the frame check can fire.
    good = frame_bytes(0, 0, 0, b"ok")
    expect(CorruptHeaderError, state_file([good, bad]), offset=ref.HEADER_SIZE + len(good))


@pytest.mark.parametrize(
    "bad",
    [
        frame_bytes(1, 0, 1, b"\xff\xff\xff", raw_length=100),  # not an lz4 block
        frame_bytes(1, 0, 1, b"\x30abc", raw_length=5),  # decodes to 3 bytes, not 5
        frame_bytes(1, 0, 1, b"", raw_length=0),  # empty lz4 block
    ],
)
def test_bad_lz4_payload_refused(bad: bytes) -> None:
    good = frame_bytes(0, 0, 0, b"ok")
    expect(CorruptFrameError, state_file([good, bad]), offset=ref.HEADER_SIZE + len(good))


def test_frames_must_tile_the_file() -> None:
    good = frame_bytes(0, 0, 0, b"ok")
    data = state_file([good, b"\x00" * 10], counts=(1, 2, 2))
    expect(CorruptHeaderError, data, offset=ref.HEADER_SIZE + len(good))


def test_hand_made_lz4_frame_with_equal_lengths_is_read() -> None:
    payload = b"abcdefgh" * 8
    block = lz4.block.compress(payload, store_size=False)
    data = state_file([frame_bytes(3, 1, 1, block, raw_length=len(payload))])
    assert read_whole(data, PATH) == [(3, 1, payload)]


# ----------------------------------------------------------------------- trailer


def test_trailer_file_id_mismatch_is_corrupt() -> None:
    body_at = len(VALID) - 40
    foreign = VALID[:body_at] + struct.pack(
        "<QQQ16s", THREE.frame_count, THREE.raw_bytes, THREE.stored_bytes, bytes(16)
    )
    fixed = foreign[: len(VALID) - 64] + frame_bytes(0xFFFFFFFF, 255, 0, foreign[body_at:])
    expect(CorruptHeaderError, fixed, offset=len(VALID) - 64)


@pytest.mark.parametrize("field", [0, 1, 2])
def test_trailer_counts_must_match(field: int) -> None:
    count, raw, stored = (
        value + (field == i)
        for i, value in enumerate((THREE.frame_count, THREE.raw_bytes, THREE.stored_bytes))
    )
    trailer = trailer_bytes(count, raw, stored, file_id=THREE.header["file_id"])
    data = VALID[:-64] + trailer
    expect(CorruptHeaderError, data, offset=len(VALID) - 64)


def test_missing_frame_is_refused() -> None:
    second, third = VALID_FRAMES[1], VALID_FRAMES[2]
    data = VALID[: second.offset] + VALID[third.offset :]
    expect(CorruptHeaderError, data, offset=len(data) - 64)


def test_damaged_trailer_is_corrupt_not_truncated() -> None:
    start = len(VALID) - 64
    for where in range(start, len(VALID)):
        expect(CorruptHeaderError, flip(VALID, where), offset=start)
    # Valid checksums, wrong fixed fields.
    trailer = frame_bytes(0xFFFFFFFF, 255, 1, VALID[-40:])
    expect(CorruptHeaderError, VALID[:start] + trailer, offset=start)


def test_garbage_after_trailer_is_truncated() -> None:
    expect(TruncatedFileError, VALID + b"\x00")
    expect(TruncatedFileError, VALID + bytes(64))
    expect(TruncatedFileError, VALID + VALID[:64])


def test_header_without_trailer_is_truncated() -> None:
    expect(TruncatedFileError, VALID[:64], offset=64)
    expect(TruncatedFileError, b"", offset=0)


# ------------------------------------------------------------------- file access


def test_errors_name_the_file_on_disk(tmp_path: Path) -> None:
    target = tmp_path / "in-00003.spill"
    target.write_bytes(flip(VALID, VALID_FRAMES[0].offset + 24))
    with open(target, "rb") as f, pytest.raises(CorruptFrameError) as info:
        read_state_file(f)
    assert info.value.path == str(target)
    assert info.value.offset == VALID_FRAMES[0].offset


def test_streaming_checks_header_and_trailer_before_any_frame() -> None:
    with pytest.raises(TruncatedFileError):
        iter_frames(io.BytesIO(VALID[:-1]), path=PATH)
    frames = iter_frames(io.BytesIO(VALID), path=PATH)
    first = next(frames)
    assert first == Frame(0, 0, 0, b"hello", 64)


def test_io_errors_become_storage_errors() -> None:
    class Failing(io.BytesIO):
        def read(self, size: int | None = -1) -> bytes:
            raise OSError(5, "Input/output error")

    with pytest.raises(StorageError) as info:
        read_state_file(Failing(VALID), path=PATH)
    assert info.value.errno == 5
    assert info.value.path == PATH


def test_failed_write_abandons_the_file() -> None:
    class FullDisk(io.BytesIO):
        def write(self, data: Any) -> int:
            if len(self.getvalue()) > 100:
                raise OSError(28, "No space left on device")
            return super().write(data)

    out = FullDisk()
    writer = ReferenceWriter(out, file_id=FILE_ID)
    writer.append(0, b"x" * 40)
    with pytest.raises(OSError):
        writer.append(0, b"y" * 40)
    with pytest.raises(ClosedError):
        writer.close()
    expect(TruncatedFileError, out.getvalue())
