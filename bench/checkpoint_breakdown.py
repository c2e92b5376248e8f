#!/usr/bin/env python3
"""Where a checkpoint's time goes: the `spillover bench` job (paced sink, one
policy) runs once, then per subtask the medians and maxima over its completed
checkpoints of what each acknowledged: start delay (trigger to snapshot), sync
(the task thread's part), async (the snapshot thread's operator part) and persist
(an unaligned checkpoint's in-flight data, from its start to the acknowledgement,
of which inputs is the wait for the last input's barrier, and close the channel
state's files finished, on the task thread when closed_on_task_thread is 1,
else on the channel-state thread),
acked (when the acknowledgement reached the coordinator, from the trigger), and the
coordinator's part after the last acknowledgement.

    PYTHONPATH=src .venv/bin/python bench/checkpoint_breakdown.py --executor local
    PYTHONPATH=src .venv/bin/python bench/checkpoint_breakdown.py --no-spares   # A/B

``--no-spares`` makes every staging file of shared channel-state files on the task
thread at the barrier, as before they were made ahead (docs/runtime.md). Run the
two alternately: single runs on a shared machine move by several milliseconds.
See docs/benchmarks.md, "Side by side with Flink 2.3".
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from typing import Any

from spillover.benchmark.runner import create_executor, run_sampled
from spillover.benchmark.spec import BenchSpec, build_job
from spillover.runtime.checkpointing import coordinator
from spillover.storage import shared

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
    args = ap.parse_args()
    if args.no_spares:
        shared._Spares.AHEAD = 0
    # The job's result keeps each checkpoint's summary; the per-subtask metrics the
    # coordinator collected go into it too, for this run only.
    plain = coordinator.CheckpointStats.summary

    def with_subtasks(self: coordinator.CheckpointStats) -> dict[str, Any]:
        return {**plain(self), "subtasks": self.subtasks, "finalize_ms": self.finalize_ms}

    coordinator.CheckpointStats.summary = with_subtasks  # type: ignore[method-assign]
    spec = BenchSpec(executor=args.executor, duration_s=args.duration, warmup_s=args.warmup)
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
    done = [c for c in result.checkpoints if c["status"] == "completed" and not c.get("final")]
    if not done:
        raise SystemExit("no checkpoint completed")
    rows: dict[str, dict[str, list[float]]] = {}
    for c in done:
        for subtask, m in c["subtasks"].items():
            for k in METRICS:
                if k in m:
                    rows.setdefault(subtask, {}).setdefault(k, []).append(float(m[k]))
    durations = [float(c["duration_ms"]) for c in done]
    finalize = [float(c["finalize_ms"]) for c in done]
    print(
        f"{len(done)} checkpoints, duration median {statistics.median(durations):.1f} ms, "
        f"max {max(durations):.1f} ms; of it after the last acknowledgement (metadata, "
        f"event log) median {statistics.median(finalize):.2f} ms "
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
