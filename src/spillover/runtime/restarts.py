"""The restart strategy in force, counted: how long to wait before the next attempt
after a failure, or that no attempt is left. Streaming jobs restart whole
generations, batch jobs regions; both ask one :class:`RestartBudget`."""

from __future__ import annotations

import time
from collections import deque

from spillover.config import RestartConfig, RestartStrategy


class RestartBudget:
    """Flink's ``none``, ``fixed-delay`` (at most ``attempts`` restarts in all) and
    ``failure-rate`` (at most ``max-failures-per-interval`` failures within the
    interval) strategies, over the failures of one run."""

    def __init__(self, strategy: RestartStrategy, config: RestartConfig) -> None:
        self.strategy = strategy
        self.config = config
        self.restarts = 0
        self._failures: deque[float] = deque()

    def after_failure(self, now: float | None = None) -> float | None:
        """Counts a failure: the seconds to wait before restarting, or None when the
        strategy allows no more restarts."""
        rs = self.config
        if self.strategy is RestartStrategy.NONE:
            return None
        if self.strategy is RestartStrategy.FIXED_DELAY:
            if self.restarts >= rs.fixed_delay_attempts:
                return None
            delay = rs.fixed_delay_delay_s
        else:
            now = time.monotonic() if now is None else now
            self._failures.append(now)
            while self._failures and now - self._failures[0] > rs.failure_rate_interval_s:
                self._failures.popleft()
            if len(self._failures) > rs.failure_rate_max_failures_per_interval:
                return None
            delay = rs.failure_rate_delay_s
        self.restarts += 1
        return delay
