"""How a cold 2->4 replay reads, next to a raw read of the same bytes.

Builds (once, under ``--dir``) the 256 MiB checkpoint of ``bench_restore.py`` at
parallelism 2, then, each round with the files evicted from the page cache
(``posix_fadvise(DONTNEED)``, as ``SPILLOVER_BENCH_RESTORE_EVICT=1``):

- ``one``: the byte ranges a 2->4 replay reads (per group of new subtasks: the old
  downstream's input file, then its section of each old upstream's output file),
  read one after the other on one thread in 1 MiB ``preadv`` calls: the device's
  limit for one stream;
- ``two``: the same ranges, each group's on its own thread at once, as the replay
  reads them: the device's limit for the replay's access pattern;
- ``replay``: ``bench_restore.replay`` of the case, with the process's CPU seconds
  and how long the new subtasks waited for the read-ahead of their shared read.

Each line gives wall seconds, requests the device served and its busy time
(``/proc/diskstats`` of ``--device``). Run from the repository root::

    PYTHONPATH=src python bench/cold_read_pattern.py --rounds 8
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
import bench_restore as br
from spillover.rescale import shared

MiB = 1 << 20


def _disk(device: str) -> tuple[int, int]:
    """(requests completed, ms spent reading) of ``device``."""
    with open("/proc/diskstats") as f:
        for line in f:
            fields = line.split()
            if fields[2] == device:
                return int(fields[3]), int(fields[6])
    return 0, 0


def _ranges(ckpt: Any, d: int) -> list[tuple[str, tuple[int, int] | None]]:
    """What the group of old downstream ``d`` reads: its input file, then its section
    of each upstream's output file."""
    out: list[tuple[str, tuple[int, int] | None]] = [(ckpt.inputs[d].uri, None)]
    for u in sorted(ckpt.outputs):
        out.append((ckpt.outputs[u].uri, ckpt.outputs[u].byte_range([d])))
    return out


def _read(ranges: list[tuple[str, tuple[int, int] | None]]) -> None:
    buf = memoryview(bytearray(MiB))
    for uri, span in ranges:
        fd = os.open(uri, os.O_RDONLY)
        try:
            start, end = span or (0, os.fstat(fd).st_size)
            while start < end:
                start += os.preadv(fd, [buf[: min(MiB, end - start)]], start)
        finally:
            os.close(fd)


class _Waits:
    """Seconds the parts of a shared read spent waiting, by what they waited for."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()
        self._lock = threading.Lock()
        wait = shared.SharedReplay._wait

        def timed(replay: Any, slot: int, timeout: float | None) -> bool:
            what = "read_ahead" if not replay._reading.locked() else "other_part_reading"
            t0 = time.perf_counter()
            try:
                return wait(replay, slot, timeout)
            finally:
                with self._lock:
                    self.seconds[what] += time.perf_counter() - t0

        shared.SharedReplay._wait = timed  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/spillover-cold-read-pattern")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="vda")
    args = ap.parse_args()
    root = Path(args.dir)
    saved = root / "p2.pickle"
    if saved.exists():
        ckpt = pickle.loads(saved.read_bytes())
    else:
        root.mkdir(parents=True, exist_ok=True)
        ckpt = br.build_checkpoint(root / "p2", 2, 256 * MiB)
        os.sync()
        saved.write_bytes(pickle.dumps(ckpt))
    waits = _Waits()
    groups = [_ranges(ckpt, d) for d in sorted(ckpt.inputs)]
    for _ in range(args.rounds):
        row: dict[str, Any] = {}
        for mode in ("one", "two", "replay"):
            br._evict(ckpt.files)
            waits.seconds.clear()
            d0, c0, t0 = _disk(args.device), time.process_time(), time.perf_counter()
            if mode == "one":
                _read([r for g in groups for r in g])
            elif mode == "two":
                threads = [threading.Thread(target=_read, args=(g,)) for g in groups]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            else:
                br.replay(br.Case(2, 4), ckpt)
            wall, cpu, d1 = time.perf_counter() - t0, time.process_time() - c0, _disk(args.device)
            row[mode] = {
                "s": round(wall, 4),
                "requests": d1[0] - d0[0],
                "device_busy_ms": d1[1] - d0[1],
            }
            if mode == "replay":
                row[mode]["cpu_s"] = round(cpu, 3)
                row[mode]["parts_waited_s"] = {k: round(v, 3) for k, v in waits.seconds.items()}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
