"""Summaries of checkpoint directories for ``spillover inspect``."""

from __future__ import annotations

import os
from typing import Any

from spillover.errors import SpilloverError
from spillover.rescale import KeepAll, KeyGroupFilter, PartitionerFilter, filter_from_dict
from spillover.runtime.checkpointing.checkpoint_meta import ChannelStateMeta
from spillover.runtime.checkpointing.metadata import METADATA_FILE, load_checkpoint
from spillover.storage.channel_index import resolve
from spillover.storage.inspection import inspect_state_file


def is_checkpoint_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA_FILE))


def checkpoint_dirs(path: str) -> list[str]:
    """``path`` itself when it is a checkpoint, else its ``chk-*`` checkpoints, oldest
    first, then the savepoints in it (``savepoint-*`` directories, also under a
    ``savepoints`` directory: where stop-with-savepoint writes them by default)."""
    if is_checkpoint_dir(path):
        return [path]
    if not os.path.isdir(path):
        return []
    names = os.listdir(path)
    found = [os.path.join(path, n) for n in names if n.startswith("chk-")]
    found = sorted(
        (d for d in found if is_checkpoint_dir(d)), key=lambda d: int(d.rsplit("-", 1)[1])
    )
    savepoints = [os.path.join(path, n) for n in sorted(names) if n.startswith("savepoint-")]
    if os.path.isdir(os.path.join(path, "savepoints")):
        inner = os.path.join(path, "savepoints")
        savepoints += [os.path.join(inner, n) for n in sorted(os.listdir(inner))]
    for sp in savepoints:
        if os.path.isdir(sp):
            found += [d for d in checkpoint_dirs(sp) if os.path.dirname(d) == sp]
    return found


def summarize(path: str, *, verify: bool = True) -> dict[str, Any]:
    """The metadata of one checkpoint plus, per subtask, its in-flight files read back
    and checked (every checksum when ``verify``)."""
    meta = load_checkpoint(os.path.abspath(path))
    subtasks = []
    total_inflight = total_state = 0
    problems = []
    for uid, entry in sorted(meta.tasks.items()):
        for idx, st in sorted(entry.subtasks.items()):
            cs = st.channel_state or ChannelStateMeta()
            gates = []
            for side, handles in (("input", cs.input), ("output", cs.output)):
                for h in handles:
                    try:  # its channel maps (metadata version 2 keeps them in the index)
                        h = resolve(h)
                    except SpilloverError as e:
                        problems.append(f"{uid}#{idx} {side} gate {h.gate_id}: {e}")
                    g = {
                        "kind": side,
                        "gate": h.gate_id,
                        "uri": h.uri,
                        "offset": h.offset,
                        "frames": h.frame_count,
                        "raw_bytes": h.raw_bytes,
                        "stored_bytes": h.stored_bytes,
                        "channels": len(h.channels),
                    }
                    try:
                        section = None if h.offset is None else (h.offset, h.size)
                        report = inspect_state_file(h.uri, verify=verify, section=section)
                        g["verified"] = report["frame_count"] == h.frame_count
                    except SpilloverError as e:
                        g["verified"] = False
                        problems.append(f"{uid}#{idx} {side} gate {h.gate_id}: {e}")
                    gates.append(g)
            refs = [
                {
                    "gate": r.gate,
                    "channel": r.channel,
                    "pieces": [(p.handle.uri, p.channel, p.skip) for p in r.pieces],
                    "filter": r.filter.to_dict() if r.filter is not None else None,
                }
                for r in cs.references
            ]
            state_bytes = int(st.metrics.get("state_bytes", 0))
            inflight = cs.bytes
            total_inflight += inflight
            total_state += state_bytes
            subtasks.append(
                {
                    "task": f"{uid}#{idx}",
                    "operators": sorted(st.operators),
                    "keyed_states": sorted(st.keyed),
                    "state_bytes": state_bytes,
                    "inflight_bytes": inflight,
                    "gates": gates,
                    "references": refs,
                }
            )
    return {
        "path": path,
        "checkpoint_id": meta.checkpoint_id,
        "job": meta.job,
        "final": meta.final,
        "savepoint": meta.is_savepoint,
        # FLIP-147: per operator, fully / partially finished or running
        "finished": {uid: e.finished for uid, e in sorted(meta.tasks.items())},
        "graph_fingerprint": meta.graph_fingerprint,
        "settings": dict(meta.settings),
        "trigger_ms": meta.trigger_ms,
        "completed_ms": meta.completed_ms,
        "inflight_bytes": total_inflight,
        "referenced_checkpoints": list(meta.references),
        "state_bytes": total_state,
        "subtasks": subtasks,
        "problems": problems,
    }


def _keeps(d: dict[str, Any] | None) -> str:
    """How a filtered reference's records are kept, for ``render``."""
    flt = filter_from_dict(d) if d else KeepAll()
    if isinstance(flt, KeyGroupFilter):
        return f", keeping key groups {flt.start}-{flt.end}"
    if isinstance(flt, PartitionerFilter):  # composed: every one of them keeps the record
        return "".join(
            f", keeping partition {c.index} of {c.parallelism} by partitioner {c.name}"
            for c in flt.choices
        )
    return ""


def render(s: dict[str, Any]) -> str:
    lines = [
        f"{'savepoint' if s.get('savepoint') else 'checkpoint'} {s['checkpoint_id']} of job "
        f"{s['job']!r} ({s['path']})" + (" [final]" if s["final"] else ""),
        f"  took {s['completed_ms'] - s['trigger_ms']} ms; settings {s['settings']}; "
        f"graph {s['graph_fingerprint']}",
        f"  operator state {s['state_bytes']} bytes, in-flight data {s['inflight_bytes']} bytes",
    ]
    done = {uid: f for uid, f in s.get("finished", {}).items() if f != "running"}
    if done:
        lines.append(
            "  finished operators: " + ", ".join(f"{uid} ({f})" for uid, f in done.items())
        )
    for t in s["subtasks"]:
        state, inflight = t["state_bytes"], t["inflight_bytes"]
        lines.append(f"  {t['task']:<28} state {state:>10} B  in-flight {inflight:>10} B")
        for g in t["gates"]:
            ok = "ok" if g["verified"] else "DAMAGED"
            lines.append(
                f"      {g['kind']} gate {g['gate']}: {g['frames']} buffers on {g['channels']} "
                f"channels, {g['raw_bytes']} B raw, {g['stored_bytes']} B stored: {ok}"
            )
        for r in t.get("references", []):
            keeps = _keeps(r.get("filter"))
            for uri, channel, skip in r["pieces"]:
                lines.append(
                    f"      input gate {r['gate']} channel {r['channel']}: references {uri} "
                    f"channel {channel} from byte {skip}{keeps} (recovered, not yet replayed)"
                )
    if s.get("referenced_checkpoints"):
        lines.append(f"  references files of checkpoints {s['referenced_checkpoints']}")
    for p in s["problems"]:
        lines.append(f"  problem: {p}")
    return "\n".join(lines)
