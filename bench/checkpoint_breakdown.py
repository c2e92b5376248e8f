#!/usr/bin/env python3
"""Where a checkpoint's time goes: the `spillover bench` job (paced sink, one
policy) runs once, then two tables over its completed checkpoints.

Phases, each beside its physical floor on this machine measured in the same run:
trigger (the coordinator triggers, a source's task takes it), barrier hop per edge
(an upstream subtask forwards the barrier, a downstream one takes it: from the
earliest upstream forward), snapshot (the operators' state: the task's
synchronous part and the snapshot thread's write), inputs (an unaligned
checkpoint's wait for the last input barrier; no floor: it is the hops behind),
channel-state close (the in-flight files finished), acknowledgement (the task
sends it, the coordinator takes it) and metadata (after the last acknowledgement:
the metadata file built, then published with the job event log's record of it).
The floors: a thread hand-off (one way of a ``queue.SimpleQueue`` ping-pong
between two threads), a loopback TCP
message (one way of a ping-pong), and a write without fsync of the same bytes
(the median subtask's state or in-flight bytes, the last checkpoint's metadata
files) into a new file. On Spark the trigger and the acknowledgement cross the
control connection: their floor is a TCP message and a hand-off; a barrier's
first arrival comes over an in-process channel: a hand-off.

On Spark the workers and the master also stamp where their threads take a
checkpoint's word (``deploy/spark/worker.py`` ``_Arrivals``, ``runner.py``), and
each hop is split: the trigger into the coordinator's sending, the wire to the
worker's control thread, and that thread to the task; a barrier from another
worker into the wire to the TCP receiving thread and that thread to the task; the
acknowledgement into the wire to the master's reading thread and that thread to
the coordinator's. Their floors: a thread woken by another process's message (a
process at rest, and one with a busy Python thread beside the woken one at the
workers' switch interval), a loopback TCP message, a hand-off. Printed apart: a
hand-off and a small step after resting the job's checkpoint interval, the price
a thread that runs once a checkpoint pays where idle memory ages
(``rested_step_ms``).

Each floor also has an "at rest" column. The writes, the copy and the durable
publish are measured again in the driver, resting the job's checkpoint interval
before each of three rounds; the header gives the price of memory written again
after that rest, per 4 KiB page (``memory_at_rest.rested_touch_us``). A hop's or
hand-off's value at rest is derived, not measured: its warm floor plus what a
hand-off and first step cost more after the rest than right after
(``rested_step_ms``, five rounds). Where idle memory ages (a VM), work done once a
checkpoint pays between the two columns: more than back to back, less than a
process that did nothing else (docs/benchmarks.md, "Memory at rest").

Each subtask's snapshot is split into its parts (the unaligned barrier's
forward with the output state it overtook, the begun records, the capture, the
hand-off to the snapshot thread, the keyed write; the capture's floor is a memory
copy of the state's bytes, the keyed write's the write above), and its wait for
the last input barrier into the upstream subtasks' forwards apart (a trigger's
spread, a busy source) and the last one's hop (floor: a loopback TCP message and a
hand-off on Spark, where the last barrier comes from the other worker).

On Spark, per worker: from the checkpoint's first trigger there to its last
acknowledgement, the time and the process's CPU time (all its threads), and their
ratio: near 1, the worker's one core was busy with the checkpoint throughout, and
what shortens it is less work, not fewer waits.

Per subtask, the medians and maxima of what each acknowledged: start delay
(trigger to snapshot), sync (the task thread's part), async (the snapshot
thread's operator part) and persist (an unaligned checkpoint's in-flight data,
from its start to the acknowledgement, of which inputs is the wait for the last
input's barrier, and close the channel state's files finished, on the task thread
when closed_on_task_thread is 1, else on the channel-state thread), acked (when
the acknowledgement reached the coordinator, from the trigger).

    PYTHONPATH=src .venv/bin/python bench/checkpoint_breakdown.py --executor local
    PYTHONPATH=src .venv/bin/python bench/checkpoint_breakdown.py --executor spark
    PYTHONPATH=src .venv/bin/python bench/checkpoint_breakdown.py --executor spark --interval-ms 100
    PYTHONPATH=src .venv/bin/python bench/checkpoint_breakdown.py --no-spares   # A/B

``--no-spares`` makes every staging file of shared channel-state files on the task
thread at the barrier, as before they were made ahead (docs/runtime.md). Run
alternately: single runs on a shared machine move by several milliseconds. See
docs/benchmarks.md, "Checkpoint phases and the task loop, issue 34".
"""

from __future__ import annotations

import argparse
import glob
import os
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from bench_durability import completion_files
from memory_at_rest import rested_median, rested_touch_us, write_ms
from spillover.benchmark.runner import create_executor, run_sampled
from spillover.benchmark.spec import BenchSpec, build_job
from spillover.cli.options import define_option, defines
from spillover.deploy.spark.worker import WorkerSpec
from spillover.errors import ConfigError
from spillover.runtime.checkpointing import coordinator
from spillover.runtime.checkpointing.metadata import METADATA_FILE
from spillover.storage import shared
from spillover.storage.channel_index import INDEX_FILE
from spillover.storage.location import Location, publish_in_order

METRICS = (
    "start_delay_ms",
    "sync_ms",
    "async_ms",
    "inputs_ms",
    "close_ms",
    "closed_on_task_thread",
    "persist_ms",
    "acked_ms",
)


def _median_p90(values: Sequence[float]) -> tuple[float, float]:
    v = sorted(values)
    return statistics.median(v), v[min(len(v) - 1, int(0.9 * len(v)))]


def handoff_ms(rounds: int = 2000) -> float:
    """One way of a ping-pong between two threads over ``queue.SimpleQueue``s: what a
    hand-off from one thread to another costs on this machine now."""
    there: queue.SimpleQueue[int] = queue.SimpleQueue()
    back: queue.SimpleQueue[int] = queue.SimpleQueue()

    def echo() -> None:
        while (n := there.get()) >= 0:
            back.put(n)

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    times = []
    for i in range(rounds):
        t0 = time.perf_counter()
        there.put(i)
        back.get()
        times.append(time.perf_counter() - t0)
    there.put(-1)
    t.join()
    return statistics.median(times) / 2 * 1000


def rested_step_ms(rest_s: float, rounds: int = 5) -> tuple[float, float]:
    """A thread's hand-off and its first small step (50 dicts built) once the process
    rested ``rest_s`` seconds, as the checkpoint's threads that run once a checkpoint
    do (the coordinator, a worker's control thread, the snapshot threads), and the
    same step right after it, warm (medians, ms). On a machine whose idle cores lose
    their caches (a VM beside others) the first is far above :func:`handoff_ms`."""
    there: queue.SimpleQueue[float] = queue.SimpleQueue()
    back: queue.SimpleQueue[tuple[float, float]] = queue.SimpleQueue()

    def step() -> float:
        t0 = time.perf_counter()
        _ = [{"step": i} for i in range(50)]
        return time.perf_counter() - t0

    def woken() -> None:
        while (sent := there.get()) >= 0:
            cold = time.perf_counter() - sent + step()
            back.put((cold, step()))

    t = threading.Thread(target=woken, daemon=True)
    t.start()
    cold, warm = [], []
    for _ in range(rounds):
        time.sleep(rest_s)
        there.put(time.perf_counter())
        c, w = back.get()
        cold.append(c)
        warm.append(w)
    there.put(-1.0)
    t.join()
    return statistics.median(cold) * 1000, statistics.median(warm) * 1000


_WAKER = r"""
import socket, sys, time
s = socket.socket(fileno=int(sys.argv[1]))
for _ in range(int(sys.argv[2])):
    time.sleep(0.001)
    s.sendall(time.monotonic_ns().to_bytes(8, "little"))
s.close()
"""


def busy_wakeup_ms(busy: int, switch_interval: float, rounds: int = 300) -> float:
    """A thread of this process woken by another process's message while ``busy``
    other threads here run Python without a pause, at ``switch_interval``: from the
    send to the woken thread running Python (median). The floor of a trigger or a
    barrier reaching a worker whose task threads are at work, since the woken
    thread waits for the interpreter lock (and, on a loaded machine, for a core)."""
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            for i in range(100):
                x += i

    before = sys.getswitchinterval()
    sys.setswitchinterval(switch_interval)
    spinners = [threading.Thread(target=spin, daemon=True) for _ in range(busy)]
    for t in spinners:
        t.start()
    mine, theirs = socket.socketpair()
    waker = subprocess.Popen(
        [sys.executable, "-c", _WAKER, str(theirs.fileno()), str(rounds)],
        pass_fds=[theirs.fileno()],
    )
    theirs.close()
    times: list[float] = []
    try:
        while len(times) < rounds:
            data = mine.recv(8, socket.MSG_WAITALL)
            if len(data) < 8:
                break
            times.append((time.monotonic_ns() - int.from_bytes(data, "little")) / 1e6)
    finally:
        stop.set()
        waker.wait()
        mine.close()
        for t in spinners:
            t.join()
        sys.setswitchinterval(before)
    return statistics.median(times) if times else float("nan")


def tcp_ms(rounds: int = 2000, size: int = 64) -> float:
    """One way of a ping-pong of ``size``-byte messages over loopback TCP, each end
    on its own thread (blocking receives, as a control connection's reader)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def echo() -> None:
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while data := conn.recv(size, socket.MSG_WAITALL):
                conn.sendall(data)

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    msg, times = b"x" * size, []
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(rounds):
            t0 = time.perf_counter()
            c.sendall(msg)
            c.recv(size, socket.MSG_WAITALL)
            times.append(time.perf_counter() - t0)
    t.join()
    server.close()
    return statistics.median(times) / 2 * 1000


def completion_publish_ms(
    nbytes: int, directory: str, rounds: int = 30, rest_s: float = 0.0
) -> float:
    """Publishing ``nbytes`` of metadata and then an event's 300 B durably, as a
    completion does (``publish_in_order``: both files written and fsynced, then each
    named and its directory fsynced in turn; median): the floor with
    ``state.checkpoints.fsync-metadata`` on, the default."""
    base, meta, event = Location.parse(directory), os.urandom(nbytes), os.urandom(300)
    tag = f"r{rest_s:g}"  # warm and rested calls share the directory

    def sample(i: int) -> float:
        files = completion_files(base, f"{tag}-{i}", meta, event)
        t0 = time.perf_counter()
        publish_in_order(files)
        return (time.perf_counter() - t0) * 1000

    return rested_median(sample, rounds, rest_s)


def copy_ms(nbytes: int, rounds: int = 200, rest_s: float = 0.0) -> float:
    """Copying ``nbytes`` in memory (median): the floor of a state's capture, which
    copies the state's arrays so that the write may run while the task goes on."""
    if nbytes <= 0:
        return 0.0
    data = np.frombuffer(os.urandom(nbytes), dtype=np.uint8)

    def sample(_: int) -> float:
        t0 = time.perf_counter()
        data.copy()
        return (time.perf_counter() - t0) * 1000

    return rested_median(sample, rounds, rest_s)


ORDER = (
    "trigger",
    "barrier hop",
    "snapshot",
    "inputs",
    "channel-state close",
    "ack",
    "meta",
    "chec",
)


def phases(
    done: list[dict[str, Any]],
    triggered_at: dict[int, float],
    predecessors: dict[str, list[str]],
    posted_at: dict[int, float] | None = None,
) -> dict[str, list[float]]:
    """Per phase, its durations in ms over every completed checkpoint (and subtask of
    the vertex a phase names), in the order a checkpoint goes through them."""
    out: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        out.setdefault(name, []).append(value)

    vertices = list(predecessors)  # the graph's order: sources first
    for c in done:
        subs: dict[str, dict[str, float]] = c["subtasks"]
        at = triggered_at.get(c["checkpoint_id"])
        posted = (posted_at or {}).get(c["checkpoint_id"])
        if at is not None and posted is not None:
            add("trigger: the coordinator sends it to every root", (posted - at) * 1000)
        by_vertex: dict[str, list[dict[str, float]]] = {}
        index: dict[int, int] = {}  # id(metrics) -> subtask: its worker, one slot each
        for key, m in subs.items():
            by_vertex.setdefault(key.rsplit("#", 1)[0], []).append(m)
            index[id(m)] = int(key.rsplit("#", 1)[1])
        for vertex in sorted(by_vertex, key=lambda v: vertices.index(v) if v in vertices else 0):
            ups = predecessors.get(vertex, [])
            for m in by_vertex[vertex]:
                if "taken_at" not in m:
                    continue
                if not ups and at is not None:
                    add("trigger", (m["taken_at"] - at) * 1000)
                    if "trigger_in_at" in m:  # Spark: the worker's control thread had it
                        add(
                            "trigger: to the worker's control thread",
                            (m["trigger_in_at"] - at) * 1000,
                        )
                        add(
                            "trigger: control thread to task",
                            (m["taken_at"] - m["trigger_in_at"]) * 1000,
                        )
                for up in ups:
                    fwd = [u["forwarded_at"] for u in by_vertex.get(up, []) if "forwarded_at" in u]
                    if fwd:
                        add(f"barrier hop {up} -> {vertex}", (m["taken_at"] - min(fwd)) * 1000)
                # Spark: a TCP receiving thread had a barrier (from another worker; the
                # benchmark's workers have one slot each, subtask i on worker i)
                inb = m.get("barrier_in_at")
                if inb is not None and ups:
                    fwd = [  # the upstream subtasks on other workers
                        u["forwarded_at"]
                        for up in ups
                        for u in by_vertex.get(up, [])
                        if "forwarded_at" in u and index[id(u)] != index[id(m)]
                    ]
                    if fwd:
                        add(
                            f"barrier hop to {vertex}: TCP to receiving thread",
                            (inb - min(fwd)) * 1000,
                        )
                    if inb <= m["taken_at"]:  # the task took this barrier first
                        add(
                            f"barrier hop to {vertex}: receiving thread to task",
                            (m["taken_at"] - inb) * 1000,
                        )
                add(f"snapshot {vertex}", m.get("sync_ms", 0.0) + m.get("async_ms", 0.0))
                if "capture_ms" in m:
                    for part, value in snapshot_parts(m).items():
                        add(f"snapshot {vertex}: {part}", value)
                if "inputs_ms" in m and ups:
                    add(f"inputs {vertex} (last barrier in)", m["inputs_ms"])
                    fwd = [
                        u["forwarded_at"]
                        for up in ups
                        for u in by_vertex.get(up, [])
                        if u.get("forwarded_at")
                    ]
                    if len(fwd) > 1:
                        # Why the last barrier comes late: the upstream subtasks' forwards
                        # apart (a trigger's spread, a busy source), then its hop.
                        last_in = m["taken_at"] + m["inputs_ms"] / 1000
                        add(
                            f"inputs {vertex}: upstream forwards apart",
                            (max(fwd) - min(fwd)) * 1000,
                        )
                        add(
                            f"inputs {vertex}: last forward to last barrier in",
                            (last_in - max(fwd)) * 1000,
                        )
                if "close_ms" in m:
                    add(f"channel-state close {vertex}", m["close_ms"])
                if "ack_sent_at" in m and "received_at" in m:
                    add("acknowledgement", (m["received_at"] - m["ack_sent_at"]) * 1000)
                    if "ack_read_at" in m:  # Spark: the master's reading thread had it
                        sent, read = m["ack_sent_at"], m["ack_read_at"]
                        add("acknowledgement: to the master's reading thread", (read - sent) * 1000)
                        add(
                            "acknowledgement: reading thread to coordinator",
                            (m["received_at"] - read) * 1000,
                        )
        roots = [
            m["taken_at"]
            for v, ms in by_vertex.items()
            if not predecessors.get(v)
            for m in ms
            if "taken_at" in m
        ]
        if len(roots) > 1:
            add("trigger: sources take it apart", (max(roots) - min(roots)) * 1000)
        add("metadata (after the last ack)", float(c["finalize_ms"]))
        if "metadata_ms" in c:  # its split: the metadata file built, then published
            add("metadata: the metadata file built", float(c["metadata_ms"]))
            add(
                "metadata: published with its log record",
                float(c["finalize_ms"]) - float(c["metadata_ms"]),
            )
        add("checkpoint (trigger to completion)", float(c["duration_ms"]))
    rank = {name: next(i for i, p in enumerate(ORDER) if name.startswith(p)) for name in out}
    return {name: out[name] for name in sorted(out, key=lambda n: rank[n])}


def worker_windows(done: list[dict[str, Any]]) -> dict[int, dict[str, list[float]]]:
    """Per Spark worker (the benchmark's subtask i runs on worker i), over the
    checkpoints, from the acknowledgement that came last there: ``wall`` and ``cpu``,
    the time and the process's CPU time from the checkpoint's first trigger there;
    ``busy`` their ratio; ``before``, the same ratio from the worker's
    acknowledgement before to that trigger (its baseline, the job between
    checkpoints)."""
    out: dict[int, dict[str, list[float]]] = {}
    for c in done:
        last: dict[int, dict[str, float]] = {}
        for key, m in c["subtasks"].items():
            worker = int(key.rsplit("#", 1)[1])
            if m.get("worker_wall_ms", -1.0) > last.get(worker, {}).get("worker_wall_ms", -1.0):
                last[worker] = m
        for worker, m in last.items():
            w = out.setdefault(worker, {"wall": [], "cpu": [], "busy": [], "before": []})
            wall, cpu = float(m["worker_wall_ms"]), float(m["worker_cpu_ms"])
            w["wall"].append(wall)
            w["cpu"].append(cpu)
            if wall > 0:
                w["busy"].append(cpu / wall)
            if "worker_busy_before" in m:
                w["before"].append(float(m["worker_busy_before"]))
    return out


def snapshot_parts(m: dict[str, float]) -> dict[str, float]:
    """A subtask's snapshot split into its parts (ms): on the task thread the
    unaligned barrier's forward with the output state it overtook, what came before
    the capture (the recovered cut, the begun records, what the barrier overtook on
    its channel), the operators' and keyed state's capture; then the hand-off to the
    snapshot thread (not in the snapshot's total), the operators' files and the
    keyed state's write."""
    sync, forward, before = m.get("sync_ms", 0.0), m.get("forward_ms", 0.0), m.get("before_ms", 0.0)
    capture, keyed = m.get("capture_ms", 0.0), m.get("keyed_write_ms", 0.0)
    return {
        "forward": forward,
        "begun records, cut": max(0.0, before - forward),
        "capture": capture,
        "rest of sync": max(0.0, sync - before - capture),
        "hand-off to snapshot thread": m.get("handoff_ms", 0.0),
        "keyed write": keyed,
        "operator files": max(0.0, m.get("async_ms", 0.0) - keyed),
    }


def record_coordinator(
    triggered_at: dict[int, float], graph: dict[str, Any], posted_at: dict[int, float] | None = None
) -> Callable[[], None]:
    """Makes the coordinator keep, for this run, each checkpoint's per-subtask metrics
    and finalize time in its summary, the wall-clock time it triggered each
    checkpoint and took each acknowledgement, and its job graph. Returns the undo."""
    cls = coordinator.CheckpointCoordinator
    posted_at = {} if posted_at is None else posted_at
    plain_summary, plain_trigger, plain_ack = (
        coordinator.CheckpointStats.summary,
        cls._trigger,
        cls._on_ack,
    )

    def summary(self: coordinator.CheckpointStats) -> dict[str, Any]:
        return {
            **plain_summary(self),
            "subtasks": self.subtasks,
            "finalize_ms": self.finalize_ms,
            "metadata_ms": self.metadata_ms,
        }

    def trigger(self: Any, *args: Any, **kw: Any) -> int | None:
        graph.update(self.graph)
        t = time.time()
        cid: int | None = plain_trigger(self, *args, **kw)
        if cid is not None:
            triggered_at[cid] = t
            posted_at[cid] = time.time()  # every root's trigger sent (Spark: written)
        return cid

    def on_ack(self: Any, ack: Any) -> None:
        ack.metrics["received_at"] = time.time()
        plain_ack(self, ack)

    coordinator.CheckpointStats.summary = summary  # type: ignore[method-assign]
    cls._trigger = trigger  # type: ignore[method-assign]
    cls._on_ack = on_ack  # type: ignore[method-assign]

    def undo() -> None:
        coordinator.CheckpointStats.summary = plain_summary  # type: ignore[method-assign]
        cls._trigger = plain_trigger  # type: ignore[method-assign]
        cls._on_ack = plain_ack  # type: ignore[method-assign]

    return undo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--executor", default="local", choices=["local", "spark"])
    ap.add_argument("--policy", default="unaligned")
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--no-spares", action="store_true", help="no staging files made ahead")
    ap.add_argument(
        "--per-file",
        type=int,
        default=None,
        help="execution.checkpointing.unaligned.max-subtasks-per-channel-state-file",
    )
    ap.add_argument(
        "--interval-ms",
        type=int,
        default=BenchSpec.interval_ms,
        help="checkpoint interval (default: spillover bench's); the floors at rest rest as long",
    )
    define_option(
        ap,
        "a configuration option for the job (repeatable), as spillover bench -D, "
        "e.g. taskmanager.network.memory.floating-buffers-per-gate=0",
    )
    args = ap.parse_args()
    if args.interval_ms < 10:
        ap.error("--interval-ms must be at least 10")
    if args.no_spares:
        shared._Spares.AHEAD = 0
    triggered_at: dict[int, float] = {}
    posted_at: dict[int, float] = {}
    graph: dict[str, Any] = {}
    record_coordinator(triggered_at, graph, posted_at)
    try:  # keys the bench sets itself are refused: --policy and the flags set them
        spec = BenchSpec(
            executor=args.executor,
            duration_s=args.duration,
            warmup_s=args.warmup,
            interval_ms=args.interval_ms,
            policies=[args.policy],
            options=defines(args.define),
        )
    except ConfigError as e:
        ap.error(str(e))
    with tempfile.TemporaryDirectory(prefix="spillover-breakdown-") as tmp:
        config = spec.config(args.policy, tmp)
        if args.per_file is not None:
            key = "execution.checkpointing.unaligned.max-subtasks-per-channel-state-file"
            config = config.with_options({key: args.per_file})
        ex = create_executor(args.executor, build_job(spec, "breakdown"), config)
        ex.prepare()
        result, _, _ = run_sampled(
            ex,
            lambda: ex.live_metric("sink", "records_in"),
            spec.warmup_s,
            spec.run_s,
            spec.duration_s,
        )
        newest = max(
            glob.glob(os.path.join(tmp, "**", METADATA_FILE), recursive=True),
            key=os.path.getmtime,
            default=None,
        )
        meta_bytes = 0
        if newest is not None:
            for name in (METADATA_FILE, INDEX_FILE):
                path = os.path.join(os.path.dirname(newest), name)
                meta_bytes += os.path.getsize(path) if os.path.exists(path) else 0
        done = [c for c in result.checkpoints if c["status"] == "completed" and not c.get("final")]
        if not done:
            raise SystemExit("no checkpoint completed")
        per_vertex: dict[str, dict[str, list[float]]] = {}
        for c in done:
            for key, m in c["subtasks"].items():
                v = per_vertex.setdefault(key.rsplit("#", 1)[0], {"state": [], "inflight": []})
                v["state"].append(m.get("state_bytes", 0.0))
                v["inflight"].append(m.get("inflight_bytes", 0.0))
        floor_dir = os.path.join(tmp, "floors")
        os.makedirs(floor_dir)
        handoff, tcp = handoff_ms(), tcp_ms()
        # Each floor twice: back to back, and after resting as long as the job did
        # between checkpoints (its interval), the state the checkpoint's path is in.
        rest = spec.interval_ms / 1000
        durable = completion_publish_ms(meta_bytes, floor_dir)
        floors: dict[str, float] = {
            "metadata (after the last ack)": write_ms(meta_bytes, floor_dir),
            "metadata: published with its log record": durable,
        }
        at_rest: dict[str, float] = {
            "metadata (after the last ack)": write_ms(meta_bytes, floor_dir, 3, rest),
            "metadata: published with its log record": completion_publish_ms(
                meta_bytes, floor_dir, 3, rest
            ),
        }
        sizes = []
        for vertex, b in per_vertex.items():
            state, inflight = (
                int(statistics.median(b["state"])),
                int(statistics.median(b["inflight"])),
            )
            for table, rounds, r in ((floors, 30, 0.0), (at_rest, 3, rest)):
                table[f"snapshot {vertex}"] = write_ms(state, floor_dir, rounds, r)
                table[f"snapshot {vertex}: keyed write"] = table[f"snapshot {vertex}"]
                table[f"snapshot {vertex}: capture"] = copy_ms(state, rounds, r)
                table[f"channel-state close {vertex}"] = write_ms(inflight, floor_dir, rounds, r)
            sizes.append(f"{vertex} {state} / {inflight}")
    remote = args.executor != "local"
    predecessors = {
        uid: [i["source"] for i in v.get("inputs", []) if not i.get("feedback")]
        for uid, v in graph.get("vertices", {}).items()
    }
    floors["trigger"] = floors["acknowledgement"] = handoff + (tcp if remote else 0.0)
    # A wake-up from another process, in a process at rest and in one with a busy
    # thread (Spark workers run at WorkerSpec.switch_interval).
    switch = WorkerSpec.switch_interval if remote else sys.getswitchinterval()
    idle, busy = busy_wakeup_ms(0, switch), busy_wakeup_ms(1, switch)
    rested, warm = rested_step_ms(rest)
    touch_cold, touch_warm = rested_touch_us(rest)
    for vertex in predecessors:
        floors[f"inputs {vertex}: last forward to last barrier in"] = floors["trigger"]
    found = phases(done, triggered_at, predecessors, posted_at)
    for name in found:
        if name.startswith(("trigger:", "acknowledgement:")):
            floors[name] = tcp if name.endswith("thread") else handoff
        if name.endswith("TCP to receiving thread"):
            floors[name] = tcp
        if name.endswith("to task") or name.endswith("to coordinator"):
            floors[name] = handoff
        if name.startswith("barrier hop") or name.endswith("hand-off to snapshot thread"):
            floors.setdefault(name, handoff)
    # A hop at rest: its warm floor plus what a hand-off and first step cost more
    # after the interval's rest than right after (rested_step_ms, five rounds).
    for name, floor in floors.items():
        at_rest.setdefault(name, floor + max(0.0, rested - warm - handoff))
    durations = [float(c["duration_ms"]) for c in done]
    print(
        f"{len(done)} checkpoints on the {args.executor} executor, median "
        f"{statistics.median(durations):.2f} ms; floors measured after the job: thread "
        f"hand-off {handoff:.3f} ms, loopback TCP one way {tcp:.3f} ms, a thread woken by "
        f"another process {idle:.3f} ms (with one busy Python thread beside it at a "
        f"{switch * 1000:g} ms switch interval: {busy:.3f} ms), a hand-off and a small "
        f"step after {rest:g} s at rest {rested:.3f} ms (the step again, warm: {warm:.3f} ms), "
        f"writes without "
        f"fsync of a subtask's median state / in-flight bytes ({', '.join(sizes)}) and "
        f"of the metadata ({meta_bytes} B; published durably with an event's 300 B "
        f"after it, as a completion does: {durable:.3f} ms). At rest: memory written "
        f"again after {rest:g} s {touch_cold:.2f} us per 4 KiB page (right after: "
        f"{touch_warm:.2f} us); the last column is each floor measured after {rest:g} s "
        f"at rest, as the job's interval leaves the checkpoint's path"
    )
    print(
        "phase".ljust(44)
        + "median ms".rjust(11)
        + "p90 ms".rjust(11)
        + "floor ms".rjust(11)
        + "at rest".rjust(11)
    )
    for name, values in found.items():
        med, p90 = _median_p90(values)
        cells = [
            f"{f:.3f}" if f is not None else "-" for f in (floors.get(name), at_rest.get(name))
        ]
        print(
            name.ljust(44)
            + f"{med:.3f}".rjust(11)
            + f"{p90:.3f}".rjust(11)
            + "".join(c.rjust(11) for c in cells)
        )
    print()
    windows = worker_windows(done)
    if windows:
        print(
            "each worker from the checkpoint's first trigger there to its last acknowledgement "
            "(Spark): the time, the process's CPU time, their ratio (1: its core was busy "
            "with the checkpoint throughout), and beside it the same ratio from the "
            "worker's acknowledgement before to the trigger (the job between checkpoints)"
        )
        heads = ("wall ms", "cpu ms", "cpu / wall", "cpu / wall before")
        print("worker".ljust(12) + "".join(k.rjust(22) for k in heads))
        for worker, w in sorted(windows.items()):
            cells = [
                "{:.3f} (p90 {:.3f})".format(*_median_p90(w[k])) if w[k] else "-"
                for k in ("wall", "cpu", "busy", "before")
            ]
            print(f"worker {worker}".ljust(12) + "".join(c.rjust(22) for c in cells))
        print()
    rows: dict[str, dict[str, list[float]]] = {}
    for c in done:
        for subtask, m in c["subtasks"].items():
            for k in METRICS:
                if k in m:
                    rows.setdefault(subtask, {}).setdefault(k, []).append(float(m[k]))
    finalize = [float(c["finalize_ms"]) for c in done]
    print(
        f"after the last acknowledgement (metadata, event log) median "
        f"{statistics.median(finalize):.2f} ms "
        "(median / max per subtask, ms; closed_on_task_thread: the share of checkpoints)"
    )
    print("subtask".ljust(12) + "".join(k.removesuffix("_ms").rjust(22) for k in METRICS))
    for subtask in sorted(rows):
        cells = []
        for k in METRICS:
            v = rows[subtask].get(k)
            if v and k == "closed_on_task_thread":
                cells.append(f"{statistics.fmean(v):.2f}")
                continue
            cells.append(f"{statistics.median(v):.2f} / {max(v):.2f}" if v else "-")
        print(subtask.ljust(12) + "".join(c.rjust(22) for c in cells))


if __name__ == "__main__":
    main()
