"""A job's status as operators read it: Flink's job states with their timestamps,
the exceptions that failed attempts, and the restarts. The job master writes it;
anything (the REST API, the CLI's progress) reads frozen snapshots from any thread."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

# Flink's JobStatus names, those a spillover job passes through.
INITIALIZING = "INITIALIZING"
RUNNING = "RUNNING"
RESTARTING = "RESTARTING"
FINISHED = "FINISHED"
CANCELED = "CANCELED"
FAILED = "FAILED"
TERMINAL = frozenset({FINISHED, CANCELED, FAILED})


@dataclass(frozen=True)
class JobException:
    """An error that ended an attempt (the job restarted after it, or failed)."""

    timestamp_ms: int
    attempt: int
    name: str  # the exception's class
    message: str
    stacktrace: str


@dataclass(frozen=True)
class JobStatusSnapshot:
    state: str
    timestamps: tuple[tuple[str, int], ...]  # (state, first entered, ms), in order
    exceptions: tuple[JobException, ...]  # oldest first
    num_restarts: int

    def entered(self, state: str) -> int | None:
        return next((t for s, t in self.timestamps if s == state), None)

    @property
    def start_ms(self) -> int:
        return self.timestamps[0][1]

    @property
    def end_ms(self) -> int | None:
        return self.entered(self.state) if self.state in TERMINAL else None


def _now_ms() -> int:
    return int(time.time() * 1000)


class JobStatusTracker:
    """Thread-safe: the job master reports, readers take :meth:`snapshot`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = INITIALIZING
        self._timestamps: dict[str, int] = {INITIALIZING: _now_ms()}
        self._exceptions: list[JobException] = []
        self._restarts = 0
        self._cancel = False

    def _enter(self, state: str) -> None:
        self._state = state
        self._timestamps.setdefault(state, _now_ms())

    def attempt_started(self, attempt: int, restart: bool = True) -> None:
        """An attempt runs; a later one counts as a restart unless it is a live
        rescale's (``restart=False``)."""
        with self._lock:
            if attempt > 0 and restart:
                self._restarts += 1
            self._enter(RUNNING)

    def attempt_failed(self, attempt: int, error: BaseException, stacktrace: str) -> None:
        with self._lock:
            self._exceptions.append(
                JobException(_now_ms(), attempt, type(error).__name__, str(error), stacktrace)
            )
            if self._state not in TERMINAL:
                self._enter(RESTARTING)

    def cancel_requested(self) -> None:
        """A cancel was asked for: the stop that follows ends the job ``CANCELED``."""
        with self._lock:
            self._cancel = True

    def ended(self, status: str) -> None:
        """The run returned with ``JobResult.status`` (finished | stopped | failed)."""
        with self._lock:
            if self._cancel and status != "failed":
                self._enter(CANCELED)
            else:
                self._enter(FAILED if status == "failed" else FINISHED)

    def snapshot(self) -> JobStatusSnapshot:
        with self._lock:
            return JobStatusSnapshot(
                state=self._state,
                timestamps=tuple(self._timestamps.items()),
                exceptions=tuple(self._exceptions),
                num_restarts=self._restarts,
            )
