#!/usr/bin/env python3
"""CPU of the task thread per buffer appended to a gate staged for a shared file.

A gate staged in memory is bounded (``execution.checkpointing.unaligned.staging-memory``,
4 MiB a gate): past its bound it moves to a file. The check runs at every buffer, so
it must cost no Python. Each repetition appends ``--buffers`` buffers of ``--size``
bytes (below the bound) to a new storer, and times the appending thread's CPU
(``time.thread_time``: the writer thread's work is not counted, and other
processes' load moves it little); the figure is the median over ``--reps``
repetitions, in ns per buffer, for a gate staged in memory and one staged in a
file (no bound to check), beside, in the same run, the machine's limit (``memcpy``:
the same loop copying each buffer into a slot of a bytearray) and the
pure-Python twin of the storer (``pure``: ``SPILLOVER_PURE=1``, staged in memory).

    PYTHONPATH=src .venv/bin/python bench/staged_append.py
    # A/B, alternating trees round by round (each a checkout with built .so files):
    .venv/bin/python bench/staged_append.py --trees base=/work/base,new=. --rounds 3

See docs/benchmarks.md, "Staging leftovers".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

_NAMES = {
    "memcpy": "copy into a bytearray (the limit)",
    "memory": "staged in memory",
    "file": "staged in a file",
    "pure": "pure-Python twin, in memory",
}


def _measure(buffers: int, size: int, reps: int) -> dict[str, float]:
    """ns of the appending thread's CPU per buffer (median of ``reps``), by staging."""
    from spillover.storage import Storage, StorageOptions
    from spillover.storage import shared as shared_mod

    payload = os.urandom(size)
    out = {}
    slots = bytearray(size * 8)
    per_rep = []
    for _ in range(reps):
        t = time.thread_time_ns()
        for i in range(buffers):
            j = (i & 7) * size
            slots[j : j + size] = payload
        per_rep.append((time.thread_time_ns() - t) / buffers)
    out["memcpy"] = statistics.median(per_rep)
    with tempfile.TemporaryDirectory(prefix="staged-append-") as root:
        for label, budget in (("memory", 64 << 20), ("file", 0), ("pure", 64 << 20)):
            shared_mod.STAGING_BUDGET.configure(budget)
            if label == "pure":
                os.environ["SPILLOVER_PURE"] = "1"  # read at every open
            per_rep = []
            for rep in range(reps):
                backend = shared_mod.StagingBackend(root)
                storer = Storage(backend, StorageOptions(), 1, 0).create_storer(rep)
                append = storer.append
                t = time.thread_time_ns()
                for i in range(buffers):
                    append(i & 7, payload)
                per_rep.append((time.thread_time_ns() - t) / buffers)
                storer.close()
                backend.take(storer._name).close()
            out[label] = statistics.median(per_rep)
    os.environ.pop("SPILLOVER_PURE", None)
    shared_mod.STAGING_BUDGET.configure(64 << 20)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--buffers", type=int, default=2000)
    ap.add_argument("--size", type=int, default=1024, help="bytes a buffer")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--trees", help="name=checkout,...: A/B in subprocesses, alternating")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="one JSON line (used by --trees)")
    a = ap.parse_args()
    if not a.trees:
        got = _measure(a.buffers, a.size, a.reps)
        if a.json:
            print(json.dumps(got))
        else:
            for label, ns in got.items():
                print(f"{_NAMES[label]}: {ns:.0f} ns of CPU per buffer")
        return
    trees = [t.split("=", 1) for t in a.trees.split(",")]
    rows: dict[str, list[dict[str, float]]] = {name: [] for name, _ in trees}
    for r in range(a.rounds):
        for name, path in trees if r % 2 == 0 else trees[::-1]:
            env = {**os.environ, "PYTHONPATH": os.path.join(os.path.abspath(path), "src")}
            args = [sys.executable, os.path.abspath(__file__), "--json"]
            args += ["--buffers", str(a.buffers), "--size", str(a.size), "--reps", str(a.reps)]
            run = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
            rows[name].append(json.loads(run.stdout))
    print(f"ns of CPU per buffer ({a.buffers} x {a.size} B, median of {a.reps}), per round:")
    for label in ("memory", "file", "memcpy", "pure"):
        for name, _ in trees:
            figures = ", ".join(f"{row[label]:.0f}" for row in rows[name])
            print(f"  {_NAMES[label]:34} {name:>8}: {figures}")


if __name__ == "__main__":
    main()
