#!/usr/bin/env python3
"""What a gate's first buffer costs at an unaligned checkpoint's barrier.

The first ``add_output`` of a checkpoint makes the gate's storer (staged for the
group's shared file) and appends and submits the buffer the barrier overtook, on
the task thread with the interpreter lock held; ``close`` then finishes it. Each
repetition times, in wall µs, ``open`` (the storer made, the buffer appended and
submitted) and ``close`` for a new gate, and reports the median and p90 over
``--reps``, beside, in the same run, the machine's limit (``raw``: a staging file
taken and the same bytes written to it with one ``os.write``) and the storer's
pure-Python twin (``pure``: ``SPILLOVER_PURE=1``). ``--pin`` runs on one CPU, as a
Spark worker does (its threads share one core).

    PYTHONPATH=src .venv/bin/python bench/gate_open.py --pin
    # A/B, alternating trees round by round (each a checkout with built .so files):
    .venv/bin/python bench/gate_open.py --trees base=/work/base,new=. --rounds 3 --pin

See docs/benchmarks.md, "Storers' threads pooled".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _stats(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    return {"median": statistics.median(values), "p90": values[int(0.9 * (len(values) - 1))]}


def _measure(size: int, reps: int) -> dict[str, dict[str, float]]:
    from spillover.storage import Storage, StorageOptions
    from spillover.storage.shared import StagingBackend

    payload = os.urandom(size)
    out: dict[str, dict[str, float]] = {}
    raw = []
    for _ in range(reps):
        staging = StagingBackend(None)
        t = time.perf_counter()
        fd, _, _ = staging.create("out-0.spill")
        os.write(fd, payload)
        raw.append((time.perf_counter() - t) * 1e6)
        staging.delete("out-0.spill")
    out["raw open"] = _stats(raw)
    for label, pure in (("native", False), ("pure", True)):
        if pure:
            os.environ["SPILLOVER_PURE"] = "1"
        opened, closed = [], []
        for rep in range(reps):
            staging = StagingBackend(None)
            storage = Storage(staging, StorageOptions(), rep + 1, 0)
            t = time.perf_counter()
            storer = storage.create_storer(0, kind="output")
            storer.append(0, payload)
            storer.submit()
            t1 = time.perf_counter()
            storer.close()
            t2 = time.perf_counter()
            opened.append((t1 - t) * 1e6)
            closed.append((t2 - t1) * 1e6)
            for name in staging.list():
                staging.delete(name)
            time.sleep(0.001)  # a gate per checkpoint: its writer thread is back, or gone
        os.environ.pop("SPILLOVER_PURE", None)
        out[f"{label} open"] = _stats(opened)
        out[f"{label} close"] = _stats(closed)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=32 * 1024, help="the buffer's bytes")
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--pin", action="store_true", help="run on one CPU, as a Spark worker")
    ap.add_argument("--trees", help="name=path,... : run each checkout in turn (A/B)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reps < 10 or args.size < 1:
        ap.error("--reps must be at least 10 and --size at least 1")
    if args.trees:
        trees = [t.split("=", 1) for t in args.trees.split(",")]
        rows: dict[str, dict[str, list[float]]] = {}
        for _ in range(args.rounds):
            for name, path in trees:
                cmd = [sys.executable, os.path.abspath(__file__), "--json"]
                cmd += ["--size", str(args.size), "--reps", str(args.reps)]
                cmd += ["--pin"] if args.pin else []
                env = {**os.environ, "PYTHONPATH": os.path.join(path, "src")}
                res = json.loads(
                    subprocess.run(cmd, env=env, capture_output=True, check=True).stdout
                )
                for k, v in res.items():
                    rows.setdefault(k, {}).setdefault(name, []).append(v["median"])
        names = [n for n, _ in trees]
        print("median µs (median of rounds) | " + " | ".join(names))
        for k, by in rows.items():
            print(f"{k:14s} | " + " | ".join(f"{statistics.median(by[n]):8.1f}" for n in names))
        return
    if args.pin:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    res = _measure(args.size, args.reps)
    if args.json:
        print(json.dumps(res))
        return
    print(f"{args.size} bytes, {args.reps} gates{' on one CPU' if args.pin else ''}: µs")
    for k, v in res.items():
        print(f"{k:14s} median {v['median']:8.1f}  p90 {v['p90']:8.1f}")


if __name__ == "__main__":
    main()
