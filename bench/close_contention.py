#!/usr/bin/env python3
"""What a small channel-state close costs when other threads want the GIL: one
subtask's two gates (ten 32 KiB buffers each) staged for a shared file and closed
as the task thread closes them, alone and beside threads that only spin (the
switch interval of the Spark workers, 0.5 ms). The same run measures the
machine's own limit: the raw writes and the in-kernel copy of the same bytes.

    PYTHONPATH=src .venv/bin/python bench/close_contention.py --spinners 0 1

See docs/benchmarks.md, "Fewer GIL reacquisitions at a close" (session L).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

from spillover.runtime.checkpointing.channel_state import ChannelStateWriter
from spillover.storage.location import Location
from spillover.storage.shared import SharedFile


def _raw(root: str, buf: bytes, n: int) -> float:
    """ms: writing the same buffers to a file and copying them to another in the kernel."""
    dst_path = os.path.join(root, f"raw-{time.monotonic_ns()}")
    with tempfile.TemporaryFile(dir=root) as src, open(dst_path, "wb") as dst:
        t = time.perf_counter()
        for _ in range(n):
            os.write(src.fileno(), buf)
        os.copy_file_range(src.fileno(), dst.fileno(), n * len(buf), 0, 0)
        return (time.perf_counter() - t) * 1000


def run(spinners: int, rounds: int, buffers: int, size: int) -> tuple[float, float, float]:
    stop = False

    def spin() -> None:
        x = 0
        while not stop:
            x += 1

    threads = [threading.Thread(target=spin, daemon=True) for _ in range(spinners)]
    for t in threads:
        t.start()
    root = tempfile.mkdtemp()
    buf = bytes(size)
    appends, closes, raws = [], [], []
    try:
        for cid in range(rounds):
            where = Location.parse(os.path.join(root, str(cid)))
            shared = SharedFile(where, "group.spill", local=True)
            t0 = time.perf_counter()
            w = ChannelStateWriter(where.uri, cid, 0, None, (shared, root))
            for i in range(buffers):
                w.add_input(0, i % 2, buf)
                w.add_output(0, i % 2, buf)
            t1 = time.perf_counter()
            assert w.close(quick=True) is not None
            t2 = time.perf_counter()
            appends.append((t1 - t0) * 1000)
            closes.append((t2 - t1) * 1000)
            raws.append(_raw(root, buf, 2 * buffers))
    finally:
        stop = True
    return statistics.median(appends), statistics.median(closes), statistics.median(raws)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spinners", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--buffers", type=int, default=10, help="buffers per gate")
    ap.add_argument("--size", type=int, default=32768)
    args = ap.parse_args()
    sys.setswitchinterval(0.0005)
    print("spinning threads | open + appends ms | close ms | raw write + copy ms (median)")
    for n in args.spinners:
        a, c, r = run(n, args.rounds, args.buffers, args.size)
        print(f"{n:16d} | {a:17.3f} | {c:8.3f} | {r:.3f}")


if __name__ == "__main__":
    main()
