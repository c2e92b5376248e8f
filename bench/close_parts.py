#!/usr/bin/env python3
"""One channel-state close of a group, beside a raw write of the same bytes.

The parts of one channel-state group (``--parts`` subtasks, each with ``--gates``
gates of ``--buffers`` network-sized buffers: 0.1-0.6 MB a part, what the paced
benchmark job persists) append their buffers, then close one after another on one
thread, as the task threads of a process do at a checkpoint; each close is timed
(the gates' trailers, the section in the group's shared file and its index
entry). In the same run, the machine's floor: the same bytes of one part written
with one ``writev`` into a new file, and that plus an in-kernel copy of them
(what a staged section cost before it was written once).

    PYTHONPATH=src .venv/bin/python bench/close_parts.py --rounds 200 --spinners 0
    PYTHONPATH=src .venv/bin/python bench/close_parts.py --rounds 200 --spinners 1

``--spinners``: threads that only spin beside the closes, with the Spark workers'
switch interval (0.5 ms), so each time a close lets the GIL go it waits to take
it back as on a busy worker.

See docs/benchmarks.md, "The channel-state close written once (issue 34)".
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

from spillover.runtime.checkpointing.channel_state import ChannelStateWriter
from spillover.storage.location import Location
from spillover.storage.shared import SharedFile


def _raw(root: str, bufs: list[bytes], copy: bool) -> float:
    """ms: the part's bytes written into a new file (and copied to another in the
    kernel with ``copy``)."""
    t = time.perf_counter()
    fd = os.open(os.path.join(root, f"raw-{time.monotonic_ns()}"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.writev(fd, bufs)
        if copy:
            dst = os.open(
                os.path.join(root, f"copy-{time.monotonic_ns()}"), os.O_WRONLY | os.O_CREAT, 0o644
            )
            try:
                os.copy_file_range(fd, dst, sum(map(len, bufs)), 0, 0)
            finally:
                os.close(dst)
    finally:
        os.close(fd)
    return (time.perf_counter() - t) * 1000


def _round(root: str, cid: int, parts: int, gates: int, bufs: list[bytes]) -> list[float]:
    """ms per part's close, one round (one checkpoint of the group)."""
    where = Location.parse(os.path.join(root, f"chk-{cid}", "channels"))
    shared = SharedFile(where, "g.spill")
    writers = [
        ChannelStateWriter(
            os.path.join(root, f"chk-{cid}", f"t{p}"), cid, p, None, (shared, root), ("t", p)
        )
        for p in range(parts)
    ]
    for w in writers:
        for g in range(gates):
            for i, b in enumerate(bufs):
                w.add_input(g, i % 4, b)
                w.submit()  # as a network buffer is: written now, not when a batch fills
    closes = []
    for w in writers:
        t = time.perf_counter()
        w.close()
        closes.append((time.perf_counter() - t) * 1000)
    return closes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--parts", type=int, default=3)
    ap.add_argument("--gates", type=int, default=2)
    ap.add_argument("--buffers", type=int, default=5, help="buffers per gate")
    ap.add_argument("--size", type=int, default=32 << 10, help="bytes per buffer")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument(
        "--spinners", type=int, default=0, help="threads that only spin, wanting the GIL"
    )
    args = ap.parse_args()
    # As on the Spark workers: a busy thread gives the GIL up after 0.5 ms.
    sys.setswitchinterval(0.0005)
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    spinners = [threading.Thread(target=spin, daemon=True) for _ in range(args.spinners)]
    for t in spinners:
        t.start()
    root = tempfile.mkdtemp(dir=args.dir, prefix="close-parts-")
    bufs = [os.urandom(args.size) for _ in range(args.buffers)]
    part_bufs = bufs * args.gates
    closes: list[float] = []
    raw: list[float] = []
    raw_copy: list[float] = []
    try:
        for r in range(args.rounds):
            closes += _round(root, r, args.parts, args.gates, bufs)
            raw.append(_raw(root, part_bufs, False))
            raw_copy.append(_raw(root, part_bufs, True))
            if r % 20 == 19:  # keep the page cache and the directory small
                for name in os.listdir(root):
                    path = os.path.join(root, name)
                    if os.path.isdir(path):
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        os.unlink(path)
    finally:
        stop.set()
        shutil.rmtree(root, ignore_errors=True)

    def q(xs: list[float]) -> str:
        xs = sorted(xs)
        return f"median {statistics.median(xs):.3f} ms, p90 {xs[int(0.9 * (len(xs) - 1))]:.3f} ms"

    part_kb = args.gates * args.buffers * args.size / 1024
    print(
        f"{args.parts} parts x {args.gates} gates, {part_kb:.0f} KiB a part, "
        f"{args.rounds} rounds, {args.spinners} spinning threads"
    )
    print(f"close of one part            {q(closes)}")
    print(f"raw write of its bytes       {q(raw)}")
    print(f"raw write + in-kernel copy   {q(raw_copy)}")


if __name__ == "__main__":
    main()
