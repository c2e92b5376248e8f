#!/usr/bin/env python3
"""What durability costs the job master: checkpoint metadata and the job event log
fsynced (``state.checkpoints.fsync-metadata``, the default) or not, beside the
machine's own price for the same bytes.

Per checkpoint: the simulated coordinator (``runtime/checkpointing/simulated.py``,
T subtasks speaking the real messages) completes checkpoints whose
``CheckpointStorage.write_metadata`` is timed (``_metadata`` and the channel index
beside it), with fsync off and on, alternating blocks so that both see the same
load. Per event: ``JobEventLog.append`` of one ``checkpoint-completed`` and the
``flush`` that publishes it as a segment, off and on. Per completion: the two
files a checkpoint's completion publishes (its metadata, then the event), one after
the other or as one ordered group (``publish_in_order``), fsync on, beside the raw
price of the same two files (each written and fsynced, then their directory). The limits,
measured in the same run: the same bytes written to a new file and renamed into place (what
``Location.publish`` does), then the same with the file and its directory fsynced.

    PYTHONPATH=src .venv/bin/python bench/bench_durability.py            # T = 100
    PYTHONPATH=src .venv/bin/python bench/bench_durability.py --subtasks 500 --dir /data
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
import time
from collections.abc import Callable

from spillover.runtime.checkpointing.simulated import SimulatedJob, Simulation
from spillover.runtime.jobevents.events import CheckpointCompleted
from spillover.runtime.jobevents.log import JobEventLog
from spillover.storage.location import Location, Publication, fsync_directory, publish_in_order

_names = itertools.count()


def raw_publish_ms(blobs: list[bytes], directory: str, fsync: bool) -> float:
    """The machine's price for ``blobs``: new files renamed to new names, optionally
    each file and then the directory fsynced (what ``Location.publish`` does; a
    rename over an existing file would cost more on ext4, which then flushes)."""
    t = time.perf_counter()
    for data in blobs:
        n = next(_names)
        tmp, final = os.path.join(directory, f"raw-{n}.tmp"), os.path.join(directory, f"raw-{n}")
        with open(tmp, "wb") as out:
            out.write(data)
            if fsync:
                out.flush()
                os.fsync(out.fileno())
        os.replace(tmp, final)
    if fsync:
        fsync_directory(directory)
    return (time.perf_counter() - t) * 1000


def alternate(blocks: int, per_block: int, run: Callable[[bool], float]) -> dict[bool, float]:
    """Median milliseconds of ``run(fsync)``, off and on in alternating blocks."""
    got: dict[bool, list[float]] = {False: [], True: []}
    for b in range(blocks):
        for fsync in (False, True) if b % 2 == 0 else (True, False):
            got[fsync] += [run(fsync) for _ in range(per_block)]
    return {k: statistics.median(v) for k, v in got.items()}


def per_checkpoint(subtasks: int, directory: str, blocks: int) -> dict[str, float]:
    job = SimulatedJob(subtasks // 2, fill=0.5)
    raw_dir = tempfile.mkdtemp(prefix="raw-", dir=directory)
    with Simulation(job, os.path.join(directory, "ckpt"), num_retained=2) as sim:
        blobs: list[bytes] = []

        def checkpoint(fsync: bool) -> float:
            sim.storage.fsync = fsync
            run = sim.checkpoint()
            assert run.status == "completed", run
            if not blobs:
                chk = sim.storage.location.child(f"chk-{run.checkpoint_id}")
                for name in ("_metadata", "_channel_index"):
                    if os.path.exists(chk.child(name).path):
                        with open(chk.child(name).path, "rb") as f:
                            blobs.append(f.read())
            return run.write_s * 1000

        measured = alternate(blocks, 5, checkpoint)
        raw = alternate(blocks, 5, lambda fsync: raw_publish_ms(blobs, raw_dir, fsync))
    return {
        "bytes": sum(len(b) for b in blobs),
        "off": measured[False],
        "on": measured[True],
        "raw_off": raw[False],
        "raw_on": raw[True],
    }


def per_event(directory: str, blocks: int) -> dict[str, float]:
    logs = {f: JobEventLog.open(os.path.join(directory, f"events-{f}"), fsync=f) for f in (0, 1)}
    raw_dir = tempfile.mkdtemp(prefix="raw-events-", dir=directory)
    counter = iter(range(1, 1 << 30))
    segment: list[bytes] = []

    def event(fsync: bool) -> float:
        log = logs[int(fsync)]
        cid = next(counter)
        t = time.perf_counter()
        log.append(CheckpointCompleted(cid, f"{directory}/ckpt/chk-{cid}/_metadata"))
        log.flush()
        ms = (time.perf_counter() - t) * 1000
        if not segment:
            names = sorted(os.listdir(log.location.path))
            with open(os.path.join(log.location.path, names[-1]), "rb") as f:
                segment.append(f.read())
        return ms

    measured = alternate(blocks, 10, event)
    raw = alternate(blocks, 10, lambda fsync: raw_publish_ms(segment, raw_dir, fsync))
    return {
        "bytes": len(segment[0]),
        "off": measured[False],
        "on": measured[True],
        "raw_off": raw[False],
        "raw_on": raw[True],
    }


def completion_files(base: Location, name: str, meta: bytes, event: bytes) -> list[Publication]:
    """A completion's two durable files under ``base``, in the order it publishes
    them: checkpoint ``name``'s metadata, then the event log segment recording it."""
    return [
        Publication(base.child(f"chk-{name}", "_metadata"), meta, fsync=True),
        Publication(
            base.child("_events", f"events-{name}.log"), event, fsync=True, overwrite=False
        ),
    ]


def per_completion(directory: str, blocks: int, meta_bytes: int) -> dict[str, float]:
    """A completion's two files, fsync on: ``meta_bytes`` of metadata and then an
    event's segment, published one after the other (two ``Location.publish``, four
    fsyncs) or as one ordered group (``publish_in_order``: both files synced
    together, then each named and its directory synced), alternating blocks."""
    base = Location.parse(tempfile.mkdtemp(prefix="completion-", dir=directory))
    meta, event = os.urandom(meta_bytes), os.urandom(260)
    got: dict[bool, list[float]] = {False: [], True: []}
    for b in range(blocks):
        for grouped in (False, True) if b % 2 == 0 else (True, False):
            for _ in range(10):
                n = next(_names)
                files = completion_files(base, str(n), meta, event)
                t = time.perf_counter()
                if grouped:
                    publish_in_order(files)
                else:
                    for f in files:
                        f.publish()
                got[grouped].append((time.perf_counter() - t) * 1000)
    raw_dir = tempfile.mkdtemp(prefix="raw-completion-", dir=directory)
    raw = alternate(blocks, 10, lambda fsync: raw_publish_ms([meta, event], raw_dir, fsync))
    return {
        "bytes": meta_bytes + len(event),
        "apart": statistics.median(got[False]),
        "grouped": statistics.median(got[True]),
        "raw_on": raw[True],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--subtasks", type=int, default=100, help="T of the simulated job")
    ap.add_argument("--blocks", type=int, default=6, help="alternating blocks of each")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary dir)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        rows = [
            (
                f"per checkpoint (T = {args.subtasks})",
                per_checkpoint(args.subtasks, d, args.blocks),
            ),
            ("per event (one flush)", per_event(d, args.blocks)),
        ]
        completion = per_completion(d, args.blocks, int(rows[0][1]["bytes"]))
    print("| what | bytes | fsync off | fsync on | raw write | raw write + fsync |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in rows:
        print(
            f"| {name} | {r['bytes']:,.0f} | {r['off']:.2f} ms | {r['on']:.2f} ms "
            f"| {r['raw_off']:.2f} ms | {r['raw_on']:.2f} ms |"
        )
    print()
    print(
        "| completion, fsync on | bytes | one file after the other | one ordered group "
        "| raw write + fsync |"
    )
    print("|---|---:|---:|---:|---:|")
    print(
        f"| metadata, then its event | {completion['bytes']:,.0f} "
        f"| {completion['apart']:.2f} ms | {completion['grouped']:.2f} ms "
        f"| {completion['raw_on']:.2f} ms |"
    )


if __name__ == "__main__":
    main()
