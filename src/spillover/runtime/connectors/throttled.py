"""A sink that takes records at a fixed pace: backpressure on purpose."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from spillover.errors import ConfigError
from spillover.runtime.api import Batch, Operator, OperatorContext, OperatorSnapshot

PACE_SLACK = 0.001
"""Seconds a :class:`ThrottledSink` in a pacing task may run ahead of its pace before
the task waits for it: below that it takes the next batch at once, the time it owes
carried over, so that a sink faster than its input (an unpaced benchmark's) never
parks its task for tens of microseconds after every buffer, each park a futex hand-off
and a wait for the GIL; over any span past the slack its rate holds."""


class ThrottledSink(Operator):
    """Consumes at most ``rate_per_subtask`` records/s per subtask: after each batch it
    takes no more input until the batch's share of time has passed (``ready_at``, less
    :data:`PACE_SLACK`; outside a pacing task it sleeps), never spinning.

    It backpressures its inputs on purpose. Pacing has no memory of idle time:
    a burst after a pause is paced like any other. ``inner`` (another sink, e.g.
    :class:`CollectingSink`) also receives every batch and every lifecycle call;
    the operator state is the inner sink's. ``clock`` and ``sleep`` are for tests.
    """

    def __init__(
        self,
        rate_per_subtask: float,
        inner: Operator | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not rate_per_subtask > 0:
            raise ConfigError(f"rate_per_subtask must be > 0, got {rate_per_subtask}")
        self.rate = float(rate_per_subtask)
        self.inner = inner
        self.clock = clock
        self.sleep = sleep

    def open(self, ctx: OperatorContext) -> None:
        super().open(ctx)
        self._due: float | None = None
        if self.inner is not None:
            self.inner.open(ctx)

    def process(self, batch: Batch, input_index: int = 0) -> None:
        if self.inner is not None:
            self.inner.process(batch, input_index)
        now = self.clock()
        start = now if self._due is None else max(self._due, now)
        self._due = start + len(batch) / self.rate
        # In a task that honours ready_at, the task waits (taking barriers meanwhile).
        if self._due > now and not self.ctx.pacing:
            self.sleep(self._due - now)

    def ready_at(self) -> float:
        return 0.0 if self._due is None else self._due - PACE_SLACK

    def restore(self, state: Any) -> None:
        if self.inner is not None:
            self.inner.restore(state)

    def restore_rescaled(self, states: list[Any]) -> None:
        if self.inner is not None:
            self.inner.restore_rescaled(states)

    def snapshot(self, checkpoint_id: int) -> OperatorSnapshot:
        return OperatorSnapshot() if self.inner is None else self.inner.snapshot(checkpoint_id)

    @property
    def commits_on_restore(self) -> bool:
        return self.inner is not None and self.inner.commits_on_restore

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        if self.inner is not None:
            self.inner.notify_checkpoint_complete(checkpoint_id)

    def notify_checkpoint_aborted(self, checkpoint_id: int) -> None:
        if self.inner is not None:
            self.inner.notify_checkpoint_aborted(checkpoint_id)

    def end_input(self, input_index: int) -> None:
        if self.inner is not None:
            self.inner.end_input(input_index)

    def finish(self) -> None:
        if self.inner is not None:
            self.inner.finish()

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
