#!/usr/bin/env python3
"""What touching memory costs once a process rested: the price of work that runs
once a checkpoint, as a paced job's checkpoint path does.

Four measures, each after resting 0 s (back to back) up to the checkpoint interval:

- one byte written into each 4 KiB page of 8 MiB this process wrote before (no page
  fault either way), the pages plain and advised as huge pages (``MADV_HUGEPAGE``);
- 1 MiB written into a new file without fsync (the raw write of an unaligned
  checkpoint's in-flight bytes);
- the keyed count's state file of one subtask of the bench job (parallelism 2: the
  records of its key groups, about 5,000 keys), written with the engine's own
  ``snapshot()`` and write;
- a round trip over two pipes to another process (one byte there and back: two
  wake-ups of a sleeping thread in another process, as a barrier's TCP hop and its
  acknowledgement take).

On a machine whose idle memory ages (a VM whose host reclaims or rescans the guest's
memory) the rested figures are far above the warm ones, whatever the code does.

    PYTHONPATH=src .venv/bin/python bench/memory_at_rest.py [--rests 0,0.1,1]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np


def rested_touch_us(
    rest_s: float, rounds: int = 5, nbytes: int = 8 << 20, huge: bool = False
) -> tuple[float, float]:
    """Writing one byte into each 4 KiB page of memory this process wrote before,
    once it rested ``rest_s`` seconds, and the same right after it, warm (medians, µs
    per page). ``huge``: the memory advised as transparent huge pages."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        if huge:
            m.madvise(mmap.MADV_HUGEPAGE)
        pages = np.frombuffer(m, dtype=np.uint8)
        pages[:] = 1
        n = len(pages[::4096])
        cold, warm = [], []
        for _ in range(rounds):
            time.sleep(rest_s)
            t0 = time.perf_counter()
            pages[::4096] += 1
            t1 = time.perf_counter()
            pages[::4096] += 1
            t2 = time.perf_counter()
            cold.append((t1 - t0) / n * 1e6)
            warm.append((t2 - t1) / n * 1e6)
        del pages  # the last view of the map, before it closes
    finally:
        m.close()
    return statistics.median(cold), statistics.median(warm)


def rested_wake_us(rest_s: float, rounds: int = 5) -> float:
    """One byte to a child process over a pipe and back over another, once both
    rested ``rest_s`` seconds (median, µs): two wake-ups across processes."""
    there_r, there_w = os.pipe()
    back_r, back_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child echoes until the pipe closes
        os.close(there_w)
        os.close(back_r)
        while os.read(there_r, 1):
            os.write(back_w, b"x")
        os._exit(0)
    os.close(there_r)
    os.close(back_w)
    try:

        def sample(_: int) -> float:
            t0 = time.perf_counter()
            os.write(there_w, b"x")
            os.read(back_r, 1)
            return (time.perf_counter() - t0) * 1e6

        sample(0)  # the child is up
        return rested_median(sample, rounds, rest_s)
    finally:
        os.close(there_w)
        os.close(back_r)
        os.waitpid(pid, 0)


def rested_median(sample: Callable[[int], float], rounds: int, rest_s: float) -> float:
    """The median of ``rounds`` samples (in the samples' unit, each timing only its
    own work), each taken after ``rest_s`` seconds at rest when ``rest_s`` is above
    0, back to back otherwise."""
    times = []
    for i in range(rounds):
        if rest_s > 0:
            time.sleep(rest_s)
        times.append(sample(i))
    return statistics.median(times)


def write_ms(nbytes: int, directory: str, rounds: int = 30, rest_s: float = 0.0) -> float:
    """Writing ``nbytes`` into a new file and closing it, without fsync (median, the
    unlink after it untimed); nothing to write costs nothing (no file is made)."""
    if nbytes <= 0:
        return 0.0
    data = os.urandom(nbytes)

    def sample(i: int) -> float:
        path = os.path.join(directory, f"floor-{i}")
        t0 = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            f.write(data)
        took = time.perf_counter() - t0
        os.unlink(path)
        return took * 1000

    return rested_median(sample, rounds, rest_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rests", default="0,0.05,0.2,1", help="seconds at rest, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rests = [float(r) for r in args.rests.split(",")]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_hotpath import MAXP, _Ctx, source_batches
    from spillover.keygroups import key_group_range_for_operator, key_groups
    from spillover.runtime.operators import KeyedCount
    from spillover.runtime.state import HeapKeyedStateBackend

    own = key_group_range_for_operator(MAXP, 2, 0)  # subtask 0 of the job's two
    keyed = HeapKeyedStateBackend(MAXP, own)
    count = KeyedCount("key")
    count.open(_Ctx(0, keyed=keyed))  # type: ignore[arg-type]
    for batch in source_batches(50):
        kg = key_groups(np.ascontiguousarray(batch["key"]), MAXP)
        count.process(batch[(kg >= own.start) & (kg <= own.end)])
    print(
        "rest s".rjust(7)
        + "page us".rjust(10)
        + "huge page us".rjust(14)
        + "1 MiB write ms".rjust(16)
        + f"keyed state ({keyed.state_bytes() >> 10} KiB) ms".rjust(28)
        + "round trip us".rjust(15)
    )
    with tempfile.TemporaryDirectory(prefix="spillover-rest-") as tmp:
        for n, rest in enumerate(rests):
            plain, _ = rested_touch_us(rest, args.rounds)
            huge, _ = rested_touch_us(rest, args.rounds, huge=True)

            def state(i: int, n: int = n) -> float:
                directory = os.path.join(tmp, f"s-{n}-{i}")
                os.mkdir(directory)
                t0 = time.perf_counter()
                keyed.snapshot()(directory)
                return (time.perf_counter() - t0) * 1000

            w = write_ms(1 << 20, tmp, args.rounds, rest)
            s = rested_median(state, args.rounds, rest)
            rt = rested_wake_us(rest, args.rounds)
            print(
                f"{rest:7g}{plain:10.3f}{huge:14.3f}{w:16.3f}{s:28.3f}{rt:15.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
