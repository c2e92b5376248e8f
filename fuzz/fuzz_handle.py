"""Fuzz target: state handles (``GateStateHandle``) and channel-state pieces (``Piece``,
a handle with a channel and a skip) parsed from dicts, from JSON input.

An input that is a JSON object is parsed as both; each must parse or be refused with
a ``SpilloverError``, and what parses must survive ``to_dict()``, JSON and
``from_dict()`` unchanged.

    python fuzz/fuzz_handle.py [libFuzzer flags] [corpus directories]
"""

from __future__ import annotations

import json

from _fuzzing import FUZZ_DIR, instrumented, main

with instrumented(__name__):
    import _harness as h
    from spillover.errors import SpilloverError
    from spillover.rescale.pieces import Piece
    from spillover.storage.handle import GateStateHandle

DEFAULTS = {"-max_len": "2048", "-timeout": "30", "-dict": str(FUZZ_DIR / "dicts" / "json.dict")}


def check(parse: type[GateStateHandle] | type[Piece], d: dict[str, object]) -> None:
    parsed: GateStateHandle | Piece | SpilloverError = h.outcome(parse.from_dict, d)
    if isinstance(parsed, SpilloverError):
        return
    again = parse.from_dict(json.loads(json.dumps(parsed.to_dict())))
    if again != parsed:
        raise h.OracleError(f"a {parse.__name__} does not survive to_dict/from_dict")
    handle = parsed if isinstance(parsed, GateStateHandle) else parsed.handle
    handle.byte_range(list(handle.channels)[:3])
    if handle.offset is not None and handle.offset < 0:  # a section before the file
        raise h.OracleError("a handle with a negative offset parsed")
    if handle.offset is None and "offset" in handle.to_dict():
        raise h.OracleError("a handle of a file of its own writes an offset")


def TestOneInput(data: bytes) -> None:
    try:
        d = json.loads(data)
    except (ValueError, RecursionError):
        return  # not JSON: nothing of spillover's to test
    if not isinstance(d, dict):
        return  # from_dict takes a dict; its values may be anything
    check(GateStateHandle, d)
    check(Piece, d)


if __name__ == "__main__":
    main(TestOneInput, DEFAULTS)
