"""What the fuzz targets share: a scratch directory, the readers of state-file format
v1 in one shape, the oracle's checks, and the decoding of a fuzz input into a file.

A reader is ``read(data) -> [(channel_id, data_type, payload)]`` (the shape of
``tests/support/format_fuzz.py``); every input either reads or is refused with a
``SpilloverError``, and any other exception escapes to atheris as a crash.

The first byte of a state-file target's input says how to use the rest:

- ``0x89`` (the magic's first byte): the input is the file, as it is;
- even: a file whose checksums are made right first (:func:`fix_state_file`; the
  byte's other bits say which), so mutations reach the checks behind the CRCs;
- any other odd byte: a recipe of frames (:func:`frames_from_recipe`) that a writer
  writes, and that must then read back exactly.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import random
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from spillover.errors import FormatError, SpilloverError, TruncatedFileError
from spillover.storage import reference

FrameTuple = tuple[int, int, bytes]
Outcome = list[FrameTuple] | SpilloverError
Reader = Callable[[bytes], list[FrameTuple]]
T = TypeVar("T")

MAGIC_BYTE = reference.MAGIC[0]
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# -------------------------------------------------------------------------- scratch

_scratch: Path | None = None
_counter = 0


def scratch() -> Path:
    """This process's scratch directory: under ``SPILLOVER_FUZZ_SCRATCH`` when set,
    else in memory (``/dev/shm``) where there is one. libFuzzer ends the process
    without Python's exit handlers, so the directories of processes that are gone
    are removed here, when the next one starts."""
    global _scratch
    if _scratch is None:
        parent = os.environ.get("SPILLOVER_FUZZ_SCRATCH") or (
            "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
        )
        os.makedirs(parent, exist_ok=True)
        for old in Path(parent).glob("spillover-fuzz-*-*"):
            pid = old.name.split("-")[2]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(old, ignore_errors=True)
        _scratch = Path(tempfile.mkdtemp(prefix=f"spillover-fuzz-{os.getpid()}-", dir=parent))
        atexit.register(shutil.rmtree, _scratch, True)
    return _scratch


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def fresh_dir() -> Path:
    """A new empty directory in the scratch directory; the previous one is removed."""
    global _counter
    root = scratch()
    shutil.rmtree(root / f"w{_counter}", ignore_errors=True)
    _counter += 1
    path = root / f"w{_counter}"
    path.mkdir()
    return path


@contextlib.contextmanager
def engine(*, pure: bool) -> Iterator[None]:
    """The native engine, or (``pure``) its pure-Python twin (``SPILLOVER_PURE=1``),
    for the storages and retrievers opened inside the block."""
    previous = os.environ.pop("SPILLOVER_PURE", None)
    if pure:
        os.environ["SPILLOVER_PURE"] = "1"
    try:
        yield
    finally:
        os.environ.pop("SPILLOVER_PURE", None)
        if previous is not None:
            os.environ["SPILLOVER_PURE"] = previous


# --------------------------------------------------------------------------- oracle


class OracleError(AssertionError):
    """What a fuzz target raises when the oracle fails (besides a foreign exception)."""


def outcome(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | SpilloverError:
    """``fn(*args, **kwargs)``, or the ``SpilloverError`` it raised; anything else escapes."""
    try:
        return fn(*args, **kwargs)
    except SpilloverError as e:
        return e


def check_refusal(error: SpilloverError, what: str) -> None:
    """A file's refusal names the file and the offset of the problem."""
    if isinstance(error, FormatError) and (error.path is None or error.offset is None):
        raise OracleError(f"{what}: {error!r} does not name the file and offset")


def agree(expected: Outcome, got: Outcome, what: str) -> None:
    """``got`` reads what ``expected`` reads, or both refuse the file."""
    if isinstance(got, SpilloverError):
        check_refusal(got, what)
    if isinstance(expected, list) and isinstance(got, list):
        if got != expected:
            raise OracleError(f"{what} read other frames than the reference reader")
    elif isinstance(expected, list):
        raise OracleError(f"{what} refused ({got!r}) a file the reference reader reads")
    elif isinstance(got, list):
        raise OracleError(f"{what} read a file the reference reader refuses ({expected!r})")


def reads_back(frames: list[FrameTuple], got: Outcome, what: str) -> None:
    """A file a writer wrote from ``frames`` reads back as exactly those."""
    if isinstance(got, SpilloverError):
        raise OracleError(f"{what} refused a file the writer wrote: {got!r}") from got
    if got != frames:
        raise OracleError(f"{what} read a written file back wrong")


def looks_like_trailer(data: bytes, file_id: bytes) -> bool:
    """Whether ``data`` ends in what a reader takes for a (perhaps damaged) trailer
    rather than a cut: its last 16 bytes are the file id, or its last 64 start with an
    intact frame header of the trailer's channel and type."""
    if len(data) < 128:
        return False
    tail = data[-64:]
    if tail[-16:] == file_id:
        return True
    intact = reference.crc32c(tail[:20]) == _U32.unpack_from(tail, 20)[0]
    return intact and tail[:5] == b"\xff" * 5


def refused_cut(got: Outcome, cut: bytes, file_id: bytes, what: str) -> None:
    """A strict prefix of a written file is refused: a ``TruncatedFileError``, unless
    the cut happens to end in bytes that look like a trailer (a payload holding the
    file id, say), which a reader refuses as a damaged trailer."""
    if not isinstance(got, SpilloverError):
        raise OracleError(f"{what} read a cut file")
    check_refusal(got, what)
    if not isinstance(got, TruncatedFileError) and not looks_like_trailer(cut, file_id):
        raise OracleError(f"{what}: a cut file gave {got!r}, not TruncatedFileError")


# ------------------------------------------------------------------ reference reader


def reference_read(data: bytes, path: str = "fuzzed.spill") -> list[FrameTuple]:
    """The pure-Python reference reader over bytes."""
    _, frames = reference.read_state_file(data, path=path)
    return [(f.channel_id, f.data_type, f.data) for f in frames]


def reference_stream(data: bytes, path: str = "fuzzed.spill") -> list[FrameTuple]:
    """The reference reader streaming from a file object."""
    frames = reference.iter_frames(io.BytesIO(data), path=path)
    return [(f.channel_id, f.data_type, f.data) for f in frames]


# ---------------------------------------------------------------------- input modes


def split_mode(data: bytes) -> tuple[str, int, bytes]:
    """``(mode, flags, rest)`` of a state-file target's input (see the module doc)."""
    if not data or data[0] == MAGIC_BYTE:
        return "raw", 0, data
    if data[0] % 2 == 0:
        return "fixed", data[0] >> 1, data[1:]
    return "recipe", data[0] >> 1, data[1:]


def fix_state_file(body: bytes, flags: int) -> bytes:
    """``body`` with its checksums recomputed, walking the frames its headers declare:
    bit 0 the state header's CRC, bit 1 every frame's header and payload CRCs, bit 2
    the trailer's; with bit 2, bit 3 also sets the trailer's sums to the frames found
    and bit 4 its file id to the header's."""
    b = bytearray(body)
    crc = reference.crc32c
    if flags & 1 and len(b) >= 64:
        b[60:64] = _U32.pack(crc(b[:60]))
    if len(b) < 128:
        return bytes(b)
    end = len(b) - 64
    off, frames, raw, stored = 64, 0, 0, 0
    while flags & 2 and end - off >= 24:
        stored_length, raw_length = struct.unpack_from("<II", b, off + 8)
        start = off + 24
        if start + stored_length <= end:
            b[off + 16 : off + 20] = _U32.pack(crc(b[start : start + stored_length]))
        b[off + 20 : off + 24] = _U32.pack(crc(b[off : off + 20]))
        frames, raw, stored = frames + 1, raw + raw_length, stored + stored_length
        off = start + stored_length
    if flags & 4:
        body_at = end + 24
        if flags & 8:
            b[body_at : body_at + 24] = struct.pack("<QQQ", frames, raw, stored)
        if flags & 16:
            b[body_at + 24 : body_at + 40] = b[40:56]
        b[end + 16 : end + 20] = _U32.pack(crc(b[body_at : body_at + 40]))
        b[end + 20 : end + 24] = _U32.pack(crc(b[end : end + 20]))
    return bytes(b)


class Recipe:
    """Reads numbers and bytes off a fuzz input; zeros once it is used up."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def bytes(self, n: int) -> bytes:
        out = self.data[self.pos : self.pos + n]
        self.pos += len(out)
        return out

    def int(self, low: int, high: int) -> int:
        """A number in ``[low, high]``."""
        span = high - low
        if span <= 0:
            return low
        width = (span.bit_length() + 7) // 8
        return low + int.from_bytes(self.bytes(width), "little") % (span + 1)

    def pick(self, values: Sequence[T]) -> T:
        return values[self.int(0, len(values) - 1)]


CHANNELS = (0, 1, 2, 3, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF)
MAX_RECIPE_BYTES = 96 * 1024


def frames_from_recipe(r: Recipe) -> list[FrameTuple]:
    """Up to 12 frames: literal, repetitive (compressible), zero or random payloads up to
    ~20 KB each (so files span several read blocks), on chosen or arbitrary channels."""
    frames: list[FrameTuple] = []
    total = 0
    for _ in range(r.int(0, 12)):
        channel = r.pick(CHANNELS) if r.int(0, 1) else r.int(0, 2**32 - 1)
        data_type = r.int(0, 1)
        kind = r.int(0, 3)
        if kind == 0:
            payload = r.bytes(r.int(0, 64))
        elif kind == 1:
            pattern = r.bytes(r.int(1, 16)) or b"\0"
            size = r.int(0, 20000)
            payload = (pattern * (size // len(pattern) + 1))[:size]
        elif kind == 2:
            payload = bytes(r.int(0, 9000))
        else:
            payload = random.Random(r.int(0, 2**32 - 1)).randbytes(r.int(0, 9000))
        total += len(payload)
        if total > MAX_RECIPE_BYTES:
            break
        frames.append((channel, data_type, payload))
    return frames


def reference_write(frames: list[FrameTuple], codec: int, file_id: bytes) -> bytes:
    """The file the reference writer writes from ``frames``."""
    out = io.BytesIO()
    writer = reference.ReferenceWriter(out, codec=codec, file_id=file_id)
    for channel_id, data_type, payload in frames:
        writer.append(channel_id, payload, data_type)
    summary = writer.close()
    data = out.getvalue()
    if summary["size"] != len(data) or summary["frame_count"] != len(frames):
        raise OracleError("the reference writer's summary does not match its file")
    return data


def frames_of(arrays: Any) -> list[FrameTuple]:
    """The frames of a ``FrameArrays`` as tuples."""
    data = arrays.data
    return [
        (
            int(arrays.channel_ids[i]),
            int(arrays.data_types[i]),
            bytes(data[int(arrays.offsets[i]) :][: int(arrays.lengths[i])]),
        )
        for i in range(len(arrays))
    ]


def dispatch(
    data: bytes, check_file: Callable[[bytes], None], check_round_trip: Callable[[bytes], None]
) -> None:
    """A reader target's input by its mode: a raw file, a file whose checksums are
    made right first, or a writer recipe (:func:`split_mode`)."""
    mode, flags, rest = split_mode(data)
    if mode == "raw":
        check_file(rest)
    elif mode == "fixed":
        check_file(fix_state_file(rest, flags))
    else:
        check_round_trip(rest)
