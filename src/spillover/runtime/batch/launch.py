"""Where a batch task runs: what it needs (:class:`BatchTaskSpec`, picklable, so a
Spark worker can run it too), how it ended (:class:`TaskOutcome`), and the local
launcher (a thread of this process). A task needs no connection to any other: it
reads its inputs from its producers' result files and writes its own."""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from spillover.config import Config
from spillover.errors import ConfigError
from spillover.runtime.batch.results import InputResult, ResultHandle, ResultUnreadableError
from spillover.runtime.batch.tasks import BatchTask, build_batch_task
from spillover.runtime.failures import FailureInjector
from spillover.runtime.graph import JobGraph
from spillover.runtime.task import Task, TaskCancelled
from spillover.storage import open_storage
from spillover.storage.location import Location


@dataclass(frozen=True)
class BatchTaskSpec:
    """One run of one batch task: ``results_dir`` is where its result files go (None:
    it has no outputs), ``splits`` a source subtask's assigned splits."""

    graph: JobGraph
    config: Config
    uid: str
    subtask: int
    attempt: int
    run_id: str
    inputs: tuple[InputResult, ...]
    results_dir: str | None
    splits: tuple[str, ...] | None
    flush_interval: float
    failures: FailureInjector

    @property
    def key(self) -> tuple[str, int]:
        return (self.uid, self.subtask)


@dataclass
class TaskOutcome:
    """How a task run ended: its results, or what failed (as text: it may come from
    another process). ``lost`` is a result it could not read (its producer must run
    again); ``fatal``: a configuration error no re-run heals; ``cancelled``: stopped
    by the scheduler. ``fired``: induced failures that fired in it (their indexes)."""

    key: tuple[str, int]
    results: tuple[ResultHandle, ...] | None = None
    error: str | None = None
    trace: str = ""
    lost: ResultHandle | None = None
    fatal: bool = False
    cancelled: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    fired: list[tuple[int, int]] = field(default_factory=list)


def build(spec: BatchTaskSpec, on_done: Callable[[Task, BaseException | None], None]) -> BatchTask:
    g = spec.graph
    v = next(v for v in g.vertices if v.uid == spec.uid)
    storage = None
    if spec.results_dir is not None:
        storage = open_storage(
            spec.results_dir,
            compression=spec.config.execution.shuffle_codec.label,
            subtask_index=spec.subtask,
        )
    bt = build_batch_task(
        g,
        spec.config,
        v,
        spec.subtask,
        attempt=spec.attempt,
        inputs=spec.inputs,
        storage=storage,
        failures=spec.failures,
        on_done=on_done,
        flush_interval=spec.flush_interval,
    )
    if spec.results_dir is not None:
        bt.location = Location.parse(spec.results_dir)
    bt.task.chain.batch_run = bt.task.chain.job_run = spec.run_id
    bt.task.splits = spec.splits
    return bt


def outcome_of(spec: BatchTaskSpec, bt: BatchTask, err: BaseException | None) -> TaskOutcome:
    """The outcome of ``bt``, which ended with ``err`` (its threads are done)."""
    out = TaskOutcome(spec.key, metrics=bt.task.metrics())
    if err is None:
        out.results = bt.results(spec.graph)
        return out
    if isinstance(err, TaskCancelled):
        out.cancelled, out.error = True, str(err)
        return out
    error = bt.reader.error if bt.reader is not None and bt.reader.error is not None else err
    out.error = f"{type(error).__name__}: {error}"
    out.trace = "".join(traceback.format_exception(error))
    out.lost = error.result if isinstance(error, ResultUnreadableError) else None
    out.fatal = isinstance(error, ConfigError)
    return out


def run_here(spec: BatchTaskSpec) -> TaskOutcome:
    """Runs one task run to its end on this process's threads (a Spark worker's)."""
    ended: list[BaseException | None] = []
    done = threading.Event()

    def on_done(task: Task, err: BaseException | None) -> None:
        ended.append(err)
        done.set()

    fired: list[tuple[int, int]] = []
    spec.failures.on_fire = lambda index, attempt: fired.append((index, attempt))
    bt = build(spec, on_done)
    bt.start()
    done.wait()
    if ended[0] is not None:
        bt.cancel()  # stops its reader; its partial result files are deleted
    bt.join()
    outcome = outcome_of(spec, bt, ended[0])
    outcome.fired = fired
    return outcome


class Running(Protocol):
    """A launched task run: ``cancel()`` stops it (its outcome then says cancelled)."""

    def cancel(self) -> None: ...


class Launcher(Protocol):
    """Starts task runs somewhere; each one's outcome goes to ``done`` exactly once,
    from any thread."""

    def launch(self, spec: BatchTaskSpec, done: Callable[[TaskOutcome], None]) -> Running: ...

    def close(self) -> None: ...


class LocalLauncher:
    """Runs each task on threads of this process (the local executor)."""

    def launch(self, spec: BatchTaskSpec, done: Callable[[TaskOutcome], None]) -> Running:
        holder: list[BatchTask] = []

        def on_done(task: Task, err: BaseException | None) -> None:
            # On the task's thread: finish off (its reader) on another one.
            threading.Thread(target=finish, args=(err,), daemon=True).start()

        def finish(err: BaseException | None) -> None:
            bt = holder[0]
            if err is not None:
                bt.cancel()  # stops its reader; its partial result files are deleted
            bt.join()
            done(outcome_of(spec, bt, err))

        bt = build(spec, on_done)
        holder.append(bt)
        bt.start()
        return bt

    def close(self) -> None:
        pass
