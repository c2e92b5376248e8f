"""The lifecycle commands, as Flink's CLI has them: ``spillover run | list |
savepoint | stop | cancel | rescale``. ``run`` serves the job's REST API and
registers it under ``SPILLOVER_HOME``; the others find the job there by id and talk
to its REST API (docs/operating.md). A bad job id, a job that has ended or a
savepoint folder that cannot be written is one line and exit code 2, and the job is
left alone."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from rich.live import Live

from spillover.cli.options import (
    EXIT_OK,
    EXIT_RUN_FAILED,
    define_option,
    defines,
    env_flag,
    env_option,
)
from spillover.config import Config
from spillover.deploy import EXECUTORS, create_executor
from spillover.errors import ConfigError, JobNotRunningError, SpilloverError
from spillover.rest import ServedJob, registry, serve
from spillover.rest.registry import JobEntry
from spillover.rest.views import vertex_metrics
from spillover.runtime.checkpointing.metadata import load_checkpoint
from spillover.runtime.graph import JobGraph, StreamEnvironment
from spillover.runtime.jobmaster import JobResult
from spillover.storage.folders import check_folder

# A detached run's child gets its job id here, so the parent knows what to wait for.
JOB_ID_ENV = "SPILLOVER_JOB_ID"
ACTIVE = ("INITIALIZING", "RUNNING", "RESTARTING")


class JobRequestError(SpilloverError, RuntimeError):
    """The job's REST API refused or failed a request (its message says why)."""


# -- run ---------------------------------------------------------------------------------


def load_job(spec: str) -> StreamEnvironment | JobGraph:
    """``PATH.py:FUNCTION`` → what ``FUNCTION()`` returns (a StreamEnvironment)."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py") or not name.isidentifier():
        raise ConfigError(
            f"not a job: {spec!r}", hint="name it PATH.py:FUNCTION, e.g. jobs/counts.py:build"
        )
    if not os.path.isfile(path):
        raise ConfigError(f"no such file: {path!r}", hint="give the job's Python file")
    module_name = f"spillover_job_{uuid.uuid4().hex[:8]}"
    loader = importlib.util.spec_from_file_location(module_name, path)
    if loader is None or loader.loader is None:
        raise ConfigError(f"cannot load {path!r} as Python")
    module = importlib.util.module_from_spec(loader)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up
    loader.loader.exec_module(module)
    function = getattr(module, name, None)
    if not callable(function):
        raise ConfigError(f"{path!r} has no function {name!r}")
    job = function()
    if not isinstance(job, StreamEnvironment | JobGraph):
        raise ConfigError(
            f"{spec} returned {type(job).__name__}, not a StreamEnvironment",
            hint="return the StreamEnvironment the job is built on",
        )
    return job


def cmd_run(args: argparse.Namespace) -> int:
    overrides = defines(args.define)
    if args.claim_mode:
        overrides["execution.state-recovery.claim-mode"] = args.claim_mode
    config = Config.load(args.config, overrides=overrides)
    job = load_job(args.job)
    if args.detached:
        return _run_detached(args)
    restore = os.path.abspath(args.from_savepoint) if args.from_savepoint else None
    if restore is not None:
        load_checkpoint(restore)  # refuses a path that holds no checkpoint, now
    executor = create_executor(
        args.executor, job, config, master=args.master, restore_checkpoint=restore
    )
    executor.job_id = os.environ.get(JOB_ID_ENV) or executor.job_id
    server = serve(executor)
    print(executor.job_id, flush=True)
    print(f"REST API and dashboard: {server.url}", flush=True)
    try:
        result = _run_with_progress(server.job) if sys.stdout.isatty() else server.job.run()
    except KeyboardInterrupt:
        executor.cancel()
        server.job.wait(60)
        raise
    finally:
        server.close()
    print(f"job {executor.job_id} {result.status} after {result.duration_s:.1f} s", flush=True)
    if result.savepoint:
        print(f"savepoint: {result.savepoint}")
    if result.status == "failed":
        print(f"spillover run: error: the job failed: {result.failures[-1:]}", file=sys.stderr)
        return EXIT_RUN_FAILED
    return EXIT_OK


def _run_with_progress(job: ServedJob) -> JobResult:
    """Runs the job with a live line: its state, checkpoints and records per second;
    raises what the run raised."""

    def run() -> None:
        with contextlib.suppress(BaseException):  # job.error keeps it, raised below
            job.run()

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    with Live(refresh_per_second=4, transient=True) as live:
        while runner.is_alive():
            st = job.executor.status.snapshot()
            s = job.executor.stats.snapshot()
            last = s.latest_completed
            rates = vertex_metrics(job)
            rate = sum(
                m.get("records_in_per_s", 0.0) for subs in rates.values() for m in subs.values()
            )
            live.update(
                f"{job.name} [bold]{st.state}[/] · checkpoints {s.completed_count} completed, "
                f"{s.failed_count} failed"
                + (f" · last {last.end_to_end_ms} ms" if last else "")
                + f" · {rate:,.0f} records/s in"
            )
            runner.join(0.25)
    if job.error is not None:
        raise job.error
    assert job.result is not None
    return job.result


def _run_detached(args: argparse.Namespace) -> int:
    """Starts ``spillover run`` without ``--detached`` in its own session and returns
    once the job runs, printing its id first."""
    job_id = uuid.uuid4().hex
    jobs = registry.jobs_dir()
    jobs.mkdir(parents=True, exist_ok=True)
    log_path = jobs / f"{job_id}.log"
    argv = [sys.executable, "-m", "spillover.cli", "run", args.job]
    argv += ["--executor", args.executor] if args.executor else []
    argv += ["--master", args.master] if args.master else []
    argv += ["--config", args.config] if args.config else []
    for d in args.define:
        argv += ["-D", d]
    argv += ["--from-savepoint", args.from_savepoint] if args.from_savepoint else []
    argv += ["--claim-mode", args.claim_mode] if args.claim_mode else []
    env = {**os.environ, JOB_ID_ENV: job_id}
    with open(log_path, "wb") as log:
        child = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    deadline = time.monotonic() + 300
    while True:
        try:
            entry: JobEntry | None = registry.read(job_id)
        except ConfigError:
            entry = None
        if entry is not None and entry.state != "INITIALIZING":
            print(job_id, flush=True)  # alone on stdout: `JOB=$(spillover run ... --detached)`
            print(f"REST API and dashboard: {entry.rest_url}", file=sys.stderr)
            return EXIT_OK
        code = child.poll()
        if code is not None or time.monotonic() > deadline:
            lines = log_path.read_text(errors="replace").strip().splitlines()
            last = lines[-1] if lines else "no output"
            raise JobRequestError(
                "the detached job did not start", detail=last, hint=f"its output: {log_path}"
            )
        time.sleep(0.05)


# -- talking to a running job --------------------------------------------------------------


def running_job(job_id: str) -> JobEntry:
    """The registry entry of a job that still runs, or a one-line error."""
    entry = registry.read(job_id)
    state = entry.effective_state
    if state not in ACTIVE:
        raise JobNotRunningError(
            f"job {entry.id} has ended ({state})",
            hint="`spillover list` shows the jobs that run",
        )
    return entry


def request(entry: JobEntry, method: str, path: str, body: Any = None) -> Any:
    """One call to the job's REST API (mutations carry its token)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(entry.rest_url + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if method != "GET":
        req.add_header("Authorization", f"Bearer {entry.token()}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            message = "; ".join(json.loads(e.read())["errors"])
        except (ValueError, KeyError, TypeError):
            message = f"HTTP {e.code}"
        if e.code == 409:
            raise JobNotRunningError(message) from None
        if e.code in (400, 404):
            raise ConfigError(message) from None
        raise JobRequestError(message, detail=f"{method} {path}") from None
    except OSError as e:  # refused: its master is gone
        raise JobNotRunningError(
            f"job {entry.id} does not answer at {entry.rest_url}", detail=str(e)
        ) from None


def _await_operation(entry: JobEntry, trigger: str, timeout: float, stop: bool = False) -> str:
    """Polls a savepoint or stop trigger; a stopped job whose master went away before
    the answer was read left its savepoint's path in the registry."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            body = request(entry, "GET", f"/jobs/{entry.id}/savepoints/{trigger}")
        except JobNotRunningError:
            ended = registry.read(entry.id)
            if stop and ended.savepoint:
                return ended.savepoint
            raise
        if body["status"]["id"] == "COMPLETED":
            op = body["operation"]
            if "failure-cause" in op:
                raise JobRequestError(
                    "the savepoint failed", detail=op["failure-cause"]["stack-trace"]
                )
            return str(op["location"])
        if time.monotonic() > deadline:
            raise JobRequestError(f"no savepoint after {timeout:g} s", detail=f"trigger {trigger}")
        time.sleep(0.1)


def _savepoint_dir(args: argparse.Namespace) -> str | None:
    if not args.savepoint_dir:
        return None
    check_folder("--savepoint-dir", args.savepoint_dir, create=False)
    return os.path.abspath(str(args.savepoint_dir))


def cmd_savepoint(args: argparse.Namespace) -> int:
    if args.dispose:
        return _dispose(args.dispose)
    if not args.job_id:
        raise ConfigError("name the job (JOB_ID), or --dispose a savepoint's PATH")
    entry = running_job(args.job_id)
    target = _savepoint_dir(args)
    body: dict[str, Any] = {"unaligned": bool(args.unaligned)}
    if target:
        body["target-directory"] = target
    trigger = request(entry, "POST", f"/jobs/{entry.id}/savepoints", body)["request-id"]
    print(_await_operation(entry, trigger, args.timeout))
    return EXIT_OK


def _dispose(path: str) -> int:
    """Removes a savepoint: its ``savepoint-*`` folder (given it or its ``chk-<id>``)."""
    p = Path(path).resolve()
    folder = p.parent if p.name.startswith("chk-") else p
    checkpoints = sorted(folder.glob("chk-*/_metadata")) if folder.is_dir() else []
    if not folder.name.startswith("savepoint-") or not checkpoints:
        raise ConfigError(
            f"not a savepoint: {path!r}",
            hint="give the path `spillover savepoint` or `stop` printed",
        )
    load_checkpoint(str(checkpoints[-1].parent))  # a damaged one is named, not removed
    shutil.rmtree(folder)
    print(f"disposed {folder}")
    return EXIT_OK


def cmd_stop(args: argparse.Namespace) -> int:
    entry = running_job(args.job_id)
    target = _savepoint_dir(args)
    if args.drain and args.unaligned:
        raise ConfigError("--drain takes an aligned savepoint", hint="drop --unaligned")
    body: dict[str, Any] = {"drain": bool(args.drain), "unaligned": bool(args.unaligned)}
    if target:
        body["targetDirectory"] = target
    trigger = request(entry, "POST", f"/jobs/{entry.id}/stop", body)["request-id"]
    print(_await_operation(entry, trigger, args.timeout, stop=True))
    return EXIT_OK


def cmd_cancel(args: argparse.Namespace) -> int:
    entry = running_job(args.job_id)
    request(entry, "PATCH", f"/jobs/{entry.id}?mode=cancel")
    deadline = time.monotonic() + args.timeout
    while registry.read(entry.id).effective_state in ACTIVE:
        if time.monotonic() > deadline:
            raise JobRequestError(f"job {entry.id} did not end after {args.timeout:g} s")
        time.sleep(0.05)
    print(f"job {entry.id} {registry.read(entry.id).effective_state}")
    return EXIT_OK


def cmd_rescale(args: argparse.Namespace) -> int:
    """A live rescale of every vertex to ``--parallelism``; waits until the job
    processed its first record at it and prints how long that took."""
    if args.parallelism < 1:
        raise ConfigError(f"--parallelism must be at least 1, not {args.parallelism}")
    entry = running_job(args.job_id)
    current = request(entry, "GET", f"/jobs/{entry.id}/resource-requirements")
    wanted = {
        vid: {"parallelism": {"lowerBound": 1, "upperBound": args.parallelism}} for vid in current
    }
    rid = request(entry, "PUT", f"/jobs/{entry.id}/resource-requirements", wanted)["request-id"]
    deadline = time.monotonic() + args.timeout
    while True:
        r = request(entry, "GET", f"/jobs/{entry.id}").get("rescale") or {}
        if r.get("request-id") == rid and r["status"] != "IN_PROGRESS":
            break
        if time.monotonic() > deadline:
            raise JobRequestError(f"the rescale did not end in {args.timeout:g} s")
        time.sleep(0.05)
    if r["status"] == "FAILED":
        raise JobRequestError("the rescale failed", detail=str(r["failure"]))
    print(
        f"job {entry.id} rescaled from {r['from-parallelism']} to {r['to-parallelism']}: "
        f"the first record at the new parallelism came "
        f"{r['request-to-first-record-ms']:.0f} ms after the request"
    )
    return EXIT_OK


def cmd_list(args: argparse.Namespace) -> int:
    rows = [{**dataclasses.asdict(e), "state": e.effective_state} for e in registry.entries()]
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
        return EXIT_OK
    if not rows:
        print(f"no jobs in {registry.jobs_dir()}")
        return EXIT_OK
    print(f"{'ID':32}  {'NAME':20}  {'STATE':10}  {'REST URL':26}  LAST CHECKPOINT")
    for r in rows:
        last = "-" if r["last_checkpoint"] is None else str(r["last_checkpoint"])
        print(f"{r['id']:32}  {r['name'][:20]:20}  {r['state']:10}  {r['rest_url']:26}  {last}")
    return EXIT_OK


# -- the parsers -------------------------------------------------------------------------


def add_parsers(sub: Any) -> None:
    """Adds the lifecycle commands to the ``spillover`` parser."""
    p = sub.add_parser("run", help="run a job, serving its REST API and dashboard")
    p.add_argument("job", help="PATH.py:FUNCTION, a function returning a StreamEnvironment")
    env_option(
        p, "--executor", env="SPILLOVER_RUN_EXECUTOR", choices=EXECUTORS, help="where it runs"
    )
    env_option(p, "--master", env="SPILLOVER_RUN_MASTER", help="the Spark master URL")
    env_option(p, "--config", env="SPILLOVER_RUN_CONFIG", help="a YAML or TOML config file")
    define_option(p, "an option")
    env_option(
        p,
        "--from-savepoint",
        env="SPILLOVER_RUN_FROM_SAVEPOINT",
        help="restore from this savepoint or checkpoint (its chk-<id> folder)",
    )
    env_option(
        p,
        "--claim-mode",
        env="SPILLOVER_RUN_CLAIM_MODE",
        choices=("claim", "no-claim"),
        help="whether the job owns the restored savepoint: claim lets retention delete "
        "it (default: execution.state-recovery.claim-mode, no-claim)",
    )
    env_flag(p, "--detached", env="SPILLOVER_RUN_DETACHED", help="return once the job runs")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("list", help="running and recently ended jobs")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_list)

    def timeout(p: argparse.ArgumentParser) -> None:
        env_option(
            p, "--timeout", env="SPILLOVER_JOB_TIMEOUT", type=float, default=300.0,
            help="seconds to wait for the job",
        )  # fmt: skip

    p = sub.add_parser("savepoint", help="take a savepoint without stopping, or dispose one")
    p.add_argument("job_id", nargs="?", help="the job (a unique prefix of its id will do)")
    p.add_argument("--unaligned", action="store_true", help="an unaligned savepoint")
    env_option(p, "--savepoint-dir", env="SPILLOVER_SAVEPOINT_DIR", help="where it goes")
    p.add_argument("--dispose", metavar="PATH", help="remove the savepoint at PATH")
    timeout(p)
    p.set_defaults(func=cmd_savepoint)

    p = sub.add_parser("stop", help="stop a job with a savepoint")
    p.add_argument("job_id", help="the job (a unique prefix of its id will do)")
    p.add_argument("--drain", action="store_true", help="finish every operator for good")
    p.add_argument("--unaligned", action="store_true", help="an unaligned savepoint, at once")
    env_option(p, "--savepoint-dir", env="SPILLOVER_SAVEPOINT_DIR", help="where it goes")
    timeout(p)
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser("cancel", help="cancel a job (no savepoint)")
    p.add_argument("job_id", help="the job (a unique prefix of its id will do)")
    timeout(p)
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("rescale", help="rescale a running job")
    p.add_argument("job_id", help="the job (a unique prefix of its id will do)")
    p.add_argument("--parallelism", type=int, required=True, help="the new parallelism")
    timeout(p)
    p.set_defaults(func=cmd_rescale)
