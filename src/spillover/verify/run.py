"""Running a spec: the failure-free reference and the run with induced
failures (and rescaled restores), then the comparison."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from spillover.config import Config
from spillover.deploy import create_executor
from spillover.errors import ConfigError
from spillover.runtime.failures import FailureInjector
from spillover.runtime.jobmaster import JobResult
from spillover.storage.location import Location
from spillover.verify.compare import (
    Report,
    compare,
)
from spillover.verify.output import (
    RunOutput,
    _read,
    _state_of,
)
from spillover.verify.spec import (
    VerifySpec,
)
from spillover.verify.topologies import (
    _ship_by_value,
)


def _checkpoints(spec: VerifySpec, workdir: str, name: str) -> str:
    if spec.checkpoint_dir is None:
        return os.path.join(workdir, name, "checkpoints")
    return Location.parse(spec.checkpoint_dir).child(name).uri


def config_for(spec: VerifySpec, ckpt: str) -> Config:
    """The runtime configuration of ``spec``'s runs, checkpoints under ``ckpt``."""
    return Config.from_dict(
        {
            "execution.checkpointing.interval": f"{spec.interval_ms} ms",
            "state.checkpoints.dir": ckpt,
            "restart-strategy.type": "fixed-delay",
            "restart-strategy.fixed-delay.attempts": spec.failures + 1,
            "restart-strategy.fixed-delay.delay": "10 ms",
            **spec.checkpoint_options(),
        }
    )


def _executor(
    spec: VerifySpec, graph: Any, cfg: Config, executor: str | None = None, **options: Any
) -> Any:
    """``executor`` (default ``spec.executor``) for ``graph``."""
    kind = executor or spec.executor
    if kind == "local":
        return create_executor("local", graph, cfg, **options)
    if callable(spec.job):
        _ship_by_value(sys.modules.get(getattr(spec.job, "__module__", "")))
    return create_executor(kind, graph, cfg, master=spec.master, **options)


def run_once(
    spec: VerifySpec,
    workdir: str,
    name: str,
    failures: FailureInjector,
    executor: str | None = None,
) -> RunOutput:
    """One run to the end; ``executor`` overrides ``spec.executor``."""
    out_dir = os.path.join(workdir, name, "output")
    ckpt = _checkpoints(spec, workdir, name)
    os.makedirs(out_dir, exist_ok=True)
    graph = spec.factory()(out_dir, name, spec.parallelism).build()
    cfg = config_for(spec, ckpt)
    result = _executor(spec, graph, cfg, executor, failures=failures).run(timeout=600)
    return output_of(spec, result, out_dir, graph.max_parallelism, failures)


def output_of(
    spec: VerifySpec,
    result: JobResult,
    out_dir: str,
    max_parallelism: int,
    failures: FailureInjector | None = None,
) -> RunOutput:
    """What a run of ``spec`` committed to ``out_dir`` and its final keyed state, for
    :func:`compare`."""
    return RunOutput(
        result,
        _read(spec, out_dir),
        _state_of(spec, result, max_parallelism),
        [s.describe() for s in failures.fired] if failures is not None else [],
        out_dir=out_dir,
        max_parallelism=max_parallelism,
    )


def run_rescaled(
    spec: VerifySpec, workdir: str, name: str, failures: FailureInjector, stop_after: float
) -> RunOutput:
    """Runs at ``spec.parallelism`` until every induced failure happened and the latest
    completed checkpoint holds in-flight data (or ``stop_after`` seconds), stops it as
    a crash would, restores that checkpoint at ``spec.rescale_to`` and runs to the end."""

    def ready(history: list[dict[str, Any]]) -> bool:
        done = [c for c in history if c["status"] == "completed" and not c["final"]]
        inflight = spec.policy == "aligned" or (bool(done) and done[-1]["inflight_bytes"] > 0)
        return failures.pending == 0 and bool(done) and inflight

    assert spec.rescale_to is not None
    out_dir = os.path.join(workdir, name, "output")
    ckpt = _checkpoints(spec, workdir, name)
    os.makedirs(out_dir, exist_ok=True)
    cfg = config_for(spec, ckpt)
    make_job = spec.factory()
    first = _executor(
        spec, make_job(out_dir, name, spec.parallelism).build(), cfg, failures=failures
    )
    r1 = first.run(timeout=600, stop_after=stop_after, stop_when=ready)
    completed = r1.completed_checkpoints()
    if r1.status == "finished":
        raise RuntimeError(
            "the run ended before it was stopped: give it more records (or a slower sink), "
            "so that every induced failure happens and then a checkpoint completes"
            + (" with in-flight data" if spec.policy != "aligned" else "")
            + " while it runs"
        )
    if not completed:
        raise RuntimeError("no checkpoint completed before the stop: lengthen the run")
    # Only the latest completed checkpoint keeps exactly-once: sinks published up to it.
    restored = completed[-1]
    graph = make_job(out_dir, name, spec.rescale_to).build()
    second = _executor(spec, graph, cfg, restore_checkpoint=restored["checkpoint_id"])
    r2 = second.run(timeout=600)
    r2.attempts += r1.attempts
    r2.checkpoints = r1.checkpoints + r2.checkpoints
    r2.failures = r1.failures + r2.failures
    r2.restored_from = r1.restored_from + r2.restored_from
    r2.replayed_bytes += r1.replayed_bytes
    if r1.status not in ("stopped", "finished"):
        r2.status = r1.status
    out = RunOutput(
        r2,
        _read(spec, out_dir),
        _state_of(spec, r2, graph.max_parallelism),
        [s.describe() for s in failures.fired],
        out_dir=out_dir,
        max_parallelism=graph.max_parallelism,
    )
    out.restored_inflight = int(restored["inflight_bytes"])
    return out


def verify(spec: VerifySpec, workdir: str | None = None) -> Report:
    """Runs the job without and with ``spec.failures`` induced failures."""
    if spec.order not in ("per-key", None):
        raise ConfigError(f"order must be 'per-key' or None, got {spec.order!r}")
    if spec.master is not None and spec.executor != "spark":
        raise ConfigError(
            "a Spark master (--master) needs the spark executor",
            detail=f"master {spec.master!r} with executor {spec.executor!r}",
            hint="add --executor spark (VerifySpec.executor='spark')",
        )
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="spillover-verify-")
    try:
        baseline = run_once(spec, workdir, "baseline", FailureInjector(), executor="local")
        if spec.job is not None and baseline.result.status == "finished" and not len(baseline.rows):
            raise ConfigError(
                f"{spec.describe()} committed nothing without failures",
                hint="end it in ParquetSink(out_dir), with out_dir the factory's first argument",
            )
        graph = spec.factory()(os.path.join(workdir, "probe"), "probe", spec.parallelism).build()
        vertices = [(v.uid, v.parallelism) for v in graph.vertices]
        injector = FailureInjector.random(
            spec.failures,
            vertices,
            seed=spec.seed,
            records_per_subtask=max(1, spec.records // spec.parallelism),
        )
        started = time.monotonic()
        if spec.rescale_to is None:
            actual = run_once(spec, workdir, "with-failures", injector)
        else:
            # A bound; stop_when decides. Spark adds a stage start per attempt.
            stop_after = 0.8 * baseline.result.duration_s + 5.0
            if spec.executor != "local":
                stop_after += 30.0
            actual = run_rescaled(spec, workdir, "with-failures", injector, stop_after)
        report = compare(spec, baseline, actual)
        report.duration_s = time.monotonic() - started
        return report
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)


def write_json(report: Report, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report.to_dict(), f, indent=1, default=str)
