"""Kill the driver: run a job in a child driver process, SIGKILL it again and again,
start it again each time with the same command, and check the output stays exact.

Each start is a fresh process running :func:`drive`: the same job name and
checkpoint directory, so the job master finds the job's event log and resumes the
run from the newest checkpoint it names. Kills land at random instants after a
start (during start-up and restore), just after a new checkpoint completed (when
sinks commit it), and at two exact points inside the master: a checkpoint whose
metadata is written but not logged, one logged but not yet told to the tasks, and
an attempt whose tasks are restoring a checkpoint.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spillover.deploy import create_executor
from spillover.errors import ConfigError, SpilloverError
from spillover.runtime.checkpointing.metadata import CheckpointStorage
from spillover.runtime.jobevents import EVENTS_DIR, JobEventLog
from spillover.runtime.jobmaster import Executor, JobResult
from spillover.storage.location import Publication
from spillover.verify.output import RunOutput, output_of
from spillover.verify.spec import VerifySpec, _checkpoints, config_for

__all__ = ["BATCH_KILL_POINTS", "KILL_POINTS", "DriverKill", "drive", "run_killing_the_driver"]

# Where a start may be killed: at a random instant, right after a checkpoint
# completed, or inside the master between a checkpoint's metadata and its log
# record ("unlogged") or between the record and the tasks' notification ("logged").
KILL_POINTS = ("random", "after-checkpoint", "unlogged", "logged", "restoring")
# A batch run: at a random instant, or right after a task finished (between stages,
# or while the other tasks of a stage still run).
BATCH_KILL_POINTS = ("random", "after-task")
_IN_MASTER = {"unlogged", "logged", "restoring"}


@dataclass
class DriverKill:
    """One start of the driver and how it ended."""

    start: int
    point: str
    killed: bool
    after_s: float
    checkpoint_before: int  # the newest checkpoint the log named when it started
    checkpoint_after: int  # ... and when it ended
    # A batch run: tasks the log named finished when it started and when it ended.
    tasks_before: int = 0
    tasks_after: int = 0
    batch: bool = False
    # ... the job's tasks; of those finished when it started, how many this start ran
    # again (0 unless a result was lost); how many this start ran to their end.
    tasks_total: int = 0
    tasks_rerun: int = 0
    tasks_ran: int = 0

    def describe(self) -> str:
        how = (
            f"killed ({self.point}) after {self.after_s:.2f} s" if self.killed else "ran to its end"
        )
        if self.batch:
            return (
                f"start {self.start}: {how}; finished tasks in the log "
                f"{self.tasks_before} -> {self.tasks_after} of {self.tasks_total}: it re-ran "
                f"{self.tasks_rerun} of the {self.tasks_before} finished at its start and "
                f"finished {self.tasks_ran - self.tasks_rerun} more"
            )
        return (
            f"start {self.start}: {how}; newest logged checkpoint "
            f"{self.checkpoint_before} -> {self.checkpoint_after}"
        )


def drive(
    spec: VerifySpec, out_dir: str, name: str, ckpt: str, result_path: str, point: str
) -> None:
    """A child driver: runs ``spec``'s job (with the checkpoints under ``ckpt``) and
    pickles its :class:`JobResult` to ``result_path``; ``point`` may make it kill
    itself inside the master (:func:`_arm`)."""
    graph = spec.factory()(out_dir, name, spec.parallelism).build()
    cfg = config_for(spec, ckpt)
    ex = create_executor(spec.executor, graph, cfg, **_options(spec))
    if point in _IN_MASTER:
        _arm(ex, point)
    result = ex.run(timeout=600)
    with open(result_path + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(result_path + ".tmp", result_path)


def _options(spec: VerifySpec) -> dict[str, Any]:
    return {"master": spec.master} if spec.executor == "spark" else {}


def _arm(ex: Executor, point: str) -> None:
    """Makes the master SIGKILL its own process at its second completed checkpoint,
    before (``unlogged``) or after (``logged``) recording it, or (``restoring``)
    20-200 ms into an attempt that restores a checkpoint (its tasks restoring state
    and replaying in-flight data)."""
    if point == "restoring":
        attempt = ex._attempt

        def restoring(n: int, restore: Any, restored_id: int | None) -> Any:
            if restored_id is not None:
                delay = random.uniform(0.02, 0.2)
                threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
            return attempt(n, restore, restored_id)

        ex._attempt = restoring  # type: ignore[method-assign,assignment]
        return
    record: Callable[[int, Publication], None] = ex.checkpoint_completed
    seen = [0]

    def completed(checkpoint_id: int, metadata: Publication) -> None:
        seen[0] += 1
        if seen[0] == 2 and point == "unlogged":
            metadata.publish()  # what a death between the group's two files leaves
            os.kill(os.getpid(), signal.SIGKILL)
        record(checkpoint_id, metadata)
        if seen[0] == 2 and point == "logged":
            os.kill(os.getpid(), signal.SIGKILL)

    ex.checkpoint_completed = completed  # type: ignore[method-assign]


def _logged_checkpoint(ckpt: str, name: str) -> int:
    """The id of the newest checkpoint the job's log names (0: none yet)."""
    loc = CheckpointStorage(ckpt, name).location.child(EVENTS_DIR)
    if not loc.exists():
        return 0
    try:
        cp = JobEventLog.open(loc).replay().checkpoint
    except (OSError, SpilloverError):  # a segment compacted away as it was read
        return 0
    return 0 if cp is None else cp.checkpoint_id


def _finished_tasks(ckpt: str, name: str) -> int:
    """How many tasks of a batch run the job's log names finished (0: no log yet)."""
    return len(_finished(ckpt, name)[0])


def _finished(ckpt: str, name: str) -> tuple[dict[tuple[str, int], int], int]:
    """The tasks of a batch run the job's log names finished, each with the generation
    that finished it, and the generation the next start of the driver runs."""
    loc = CheckpointStorage(ckpt, name).location.child(EVENTS_DIR)
    if not loc.exists():
        return {}, 0
    try:
        state = JobEventLog.open(loc).replay()
    except (OSError, SpilloverError):  # a segment compacted away as it was read
        return {}, 0
    after = 0 if state.generation is None else state.generation.generation + 1
    return {k: e.generation for k, e in state.finished_tasks.items()}, after


def _batch_start(
    ckpt: str, name: str, before: dict[tuple[str, int], int], generation: int
) -> tuple[int, int]:
    """(tasks finished before a start that it ran again, tasks it ran to their end):
    from the generation the log names each finished task's end in."""
    now, _ = _finished(ckpt, name)
    mine = {k for k, g in now.items() if g == generation}
    return len(mine & set(before)), len(mine)


def run_killing_the_driver(
    spec: VerifySpec,
    workdir: str,
    name: str,
    kills: int,
    *,
    seed: int = 1,
    points: tuple[str, ...] = KILL_POINTS,
    cycle: bool = False,
    progress: Callable[[DriverKill], None] | None = None,
) -> tuple[RunOutput, list[DriverKill]]:
    """Runs ``spec``'s job in child driver processes, SIGKILLs ``kills`` of them (at
    points drawn from ``points`` with ``seed``, or taken in turn with ``cycle``),
    then lets the last start run to its end. Returns that run's output (committed
    rows and final state) and each start."""
    if kills < 0:
        raise ConfigError("the number of driver kills must be at least 0", detail=str(kills))
    known = BATCH_KILL_POINTS if spec.batch else KILL_POINTS
    if spec.batch and points == KILL_POINTS:  # the default: a batch run's own points
        points = BATCH_KILL_POINTS
    bad = [p for p in points if p not in known]
    if bad or not points:
        raise ConfigError(f"unknown kill points {bad}", hint=f"choose from {known}")
    rng = random.Random(seed)
    out_dir = os.path.join(workdir, name, "output")
    os.makedirs(out_dir, exist_ok=True)
    ckpt = _checkpoints(spec, workdir, name)
    ctx = multiprocessing.get_context("spawn")
    starts: list[DriverKill] = []
    interval = spec.interval_ms / 1000
    result_path = os.path.join(workdir, name, "result.pickle")
    result: JobResult | None = None
    probe = spec.factory()(os.path.join(workdir, name, "probe"), name, spec.parallelism).build()
    total = sum(v.parallelism for v in probe.vertices)
    for start in range(kills + 1):
        pick = points[start % len(points)] if cycle else rng.choice(points)
        point = pick if start < kills else "none"
        before = _logged_checkpoint(ckpt, name)
        finished, generation = _finished(ckpt, name) if spec.batch else ({}, 0)
        tasks_before = len(finished)
        if point == "restoring" and not before:  # nothing to restore yet
            point = "random"
        child = ctx.Process(
            target=drive,
            args=(spec, out_dir, name, ckpt, result_path, point),
            name=f"spillover-driver-{start}",
        )
        began = time.monotonic()
        child.start()
        killed = False
        if point == "random":
            child.join(timeout=rng.uniform(0.0, 3.0 + 4 * interval))
        elif point == "after-checkpoint":
            _wait_for_checkpoint(child, ckpt, name, before, deadline=began + 120)
            child.join(timeout=rng.uniform(0.0, interval))
        elif point == "after-task":
            _wait_for_task(child, ckpt, name, tasks_before, deadline=began + 120)
        if point in ("random", "after-checkpoint", "after-task") and child.is_alive():
            os.kill(child.pid or 0, signal.SIGKILL)
            killed = True
        child.join(timeout=900)
        if child.is_alive():  # a hung driver is a failure of the run, not of the harness
            os.kill(child.pid or 0, signal.SIGKILL)
            child.join()
            raise RuntimeError(f"driver start {start} did not end within 900 s")
        killed = killed or child.exitcode == -signal.SIGKILL
        rerun, ran = _batch_start(ckpt, name, finished, generation) if spec.batch else (0, 0)
        kill = DriverKill(
            start,
            point,
            killed,
            time.monotonic() - began,
            before,
            _logged_checkpoint(ckpt, name),
            tasks_before,
            _finished_tasks(ckpt, name) if spec.batch else 0,
            spec.batch,
            total,
            rerun,
            ran,
        )
        starts.append(kill)
        if progress is not None:
            progress(kill)
        if not killed:
            if child.exitcode != 0 or not os.path.exists(result_path):
                raise RuntimeError(f"driver start {start} failed (exit code {child.exitcode})")
            with open(result_path, "rb") as f:
                result = pickle.load(f)
            if result is not None and not result.already_finished:
                break  # ran to its end: what comes after would find it finished
    assert result is not None
    return output_of(spec, result, out_dir, probe.max_parallelism), starts


def _wait_for_task(child: Any, ckpt: str, name: str, before: int, *, deadline: float) -> None:
    """Until the log names a task finished beyond the ``before`` it named (or the
    child ended)."""
    while child.is_alive() and time.monotonic() < deadline:
        if _finished_tasks(ckpt, name) > before:
            return
        time.sleep(0.01)


def _wait_for_checkpoint(child: Any, ckpt: str, name: str, before: int, *, deadline: float) -> None:
    """Until the log names a checkpoint newer than ``before`` (or the child ended)."""
    while child.is_alive() and time.monotonic() < deadline:
        if _logged_checkpoint(ckpt, name) > before:
            return
        time.sleep(0.01)
