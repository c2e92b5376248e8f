#!/usr/bin/env python3
"""The checkpoint coordinator at scale, simulated: T subtasks (two operators at
p = T/2, key_by between them) that speak the real messages to the real
coordinator (``spillover.runtime.checkpointing.simulated``), and what a checkpoint
costs the driver as T grows.

Per T: three checkpoints timed (medians), then the metadata of the last one read
back and a restore planned from it at half the parallelism (the real planner), then
one checkpoint under tracemalloc, one declined, one after the sources finished and
one after they exited. Columns:

- ``wall``: ``trigger_now()`` to the last subtask's completion notice;
- ``coord cpu``: the coordinator thread's CPU time, trigger to metadata written;
- ``relay cpu``: unpickling the acknowledgements (the driver's control endpoint);
- ``write``: ``CheckpointStorage.write_metadata``; ``_metadata``: its size;
- ``index``: the channel index beside it, its size (metadata version 2; ``-`` for
  version 3, whose entries the simulated tasks write into their shared files);
- ``raw write``: the machine's limit for the same bytes, measured in the same run:
  ``_metadata`` and the index written to new files and renamed into place, as
  ``Location.publish`` does (no fsync, the storage's default), no encoding;
- ``read``: reading the metadata back into ``CheckpointMetadata``; ``raw read``:
  the same files' bytes read, nothing decoded (the limit of ``read``);
- ``plan T->T/2``: ``plan_restore`` at half the parallelism;
- ``resolve``: one restored map subtask reads the channel maps of every gate
  it replays (the index, lazily); ``resolve +1``: the next one, in the same
  process and attempt (the entries both read are read once per attempt here);
- ``peak``: tracemalloc's peak over one checkpoint, every thread;
- ``gc``: the cyclic garbage collector's time within a timed checkpoint (median,
  every thread, from ``gc.callbacks``) and how many full (generation 2)
  collections struck the timed checkpoints. A full collection walks the whole
  heap, the retained checkpoints' metadata included, so where one falls shows in
  that checkpoint's ``coord cpu``; ``--gc-off`` turns the collector off during the
  timed checkpoints to show the coordinator's own work alone.

    PYTHONPATH=src .venv/bin/python bench/sim_coordinator.py            # T = 100 500 1000 2000
    PYTHONPATH=src .venv/bin/python bench/sim_coordinator.py 100 1000 --fill 0.5
    PYTHONPATH=src .venv/bin/python bench/sim_coordinator.py --checkpoints 9 --gc-off
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from typing import Any

from spillover.runtime.checkpointing.checkpoint_meta import CheckpointMetadata
from spillover.runtime.checkpointing.simulated import MAP, SOURCE, SimulatedJob, Simulation
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.graph import JobGraph, StreamEnvironment
from spillover.runtime.recovery.plan import graph_info, plan_restore
from spillover.storage.channel_index import ReadEntries


def job_graph(parallelism: int, max_parallelism: int) -> JobGraph:
    """The simulated job as a real graph: source -> key_by -> map."""
    env = StreamEnvironment("sim", parallelism=parallelism, max_parallelism=max_parallelism)
    source = GeneratorSource(partitions=parallelism, records_per_partition=1)
    env.from_source(source, uid=SOURCE).key_by("key").map(lambda b: b, uid=MAP)
    return env.build()


def _index_bytes(sim: Simulation, cid: int) -> int:
    path = sim.storage.location.child(f"chk-{cid}", "_channel_index").path
    return os.path.getsize(path) if os.path.exists(path) else 0


def _raw_io_ms(files: list[str], directory: str) -> tuple[float, float]:
    """The machine's limit for the metadata's I/O: ``files``' bytes written to new
    files renamed into place (as ``Location.publish`` does), then read back."""
    blobs = []
    for f in files:
        with open(f, "rb") as src:
            blobs.append(src.read())
    t = time.perf_counter()
    for i, data in enumerate(blobs):
        tmp, final = os.path.join(directory, f"raw-{i}.tmp"), os.path.join(directory, f"raw-{i}")
        with open(tmp, "wb") as out:
            out.write(data)
        os.replace(tmp, final)
    write_ms = (time.perf_counter() - t) * 1000
    t = time.perf_counter()
    for i in range(len(blobs)):
        with open(os.path.join(directory, f"raw-{i}"), "rb") as src:
            src.read()
    return write_ms, (time.perf_counter() - t) * 1000


class _GcTime:
    """The collector's time and full collections, from ``gc.callbacks`` (collections
    run one at a time, under the interpreter lock)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._started
        self.full += info["generation"] == 2


def _timed_checkpoints(sim: Simulation, n: int, gc_off: bool) -> tuple[list[Any], list[float], int]:
    """``n`` checkpoints, each with the collector's time within it."""
    timer = _GcTime()
    gc.callbacks.append(timer)
    if gc_off:
        gc.disable()
    runs, gc_s = [], []
    try:
        for _ in range(n):
            before = timer.seconds
            runs.append(sim.checkpoint())
            gc_s.append(timer.seconds - before)
    finally:
        gc.enable()
        gc.callbacks.remove(timer)
    return runs, gc_s, timer.full


def measure(
    subtasks: int, fill: float, directory: str, checkpoints: int = 3, gc_off: bool = False
) -> dict[str, Any]:
    p = subtasks // 2
    job = SimulatedJob(p, fill=fill)
    graph = graph_info(job_graph(p, job.max_parallelism))
    half = job_graph(max(1, p // 2), job.max_parallelism)
    row: dict[str, Any] = {"T": subtasks, "p": p}
    with Simulation(job, directory, graph=graph, num_retained=2) as sim:
        runs, gc_s, row["full_gcs"] = _timed_checkpoints(sim, checkpoints, gc_off)
        row["gc_ms"] = statistics.median(gc_s) * 1000
        assert all(r.status == "completed" for r in runs), runs
        cid = runs[-1].checkpoint_id
        gc.collect()
        t = time.perf_counter()
        raw = sim.storage.read_metadata(cid)
        meta = CheckpointMetadata.from_json(raw, f"chk-{cid}")
        row["read_ms"] = (time.perf_counter() - t) * 1000
        del raw
        t = time.perf_counter()
        plans = plan_restore(meta, half, validate=False)
        row["plan_ms"] = (time.perf_counter() - t) * 1000
        # As the workers do: subtask 0 resolves what it reads, then subtask 1 in the
        # same process and attempt (the entries it shares with 0 are not read again).
        entries = ReadEntries()
        for name, i in (("resolve_ms", 0), ("resolve_next_ms", 1)):
            if (MAP, i) not in plans:
                row[name] = None
                continue
            t = time.perf_counter()
            plans[(MAP, i)].channel_state.resolved(i, entries)
            row[name] = (time.perf_counter() - t) * 1000
        del plans, meta, entries
        row["index_bytes"] = _index_bytes(sim, cid)
        chk = sim.storage.location.child(f"chk-{cid}")
        files = [chk.child(n).path for n in ("_metadata", "_channel_index")]
        row["raw_write_ms"], row["raw_read_ms"] = _raw_io_ms(
            [f for f in files if os.path.exists(f)], directory
        )
        traced = sim.checkpoint(trace=True)
        declined = sim.checkpoint(decline=True)
        sim.finish_sources()
        finishing = sim.checkpoint()
        sim.exit_finished()
        after_exit = sim.checkpoint()
    assert declined.status == "aborted" and finishing.status == after_exit.status == "completed"
    for name in ("wall_s", "coordinator_cpu_s", "relay_cpu_s", "write_s"):
        row[name.replace("_s", "_ms")] = statistics.median(getattr(r, name) for r in runs) * 1000
    row["metadata_bytes"] = runs[-1].metadata_bytes
    row["peak_bytes"] = traced.peak_bytes
    row["after_exit_metadata_bytes"] = after_exit.metadata_bytes
    return row


def _size(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.0f} KB"


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| T | p | wall | coord cpu | per subtask | relay cpu | write | raw write | `_metadata` "
        "| index | read | raw read | plan T->T/2 | resolve | resolve +1 | peak | gc |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
    )
    lines = [head]
    for r in rows:
        resolve, after = (
            f"{r[k]:.0f} ms" if r[k] is not None else "-" for k in ("resolve_ms", "resolve_next_ms")
        )
        lines.append(
            f"| {r['T']:,} | {r['p']} | {r['wall_ms']:.0f} ms | {r['coordinator_cpu_ms']:.0f} ms "
            f"| {r['coordinator_cpu_ms'] * 1000 / r['T']:.0f} µs "
            f"| {r['relay_cpu_ms']:.0f} ms | {r['write_ms']:.0f} ms | {r['raw_write_ms']:.1f} ms "
            f"| {_size(r['metadata_bytes'])} "
            f"| {_size(r['index_bytes']) if r['index_bytes'] else '-'} | {r['read_ms']:.0f} ms "
            f"| {r['raw_read_ms']:.1f} ms "
            f"| {r['plan_ms']:.0f} ms | {resolve} | {after} | {_size(r['peak_bytes'])} "
            f"| {r['gc_ms']:.0f} ms, {r['full_gcs']} full |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("subtasks", nargs="*", type=int, default=[100, 500, 1000, 2000])
    ap.add_argument("--fill", type=float, default=1.0, help="share of channels holding data")
    ap.add_argument(
        "--checkpoints", type=int, default=3, help="checkpoints timed per T (their medians)"
    )
    ap.add_argument(
        "--gc-off",
        action="store_true",
        help="the cyclic garbage collector off during the timed checkpoints",
    )
    args = ap.parse_args()
    rows = []
    for t in args.subtasks:
        with tempfile.TemporaryDirectory(prefix="sim-coordinator-") as d:
            rows.append(measure(t, args.fill, d, args.checkpoints, args.gc_off))
        print(f"T = {t}: done", flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
