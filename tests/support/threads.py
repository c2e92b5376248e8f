"""Threads in tests: a worker that keeps its result or exception, a wait for a
condition, and the transport's threads, each bounded so that a hang fails the test
instead of stalling the run."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

JOIN = 10.0  # seconds a thread or a condition may take before the test fails, not hangs


class Worker(threading.Thread):
    """A daemon thread, started at once, that keeps its function's result or
    exception for :meth:`finish`."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as e:
            self.error = e

    def finish(self, timeout: float = JOIN) -> Any:
        """The function's result once the thread ended (its exception raised here);
        fails the test when it runs on after ``timeout`` seconds."""
        self.join(timeout)
        assert not self.is_alive(), "thread did not finish"
        if self.error is not None:
            raise self.error
        return self.result


def eventually(cond: Callable[[], bool], timeout: float = JOIN) -> None:
    """Waits until ``cond()`` holds; fails the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.001)


def transport_threads() -> set[threading.Thread]:
    """The TCP transport's live threads (a test checks that none outlives it)."""
    return {t for t in threading.enumerate() if t.name.startswith("spillover-tcp")}
