#!/usr/bin/env python3
"""What a data frame costs the TCP transport's own threads, in one process: a
producer thread emits ``--frames`` buffers of ``--size`` bytes into one TCP
channel on 127.0.0.1, a consumer thread polls and releases them, and ``--busy``
Python threads spin beside them (a worker's task threads, which the transport's
threads wait behind for the interpreter lock). Per frame: the CPU time of the
receiving thread, of the producer and of the sender thread (each thread's own
clock, so the busy threads do not count; the credit-reading thread apart), and
each one's context switches
(voluntary: it waited, for the socket or for the lock). Run it per tree,
alternating; the figures move far less with the machine's load than the rate.
In the same run, beside the same spinning threads: the pure-Python twin of the
transport (``SPILLOVER_PURE=1``), and the machine's limit, the same frames sent
with ``sendall`` and read with ``recv_into`` over plain loopback sockets (no
framing, no credits, no pool).

    PYTHONPATH=src .venv/bin/python bench/tcp_frames.py --frames 20000 --busy 1

See docs/benchmarks.md, "The TCP receiving thread (issue 34)".
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from spillover.runtime.network.buffers import BufferPool
from spillover.runtime.network.gate import InputGate
from spillover.runtime.network.partition import ResultPartition
from spillover.runtime.network.tcp import TcpReceiver, connect_tcp

SECRET = b"tcp-frames bench"


def _switches(tid: int) -> tuple[int, int]:
    """``(voluntary, involuntary)`` context switches of thread ``tid`` so far."""
    vol = invol = 0
    for line in Path(f"/proc/self/task/{tid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches"):
            vol = int(line.split()[1])
        elif line.startswith("nonvoluntary_ctxt_switches"):
            invol = int(line.split()[1])
    return vol, invol


def _cpu(thread: threading.Thread) -> float:
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def _busy(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        x += 1


def run(frames: int, size: int, busy: int, exclusive: int) -> dict[str, float]:
    """One run; the figures per frame (µs of CPU, switches) and frames/s."""
    rcv = TcpReceiver(SECRET, "127.0.0.1", 0, poll_interval=0.2)
    part = ResultPartition(1, BufferPool(size, 2 * exclusive + 2, "bench"), "p")
    gate = InputGate(1, floating_buffers=0, buffers_per_channel=exclusive, name="g")
    rcv.register(gate)
    sub = connect_tcp(part, 0, rcv.address, "g", 0, SECRET, poll_interval=0.2)
    stop = threading.Event()
    spinners = [threading.Thread(target=_busy, args=(stop,), daemon=True) for _ in range(busy)]
    go = threading.Barrier(3)
    own: dict[str, tuple[float, int, int]] = {}  # a thread's CPU and switches, measured by it

    def measured(name: str, work: Callable[[], None]) -> Callable[[], None]:
        def body() -> None:
            go.wait()
            tid = threading.get_native_id()
            cpu, (vol, invol) = time.thread_time(), _switches(tid)
            work()
            cpu1, (vol1, invol1) = time.thread_time(), _switches(tid)
            own[name] = (cpu1 - cpu, vol1 - vol, invol1 - invol)

        return body

    def produce() -> None:
        for _ in range(frames):
            seg = part.pool.request_segment(timeout=30)
            part.emit(0, part.pool.wrap(seg), timeout=30)

    def consume() -> None:
        for _ in range(frames):
            item = gate.poll(30)
            assert item is not None, "a frame did not come in 30 s"
            item[1].release()

    producer = threading.Thread(target=measured("producer", produce))
    consumer = threading.Thread(target=measured("consumer", consume))
    for t in (*spinners, producer, consumer):
        t.start()
    recv = next(t for t in threading.enumerate() if t.name.startswith("spillover-tcp-recv"))
    send = next(t for t in threading.enumerate() if t.name.startswith("spillover-tcp-send"))
    credit = next(t for t in threading.enumerate() if t.name.startswith("spillover-tcp-credit"))
    watched = {"receiving": recv, "sender": send, "credit": credit}
    cpu0 = {k: _cpu(t) for k, t in watched.items()}
    sw0 = {k: _switches(t.native_id or 0) for k, t in watched.items()}
    start = time.perf_counter()
    go.wait()
    producer.join()
    consumer.join()  # every frame came; the transport's threads live on until the end
    wall = time.perf_counter() - start
    for k, t in watched.items():
        (vol1, invol1), (vol, invol) = _switches(t.native_id or 0), sw0[k]
        own[k] = (_cpu(t) - cpu0[k], vol1 - vol, invol1 - invol)
    stop.set()
    part.finish()
    while not gate.finished:
        item = gate.poll(30)
        if item is not None:
            item[1].release()
    sub.close(10)
    rcv.close()
    out = {"frames/s": frames / wall}
    for k in ("receiving", "sender", "credit", "producer", "consumer"):
        cpu, vol, invol = own[k]
        out[f"{k} µs"] = cpu / frames * 1e6
        out[f"{k} vol"] = vol / frames
        out[f"{k} invol"] = invol / frames
    return out


def raw(frames: int, size: int, busy: int) -> dict[str, float]:
    """The machine's limit: ``frames`` frames of ``size`` bytes over a plain loopback
    TCP connection, a thread sending each whole and one reading each whole; per
    frame, each thread's CPU."""
    lsock = socket.create_server(("127.0.0.1", 0))
    out_sock = socket.create_connection(lsock.getsockname())
    in_sock, _ = lsock.accept()
    lsock.close()
    stop = threading.Event()
    spinners = [threading.Thread(target=_busy, args=(stop,), daemon=True) for _ in range(busy)]
    cpu: dict[str, float] = {}

    def send() -> None:
        data = bytes(size)
        t = time.thread_time()
        for _ in range(frames):
            out_sock.sendall(data)
        cpu["raw sender"] = time.thread_time() - t

    def receive() -> None:
        buf = memoryview(bytearray(size))
        t = time.thread_time()
        for _ in range(frames):
            got = 0
            while got < size:
                n = in_sock.recv_into(buf[got:])
                assert n, "the raw connection closed early"
                got += n
        cpu["raw receiving"] = time.thread_time() - t

    threads = [threading.Thread(target=send), threading.Thread(target=receive)]
    for t in (*spinners, *threads):
        t.start()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    stop.set()
    out_sock.close()
    in_sock.close()
    out = {"raw frames/s": frames / wall}
    out.update({f"{k} µs": v / frames * 1e6 for k, v in cpu.items()})
    return out


def _line(r: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.3f}" if v < 1000 else f"{k}={v:,.0f}" for k, v in r.items())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=20_000)
    p.add_argument("--size", type=int, default=128 << 10, help="bytes a frame (128 KiB)")
    p.add_argument("--busy", type=int, default=1, help="spinning Python threads beside")
    p.add_argument("--exclusive", type=int, default=2, help="credits of the channel")
    p.add_argument("--switch", type=float, default=0.0005, help="sys.setswitchinterval")
    a = p.parse_args()
    sys.setswitchinterval(a.switch)
    print("native:", _line(run(a.frames, a.size, a.busy, a.exclusive)))
    was = os.environ.get("SPILLOVER_PURE")
    os.environ["SPILLOVER_PURE"] = "1"  # read at every connection's open
    try:
        print("pure:  ", _line(run(a.frames, a.size, a.busy, a.exclusive)))
    finally:
        if was is None:
            del os.environ["SPILLOVER_PURE"]
        else:
            os.environ["SPILLOVER_PURE"] = was
    print("raw:   ", _line(raw(a.frames, a.size, a.busy)))


if __name__ == "__main__":
    main()
