"""The restart budget that streaming generations and batch regions share."""

from __future__ import annotations

from datetime import timedelta

from hypothesis import given
from hypothesis import strategies as st

from spillover.config import RestartConfig, RestartStrategy
from spillover.runtime.restarts import RestartBudget


def test_none_allows_no_restart() -> None:
    assert RestartBudget(RestartStrategy.NONE, RestartConfig()).after_failure() is None


@given(attempts=st.integers(0, 20), delay_ms=st.integers(0, 5000))
def test_fixed_delay_allows_exactly_its_attempts(attempts: int, delay_ms: int) -> None:
    rs = RestartConfig(
        fixed_delay_attempts=attempts, fixed_delay_delay=timedelta(milliseconds=delay_ms)
    )
    budget = RestartBudget(RestartStrategy.FIXED_DELAY, rs)
    delays = [budget.after_failure() for _ in range(attempts)]
    assert delays == [delay_ms / 1000] * attempts
    assert budget.after_failure() is None
    assert budget.restarts == attempts


def test_failure_rate_counts_only_failures_inside_the_interval() -> None:
    rs = RestartConfig(
        failure_rate_max_failures_per_interval=2,
        failure_rate_interval=timedelta(seconds=10),
        failure_rate_delay=timedelta(seconds=0.5),
    )
    budget = RestartBudget(RestartStrategy.FAILURE_RATE, rs)
    assert budget.after_failure(now=0.0) == 0.5
    assert budget.after_failure(now=5.0) == 0.5
    assert budget.after_failure(now=9.0) is None  # three within 10 s
    fresh = RestartBudget(RestartStrategy.FAILURE_RATE, rs)
    assert fresh.after_failure(now=0.0) == 0.5
    assert fresh.after_failure(now=5.0) == 0.5
    assert fresh.after_failure(now=16.0) == 0.5  # the first one left the interval
