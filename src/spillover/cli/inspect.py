"""``spillover inspect``: summarise and verify state files, storage directories and checkpoints."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any

from spillover.cli.options import fmt_bytes
from spillover.errors import SpilloverError
from spillover.runtime.checkpointing.inspect import checkpoint_dirs, render, summarize
from spillover.storage.inspection import inspect_state_file, state_files


def cmd_inspect(args: argparse.Namespace) -> int:

    # `spillover inspect ... | head` ends quietly. Only while inspecting: a job's
    # driver must survive a write to a peer that died (EPIPE, not a signal).
    previous = signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        return _inspect(args)
    finally:
        signal.signal(signal.SIGPIPE, previous)


def _inspect(args: argparse.Namespace) -> int:

    checkpoints = checkpoint_dirs(args.path)
    if checkpoints:
        summaries = [summarize(d, verify=not args.no_verify) for d in checkpoints]
        if args.json:
            json.dump(summaries if len(summaries) > 1 else summaries[0], sys.stdout, indent=2)
            print()
        else:
            print("\n".join(render(x) for x in summaries))
        return 1 if any(x["problems"] for x in summaries) else 0
    reports: list[dict[str, Any]] = []
    failed = 0
    files = state_files(args.path)
    if not files:
        print(f"no state files (*.spill) under {args.path}", file=sys.stderr)
        return 1
    for uri in files:
        try:
            reports.append(inspect_state_file(uri, verify=not args.no_verify))
        except SpilloverError as e:
            failed += 1
            reports.append({"uri": uri, "error": type(e).__name__, "message": str(e)})
    if args.json:
        json.dump(reports if len(reports) > 1 else reports[0], sys.stdout, indent=2)
        print()
        return 1 if failed else 0
    for r in reports:
        if "error" in r:
            print(f"{r['uri']}: {r['error']}: {r['message']}")
            continue
        print(f"{r['uri']}  ({fmt_bytes(r['size'])})")
        print(
            f"  format v{r['format_version']}, checkpoint {r['checkpoint_id']}, "
            f"subtask {r['subtask_index']}, {r['gate_kind']} gate {r['gate_id']}, "
            f"codec {r['codec']}, file id {r['file_id']}"
        )
        ratio = r["raw_bytes"] / r["stored_bytes"] if r["stored_bytes"] else 1.0
        print(
            f"  {r['frame_count']} frames, {fmt_bytes(r['raw_bytes'])} raw, "
            f"{fmt_bytes(r['stored_bytes'])} stored ({ratio:.2f}x)"
        )
        if r["channels"]:
            cols = ("channel", 8), ("frames", 8), ("events", 7), ("raw", 12), ("stored", 12)
            print("  " + " ".join(f"{c:>{w}}" for c, w in cols) + f" {'lz4':>6}")
            for ch, c in r["channels"].items():
                print(
                    f"  {ch:>8} {c['frames']:>8} {c['events']:>7} "
                    f"{fmt_bytes(c['raw_bytes']):>12} {fmt_bytes(c['stored_bytes']):>12} "
                    f"{c['lz4_frames']:>6}"
                )
        verified = "every checksum verified" if r["checksums_verified"] else "checksums not checked"
        print(f"  ok: {verified}")
    return 1 if failed else 0


def add_parser(sub: Any) -> None:
    """Adds the command to the ``spillover`` parser."""
    p = sub.add_parser("inspect", help="summarise and verify state files")
    p.add_argument("path", help="a state file, or a storage directory (local path or URI)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--no-verify", action="store_true", help="skip payload checksums")
    p.set_defaults(func=cmd_inspect)
