#!/usr/bin/env python3
"""Files per checkpoint on a Spark standalone cluster: a master and W workers started
from the pyspark distribution on loopback, ``spillover verify``'s keyed pipeline at
parallelism 8 with unaligned checkpoints and an induced failure on it, once per
``taskmanager.numberOfTaskSlots`` k and group size N
(``max-subtasks-per-channel-state-file``) given, exactness checked against a
failure-free local run; per checkpoint, the channel-state files it wrote against
the worker processes (Spark tasks) that wrote them.

    PYTHONPATH=src .venv/bin/python bench/spark_cluster.py      # W = 4; k:N = 1:5 2:5 2:6
    PYTHONPATH=src .venv/bin/python bench/spark_cluster.py --runs 2:6 --json out.json

The cluster is :func:`spillover.deploy.spark.standalone.standalone_cluster`. One
SparkContext a process: the driver is this process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

SLOTS = "taskmanager.numberOfTaskSlots"
PER_FILE = "execution.checkpointing.unaligned.max-subtasks-per-channel-state-file"
SRC = str(Path(__file__).resolve().parent.parent / "src")
if SRC not in sys.path:
    sys.path.insert(0, SRC)

from spillover.deploy.spark.standalone import standalone_cluster  # noqa: E402


def channel_files(checkpoints: Path) -> dict[int, int]:
    """Channel-state files per completed checkpoint under ``checkpoints``: shared
    files (``chk-<id>/channels/*.spill``) and per-gate files
    (``chk-<id>/<uid>-<i>/channels/*``)."""
    out: dict[int, int] = {}
    for meta in checkpoints.rglob("_metadata"):
        chk = meta.parent
        if chk.name.startswith("chk-"):
            n = sum(1 for p in chk.rglob("*") if p.is_file() and "channels" in p.parts)
            out[int(chk.name[4:])] = n
    return out


def measure(
    master: str, workdir: str, slots: int, per_file: int, parallelism: int, failures: int
) -> dict[str, Any]:
    """One verified run at ``slots`` subtasks of each operator per Spark task, groups
    of ``per_file`` subtasks a channel-state file."""
    from spillover.verify import VerifySpec, verify
    from spillover.verify.topologies import build

    spec = VerifySpec(
        topology="pipeline",
        parallelism=parallelism,
        records=40_000,
        rate_per_subtask=10_000.0,
        failures=failures,
        policy="unaligned",
        interval_ms=200,
        executor="spark",
        master=master,
        num_retained=1000,  # keep every checkpoint to count its files
        options={SLOTS: slots, PER_FILE: per_file},
    )
    graph = build(spec, os.path.join(workdir, "probe"), "probe").build()
    tasks = -(-max(v.parallelism for v in graph.vertices) // slots)
    operators = len(graph.vertices)
    report = verify(spec, workdir)
    files = channel_files(Path(workdir, "with-failures", "checkpoints"))
    with_data = [n for n in files.values() if n]
    return {
        "slots": slots,
        "parallelism": parallelism,
        "operators": operators,
        "worker_processes": tasks,
        "subtasks_per_process": slots * operators,
        "per_file": per_file,
        "exact": report.exact,
        "attempts": report.attempts,
        "checkpoints": len(files),
        "checkpoints_with_data": len(with_data),
        "files_min": min(with_data, default=0),
        "files_median": statistics.median(with_data) if with_data else 0,
        "files_max": max(with_data, default=0),
        "inflight_persisted": report.inflight_persisted,
        "report": report.text() if not report.exact else "",
    }


def table(rows: list[dict[str, Any]], workers: int) -> str:
    head = (
        "| k | N | Spark workers | worker processes | subtasks a process | checkpoints (with "
        "in-flight data) | channel-state files per checkpoint, min / median / max | exact |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['slots']} | {r['per_file']} | {workers} | {r['worker_processes']} "
            f"| {r['subtasks_per_process']} "
            f"| {r['checkpoints']} ({r['checkpoints_with_data']}) "
            f"| {r['files_min']} / {r['files_median']:g} / {r['files_max']} "
            f"| {'yes' if r['exact'] else 'NO'} ({r['attempts']} attempts) |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4, help="Spark workers (W)")
    ap.add_argument("--cores", type=int, default=2, help="cores a worker offers")
    ap.add_argument(
        "--runs",
        nargs="+",
        default=["1:5", "2:5", "2:6"],
        help="k:N pairs to run (slots per worker : subtasks per channel-state file)",
    )
    ap.add_argument("--parallelism", type=int, default=8)
    ap.add_argument("--failures", type=int, default=1, help="induced failures per run")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args()
    # The driver (this process) binds to loopback, as the cluster does.
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="spillover-cluster-") as root,
        standalone_cluster(root, args.workers, args.cores) as cluster,
    ):
        for run in args.runs:
            k, n = (int(x) for x in run.split(":"))
            workdir = os.path.join(root, f"k{k}-n{n}")
            rows.append(measure(cluster.url, workdir, k, n, args.parallelism, args.failures))
            print(f"k = {k}, N = {n}: done", file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(table(rows, args.workers))
    for r in rows:
        if r["report"]:
            print(r["report"])
    print(json.dumps({"rows": rows}))
    sys.exit(0 if all(r["exact"] for r in rows) else 1)


if __name__ == "__main__":
    main()
