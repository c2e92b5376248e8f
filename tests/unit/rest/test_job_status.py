"""The job's status as operators read it: Flink's states, exceptions and restarts."""

from __future__ import annotations

from spillover.rest.views import min_max_avg
from spillover.runtime.jobstatus import JobStatusTracker


def test_a_failed_attempt_is_an_exception_and_the_next_a_restart() -> None:
    t = JobStatusTracker()
    assert t.snapshot().state == "INITIALIZING"
    t.attempt_started(0)
    t.attempt_failed(0, RuntimeError("boom"), "Traceback ...")
    assert t.snapshot().state == "RESTARTING"
    t.attempt_started(1)
    t.ended("finished")
    s = t.snapshot()
    assert s.state == "FINISHED" and s.num_restarts == 1
    assert [(e.attempt, e.name, e.message) for e in s.exceptions] == [(0, "RuntimeError", "boom")]
    assert [name for name, _ in s.timestamps] == [
        "INITIALIZING",
        "RUNNING",
        "RESTARTING",
        "FINISHED",
    ]
    assert s.end_ms is not None and s.end_ms >= s.start_ms


def test_a_cancel_ends_canceled_unless_the_job_failed() -> None:
    t = JobStatusTracker()
    t.attempt_started(0)
    t.cancel_requested()
    t.ended("cancelled")
    assert t.snapshot().state == "CANCELED"
    failed = JobStatusTracker()
    failed.cancel_requested()
    failed.ended("failed")
    assert failed.snapshot().state == "FAILED"


def test_an_empty_summary_is_zeros() -> None:
    assert set(min_max_avg([]).values()) == {0}
