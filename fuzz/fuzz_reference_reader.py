"""Fuzz target: the pure-Python reference reader of state-file format v1.

Every input is read from bytes (``read_state_file``), streamed from a file object
(``iter_frames``) and through the engine's pure-Python twin (``SPILLOVER_PURE=1``,
the retriever over the reference reader). They must agree, down to the class and
offset of a refusal, which must be a ``SpilloverError``. A recipe input (see
``_harness``) is written by the reference writer and must read back exactly in each,
and be refused as truncated when cut.

    python fuzz/fuzz_reference_reader.py [libFuzzer flags] [corpus directories]
"""

from __future__ import annotations

from _fuzzing import FUZZ_DIR, instrumented, main

with instrumented(__name__):
    import _harness as h
    import spillover

DEFAULTS = {"-max_len": "8192", "-timeout": "30", "-dict": str(FUZZ_DIR / "dicts" / "spill.dict")}


def pure_read(data: bytes) -> list[h.FrameTuple]:
    """Every frame through the engine's pure-Python twin, from a local file."""
    path = h.scratch() / "in-00000.spill"
    path.write_bytes(data)
    with h.engine(pure=True), spillover.open_retriever(str(path), read_block_bytes=4096) as r:
        return [(b.channel_id, b.data_type, bytes(b)) for b in r]


def check_file(data: bytes) -> None:
    """The reference reader's three ways agree on ``data``."""
    whole = h.outcome(h.reference_read, data)
    stream = h.outcome(h.reference_stream, data)
    if isinstance(whole, spillover.SpilloverError):
        h.check_refusal(whole, "read_state_file")
        if not isinstance(stream, spillover.SpilloverError) or (
            type(stream),
            stream.offset,
        ) != (type(whole), whole.offset):
            raise h.OracleError(f"iter_frames gave {stream!r}, read_state_file {whole!r}")
    else:
        h.agree(whole, stream, "iter_frames")
    h.agree(whole, h.outcome(pure_read, data), "the pure-Python retriever")


def check_round_trip(recipe: bytes) -> None:
    """The reference writer's file from a recipe reads back exactly, every way."""
    r = h.Recipe(recipe)
    codec = r.int(0, 1)
    file_id = r.bytes(16).ljust(16, b"\0")
    frames = h.frames_from_recipe(r)
    data = h.reference_write(frames, codec, file_id)
    cut = data[: r.int(0, len(data) - 1)]
    for what, read in READERS:
        h.reads_back(frames, h.outcome(read, data), what)
        h.refused_cut(h.outcome(read, cut), cut, file_id, what)


READERS = (
    ("read_state_file", h.reference_read),
    ("iter_frames", h.reference_stream),
    ("the pure-Python retriever", pure_read),
)


def TestOneInput(data: bytes) -> None:
    h.dispatch(data, check_file, check_round_trip)


if __name__ == "__main__":
    main(TestOneInput, DEFAULTS)
