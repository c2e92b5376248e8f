#!/usr/bin/env python3
"""What one take of the interpreter lock costs the network's threads, with a busy
Python thread beside them: a barrier frame's read by a TCP receiving thread (the
timed socket's poll, header read and payload read against one
``netio.read_frame``). Each side runs in
the same process, alternating, at a given switch interval (the driver's is
Python's 5 ms, a worker's 0.5 ms); the figure is the wall time of the step:
median, mean and p90 over many repetitions. A step that lets the lock go waits to
take it back behind the busy thread: up to a switch interval each time.

    PYTHONPATH=src .venv/bin/python bench/lock_takes.py --switch 0.005
    PYTHONPATH=src .venv/bin/python bench/lock_takes.py --switch 0.0005

See docs/benchmarks.md, "One lock take per barrier hop (issue 34)".
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable

from spillover.runtime.network.tcp.protocol import (
    _MAX_MESSAGE,
    HEADER,
    FrameType,
    _read_frame,
    _read_header,
    _read_payload,
    _tune,
)


def busy(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        x += 1


def timed(step: Callable[[], None], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        out.append((time.perf_counter() - t) * 1000)
        time.sleep(0.002)  # the busy thread holds the lock again
    return out


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        w = socket.create_connection(listener.getsockname()[:2])
        r, _ = listener.accept()
    return w, r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--switch", type=float, default=0.005, help="switch interval, s")
    ap.add_argument("--repeat", type=int, default=300)
    args = ap.parse_args()
    sys.setswitchinterval(args.switch)
    stop = threading.Event()
    threading.Thread(target=busy, args=(stop,), daemon=True).start()

    w, r = tcp_pair()
    _tune(r, 0.2)
    frame = HEADER.pack(FrameType.PRIORITY_EVENT, 0, 0, 0, 40) + bytes(40)
    buf = bytearray(HEADER.size + _MAX_MESSAGE + 2)
    hdr = memoryview(buf)[: HEADER.size]
    quick = socket.socket(fileno=os.dup(r.fileno()))
    quick.settimeout(0.0)

    def never() -> bool:
        return False

    def read_pure() -> None:
        w.sendall(frame)
        head = _read_header(r, hdr, 0, never)
        assert head is not None
        _read_payload(r, head[1], 256, never, "event", quick)

    def read_native() -> None:
        w.sendall(frame)
        _read_frame(r, buf, 0, never, 0.2)

    steps = {
        "barrier frame read: timed socket (pure)": read_pure,
        "barrier frame read: netio.read_frame": read_native,
    }
    results: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(3):  # alternating rounds
        for name, step in steps.items():
            results[name] += timed(step, args.repeat // 3)
    stop.set()
    print(f"switch interval {args.switch * 1000:g} ms, one busy Python thread beside")
    print(f"{'step':52} {'median ms':>10} {'mean ms':>8} {'p90 ms':>8}")
    for name, xs in results.items():
        xs.sort()
        med, mean, p90 = statistics.median(xs), statistics.fmean(xs), xs[int(0.9 * len(xs))]
        print(f"{name:52} {med:10.3f} {mean:8.3f} {p90:8.3f}")


if __name__ == "__main__":
    main()
