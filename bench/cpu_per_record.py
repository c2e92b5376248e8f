#!/usr/bin/env python3
"""CPU time per record of the `spillover bench` job: one policy runs once, and over
its measured window (warm-up excluded) the CPU time of this process and every
process below it (the Spark workers and driver JVM with ``--executor spark``) is
divided by the records the sinks took. On a loaded shared machine the records per
second of single runs move by tens of percent; CPU time per record moves far less,
so an A/B of two trees reads better in it (same command, alternating trees).

    PYTHONPATH=src .venv/bin/python bench/cpu_per_record.py --executor local --policy none
    PYTHONPATH=src .venv/bin/python bench/cpu_per_record.py --policy unaligned --sink-rate 5000
    PYTHONPATH=src .venv/bin/python bench/cpu_per_record.py --executor spark --segment-size 512kb
    PYTHONPATH=src .venv/bin/python bench/cpu_per_record.py --executor spark --slots 2  # one worker
    PYTHONPATH=src .venv/bin/python bench/cpu_per_record.py -D spillover.cpu-pinning.enabled=false
    # each process's cores (driver, JVM, workers): paced, with checkpoints and without
    PYTHONPATH=src .venv/bin/python bench/cpu_per_record.py --executor spark --policy unaligned \
        --sink-rate 5000 --by-process

See docs/benchmarks.md, "Checkpoint phases and the task loop, issue 34".
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from spillover.benchmark.runner import create_executor, run_sampled
from spillover.benchmark.spec import BenchSpec, build_job
from spillover.cli.options import defines
from spillover.config import Config, NetworkConfig
from spillover.config.units import parse_memory_size
from spillover.errors import ConfigError

_TICKS = os.sysconf("SC_CLK_TCK")


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        out.setdefault(ppid, []).append(int(name))
    return out


def tree_cpu_by_process(root: int | None = None) -> dict[tuple[int, str], float]:
    """User + system CPU seconds of process ``root`` (this one) and of each of its live
    descendants, from /proc (a process that already exited is not counted):
    ``(pid, role)`` -> seconds, the role ``driver`` (this process), ``jvm``,
    ``worker`` (a Python process below the JVM that runs subtasks) or its command's
    name."""
    root = os.getpid() if root is None else root
    kids, todo, out = _children(), [root], {}
    while todo:
        pid = todo.pop()
        todo.extend(kids.get(pid, []))
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        name = os.path.basename(argv[0].decode(errors="replace")) if argv[0] else "?"
        role = (
            "driver"
            if pid == root
            else "jvm"
            if name == "java"
            else "worker"
            if name.startswith("python")
            else name
        )
        out[(pid, role)] = (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--executor", default="local", choices=["local", "spark", "processes"])
    ap.add_argument("--policy", default="none")
    ap.add_argument("--sink-rate", type=float, default=1e8)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument(
        "--segment-size",
        type=parse_memory_size,
        default=NetworkConfig.segment_size,
        help="taskmanager.memory.segment-size, e.g. 256kb (default: the configuration's)",
    )
    ap.add_argument(
        "--by-process",
        action="store_true",
        help="also the cores of each process in the window (driver, JVM, each worker): "
        "a checkpointing policy's less a --policy none run's, times the interval, is "
        "what each process spends on a checkpoint",
    )
    ap.add_argument(
        "--slots",
        type=int,
        default=BenchSpec.slots,
        help="taskmanager.numberOfTaskSlots: subtasks of each operator one worker hosts",
    )
    ap.add_argument(
        "-D",
        dest="options",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a configuration key for the job, e.g. -D spillover.cpu-pinning.enabled=false",
    )
    args = ap.parse_args()
    try:  # a bad -D: one line, before anything starts
        options = defines(args.options)
    except ConfigError as e:
        ap.error(str(e))
    try:
        Config.from_dict(options)
    except ConfigError as e:
        ap.error(f"-D: {e}")
    spec = BenchSpec(
        executor=args.executor,
        duration_s=args.duration,
        warmup_s=args.warmup,
        sink_rate=args.sink_rate,
        segment_size=args.segment_size,
        slots=args.slots,
        options=options,
    )
    # (wall, CPU seconds per process, sink records, the count's input records: what
    # the sources generated)
    samples: list[tuple[float, dict[tuple[int, str], float], float, float]] = []
    with tempfile.TemporaryDirectory(prefix="spillover-cpu-") as tmp:
        ex = create_executor(args.executor, build_job(spec, "cpu"), spec.config(args.policy, tmp))
        ex.prepare()

        def read() -> float:
            records = float(ex.live_metric("sink", "records_in"))
            counted = float(ex.live_metric("count", "records_in"))
            samples.append((time.monotonic(), tree_cpu_by_process(), records, counted))
            return records

        run_sampled(ex, read, spec.warmup_s, spec.run_s, spec.duration_s)
        started = ex.running_since()
    # The window's ends: the first sample at or after the warm-up, and the last.
    inside = [s for s in samples if started is None or s[0] - started >= spec.warmup_s - 0.05]
    (w0, first, r0, g0), (w1, last, r1, g1) = inside[0], inside[-1]
    c0, c1 = sum(first.values()), sum(last.values())
    if r1 <= r0 or g1 <= g0:
        raise SystemExit("the sinks took no records in the window")
    # The count emits one row per key a buffer touched, so the sink's rows per
    # generated record fall as buffers grow: both counts are given.
    print(
        f"{args.executor} {args.policy}: {(r1 - r0) / (w1 - w0):,.0f} records/s, "
        f"{(c1 - c0) / (w1 - w0):.2f} cores, CPU {(c1 - c0) / (r1 - r0) * 1e6:.3f} µs per record "
        f"(load average {os.getloadavg()[0]:.1f}); generated {(g1 - g0) / (w1 - w0):,.0f} "
        f"records/s, CPU {(c1 - c0) / (g1 - g0) * 1e6:.3f} µs per generated record, "
        f"{(r1 - r0) / (g1 - g0):.3f} sink rows per generated record"
    )
    if args.by_process:  # a checkpoint's CPU: these against a --policy none run's
        for key in sorted(last, key=lambda k: (k[1], k[0])):
            used = last[key] - first.get(key, 0.0)
            print(f"  {key[1]} (pid {key[0]}): {used / (w1 - w0):.3f} cores")


if __name__ == "__main__":
    main()
