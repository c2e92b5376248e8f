"""Running one scenario: its job and script as a :class:`~spillover.verify.VerifySpec`
and the faults around it, checked exactly by :func:`~spillover.verify.verify`
against a failure-free run.

How each action is played:

- ``failure``: induced failures (operator, snapshot, restore and commit points,
  placed among the records with the scenario's seed);
- ``rescale``: the run is stopped part way (as a crash, or by the scenario's stop)
  and restored at the other parallelism;
- ``stop`` / ``stop-drain``: stop-with-savepoint part way (aligned or unaligned;
  with drain), then the savepoint is restored and run to the end;
- ``aborted-savepoint``: when the stop is asked, the next checkpoints' state files
  cannot be created (ENOSPC), so the first savepoint attempts abort and a later
  one is the savepoint;
- ``storage-fault``: checkpoint storage of the run with faults is a
  fault-injecting filesystem (:mod:`spillover.chaos.faults`; a local disk whose
  renames consult it for ``rename``) that fails or slows a window of operations:
  the operations after the first ``skip`` of that kind on the files of
  checkpoints and savepoints, ``count`` of them. Reads happen in restores, so a
  ``read`` fault strikes inside a failure's or a rescale's restore;
- ``driver-kill``: the job runs in child driver processes, SIGKILLed and started
  again (:mod:`spillover.verify.driver`);
- ``worker-kill``: a Spark worker's Python process is SIGKILLed once a checkpoint
  completed (:mod:`spillover.verify.chaos`);
- ``network-fault``: a Spark worker's data or control connection is reset or
  stalled after some frames (:mod:`spillover.runtime.network.tcp.faults`); the
  attempt must fail over (a stall within ``heartbeat.timeout``) and the job end
  exact.

The failure-free run uses the same storage with no fault armed for it: every rule
matches only the paths of the run with faults, and the rules are disarmed once
that run ended, before the comparison reads its output and final state.
"""

from __future__ import annotations

import contextlib
import errno
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from spillover.chaos.faults import Faults, failing_renames, faulty_dir
from spillover.chaos.scenario import Scenario
from spillover.errors import ConfigError
from spillover.runtime.jobmaster import JobDiagnosis, running_executors
from spillover.runtime.network.tcp.faults import NetworkFault
from spillover.verify.chaos import run_killing_a_worker, run_with_network_fault
from spillover.verify.compare import Report
from spillover.verify.run import verify
from spillover.verify.spec import VerifySpec

__all__ = [
    "HangReport",
    "IsolatedRunner",
    "Outcome",
    "Runner",
    "hang_report",
    "run_scenario",
    "spec_of",
]

# A hang report: the innermost frames of each thread's stack it shows.
_STACK_DEPTH = 8
# How long after its time limit a scenario's process may take to report its hang.
_REPORT_GRACE_S = 20.0

# What a run with faults is called in the work directory (verify/run.py), and so
# in every path of its checkpoints: the faults match these.
_FAULTED_RUNS = ("/with-", "/killed-")


@dataclass(frozen=True)
class Outcome:
    """How a scenario ended: ``exact`` only when the run with faults matched the
    failure-free run exactly; ``error`` names why a run could not complete."""

    exact: bool
    seconds: float
    summary: str = ""
    error: str | None = None
    failures_fired: tuple[str, ...] = ()
    storage_faults: int = 0
    attempts: int = 0
    checkpoints_completed: int = 0
    report: str = ""
    tries: int = 1
    """Runs it took: more than one when a run proved nothing (``VACUOUS_TRIES``),
    so a soak can count how often timing, not the system, left nothing to check."""

    @property
    def kind(self) -> str:
        """How it failed, for shrinking to keep: ``exact``, the error's type (say
        ``StorageError``), or ``not exact`` (output or state differ)."""
        if self.exact:
            return "exact"
        if self.error:
            return self.error.split(":")[0]
        return "not exact"


Runner = Callable[[Scenario, str], Outcome]
"""``(scenario, work directory) -> outcome``: :func:`run_scenario`, or a fake in tests."""


def spec_of(s: Scenario, checkpoint_dir: str | None = None) -> VerifySpec:
    """The verification ``s`` is: its job, settings and the counts of its actions."""
    st = s.settings
    stop = None
    if s.has("stop-drain"):
        stop = "drain"
    elif s.has("stop"):
        unaligned = s.actions_of("stop")[0].detail == "unaligned"
        stop = "unaligned-savepoint" if unaligned else "savepoint"
    rescale = s.actions_of("rescale")
    failures = len(s.actions_of("failure"))
    options: dict[str, Any] = {
        # What a storage fault or an aborted savepoint costs is checkpoints, not the job.
        "execution.checkpointing.tolerable-failed-checkpoints": 1_000_000,
        # Restores that meet a storage fault fail their attempt and try again.
        "restart-strategy.fixed-delay.attempts": failures + 20,
    }
    if not s.has("batch"):
        options["execution.checkpointing.max-concurrent-checkpoints"] = (
            st.max_concurrent_checkpoints
        )
        options["execution.checkpointing.unaligned.max-subtasks-per-channel-state-file"] = (
            st.max_subtasks_per_channel_state_file
        )
    batch = s.has("batch")
    return VerifySpec(
        topology=s.topology,
        parallelism=st.parallelism,
        records=st.records,
        # A worker is killed once a checkpoint completed: on Spark that takes longer.
        rate_per_subtask=15_000.0 if s.has("worker-kill") else 40_000.0,
        failures=failures,
        seed=s.seed * 1_000_003 + s.index,
        interval_ms=100 if batch else st.interval_ms,
        policy=st.policy,
        executor=s.executor,
        rescale_to=int(rescale[0].detail.split("->")[1]) if rescale else None,
        stop=stop,
        kill_driver=len(s.actions_of("driver-kill")),
        runtime_mode="batch" if batch else "streaming",
        event_time=s.has("event-time") and s.topology != "finishing",
        checkpoint_dir=checkpoint_dir,
        options=options,
    )


_STORAGE = re.compile(r"^(\w+) (\w+) after (\d+) for (\d+)$")


def _error(kind: str) -> BaseException:
    if kind == "ENOSPC":
        return OSError(errno.ENOSPC, "No space left on device (induced)")
    return OSError(errno.EIO, "Input/output error (induced)")


def _struck(op: str, path: str) -> bool:
    """Whether a storage fault may strike ``op`` on ``path``: the files of the run
    with faults' checkpoints and savepoints (``chk-N``), what the checkpoint writers
    and restores use. A job master that cannot read its event log, lease or the
    metadata it restores from at start refuses to start, by design: those stay
    out (the ``_events`` folder, and reads of ``_metadata``)."""
    if not any(r in path for r in _FAULTED_RUNS) or "/chk-" not in path or "/_events" in path:
        return False
    return not (op == "read" and path.endswith("_metadata"))


class _Window:
    """A rule failing (or slowing) ``op`` on the run with faults' paths: the
    operations after the first ``skip``, ``count`` of them."""

    def __init__(self, op: str, error: str, skip: int, count: int) -> None:
        self.op, self.error, self.skip, self.count = op, error, skip, count
        self.seen = 0
        self.lock = threading.Lock()

    def __call__(self, op: str, path: str) -> BaseException | None:
        if op != self.op or not _struck(op, path):
            return None
        with self.lock:
            self.seen += 1
            inside = self.skip < self.seen <= self.skip + self.count
        if not inside:
            return None
        if self.error == "latency":
            time.sleep(0.02)
            return None
        return _error(self.error)


class _AbortSavepoints:
    """Armed when the stop is asked: the state files of the next ``n`` checkpoints
    begun after it cannot be created, so those savepoint attempts abort."""

    _CHK = re.compile(r"/chk-(\d+)/")

    def __init__(self, n: int) -> None:
        self.n = n
        self.armed_after: int | None = None
        self.highest = 0
        self.doomed: set[int] = set()
        self.lock = threading.Lock()

    def arm(self) -> None:
        with self.lock:
            self.armed_after = self.highest

    def __call__(self, op: str, path: str) -> BaseException | None:
        m = self._CHK.search(path)
        if m is None or not any(r in path for r in _FAULTED_RUNS):
            return None
        cid = int(m.group(1))
        with self.lock:
            self.highest = max(self.highest, cid)
            if self.armed_after is None or op != "open" or cid <= self.armed_after:
                return None
            if cid not in self.doomed and len(self.doomed) < self.n:
                self.doomed.add(cid)
            doomed = cid in self.doomed
        return _error("ENOSPC") if doomed else None


@contextlib.contextmanager
def _storage(
    s: Scenario, workdir: str, faults: Faults
) -> Iterator[tuple[str | None, Callable[[], None]]]:
    """``(checkpoint directory, on_stop)`` of ``s``: its storage faults and aborted
    savepoints armed in ``faults``, on a fault-injecting filesystem (or local
    renames)."""
    windows = []
    for a in s.actions_of("storage-fault"):
        m = _STORAGE.match(a.detail)
        assert m is not None, a.detail
        windows.append(_Window(m.group(1), m.group(2), int(m.group(3)), int(m.group(4))))
    aborted = [int(a.detail.split()[0]) for a in s.actions_of("aborted-savepoint")]
    abort = _AbortSavepoints(aborted[0]) if aborted else None
    faults.rules = [*windows, *([abort] if abort else [])]
    on_stop = abort.arm if abort is not None else (lambda: None)
    if not faults.rules:
        yield None, on_stop
        return
    base = os.path.join(workdir, "checkpoints")
    if any(w.op == "rename" for w in windows):
        # Checkpoint storage renames only on a local disk: faults there go through os.
        with failing_renames(faults):
            yield base, on_stop
        return
    with faulty_dir(base, scheme="chaos", faults=faults) as (uri, _):
        yield uri, on_stop


VACUOUS_TRIES = 3
"""Runs of one scenario at most while each proves nothing (``Report.vacuous``): its
timing, not the system, left nothing to check; three in a row count as not exact."""


def run_scenario(s: Scenario, workdir: str | None = None) -> Outcome:
    """Runs ``s`` and its failure-free twin, and compares them exactly. A scenario
    that cannot be set up (a :class:`ConfigError`) is not exact, with the reason."""
    started = time.monotonic()
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="spillover-chaos-")
    faults = Faults()
    try:
        if s.has("worker-kill"):
            return _killing_a_worker(s, workdir, started)
        if s.has("network-fault"):
            return _with_network_fault(s, workdir, started)
        for tried in range(1, VACUOUS_TRIES + 1):
            # A run whose timing left it nothing to prove (a failure during a drain
            # restored positions 0: ``Report.vacuous``) runs again, on fresh storage.
            faults = Faults()
            sub = workdir if tried == 1 else os.path.join(workdir, f"try-{tried}")
            with _storage(s, sub, faults) as (ckpt, on_stop):
                spec = spec_of(s, ckpt)
                report: Report = verify(
                    spec, os.path.join(sub, "verify"), on_stop=on_stop, on_ended=faults.disarm
                )
            if report.errors or not report.vacuous():
                break
        injected = sum(faults.counts.values())
        errors = [*report.errors, *report.vacuous()]
        return Outcome(
            exact=report.exact and not errors,
            seconds=time.monotonic() - started,
            summary=_summary(report),
            error="; ".join(errors) or None,
            failures_fired=tuple(report.failures_fired),
            storage_faults=injected,
            attempts=report.attempts,
            checkpoints_completed=report.checkpoints_completed,
            report=report.text(),
            tries=tried,
        )
    except ConfigError as e:
        return Outcome(
            False,
            time.monotonic() - started,
            error=f"ConfigError: {e}",
            storage_faults=sum(faults.counts.values()),
        )
    except Exception as e:  # the run could not complete: that is what chaos looks for
        first = (str(e).strip().splitlines() or [""])[0]
        return Outcome(
            False,
            time.monotonic() - started,
            error=f"{type(e).__name__}: {first}",
            storage_faults=sum(faults.counts.values()),
            report=traceback.format_exc(),
        )
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)


def _killing_a_worker(s: Scenario, workdir: str, started: float) -> Outcome:
    """``worker-kill``: the run on Spark whose worker is SIGKILLed once a checkpoint
    completed (a kill that never came, the job having ended first, proves nothing)."""
    worker = int(s.actions_of("worker-kill")[0].detail.split()[1])
    got = run_killing_a_worker(os.path.join(workdir, "verify"), spec=spec_of(s), kill_worker=worker)
    error = None if got["killed"] else "the job ended before the worker could be killed"
    return Outcome(
        exact=bool(got["exact"]) and error is None,
        seconds=time.monotonic() - started,
        summary=f"{got['rows']:,} records, {got['attempts']} attempts, worker {worker} killed",
        error=error,
        attempts=int(got["attempts"]),
        report=str(got["report"]),
    )


def _with_network_fault(s: Scenario, workdir: str, started: float) -> Outcome:
    """``network-fault``: the run on Spark whose worker resets or stalls a connection
    (a fault that never struck, the job having ended first, proves nothing)."""
    # The action's detail is NetworkFault.describe(): "data stall after 40 frames on worker 1".
    connection, action, _, after, _, _, _, worker = s.actions_of("network-fault")[0].detail.split()
    fault = NetworkFault(connection, action, int(after), worker=int(worker))
    got = run_with_network_fault(os.path.join(workdir, "verify"), fault, spec=spec_of(s))
    error = None if got["attempts"] > 1 else "the job ended before the fault struck"
    return Outcome(
        exact=bool(got["exact"]) and error is None,
        seconds=time.monotonic() - started,
        summary=f"{got['rows']:,} records, {got['attempts']} attempts, {got['fault']}",
        error=error,
        attempts=int(got["attempts"]),
        report=str(got["report"]),
    )


def _summary(r: Report) -> str:
    parts = [f"{r.records:,} records", f"{r.attempts} attempts"]
    wrong = {
        "lost": len(r.lost),
        "duplicated": len(r.duplicated),
        "reordered": len(r.reordered),
        "unexpected": len(r.unexpected),
        "state": len(r.state_mismatch) + len(r.keyed_state_mismatch),
        "windows": len(r.windows_wrong),
    }
    parts += [f"{n} {k}" for k, n in wrong.items() if n]
    return ", ".join(parts)


@dataclass(frozen=True)
class HangReport:
    """Where a process was when its run did not end: each running job's master
    (:class:`~spillover.runtime.jobmaster.JobDiagnosis`) and every thread's
    innermost frames, threads with the same stack together."""

    jobs: tuple[JobDiagnosis, ...]
    threads: tuple[str, ...]

    def summary(self) -> str:
        """One line for the JSON's ``error``: per job its attempt, its stop and what
        its coordinator waits for; not the subtasks, nor the stacks."""
        parts = []
        for job in self.jobs:
            parts.append(f"job {job.job_name}: attempt {job.attempt}, stop {job.stop}")
            if job.coordinator is not None:
                parts += [line.strip() for line in job.coordinator.describe().splitlines()]
        return " | ".join(parts) or "no job running"

    def text(self) -> str:
        """All of it, for the scenario's report."""
        jobs = [job.describe() for job in self.jobs] or ["no job running"]
        return "\n".join([*jobs, "threads:", *self.threads])


def hang_report() -> HangReport:
    """Where this process is now (from any thread but the one that hangs)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    stacks: dict[str, list[str]] = {}
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue  # the caller's own
        lines = [
            f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
            for f in traceback.extract_stack(frame)[-_STACK_DEPTH:]
        ]
        stacks.setdefault(" < ".join(reversed(lines)), []).append(names.get(ident, str(ident)))
    threads = tuple(
        f"{len(who)} thread(s) [{', '.join(sorted(who)[:6])}{', ...' if len(who) > 6 else ''}]: "
        f"{stack}"
        for stack, who in sorted(stacks.items(), key=lambda kv: -len(kv[1]))
    )
    return HangReport(tuple(ex.diagnosis() for ex in running_executors()), threads)


def _serve(conn: Connection, run: Runner) -> None:
    """A child's loop: scenarios in, ``("done", outcome)`` out, until told to end
    (None). A scenario still running after its time limit sends ``("hang", where
    the process is)`` first (:func:`hang_report`), from a watchdog thread."""
    sending = threading.Lock()

    def send(message: tuple[str, Any]) -> None:
        with sending:
            conn.send(message)

    def report_hang() -> None:
        try:
            where = hang_report()
        except Exception as e:  # a report that fails still ends the scenario as a hang
            where = HangReport((), (f"the report failed: {type(e).__name__}: {e}",))
        send(("hang", where))

    while True:
        job = conn.recv()
        if job is None:
            return
        scenario, workdir, timeout_s = job
        watchdog = threading.Timer(timeout_s, report_hang)
        watchdog.daemon = True
        watchdog.start()
        try:
            outcome = run(scenario, workdir)
        finally:
            watchdog.cancel()
        send(("done", outcome))


class IsolatedRunner:
    """Runs each scenario in a child process (kept from one scenario to the next), and
    ends the child when a scenario has not ended after ``timeout_s``: a job that hangs
    is a finding (``Hang``), not the end of a chaos run, and leaves no threads
    behind in the runs that follow. Before it ends the child, the child reports
    where it was (:class:`HangReport`): in ``error``, compactly, and in ``report``.
    ``run`` is what the child runs (a module-level function: it is pickled by name).
    Use it as a context manager."""

    def __init__(self, timeout_s: float, run: Runner = run_scenario) -> None:
        self.timeout_s = timeout_s
        self.run = run
        self._child: BaseProcess | None = None
        self._conn: Connection | None = None

    def _start(self) -> Connection:
        if self._child is None or not self._child.is_alive() or self._conn is None:
            ctx = multiprocessing.get_context("spawn")
            ours, theirs = ctx.Pipe()
            self._child = ctx.Process(
                target=_serve, args=(theirs, self.run), name="spillover-chaos"
            )
            self._child.start()
            theirs.close()
            self._conn = ours
        return self._conn

    def __call__(self, s: Scenario, workdir: str) -> Outcome:
        started = time.monotonic()
        conn = self._start()
        conn.send((s, workdir, self.timeout_s))
        hang = f"Hang: the scenario had not ended after {self.timeout_s:.0f} s"
        # The child reports a hang itself once the limit passed; a child that cannot
        # (its interpreter stuck in native code) is ended a little later without.
        if conn.poll(self.timeout_s + _REPORT_GRACE_S):
            try:
                what, got = conn.recv()
            except EOFError:  # the child died (a crash in native code, say)
                self.close(kill=True)
                return Outcome(
                    False, time.monotonic() - started, error="Crash: the run's process died"
                )
            if what == "done":
                outcome: Outcome = got
                return outcome
            self.close(kill=True)
            where: HangReport = got
            return Outcome(
                False,
                time.monotonic() - started,
                error=f"{hang}: {where.summary()}",
                report=where.text(),
            )
        self.close(kill=True)
        return Outcome(False, time.monotonic() - started, error=f"{hang} (and could not say where)")

    def close(self, kill: bool = False) -> None:
        """Ends the child: asked to (it finishes its scenario), or SIGKILLed."""
        child, conn = self._child, self._conn
        self._child = self._conn = None
        if child is None or conn is None:
            return
        if kill:
            child.kill()
        else:
            with contextlib.suppress(OSError):
                conn.send(None)
        child.join(timeout=30)
        conn.close()

    def __enter__(self) -> IsolatedRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(kill=exc[0] is not None)
