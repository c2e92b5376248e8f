"""Fuzz target: checkpoint metadata (``check_metadata``, ``read_checkpoint``,
``load_checkpoint``).

An input is the ``_metadata`` file of a checkpoint directory ``<job>/chk-1``, read
with ``read_checkpoint``; when it is JSON, ``check_metadata`` also checks the decoded
value. An input starting with a zero byte is instead a path (the rest, as UTF-8 with
surrogate escapes) below a directory that holds a valid checkpoint, given to
``read_checkpoint``. Each call must return or raise a ``SpilloverError``; metadata
that reads is a dict of the checkpoint format, in a version this reader reads, from
the ``_metadata`` file of the directory named, and ``load_checkpoint`` gives it as
one ``CheckpointMetadata`` or raises a ``SpilloverError``.

    python fuzz/fuzz_metadata.py [libFuzzer flags] [corpus directories]
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from _fuzzing import FUZZ_DIR, instrumented, main

with instrumented(__name__):
    import _harness as h
    from spillover.errors import SpilloverError
    from spillover.runtime.checkpointing.checkpoint_meta import CheckpointMetadata
    from spillover.runtime.checkpointing.metadata import (
        METADATA_FILE,
        METADATA_FORMAT,
        METADATA_VERSION,
        check_metadata,
        load_checkpoint,
        new_metadata,
        read_checkpoint,
    )

DEFAULTS = {"-max_len": "4096", "-timeout": "30", "-dict": str(FUZZ_DIR / "dicts" / "json.dict")}

VALID = json.dumps(
    new_metadata(
        job_name="job",
        checkpoint_id=1,
        trigger_ms=0,
        fingerprint="f",
        settings={"max-parallelism": 128},
        tasks={},
        final=False,
    ).to_json()
).encode()


def check_read(path: str) -> None:
    meta = h.outcome(read_checkpoint, path)
    if isinstance(meta, SpilloverError):
        return
    if not isinstance(meta, dict) or meta.get("format") != METADATA_FORMAT:
        raise h.OracleError("read_checkpoint returned what is not checkpoint metadata")
    version = meta.get("version")
    if not isinstance(version, int) or not 1 <= version <= METADATA_VERSION:
        raise h.OracleError(f"read_checkpoint accepted version {meta.get('version')!r}")
    if not os.path.isfile(os.path.join(path, METADATA_FILE)):
        raise h.OracleError(f"read_checkpoint({path!r}) read the metadata of another directory")
    typed = h.outcome(load_checkpoint, path)  # the typed value, or one SpilloverError
    if not isinstance(typed, SpilloverError | CheckpointMetadata):
        raise h.OracleError("load_checkpoint returned what is not CheckpointMetadata")


def checkpoint_dir() -> Path:
    """``<scratch>/job/chk-1``, made once; each input writes its ``_metadata``."""
    chk = h.scratch() / "job" / "chk-1"
    chk.mkdir(parents=True, exist_ok=True)
    return chk


def TestOneInput(data: bytes) -> None:
    chk = checkpoint_dir()
    if data[:1] == b"\0":
        (chk / METADATA_FILE).write_bytes(VALID)
        check_read(f"{chk.parent.parent}/{data[1:].decode('utf-8', 'surrogateescape')}")
        return
    (chk / METADATA_FILE).write_bytes(data)
    check_read(str(chk))
    try:
        meta = json.loads(data)
    except (ValueError, RecursionError):
        return  # not JSON: read_checkpoint refused it above
    h.outcome(check_metadata, meta, "_metadata")


if __name__ == "__main__":
    main(TestOneInput, DEFAULTS)
