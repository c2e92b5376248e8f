#!/usr/bin/env python3
"""The kernel's price of moving bytes between two processes on one machine: loopback
TCP (what the runtime's workers use between them) against a Unix domain socket.

A child process writes ``--frames`` frames of ``--frame-bytes`` with ``sendall``; this
process reads them with ``recv_into`` into one buffer. Printed per family: GB/s and
the CPU seconds of both processes per GB moved, alternating the families ``--rounds``
times.

    PYTHONPATH=src .venv/bin/python bench/socket_families.py [--rounds 3]

See docs/benchmarks.md, "The second worker's core (issue 34, target 1)".
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time


def move(family: str, frames: int, frame_bytes: int) -> tuple[float, float]:
    """``(GB/s, CPU s per GB)`` of one transfer over a fresh connection of ``family``."""
    if family == "tcp":
        server = socket.create_server(("127.0.0.1", 0))
        address: str | tuple[str, int] = server.getsockname()
        kind = socket.AF_INET
    else:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address = f"\0spillover-socket-families-{os.getpid()}"
        server.bind(address)
        server.listen()
        kind = socket.AF_UNIX
    pid = os.fork()
    if pid == 0:  # the writer
        server.close()
        with socket.socket(kind, socket.SOCK_STREAM) as out:
            out.connect(address)
            payload = b"x" * frame_bytes
            for _ in range(frames):
                out.sendall(payload)
        os._exit(0)
    conn, _ = server.accept()
    server.close()
    view = memoryview(bytearray(frame_bytes))
    got, t0, c0 = 0, time.perf_counter(), os.times()
    with conn:
        while n := conn.recv_into(view):
            got += n
    took = time.perf_counter() - t0
    os.waitpid(pid, 0)
    c1 = os.times()
    cpu = sum(
        getattr(c1, f) - getattr(c0, f)
        for f in ("user", "system", "children_user", "children_system")
    )
    return got / took / 1e9, cpu / (got / 1e9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--frames", type=int, default=4000)
    ap.add_argument("--frame-bytes", type=int, default=256 * 1024, help="the segment size")
    a = ap.parse_args()
    got: dict[str, list[tuple[float, float]]] = {"tcp": [], "unix": []}
    for _ in range(a.rounds):
        for family in got:
            got[family].append(move(family, a.frames, a.frame_bytes))
    for family, runs in got.items():
        rates = ", ".join(f"{r:.2f}" for r, _ in runs)
        cpus = ", ".join(f"{c:.3f}" for _, c in runs)
        print(
            f"{family}: median {statistics.median(r for r, _ in runs):.2f} GB/s ({rates}), "
            f"{statistics.median(c for _, c in runs):.3f} CPU s per GB ({cpus})"
        )


if __name__ == "__main__":
    main()
