"""Where the `spillover bench` job's time goes: py-spy samples of its task threads, per stage.

Run (what ``make profile`` does)::

    .venv/bin/py-spy record --native --idle -r 200 --format raw -o profile.txt -- \\
        .venv/bin/spillover bench --executor local --policies none --sink-rate 100000000 \\
        --duration 10 --warmup 3 --repeat 1 --out profile-results
    .venv/bin/python bench/profile_stages.py profile.txt profile-results/bench.json

For Spark, record the worker processes too (``py-spy record --subprocesses``): their
task threads are classified the same way.

Every sample of a task thread (a stack through ``Task._run``) is one of:

- **busy**: running, or runnable and descheduled by the OS (on a loaded machine the two
  look alike, so shares are meaningful and absolute times are not);
- **GIL wait**: blocked re-acquiring the GIL (``pthread_cond_timedwait`` called straight
  from the interpreter or a native module after a release, not from a lock wait);
- **idle**: blocked on a lock, queue or condition (waiting for input, credit or mail).

and belongs to the stage of the innermost frame that names one (table ``STAGES``).
The µs per record share out the task threads' time per record (3 vertices × the
parallelism threads, over the warm-up and the measured window, per record the sinks
took) by samples, so samples py-spy drops when it falls behind do not bias them; under
load they are wall time summed over threads, not CPU time.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from typing import Any

STAGES: list[tuple[str, str]] = [  # innermost match wins
    ("ThrottledSink.process", "sink"),
    ("RecordWriter.write_batch", "rebalance: serialize + pack"),
    ("KeyGroupDemux.push", "key_by: frame + route"),
    ("PartitionWriter.emit", "writer (Python)"),
    ("_KeyedAggregate.process", "keyed count"),
    ("GeneratorSource", "source: generate"),
    ("FixedWidthSerializer", "deserialize"),
    ("RecordReader.feed", "deserialize"),
    ("Task._process", "deserialize"),
    ("Outbox.drain", "network hand-off"),
    ("ResultPartition.emit", "network hand-off"),
    ("NetworkBuffer.release", "network hand-off"),
    ("InputGate.poll", "gate poll"),
    ("Task.mail", "mailbox"),
    ("Task.take_priority", "mailbox"),
]
_LOCK_WAITS = ("PyThread_acquire_lock_timed", "sem_clockwait", "sem_timedwait", "spl_wake_wait")


def wait_state(frames: list[str]) -> str:
    """``busy``, ``gil`` or ``idle`` for one stack (outermost frame first)."""
    for i in range(len(frames) - 1, -1, -1):
        name = frames[i]
        if name.startswith(("pthread_cond_timedwait", "pthread_cond_wait")):
            callers = frames[max(0, i - 2) : i]
            return "idle" if any(c.startswith(_LOCK_WAITS) for c in callers) else "gil"
        if name.startswith(_LOCK_WAITS):
            return "idle"
        if not name.startswith(("0x", "pthread_mutex", "__")):
            return "busy"  # the innermost named frame is not a wait
    return "busy"


def stage_of(frames: list[str]) -> str:
    for name in reversed(frames):
        for marker, stage in STAGES:
            if name.startswith(marker):
                if stage == "writer (Python)":
                    from_source = any("GeneratorSource" in f for f in frames)
                    return "key_by: frame + route" if from_source else "rebalance: serialize + pack"
                return stage
    return "task loop"


def classify(path: str) -> tuple[collections.Counter[tuple[str, str]], collections.Counter[str]]:
    by: collections.Counter[tuple[str, str]] = collections.Counter()
    states: collections.Counter[str] = collections.Counter()
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            if "Task._run " not in stack:
                continue
            frames = stack.split(";")
            state = wait_state(frames)
            by[(stage_of(frames), state)] += int(count)
            states[state] += int(count)
    return by, states


def sink_records(results: Any) -> int | None:
    """Records the sinks took over the whole run (the last point of ``sink_series``)."""
    if isinstance(results, dict):
        series = results.get("sink_series")
        if series:
            return int(series[-1][1])
        items: list[Any] = list(results.values())
    elif isinstance(results, list):
        items = results
    else:
        return None
    for v in items:
        found = sink_records(v)
        if found:
            return found
    return None


def thread_seconds(results: Any) -> float | None:
    """Task-thread seconds of the run: 3 vertices × parallelism × (warm-up + window)."""
    spec = results.get("spec") if isinstance(results, dict) else None
    if not spec:
        return None
    return 3 * float(spec["parallelism"]) * (float(spec["warmup_s"]) + float(spec["duration_s"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("profile", help="py-spy --format raw output")
    ap.add_argument("results", nargs="?", help="the run's bench.json (for µs per record)")
    a = ap.parse_args(argv)
    try:
        by, states = classify(a.profile)
        records, seconds = None, None
        if a.results:
            with open(a.results) as f:
                results = json.load(f)
            records, seconds = sink_records(results), thread_seconds(results)
    except (OSError, ValueError) as e:
        print(f"profile_stages: {e}", file=sys.stderr)
        return 2
    total = sum(states.values())
    if not total:
        print("profile_stages: no task-thread samples in the profile", file=sys.stderr)
        return 2
    busy, gil = states["busy"], states["gil"]
    print(
        f"task-thread samples: {total}; busy {busy / total:.1%}, "
        f"GIL wait {gil / total:.1%}, idle {states['idle'] / total:.1%}"
        + (f"; {records:,} records at the sinks" if records else "")
    )

    per_record = seconds * 1e6 / records if records and seconds else None

    def us(n: int) -> str:
        return f"{n / total * per_record:.2f}" if per_record else "–"

    print("\n| stage | share of busy | busy µs/record | GIL wait µs/record |")
    print("|---|---:|---:|---:|")
    for stage in sorted({s for s, _ in by}, key=lambda s: -by[(s, "busy")]):
        b, g = by[(stage, "busy")], by[(stage, "gil")]
        print(f"| {stage} | {b / busy:.1%} | {us(b)} | {us(g)} |")
    print(f"| all | 100% | {us(busy)} | {us(gil)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
