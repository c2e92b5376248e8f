"""Kill a worker's Python process, or break one of its connections, mid-run and
check the job's output stays exact.

:func:`run_killing_a_worker` runs a verify topology (or a job factory) on Spark,
SIGKILLs one worker process once a checkpoint completed, lets the job master
restart the job, and compares the committed output with a failure-free run on the
local executor. The workers must run on this machine (a local master, or a
cluster on loopback). :func:`run_with_network_fault` does the same with a data or
control connection reset or stalled instead (``runtime/network/tcp/faults.py``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from spillover.deploy import create_executor
from spillover.runtime.failures import FailureInjector
from spillover.runtime.jobmaster import JobResult
from spillover.runtime.network.tcp.faults import NetworkFault
from spillover.verify import RunOutput, VerifySpec, compare, config_for, output_of, run_once

__all__ = ["HEARTBEATS", "kill_spec", "run_killing_a_worker", "run_with_network_fault"]

# Heartbeats of a run with a network fault: a stall is told within seconds, and a
# busy machine still leaves a worker many chances to be heard in time.
HEARTBEATS = {"heartbeat.interval": "250 ms", "heartbeat.timeout": "5 s"}


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
    return _outcome(
        spec,
        baseline,
        result,
        out_dir,
        graph.max_parallelism,
        killed=killed,
        restart_s=result.restart_s,
    )


def run_with_network_fault(
    workdir: str,
    fault: NetworkFault,
    *,
    master: str | None = None,
    spec: VerifySpec | None = None,
    executor: str = "spark",
) -> dict[str, Any]:
    """Runs ``spec`` on Spark (or the ``processes`` executor) with ``fault`` shipped to
    its workers and :data:`HEARTBEATS`, and compares the committed output with a
    failure-free local run. The attempt the fault breaks must fail (a reset at once,
    a stall once ``heartbeat.timeout`` passed) and the job restart from its latest
    checkpoint: never a hang, never a gap. Returns what happened (JSON-able);
    ``attempts`` 1 means the fault never struck (the job ended first)."""
    spec = spec or kill_spec()
    baseline = run_once(spec, workdir, "baseline", FailureInjector(), executor="local")
    out_dir = os.path.join(workdir, "faulted", "output")
    os.makedirs(out_dir, exist_ok=True)
    ckpt = os.path.join(workdir, "faulted", "checkpoints")
    graph = spec.factory()(out_dir, "faulted", spec.parallelism).build()
    config = config_for(spec, ckpt).with_options(HEARTBEATS)
    ex: Any = create_executor(executor, graph, config, master=master, network_fault=fault)
    result = ex.run(timeout=300)
    return _outcome(spec, baseline, result, out_dir, graph.max_parallelism, fault=fault.describe())


def _outcome(
    spec: VerifySpec,
    baseline: RunOutput,
    result: JobResult,
    out_dir: str,
    max_parallelism: int,
    **what: Any,
) -> dict[str, Any]:
    """What a faulted run did (JSON-able): its status, attempts and failures, ``what``
    befell it, and how its committed output in ``out_dir`` compares with ``baseline``."""
    actual = output_of(spec, result, out_dir, max_parallelism)
    report = compare(spec, baseline, actual)
    return {
        "status": result.status,
        "attempts": result.attempts,
        "failures": result.failures,
        **what,
        "exact": report.exact,
        "report": report.text(),
        "rows": len(actual.rows),
    }
