"""Kill a worker's Python process mid-run and check the job's output stays exact.

:func:`run_killing_a_worker` runs a verify topology (or a job factory) on Spark,
SIGKILLs one worker process once a checkpoint completed, lets the job master
restart the job, and compares the committed output with a failure-free run on the
local executor. The workers must run on this machine (a local master, or a
cluster on loopback).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from spillover.deploy import create_executor
from spillover.runtime.failures import FailureInjector
from spillover.verify import VerifySpec, compare, config_for, output_of, run_once

__all__ = ["kill_spec", "run_killing_a_worker"]


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
    executor: str = "spark",
) -> dict[str, Any]:
    """Runs ``spec`` on Spark (or the ``processes`` executor), SIGKILLs worker
    ``kill_worker``'s Python process once a checkpoint completed, lets the job master
    restart it, and compares the committed output with a failure-free local run.
    Returns what happened (JSON-able)."""
    spec = spec or kill_spec()
    baseline = run_once(spec, workdir, "baseline", FailureInjector(), executor="local")
    out_dir = os.path.join(workdir, "killed", "output")
    os.makedirs(out_dir, exist_ok=True)
    ckpt = (
        os.path.join(workdir, "killed", "checkpoints") if checkpoint_dir is None else checkpoint_dir
    )
    graph = spec.factory()(out_dir, "killed", spec.parallelism).build()
    ex: Any = create_executor(executor, graph, config_for(spec, ckpt), master=master)
    ex.prepare()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = ex.run(timeout=300)
        except BaseException as e:  # re-raised below, in the caller's thread
            box["error"] = e

    runner = threading.Thread(target=run, name="spillover-chaos-run", daemon=True)
    runner.start()
    killed: dict[str, Any] = {}
    deadline = time.monotonic() + 120
    while runner.is_alive() and time.monotonic() < deadline:
        workers = ex.workers()
        if ex.completed_ids() and kill_worker in workers:
            w = workers[kill_worker]
            os.kill(int(w["pid"]), signal.SIGKILL)
            killed = {"pid": w["pid"], "host": w["host"], "after": ex.completed_ids()}
            break
        time.sleep(0.02)
    runner.join(timeout=300)
    if runner.is_alive():
        raise TimeoutError("the job on Spark did not end within 300 s of the kill")
    if "error" in box:
        raise box["error"]
    result = box["result"]
    actual = output_of(spec, result, out_dir, graph.max_parallelism)
    report = compare(spec, baseline, actual)
    return {
        "status": result.status,
        "attempts": result.attempts,
        "failures": result.failures,
        "killed": killed,
        "restart_s": result.restart_s,
        "exact": report.exact,
        "report": report.text(),
        "rows": len(actual.rows),
    }
