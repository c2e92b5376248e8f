"""Fuzz target: the native reader of state-file format v1 against the reference reader.

Every input is read by the pure-Python reference reader and by the native retriever,
one of two ways (half of the inputs each, by their CRC): a local file read ahead by
the native thread, buffer by buffer, or the same file through a pyarrow filesystem,
read in Python and scanned natively, block by block as ``FrameArrays``. The two
readers must agree: both read the same frames, or both refuse with a
``SpilloverError``. A recipe input (see ``_harness``) is written by the native writer
and must read back exactly in both readers, through its handle and by channel range,
and be refused as truncated when cut (by the other way of the native reader).

    python fuzz/fuzz_native_reader.py [libFuzzer flags] [corpus directories]
"""

from __future__ import annotations

import zlib
from typing import Any

import pyarrow.fs as pafs

from _fuzzing import FUZZ_DIR, instrumented, main

with instrumented(__name__):
    import _harness as h
    import spillover
    from spillover.storage.handle import GateStateHandle

DEFAULTS = {"-max_len": "8192", "-timeout": "30", "-dict": str(FUZZ_DIR / "dicts" / "spill.dict")}
OPTS: dict[str, Any] = {"read_block_bytes": 4096, "read_ahead_bytes": 8192}
_arrow = pafs.LocalFileSystem()


def native_read(source: str | GateStateHandle, *, arrow: bool = False) -> list[h.FrameTuple]:
    """Every frame of a state file through the native retriever: the native read-ahead
    thread buffer by buffer, or (``arrow``) Python reads and native scans, in blocks."""
    if arrow:
        uri = source.uri if isinstance(source, GateStateHandle) else source
        with spillover.open_retriever(uri, filesystem=_arrow, **OPTS) as r:
            return [f for arrays in r.iter_frames() for f in h.frames_of(arrays)]
    with spillover.open_retriever(source, **OPTS) as r:
        return [(b.channel_id, b.data_type, bytes(b)) for b in r]


def check_file(data: bytes) -> None:
    """The native reader agrees with the reference reader on ``data``."""
    path = h.scratch() / "in-00000.spill"
    path.write_bytes(data)
    expected = h.outcome(h.reference_read, data)
    if isinstance(expected, spillover.SpilloverError):
        h.check_refusal(expected, "reference reader")
    arrow = use_arrow(data)
    got = h.outcome(native_read, str(path), arrow=arrow)
    h.agree(expected, got, "native reader" + (" (pyarrow)" if arrow else ""))


def use_arrow(data: bytes) -> bool:
    """Which way of the native reader reads an input: half of them each, always the
    same way for the same input."""
    return zlib.crc32(data) % 2 == 1


def check_round_trip(recipe: bytes) -> None:
    """The native writer's file from a recipe reads back exactly, every way."""
    r = h.Recipe(recipe)
    lz4 = bool(r.int(0, 1))
    blocking = bool(r.int(0, 1))
    gate_id = r.int(0, 2**32 - 1)
    frames = h.frames_from_recipe(r)
    storage = spillover.open_storage(
        h.fresh_dir(),
        compression="lz4" if lz4 else None,
        blocking=blocking,
        checkpoint_id=r.int(0, 2**64 - 1),
        subtask_index=r.int(0, 2**32 - 1),
        batch_bytes=4096,
        pool_bytes=64 * 1024,
    )
    with storage.create_storer(gate_id) as storer:
        for channel_id, data_type, payload in frames:
            storer.append(channel_id, payload, data_type)
    handle = storer.close()
    with open(handle.uri, "rb") as f:
        data = f.read()
    if (handle.size, handle.frame_count) != (len(data), len(frames)):
        raise h.OracleError("the handle does not describe the file written")
    if GateStateHandle.from_dict(handle.to_dict()) != handle:
        raise h.OracleError("the handle does not survive to_dict/from_dict")
    h.reads_back(frames, h.outcome(h.reference_read, data), "reference reader")
    arrow = use_arrow(recipe)
    got = h.outcome(native_read, handle, arrow=arrow)
    h.reads_back(frames, got, "native reader" + (" (pyarrow)" if arrow else ""))
    if frames:
        channel = r.pick([c for c, _, _ in frames])
        with spillover.open_retriever(handle, channels=[channel], **OPTS) as ret:
            got = [(b.channel_id, b.data_type, bytes(b)) for b in ret if b.channel_id == channel]
        if got != [f for f in frames if f[0] == channel]:
            raise h.OracleError(f"reading channel {channel} by its byte range went wrong")
    cut = data[: r.int(0, len(data) - 1)]
    file_id = bytes.fromhex(handle.file_id)
    h.refused_cut(h.outcome(h.reference_read, cut), cut, file_id, "reference reader")
    cut_path = h.scratch() / "in-00000.spill"
    cut_path.write_bytes(cut)
    got = h.outcome(native_read, str(cut_path), arrow=not arrow)
    h.refused_cut(got, cut, file_id, "native reader")


def TestOneInput(data: bytes) -> None:
    with h.engine(pure=False):  # the native engine even where SPILLOVER_PURE=1 is set
        h.dispatch(data, check_file, check_round_trip)


if __name__ == "__main__":
    main(TestOneInput, DEFAULTS)
