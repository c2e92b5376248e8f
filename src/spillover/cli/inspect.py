"""``spillover inspect``: summarise and verify state files, storage directories,
checkpoints and job event logs."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from datetime import UTC, datetime
from typing import Any

from spillover.cli.options import fmt_bytes
from spillover.errors import SpilloverError
from spillover.runtime.checkpointing.inspect import checkpoint_dirs, render, summarize
from spillover.runtime.jobevents import JobEventLog, JobLogState, LogEntry, is_event_log
from spillover.storage.inspection import inspect_state_file, shared_sections, state_files
from spillover.storage.location import Location


def cmd_inspect(args: argparse.Namespace) -> int:

    # `spillover inspect ... | head` ends quietly. Only while inspecting: a job's
    # driver must survive a write to a peer that died (EPIPE, not a signal).
    previous = signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        return _inspect(args)
    finally:
        signal.signal(signal.SIGPIPE, previous)


def _inspect(args: argparse.Namespace) -> int:

    log_dir = _event_log_dir(args.path)
    if log_dir is not None:
        return _inspect_event_log(log_dir, as_json=args.json)
    checkpoints = checkpoint_dirs(args.path)
    if checkpoints:
        summaries: list[dict[str, Any]] = []
        for d in checkpoints:
            try:
                summaries.append(summarize(d, verify=not args.no_verify))
            except SpilloverError as e:  # its metadata is damaged: what inspect reports
                summaries.append({"path": d, "error": type(e).__name__, "message": str(e)})
        if args.json:
            json.dump(summaries if len(summaries) > 1 else summaries[0], sys.stdout, indent=2)
            print()
        else:
            print(
                "\n".join(
                    f"{x['path']}: {x['error']}: {x['message']}" if "error" in x else render(x)
                    for x in summaries
                )
            )
        return 1 if any("error" in x or x["problems"] for x in summaries) else 0
    reports: list[dict[str, Any]] = []
    failed = 0
    files = state_files(args.path)
    if not files:
        print(f"no state files (*.spill) under {args.path}", file=sys.stderr)
        return 1
    for uri in files:
        # A shared file holds the gates of several subtasks: each is read as its own.
        sections = shared_sections(uri)
        for section in sections if sections is not None else [None]:
            try:
                reports.append(inspect_state_file(uri, verify=not args.no_verify, section=section))
            except SpilloverError as e:
                failed += 1
                where = {} if section is None else {"offset": section[0]}
                reports.append({"uri": uri, **where, "error": type(e).__name__, "message": str(e)})
    if args.json:
        json.dump(reports if len(reports) > 1 else reports[0], sys.stdout, indent=2)
        print()
        return 1 if failed else 0
    for r in reports:
        if "error" in r:
            print(f"{r['uri']}: {r['error']}: {r['message']}")
            continue
        at = f", section at byte {r['offset']}" if "offset" in r else ""
        print(f"{r['uri']}  ({fmt_bytes(r['size'])}{at})")
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


def _event_log_dir(path: str) -> Location | None:
    try:
        loc = Location.parse(path)
    except SpilloverError:
        return None
    return loc if is_event_log(loc) else None


def _inspect_event_log(directory: Location, *, as_json: bool) -> int:
    """Prints a job event log: one line per event, then what its replay says."""
    try:
        log = JobEventLog.open(directory)
    except SpilloverError as e:
        print(f"{directory.uri}: {type(e).__name__}: {e}")
        return 1
    entries, state = list(log.entries()), log.replay()
    if as_json:
        doc = {
            "log": directory.uri,
            "log_id": log.log_id,
            "events": [_entry_dict(e) for e in entries],
            "summary": _summary_dict(state),
            "warnings": log.warnings,
        }
        json.dump(doc, sys.stdout, indent=2)
        print()
        return 0
    print(f"job event log {directory.uri}  (log id {log.log_id}, {len(entries)} events)")
    for entry in entries:
        fields = " ".join(
            f"{k}={json.dumps(v, sort_keys=True)}" for k, v in entry.event.payload().items()
        )
        mark = " (snapshot)" if entry.snapshot else ""
        print(f"  #{entry.index:<5} {_when(entry.at)}  {entry.event.KIND}{mark}  {fields}")
    print("\n".join(_render_summary(state)))
    for w in log.warnings:
        print(f"  warning: {w}")
    return 0


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds")


def _entry_dict(e: LogEntry) -> dict[str, Any]:
    return {"index": e.index, "at": e.at, "kind": e.event.KIND, "snapshot": e.snapshot} | (
        e.event.payload()
    )


def _summary_dict(s: JobLogState) -> dict[str, Any]:
    def one(e: Any) -> Any:
        return None if e is None else e.payload()

    return {
        "status": s.status,
        "submitted": one(s.submitted),
        "generation": one(s.generation),
        "generation_end": one(s.generation_end),
        "checkpoint": one(s.checkpoint),
        "savepoints": [x.payload() for x in s.savepoints],
        "finished_tasks": [x.payload() for x in s.finished_tasks.values()],
        "splits": {uid: x.payload()["assignment"] for uid, x in s.splits.items()},
        "rescale": one(s.rescale),
        "terminal": one(s.terminal),
    }


def _render_summary(s: JobLogState) -> list[str]:
    lines = [f"  summary: {s.status}"]
    if s.submitted:
        sub = s.submitted
        lines.append(
            f"    job {sub.job_name!r}, graph {sub.graph_fingerprint}, "
            f"parallelism {sub.parallelism}" + (f", run {sub.run_id}" if sub.run_id else "")
        )
    if s.generation:
        g = s.generation
        ended = f", ended: {s.generation_end.cause}" if s.generation_end else ""
        restore = f", restores {g.restore_path}" if g.restore_path else ""
        lines.append(
            f"    generation {g.generation} at parallelism {g.parallelism} ({g.cause}){restore}"
            + ended
        )
    if s.checkpoint:
        c = s.checkpoint
        lines.append(f"    last completed checkpoint {c.checkpoint_id}: {c.metadata_path}")
    for sp in s.savepoints:
        lines.append(f"    savepoint {sp.savepoint_id}: {sp.path}")
    if s.rescale:
        r = s.rescale
        cause = f" ({r.cause})" if r.cause else ""
        lines.append(f"    rescale {r.from_parallelism} -> {r.to_parallelism}{cause}")
    if s.finished_tasks:
        tasks = sorted(s.finished_tasks)
        lines.append(
            f"    {len(tasks)} finished task(s): " + ", ".join(f"{u}-{i}" for u, i in tasks)
        )
    for uid, a in sorted(s.splits.items()):
        parts = ", ".join(f"{i}: {list(v)}" for i, v in sorted(a.assignment.items()))
        lines.append(f"    splits of {uid}: {{{parts}}}")
    if s.terminal:
        cause = f": {s.terminal.cause}" if s.terminal.cause else ""
        lines.append(f"    job {s.terminal.STATUS}{cause}")
    return lines


def add_parser(sub: Any) -> None:
    """Adds the command to the ``spillover`` parser."""
    p = sub.add_parser("inspect", help="summarise and verify state files and job event logs")
    p.add_argument(
        "path",
        help="a state file, a storage or checkpoint directory, or a job's event log "
        "directory (<checkpoints>/<job>/_events); a local path or URI. A directory that "
        "is no checkpoint is searched for *.spill files, subdirectories included",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--no-verify", action="store_true", help="skip payload checksums")
    p.set_defaults(func=cmd_inspect)
