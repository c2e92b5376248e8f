"""Shared checks for any reader of state-file format v1 (helpers, not tests).

A reader is a function ``read(data: bytes, path: str) -> [(channel_id,
data_type, payload)]``; a writer is ``write(frames, codec) -> bytes``. The
reference tests and the native reader's tests run the same checks:

- :func:`check_golden`: the reader reads every golden file back exactly;
- :func:`fuzz_reader`: a mutated valid file is either read back exactly or
  refused with a ``SpilloverError``, never another exception or wrong data;
- :func:`check_every_cut_truncated`: every strict prefix of a file is a
  ``TruncatedFileError``.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spillover.errors import SpilloverError, TruncatedFileError

FrameTuple = tuple[int, int, bytes]
Reader = Callable[[bytes, str], list[FrameTuple]]
Writer = Callable[[list[FrameTuple], int], bytes]

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden"
MAX_BUFFER = 70 * 1024


# ------------------------------------------------------------------ golden files


def payload_from_recipe(recipe: dict[str, Any]) -> bytes:
    """The bytes a manifest payload recipe stands for (see ``tests/golden/README.md``)."""
    if "hex" in recipe:
        return bytes.fromhex(recipe["hex"])
    if "repeat_hex" in recipe:
        return bytes.fromhex(recipe["repeat_hex"]) * int(recipe["times"])
    if "sha256_stream" in recipe:
        seed, length = recipe["sha256_stream"].encode(), int(recipe["length"])
        blocks = (
            hashlib.sha256(seed + i.to_bytes(4, "little")).digest() for i in range(length // 32 + 1)
        )
        return b"".join(blocks)[:length]
    raise ValueError(f"unknown payload recipe {recipe!r}")


@dataclass(frozen=True)
class GoldenFrame:
    channel_id: int
    data_type: int
    codec: int  # as stored in the file
    payload: bytes


@dataclass(frozen=True)
class GoldenFile:
    name: str
    path: Path
    header: dict[str, Any]  # file_id as bytes
    frames: list[GoldenFrame]
    size: int
    sha256: str
    frame_count: int
    raw_bytes: int
    stored_bytes: int

    def frame_tuples(self) -> list[FrameTuple]:
        return [(f.channel_id, f.data_type, f.payload) for f in self.frames]


def load_golden(directory: Path = GOLDEN_DIR) -> list[GoldenFile]:
    """The golden files described by ``manifest.json``, payloads decoded."""
    manifest = json.loads((directory / "manifest.json").read_text())
    files = []
    for entry in manifest["files"]:
        header = dict(entry["header"])
        header["file_id"] = bytes.fromhex(header["file_id"])
        frames = [
            GoldenFrame(
                f["channel_id"], f["data_type"], f["codec"], payload_from_recipe(f["payload"])
            )
            for f in entry["frames"]
        ]
        files.append(
            GoldenFile(
                name=entry["name"],
                path=directory / entry["name"],
                header=header,
                frames=frames,
                size=entry["size"],
                sha256=entry["sha256"],
                frame_count=entry["frame_count"],
                raw_bytes=entry["raw_bytes"],
                stored_bytes=entry["stored_bytes"],
            )
        )
    return files


def check_golden(read: Reader, directory: Path = GOLDEN_DIR) -> None:
    """Assert that ``read`` reads every golden file back to exactly its manifest frames."""
    golden = load_golden(directory)
    assert golden, "no golden files"
    for case in golden:
        data = case.path.read_bytes()
        assert len(data) == case.size, case.name
        assert hashlib.sha256(data).hexdigest() == case.sha256, case.name
        assert read(data, str(case.path)) == case.frame_tuples(), case.name


# --------------------------------------------------------------------- strategies


@st.composite
def _large_payloads(draw: st.DrawFn) -> bytes:
    size = draw(st.integers(0, MAX_BUFFER))
    kind = draw(st.sampled_from(["random", "zeros", "pattern"]))
    if kind == "zeros":
        return bytes(size)
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    if kind == "random":
        return rng.randbytes(size)
    pattern = rng.randbytes(rng.randint(1, 64))
    return (pattern * (size // len(pattern) + 1))[:size]


def payloads() -> st.SearchStrategy[bytes]:
    """Buffers from 0 bytes to ~70 KiB: random (incompressible) or repetitive (compressible)."""
    return st.one_of(st.binary(max_size=64), _large_payloads())


def channel_ids() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(0, 7), st.integers(0, 2**32 - 1))


def frame_lists(max_frames: int = 6) -> st.SearchStrategy[list[FrameTuple]]:
    """Lists of ``(channel_id, data_type, payload)`` to append, in order."""
    frame = st.tuples(channel_ids(), st.sampled_from([0, 1]), payloads())
    return st.lists(frame, max_size=max_frames)


@dataclass(frozen=True)
class Mutation:
    description: str
    data: bytes


@st.composite
def mutations(draw: st.DrawFn, original: bytes) -> Mutation:
    """One damage to ``original``: a byte flipped, bytes inserted or deleted, a cut, garbage."""
    n = len(original)
    kind = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "append", "overwrite"]))
    if kind == "flip":
        # Bias towards the state header and the trailer, where the structure is.
        offset = draw(
            st.one_of(st.integers(0, min(n, 64) - 1), st.integers(max(0, n - 64), n - 1))
            | st.integers(0, n - 1)
        )
        mask = draw(st.integers(1, 255))
        data = bytearray(original)
        data[offset] ^= mask
        return Mutation(f"flip byte {offset} with mask {mask:#04x}", bytes(data))
    if kind == "insert":
        offset = draw(st.integers(0, n))
        extra = draw(st.binary(min_size=1, max_size=32))
        return Mutation(
            f"insert {extra.hex()} at {offset}", original[:offset] + extra + original[offset:]
        )
    if kind == "delete":
        start = draw(st.integers(0, n - 1))
        length = draw(st.integers(1, min(n - start, 96)))
        return Mutation(
            f"delete {length} bytes at {start}", original[:start] + original[start + length :]
        )
    if kind == "truncate":
        length = draw(st.integers(0, n - 1))
        return Mutation(f"truncate to {length} bytes", original[:length])
    if kind == "append":
        extra = draw(st.binary(min_size=1, max_size=96))
        return Mutation(f"append {extra.hex()}", original + extra)
    start = draw(st.integers(0, n - 1))
    garbage = draw(st.binary(min_size=1, max_size=min(n - start, 32)))
    end = start + len(garbage)
    return Mutation(
        f"overwrite {len(garbage)} bytes at {start}", original[:start] + garbage + original[end:]
    )


# ------------------------------------------------------------------------ checks


def check_read(
    read: Reader, data: bytes, expected: list[FrameTuple], path: str, what: str = ""
) -> SpilloverError | None:
    """Assert that ``read(data)`` returns exactly ``expected`` or raises a ``SpilloverError``.

    Returns the error raised, or ``None`` when the frames came back intact.
    """
    try:
        frames = read(data, path)
    except SpilloverError as exc:
        return exc
    except Exception as exc:
        raise AssertionError(f"{what}: reader raised {type(exc).__name__}: {exc}") from exc
    assert frames == expected, f"{what}: reader returned different frames"
    return None


def reference_writer() -> Writer:
    """A writer that uses the pure-Python reference implementation."""
    import io

    from spillover.storage.reference import ReferenceWriter

    def write(frames: list[FrameTuple], codec: int) -> bytes:
        out = io.BytesIO()
        writer = ReferenceWriter(out, codec=codec, file_id=bytes(range(16)))
        for channel_id, data_type, payload in frames:
            writer.append(channel_id, payload, data_type)
        writer.close()
        return out.getvalue()

    return write


def fuzz_reader(
    read: Reader,
    write: Writer | None = None,
    *,
    max_examples: int = 200,
    path: str = "fuzzed.spill",
) -> None:
    """Damage valid files in many ways; ``read`` must return the original frames or refuse."""
    write = write or reference_writer()

    @settings(
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(frames=frame_lists(), codec=st.sampled_from([0, 1]), data=st.data())
    def run(frames: list[FrameTuple], codec: int, data: st.DataObject) -> None:
        original = write(frames, codec)
        assert read(original, path) == frames, "the undamaged file does not read back"
        mutation = data.draw(mutations(original), label="mutation")
        error = check_read(read, mutation.data, frames, path, mutation.description)
        if error is not None:
            assert error.path == path, f"{mutation.description}: {error!r} does not name the file"
            assert error.offset is not None, f"{mutation.description}: {error!r} has no offset"

    run()


def check_every_cut_truncated(read: Reader, data: bytes, path: str = "cut.spill") -> None:
    """Every strict prefix of the valid file ``data`` must be refused as truncated."""
    for length in range(len(data)):
        error = check_read(read, data[:length], [], path, f"cut to {length} bytes")
        assert isinstance(error, TruncatedFileError), f"cut to {length} bytes gave {error!r}"
        assert error.path == path and error.offset is not None
