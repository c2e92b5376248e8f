"""Writes the seed corpora, ``fuzz/corpus/<target>/``: small valid inputs of each target.

    .venv/bin/python fuzz/make_corpus.py

The state-file targets start from the golden files (``tests/golden``), a golden file
in the checksum-fixing mode and a few writer recipes; the others from what spillover
itself writes (a state handle and a piece, checkpoint metadata, event logs, a lease).
The output is the same on every run.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

FUZZ_DIR = Path(__file__).resolve().parent
ROOT = FUZZ_DIR.parent
GOLDEN = ROOT / "tests" / "golden"
sys.path.insert(0, str(ROOT / "src"))

from spillover.rescale.pieces import Piece, Reference  # noqa: E402
from spillover.runtime.checkpointing.checkpoint_meta import (  # noqa: E402
    ChannelStateMeta,
    OperatorMeta,
    SubtaskMeta,
)
from spillover.runtime.checkpointing.metadata import new_metadata  # noqa: E402
from spillover.runtime.jobevents import (  # noqa: E402
    CheckpointCompleted,
    GenerationEnded,
    GenerationStarted,
    JobEventLog,
    JobSubmitted,
    Lease,
    LeaseHolder,
    SavepointCompleted,
    SplitsAssigned,
    TaskFinished,
)
from spillover.runtime.jobevents.events import encode_event  # noqa: E402
from spillover.storage.handle import Codec, GateKind, GateStateHandle  # noqa: E402

SEPARATOR = b"@@segment@@"  # fuzz_event_log.py


def state_file_seeds() -> dict[str, bytes]:
    seeds = {f"golden-{p.name}": p.read_bytes() for p in sorted(GOLDEN.glob("*.spill"))}
    # 0x3e: checksum-fixing mode, every fix (see _harness.split_mode / fix_state_file).
    seeds["fixed-three_channels"] = b"\x3e" + (GOLDEN / "three_channels.spill").read_bytes()
    # An odd first byte other than 0x89: a writer recipe (_harness.frames_from_recipe).
    seeds["recipe-empty"] = b"\x01"
    return seeds


def enc(low: int, high: int, value: int) -> bytes:
    """What ``_harness.Recipe.int(low, high)`` reads as ``value``."""
    width = ((high - low).bit_length() + 7) // 8
    return (value - low).to_bytes(width, "little")


# Five frames: literal, event, 20 KB of a pattern (lz4 shrinks it; it spans read blocks),
# zeros on an arbitrary channel, incompressible bytes.
RECIPE_FRAMES = b"".join(
    [
        enc(0, 12, 5),
        *(enc(0, 1, 1), enc(0, 7, 0), enc(0, 1, 0), enc(0, 3, 0), enc(0, 64, 5), b"hello"),
        *(enc(0, 1, 1), enc(0, 7, 7), enc(0, 1, 1), enc(0, 3, 0), enc(0, 64, 2), b"\0\1"),
        *(enc(0, 1, 1), enc(0, 7, 1), enc(0, 1, 0), enc(0, 3, 1), enc(1, 16, 4), b"abcd"),
        enc(0, 20000, 20000),
        *(enc(0, 1, 0), enc(0, 2**32 - 1, 12345), enc(0, 1, 0), enc(0, 3, 2), enc(0, 9000, 5000)),
        *(enc(0, 1, 1), enc(0, 7, 2), enc(0, 1, 0), enc(0, 3, 3), enc(0, 2**32 - 1, 7)),
        enc(0, 9000, 3000),
    ]
)


def native_reader_seeds() -> dict[str, bytes]:
    seeds = state_file_seeds()
    # lz4, not blocking, gate 3, checkpoint 7, subtask 2; then channel 1's range, a cut.
    head = enc(0, 1, 1) + enc(0, 1, 0) + enc(0, 2**32 - 1, 3)
    head += enc(0, 2**64 - 1, 7) + enc(0, 2**32 - 1, 2)
    seeds["recipe-lz4"] = b"\x01" + head + RECIPE_FRAMES + enc(0, 4, 2) + b"\x64\x00"
    return seeds


def reference_reader_seeds() -> dict[str, bytes]:
    seeds = state_file_seeds()
    # lz4, file id 00 01 .. 0f; then a cut.
    seeds["recipe-lz4"] = b"\x01" + enc(0, 1, 1) + bytes(range(16)) + RECIPE_FRAMES + b"\x64\x00"
    return seeds


def handle() -> GateStateHandle:
    return GateStateHandle(
        uri="/checkpoints/job/chk-7/map-2/in-00003.spill",
        gate_id=3,
        gate_kind=GateKind.INPUT,
        checkpoint_id=7,
        subtask_index=2,
        file_id="00112233445566778899aabbccddeeff",
        size=679,
        frame_count=7,
        raw_bytes=383,
        stored_bytes=383,
        codec=Codec.LZ4,
        channels={0: (3, 120), 1: (2, 200), 2: (2, 63)},
        channel_ranges={0: (64, 400), 1: (200, 520), 2: (300, 615)},
    )


def handle_seeds() -> dict[str, bytes]:
    h = handle()
    old = h.to_dict()
    del old["channel_ranges"]
    section = replace(h, uri="/checkpoints/job/chk-7/channels/map-0.spill", offset=4096)
    return {
        "handle.json": json.dumps(h.to_dict()).encode(),
        "handle-without-ranges.json": json.dumps(old).encode(),
        "piece.json": json.dumps(Piece(h, 1, 17).to_dict()).encode(),
        # A gate in a shared file: a section at an offset (docs/format.md, "Shared files").
        "handle-section.json": json.dumps(section.to_dict()).encode(),
        "piece-section.json": json.dumps(Piece(section, 2, 5).to_dict()).encode(),
    }


def metadata_seeds() -> dict[str, bytes]:
    refs = (Reference(0, 1, (Piece(handle(), 1, 17),)),)
    subtask = SubtaskMeta(channel_state=ChannelStateMeta(references=refs))
    meta = new_metadata(
        job_name="job",
        checkpoint_id=8,
        trigger_ms=1700000000000,
        fingerprint="0f1e2d3c",
        settings={"max-parallelism": 128},
        tasks={"map": OperatorMeta({0: subtask}, 1)},
        final=False,
    )
    raw = replace(meta, completed_ms=1700000000250).to_json()
    return {
        "metadata.json": json.dumps(raw, indent=1, sort_keys=True).encode(),
        "path-checkpoint": b"\0job/chk-1",
        "path-not-a-checkpoint": b"\0job/chk-x",
    }


def event_log_seeds(work: Path) -> dict[str, bytes]:
    def input_of(directory: Path) -> bytes:
        chunks, seq = [], 0
        for path in sorted(directory.glob("events-*.log")):
            number = int(path.name[7:15])
            chunks.append(bytes([number - seq]) + path.read_bytes())
            seq = number
        return SEPARATOR.join(chunks)

    def new_log(name: str) -> JobEventLog:
        clock = iter(range(1700000000, 1700001000))
        log = JobEventLog.open(work / name, clock=lambda: float(next(clock)), compact_after=None)
        log._log_id = bytes(range(16))  # a fixed id: the same corpus on every run
        return log

    log = new_log("two-segments")
    log.append(JobSubmitted("job", "0f1e2d3c", 2, {"k": "v"}, "run-1"))
    log.append(GenerationStarted(0, 2, "start"))
    log.flush()
    log.append(TaskFinished("sink", 1, 0, ({"uri": "/x/out-00000.spill"},)))
    log.append(SplitsAssigned("source", {0: ("a", "b"), 1: ("c",)}))
    log.append(CheckpointCompleted(1, "/ckpt/job/chk-1/_metadata"))
    log.append(SavepointCompleted(2, "/savepoints/chk-2"))
    log.append(GenerationEnded(0, "finished"))
    log.flush()

    compacted = new_log("compacted")
    compacted.append(JobSubmitted("job", "0f1e2d3c", 1))
    compacted.append(CheckpointCompleted(3, "/ckpt/job/chk-3/_metadata"))
    compacted.flush()
    compacted.compact()
    compacted.append(GenerationStarted(1, 1, "restart", "/ckpt/job/chk-3", 4))
    compacted.flush()

    seeds = {name: input_of(work / name) for name in ("two-segments", "compacted")}
    # A JSON array of events, written as one segment by the target.
    events = [json.loads(encode_event(e.event, e.at)) for e in log.entries()]
    seeds["events.json"] = json.dumps(events).encode()
    # Checksum-fixing mode (bit 2 of each segment's first byte).
    seeds["two-segments-fixed"] = SEPARATOR.join(
        bytes([c[0] | 4]) + c[1:] for c in seeds["two-segments"].split(SEPARATOR)
    )
    return seeds


def lease_seeds() -> dict[str, bytes]:
    lease = Lease(LeaseHolder("worker-3", 4711, "9f0c" * 8), 1700000000.0, 1700000060.0)
    return {"lease.json": lease.to_bytes()}


def main() -> None:
    work = FUZZ_DIR / "corpus" / ".work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        corpora = {
            "native_reader": native_reader_seeds(),
            "reference_reader": reference_reader_seeds(),
            "handle": handle_seeds(),
            "metadata": metadata_seeds(),
            "event_log": event_log_seeds(work),
            "lease": lease_seeds(),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for target, seeds in corpora.items():
        directory = FUZZ_DIR / "corpus" / target
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        for name, data in seeds.items():
            (directory / name).write_bytes(data)
        size = sum(map(len, seeds.values()))
        print(f"{directory.relative_to(ROOT)}: {len(seeds)} inputs, {size} bytes")


if __name__ == "__main__":
    main()
