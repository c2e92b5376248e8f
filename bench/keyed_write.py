#!/usr/bin/env python3
"""The keyed-state write of one checkpoint, step by step, warm.

A keyed operator's snapshot thread writes its state as one Arrow IPC file per state
(``runtime/state/files.py``, ``_write_snapshot``): the rows' key groups, a stable
sort by them, the same file pyarrow's writer makes, built from the schema's layout
with the three columns gathered into it (``ipcfile.py``), then the file's creation
and write; pyarrow's own writer, which it replaces, is timed beside it. This
times each step apart (medians of ``--runs``, µs) on ``--rows`` rows of int64 keys
and sums (the bench's count holds 5,000), beside, in the same run, the machine's
limits of the same work: the three sorted columns copied into one buffer (memcpy:
the copy an IPC file cannot beat), a new file's creation (``open(O_CREAT|O_EXCL)``,
``close``) and a write of the file's bytes over pages already cached; and the whole
write with the pure-Python twin
(``SPILLOVER_PURE=1``, in a child process). A new file's creation moves with the
file system's journal: compare it with the limit of the same run, not across runs.

    PYTHONPATH=src .venv/bin/python bench/keyed_write.py

In place on a worker the same steps run once a second on cold caches and cost
several times as much; docs/benchmarks.md, "The count's keyed write, step by step".
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
from collections.abc import Callable
from typing import Any

_STEPS = {
    "key_groups": "the key groups",
    "sort": "their stable sort",
    "gathers": "the three gathers",
    "raw_join": "the sorted columns copied into one buffer (memcpy: the limit)",
    "ipc": "the Arrow batch and its IPC file in memory (pyarrow's writer)",
    "layout": "the gathers and the same file from its layout (what a write does)",
    "file": "the file's creation and write (Location.write_new)",
    "create": "  of which a new file: open(O_CREAT|O_EXCL), close (the limit)",
    "write": "  of which the bytes: pwrite over a file's cached pages (the limit)",
    "whole": "the whole write (_write_snapshot)",
}


def _median_us(fn: Callable[[int], object], runs: int) -> float:
    fn(-1)
    times = []
    for i in range(runs):
        t = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def measure(rows: int, runs: int, whole_only: bool = False) -> dict[str, float]:
    """µs per step (median of ``runs``), by the keys of :data:`_STEPS`."""
    import numpy as np
    import numpy.typing as npt
    import pyarrow as pa

    from spillover.keygroups import KeyGroupRange, key_groups
    from spillover.runtime.state import files
    from spillover.storage.location import Location

    max_p, rng = 128, KeyGroupRange(0, 63)
    gen = np.random.default_rng(1)
    keys = np.sort(gen.choice(10**9, rows, replace=False)).astype(np.int64)
    values = gen.integers(0, 1000, rows).astype(np.int64)
    dtype = np.dtype(np.int64)
    kg = key_groups(keys, max_p)
    order = np.argsort(kg.astype(np.int16, copy=False), kind="stable")
    cols: list[npt.NDArray[Any]] = [kg[order], keys[order], values[order]]
    schema = files._schema("count", "value", dtype, max_p, rng.start, rng.end)
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="keyed-write-") as root:

        def fresh(tag: str, i: int) -> str:
            path = os.path.join(root, f"{tag}{i}")
            os.mkdir(path)
            return path

        layout = files.learn_layout("count", "value", dtype, max_p, rng)
        assert layout is not None
        copies = [("count", "value", dtype, keys, values, layout)]
        out["whole"] = _median_us(
            lambda i: files._write_snapshot(fresh("w", i), copies, max_p, rng, "p", False), runs
        )
        if whole_only:
            return out

        def ipc(_: int) -> object:
            arrays = [pa.array(c) for c in cols]
            sink = pa.BufferOutputStream()
            with pa.ipc.new_file(sink, schema) as writer:
                writer.write_batch(pa.record_batch(arrays, schema=schema))
            return sink.getvalue()

        data: Any = ipc(0)
        assert layout.write([kg, keys, values], order).tobytes() == data.to_pybytes()

        def create(i: int) -> None:
            os.close(
                os.open(os.path.join(fresh("c", i), "f"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            )

        cached = os.open(os.path.join(root, "cached"), os.O_CREAT | os.O_WRONLY)

        def file(i: int) -> None:
            where = Location.parse(fresh("f", i)).child("f")
            where.write_new(data, fsync=False, what="keyed-state file", hint="")

        steps: dict[str, Callable[[int], object]] = {
            "key_groups": lambda _: key_groups(keys, max_p),
            "sort": lambda _: np.argsort(kg.astype(np.int16, copy=False), kind="stable"),
            "gathers": lambda _: (kg[order], keys[order], values[order]),
            "raw_join": lambda _: np.concatenate([c.view(np.uint8) for c in cols]),
            "ipc": ipc,
            "layout": lambda _: layout.write([kg, keys, values], order),
            "file": file,
            "create": create,
            "write": lambda _: os.pwrite(cached, data, 0),
        }
        try:
            for name, fn in steps.items():
                out[name] = _median_us(fn, runs)
        finally:
            os.close(cached)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=5000, help="state rows (default 5,000)")
    ap.add_argument("--runs", type=int, default=300, help="runs per step (default 300)")
    ap.add_argument("--json", action="store_true", help="the whole write only, as JSON")
    a = ap.parse_args(argv)
    if a.rows < 1 or a.runs < 1:
        ap.error("--rows and --runs must be >= 1")
    if a.json:
        print(json.dumps(measure(a.rows, a.runs, whole_only=True)))
        return 0
    got = measure(a.rows, a.runs)
    env = {**os.environ, "SPILLOVER_PURE": "1"}
    argv_pure = [sys.executable, __file__, "--rows", str(a.rows), "--runs", str(a.runs), "--json"]
    pure = json.loads(subprocess.run(argv_pure, env=env, check=True, capture_output=True).stdout)
    print(f"{a.rows:,} rows, {a.rows * 20:,} bytes of columns, median of {a.runs} runs, warm")
    print(f"{'step':<70} {'µs':>9}")
    for key, label in _STEPS.items():
        print(f"{label:<70} {got[key]:>9.1f}")
    print(f"{'the whole write, pure-Python twin (SPILLOVER_PURE=1)':<70} {pure['whole']:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
