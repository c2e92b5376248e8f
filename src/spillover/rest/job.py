"""A running job as its REST API sees it: the executor, its asynchronous operations
(savepoint and stop triggers, polled by id as in Flink), and rates of its counters."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spillover.errors import ConfigError, JobNotRunningError
from spillover.runtime.jobmaster import Executor, JobResult
from spillover.storage.location import Location

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Operation:
    """An asynchronous operation's state (Flink's ``AsynchronousOperationResult``)."""

    status: str  # IN_PROGRESS | COMPLETED
    location: str | None = None
    failure: str | None = None


class _Trigger:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.location: str | None = None
        self.failure: str | None = None

    def finish(self, location: str | None, failure: str | None) -> None:
        self.location, self.failure = location, failure
        self.done.set()

    def operation(self) -> Operation:
        if not self.done.is_set():
            return Operation("IN_PROGRESS")
        return Operation("COMPLETED", self.location, self.failure)


def check_savepoint_dir(target: str) -> None:
    """A local savepoint directory must be one the job can create and write: refused
    now (ConfigError) rather than after the savepoint's checkpoint."""
    loc = Location.parse(target)
    if not loc.local:
        return
    existing = os.path.abspath(loc.path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            "cannot write the savepoint directory",
            detail=f"{target!r}: {existing!r} is not a folder this job can write",
            hint="give a folder the job can write",
        )


class RateMeter:
    """Per-second rates of monotonic counters, over a window of recent samples
    (Flink's ``MeterView``), sampled whenever a reader asks."""

    def __init__(self, window_s: float = 5.0) -> None:
        self.window_s = window_s
        self._lock = threading.Lock()
        self._samples: dict[str, list[tuple[float, float]]] = {}

    def rate(self, key: str, value: float, now: float | None = None) -> float:
        t = time.monotonic() if now is None else now
        with self._lock:
            samples = self._samples.setdefault(key, [])
            if samples and value < samples[-1][1]:  # a restart reset the counter
                samples.clear()
            samples.append((t, value))
            while len(samples) > 2 and t - samples[1][0] >= self.window_s:
                samples.pop(0)
            t0, v0 = samples[0]
            return (value - v0) / (t - t0) if t > t0 else 0.0


class ServedJob:
    """An :class:`Executor` with what its REST API needs: ``run`` runs the job (on the
    caller's thread), the ``trigger_*`` methods start operations polled by id."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.meter = RateMeter()
        self.result: JobResult | None = None
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._triggers: dict[str, _Trigger] = {}
        self._stop: _Trigger | None = None
        self._ended = threading.Event()
        self._on_end: list[Callable[[ServedJob], None]] = []

    @property
    def job_id(self) -> str:
        return self.executor.job_id

    @property
    def name(self) -> str:
        return self.executor.graph.name

    def on_end(self, f: Callable[[ServedJob], None]) -> None:
        self._on_end.append(f)

    def run(self, **options: Any) -> JobResult:
        """Runs the job to its end (``Executor.run``'s options); a stop trigger
        completes with the savepoint's path."""
        try:
            self.result = self.executor.run(**options)
            return self.result
        except BaseException as e:
            self.error = e
            raise
        finally:
            stop = self._stop
            if stop is not None:
                r = self.result
                if r is not None and r.savepoint:
                    stop.finish(r.savepoint, None)
                else:
                    why = f"the job ended {r.status} without a savepoint" if r else "the job failed"
                    stop.finish(None, why)
            self._ended.set()
            for f in self._on_end:
                try:
                    f(self)
                except Exception as e:  # a listener's failure must not hide the job's
                    logger.warning("job end listener failed: %s", e)

    @property
    def ended(self) -> bool:
        return self._ended.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._ended.wait(timeout)

    def _new_trigger(self) -> tuple[str, _Trigger]:
        tid = uuid.uuid4().hex
        t = _Trigger()
        with self._lock:
            self._triggers[tid] = t
        return tid, t

    def _check_running(self) -> None:
        if self.ended:
            state = self.executor.status.snapshot().state
            raise JobNotRunningError(
                f"the job has ended ({state})", hint="`spillover list` shows its state"
            )

    def trigger_savepoint(self, target: str | None, unaligned: bool) -> str:
        """Starts a savepoint without stopping; returns the trigger id to poll."""
        self._check_running()
        if target:
            check_savepoint_dir(target)
        request = self.executor.trigger_savepoint(target, unaligned=unaligned)
        tid, trigger = self._new_trigger()

        def wait() -> None:
            try:
                trigger.finish(request.wait(), None)
            except Exception as e:
                trigger.finish(None, str(e))

        threading.Thread(target=wait, name=f"savepoint-{tid[:8]}", daemon=True).start()
        return tid

    def trigger_stop(self, target: str | None, drain: bool, unaligned: bool) -> str:
        """Stop-with-savepoint; returns the trigger id to poll."""
        self._check_running()
        if target:
            check_savepoint_dir(target)
        tid, trigger = self._new_trigger()
        with self._lock:
            if self._stop is not None:
                raise ConfigError("the job is stopping already")
            self._stop = trigger
        try:
            self.executor.stop_with_savepoint(
                drain=drain, savepoint_dir=target, unaligned=unaligned
            )
        except BaseException:
            self._stop = None
            raise
        return tid

    def operation(self, trigger_id: str) -> Operation | None:
        with self._lock:
            t = self._triggers.get(trigger_id)
        return None if t is None else t.operation()

    def cancel(self) -> None:
        self._check_running()
        self.executor.cancel()
