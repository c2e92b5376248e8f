"""Write the golden state files of format v1 and their manifest into ``tests/golden/``.

The files come from the pure-Python reference writer with fixed file ids, so the
same input always gives the same bytes. ``--check`` rewrites nothing and fails
when the files in place differ from what this script would write.

Run from the repository root: ``PYTHONPATH=src python tools/make_golden.py [--check]``.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

from spillover.storage.reference import ReferenceWriter, read_state_file  # noqa: E402
from support.checkpoint_golden import GOLDEN_CHECKPOINTS, golden_files  # noqa: E402
from support.format_fuzz import GOLDEN_DIR, payload_from_recipe  # noqa: E402

DATA, EVENT = 0, 1

# Each case: header fields for the writer, then (channel_id, data_type, payload recipe).
CASES: list[dict[str, Any]] = [
    {
        "name": "empty.spill",
        "description": "an input gate with no buffers: header and trailer only",
        "header": {
            "checkpoint_id": 7,
            "subtask_index": 2,
            "gate_id": 3,
            "gate_kind": 0,
            "codec": 0,
            "file_id": "00112233445566778899aabbccddeeff",
        },
        "frames": [],
    },
    {
        "name": "three_channels.spill",
        "description": "data and event buffers on channels 0-2, one of them empty, no codec",
        "header": {
            "checkpoint_id": 42,
            "subtask_index": 1,
            "gate_id": 0,
            "gate_kind": 0,
            "codec": 0,
            "file_id": "a0a1a2a3a4a5a6a7a8a9aaabacadaeaf",
        },
        "frames": [
            (0, DATA, {"hex": "68656c6c6f"}),
            (1, DATA, {"hex": ""}),
            (2, EVENT, {"hex": "0000000100000000000000000000002a"}),
            (0, DATA, {"repeat_hex": "00010203", "times": 64}),
            (1, DATA, {"hex": "776f726c64"}),
            (2, DATA, {"sha256_stream": "three_channels", "length": 100}),
            (0, EVENT, {"hex": "ff"}),
        ],
    },
    {
        "name": "lz4.spill",
        "description": "codec lz4: compressible buffers stored as lz4, the rest as codec 0",
        "header": {
            "checkpoint_id": 43,
            "subtask_index": 0,
            "gate_id": 1,
            "gate_kind": 0,
            "codec": 1,
            "file_id": "4c5a344c5a344c5a344c5a344c5a344c",
        },
        "frames": [
            (0, DATA, {"repeat_hex": "61", "times": 4096}),
            (1, DATA, {"sha256_stream": "lz4-incompressible", "length": 3000}),
            (0, DATA, {"hex": "7879"}),
            (2, DATA, {"hex": ""}),
            (1, EVENT, {"repeat_hex": "000102030405060708090a0b0c0d0e0f", "times": 64}),
            # LZ4 gives a 27-byte block for these 27 bytes: not smaller, so codec 0.
            (2, DATA, {"hex": "646566676869616161616161c8c9cacbcccdcecfd0d1d2d3d4d5d6"}),
            (2, DATA, {"repeat_hex": "61", "times": 13}),
        ],
    },
    {
        "name": "output_gate.spill",
        "description": "an output gate with large checkpoint, subtask, gate and channel ids",
        "header": {
            "checkpoint_id": 0xFEDCBA9876543210,
            "subtask_index": 0xFFFFFFFE,
            "gate_id": 0x80000001,
            "gate_kind": 1,
            "codec": 0,
            "file_id": "0f0e0d0c0b0a09080706050403020100",
        },
        "frames": [
            (0xFFFFFFFF, DATA, {"hex": "deadbeef"}),
            (0x7FFFFFFF, EVENT, {"hex": "01"}),
            (0x80000000, DATA, {"sha256_stream": "output_gate", "length": 513}),
            (0xFFFFFFFF, DATA, {"hex": ""}),
        ],
    },
]


def build(case: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
    """The file's bytes and its manifest entry."""
    fields = dict(case["header"])
    fields["file_id"] = bytes.fromhex(fields["file_id"])
    out = io.BytesIO()
    writer = ReferenceWriter(out, **fields)
    for channel_id, data_type, recipe in case["frames"]:
        writer.append(channel_id, payload_from_recipe(recipe), data_type)
    summary = writer.close()
    data = out.getvalue()

    _, frames = read_state_file(data, path=case["name"])
    entry = {
        "name": case["name"],
        "description": case["description"],
        "header": case["header"],
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "frame_count": summary["frame_count"],
        "raw_bytes": summary["raw_bytes"],
        "stored_bytes": summary["stored_bytes"],
        "frames": [
            {
                "channel_id": channel_id,
                "data_type": data_type,
                "codec": frame.codec,
                "offset": frame.offset,
                "payload": recipe,
            }
            for (channel_id, data_type, recipe), frame in zip(case["frames"], frames, strict=True)
        ],
    }
    return data, entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("--out", type=Path, default=GOLDEN_DIR, help="target directory")
    args = parser.parse_args(argv)

    entries, stale = [], []
    for case in CASES:
        data, entry = build(case)
        entries.append(entry)
        target = args.out / case["name"]
        if args.check:
            if not target.exists() or target.read_bytes() != data:
                stale.append(case["name"])
        else:
            args.out.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    # Checkpoint metadata of every version (written with the state files' --out).
    checkpoints = args.out / GOLDEN_CHECKPOINTS.name
    for name, data in golden_files().items():
        target = checkpoints / name
        if args.check:
            if not target.exists() or target.read_bytes() != data:
                stale.append(f"{checkpoints.name}/{name}")
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    manifest = json.dumps({"format_version": 1, "files": entries}, indent=2) + "\n"
    manifest_path = args.out / "manifest.json"
    if args.check:
        if not manifest_path.exists() or manifest_path.read_text() != manifest:
            stale.append("manifest.json")
        for name in stale:
            print(f"stale: {name}", file=sys.stderr)
        return 1 if stale else 0
    manifest_path.write_text(manifest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
