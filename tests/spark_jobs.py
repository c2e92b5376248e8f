"""A job on Spark whose worker process is killed mid-run, checked against a local run.

Imported by tests/test_spark.py (embedded local master) and run as a script by the
cluster test (``python tests/spark_jobs.py --master spark://... --workdir ...``), so
the same check runs on both; the script prints one JSON line with the outcome.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from typing import Any

from spillover.runtime.failures import FailureInjector
from spillover.verify import VerifySpec, compare, config_for, output_of, run_once


def kill_spec(parallelism: int = 2, records: int = 60_000) -> VerifySpec:
    """A pipeline slow enough to be killed part way, with unaligned checkpoints."""
    return VerifySpec(
        topology="pipeline",
        parallelism=parallelism,
        records=records,
        rate_per_subtask=15_000.0,
        failures=0,
        policy="unaligned",
        interval_ms=200,
    )


def run_killing_a_worker(
    workdir: str,
    *,
    master: str | None = None,
    checkpoint_dir: str | None = None,
    kill_worker: int = 1,
    spec: VerifySpec | None = None,
) -> dict[str, Any]:
    """Runs ``spec`` on Spark, SIGKILLs worker ``kill_worker``'s Python process once a
    checkpoint completed, lets the job master restart it, and compares the committed
    output with a failure-free local run. Returns what happened (JSON-able)."""
    from spillover.spark import SparkExecutor

    spec = spec or kill_spec()
    baseline = run_once(spec, workdir, "baseline", FailureInjector(), executor="local")
    out_dir = os.path.join(workdir, "killed", "output")
    os.makedirs(out_dir, exist_ok=True)
    ckpt = (
        os.path.join(workdir, "killed", "checkpoints") if checkpoint_dir is None else checkpoint_dir
    )
    graph = spec.factory()(out_dir, "killed", spec.parallelism).build()
    ex = SparkExecutor(graph, config_for(spec, ckpt), master=master)
    ex.prepare()
    box: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: box.update(result=ex.run(timeout=300)))
    runner.start()
    killed: dict[str, Any] = {}
    deadline = time.monotonic() + 120
    while runner.is_alive() and time.monotonic() < deadline:
        workers = ex.workers()
        if ex.completed_ids() and kill_worker in workers:
            w = workers[kill_worker]
            os.kill(int(w["pid"]), signal.SIGKILL)
            killed = {"pid": w["pid"], "host": w["host"], "after": ex.completed_ids()}
            killed_at = time.monotonic()
            break
        time.sleep(0.02)
    restarted_in = None
    if killed:
        # From the kill to the next generation's workers all running.
        while runner.is_alive() and time.monotonic() < deadline:
            run = ex._current
            if run is not None and run.generation > 0 and getattr(run, "running_at", None):
                restarted_in = run.running_at - killed_at
                break
            time.sleep(0.01)
    runner.join(timeout=300)
    result = box["result"]
    actual = output_of(spec, result, out_dir, graph.max_parallelism)
    report = compare(spec, baseline, actual)
    return {
        "status": result.status,
        "attempts": result.attempts,
        "failures": result.failures,
        "killed": killed,
        "restart_s": restarted_in,
        "exact": report.exact,
        "report": report.text(),
        "rows": len(actual.rows),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--master", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--checkpoint-dir", default=None)
    args = p.parse_args()
    out = run_killing_a_worker(args.workdir, master=args.master, checkpoint_dir=args.checkpoint_dir)
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
