"""A running job as its REST API sees it: the executor, its asynchronous operations
(savepoint and stop triggers, polled by id as in Flink), the operators' commands
that reached it, and rates of its counters."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spillover.errors import ConfigError, JobNotRunningError
from spillover.rest.registry import Command
from spillover.runtime.checkpointing.savepoint_request import SavepointRequest
from spillover.runtime.jobmaster import Executor, JobResult
from spillover.runtime.live_rescale import RescaleStatus
from spillover.storage.folders import check_folder
from spillover.storage.location import Location

logger = logging.getLogger(__name__)

COMMANDS_KEPT = 100  # the latest operator commands a job keeps (the registry shows them)


@dataclass(frozen=True)
class Operation:
    """An asynchronous operation's state (Flink's ``AsynchronousOperationResult``)."""

    status: str  # IN_PROGRESS | COMPLETED
    location: str | None = None
    failure: str | None = None

    @classmethod
    def of(cls, request: SavepointRequest) -> Operation:
        if not request.done:
            return cls("IN_PROGRESS")
        return cls("COMPLETED", request.path, request.error)


def check_savepoint_dir(target: str) -> None:
    """A local savepoint directory must be one the job can create and write: refused
    now (ConfigError) rather than after the savepoint's checkpoint."""
    loc = Location.parse(target)
    if loc.local:
        check_folder("target-directory", loc.path, create=False)


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
        self._triggers: dict[str, SavepointRequest] = {}
        self._stop: SavepointRequest | None = None
        self._commands: deque[Command] = deque(maxlen=COMMANDS_KEPT)
        self._ended = threading.Event()
        self._on_end: list[Callable[[ServedJob], None]] = []

    @property
    def job_id(self) -> str:
        return self.executor.job_id

    @property
    def name(self) -> str:
        return self.executor.graph.name

    @property
    def commands(self) -> tuple[Command, ...]:
        """The latest operator commands that reached the job, oldest first."""
        with self._lock:
            return tuple(self._commands)

    def on_end(self, f: Callable[[ServedJob], None]) -> None:
        self._on_end.append(f)

    def run(self, **options: Any) -> JobResult:
        """Runs the job to its end (``Executor.run``'s options). Then the end
        listeners run (the registry says it ended), :meth:`wait` returns, and only
        then a stop trigger completes with the savepoint's path (whoever polls it
        finds the job ended everywhere) and any other trigger still open fails."""
        try:
            self.result = self.executor.run(**options)
            return self.result
        except BaseException as e:
            self.error = e
            raise
        finally:
            for f in self._on_end:
                try:
                    f(self)
                except Exception as e:  # a listener's failure must not hide the job's
                    logger.warning("job end listener failed: %s", e)
            self._ended.set()
            self._finish_triggers()

    def _finish_triggers(self) -> None:
        r = self.result
        with self._lock:
            stop, triggers = self._stop, list(self._triggers.values())
        if stop is not None:
            if r is not None and r.savepoint:
                stop.succeeded(r.savepoint)
            else:
                stop.failed(
                    f"the job ended {r.status} without a savepoint" if r else "the job failed"
                )
        for t in triggers:
            t.failed(f"the job ended ({r.status if r else 'failed'}) before the savepoint")

    @property
    def ended(self) -> bool:
        return self._ended.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._ended.wait(timeout)

    def _check_running(self) -> None:
        if self.ended:
            state = self.executor.status.snapshot().state
            raise JobNotRunningError(
                f"the job has ended ({state})", hint="`spillover list` shows its state"
            )

    def _command(self, command: str, detail: str) -> None:
        """Records a command the job accepted: the log, and the job's bounded list (the
        job master records it in the job event log too)."""
        logger.info("job %s: %s %s", self.job_id, command, detail)
        with self._lock:
            self._commands.append(Command(time.time(), command, detail))

    def trigger_savepoint(self, target: str | None, unaligned: bool) -> str:
        """Starts a savepoint without stopping; returns the trigger id to poll."""
        self._check_running()
        if target:
            check_savepoint_dir(target)
        tid = uuid.uuid4().hex
        request = self.executor.trigger_savepoint(target, unaligned=unaligned)
        self._command("savepoint", f"target={target} unaligned={unaligned} trigger={tid}")
        with self._lock:
            self._triggers[tid] = request
        return tid

    def trigger_stop(self, target: str | None, drain: bool, unaligned: bool) -> str:
        """Stop-with-savepoint; returns the trigger id to poll."""
        self._check_running()
        if target:
            check_savepoint_dir(target)
        tid = uuid.uuid4().hex
        with self._lock:
            if self._stop is not None and not self._stop.done:
                raise ConfigError("the job is stopping already")
        # Answered by the job master: the savepoint's path once the job ended, or why
        # the stop failed (the job then goes on as it was).
        stop = self.executor.stop_with_savepoint(
            drain=drain, savepoint_dir=target, unaligned=unaligned
        )
        self._command("stop", f"target={target} drain={drain} unaligned={unaligned} trigger={tid}")
        with self._lock:
            self._stop = stop
            self._triggers[tid] = stop
        return tid

    def rescale(self, wanted: dict[str, int]) -> str:
        """A live rescale to ``wanted`` (a parallelism per vertex uid); returns its
        request id. Refused (ConfigError) before the job is touched."""
        self._check_running()
        request = self.executor.rescale_live(wanted)
        detail = " ".join(f"{uid}={p}" for uid, p in sorted(wanted.items()))
        self._command("rescale", f"{detail} request={request.request_id}")
        return request.request_id

    def rescale_status(self) -> RescaleStatus | None:
        """The latest live rescale's status (None before any)."""
        request = self.executor.last_rescale
        return None if request is None else request.status()

    def operation(self, trigger_id: str) -> Operation | None:
        """A trigger's state. A stop whose savepoint the master has taken stays in
        progress until the job ended and the registry says so (Flink's stop
        completes once the job terminated); a stop that failed ends at once."""
        with self._lock:
            t, stop = self._triggers.get(trigger_id), self._stop
        if t is None:
            return None
        if t is stop and t.done and t.error is None and not self.ended:
            return Operation("IN_PROGRESS")
        return Operation.of(t)

    def cancel(self) -> None:
        self._check_running()
        self._command("cancel", "")
        self.executor.cancel()
