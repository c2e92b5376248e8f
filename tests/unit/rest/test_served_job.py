"""The REST API's view of a job, over a stand-in executor: triggers are the job
master's savepoint requests, finished once the job ended (after the registry heard
of it), and the operators' commands are kept."""

from __future__ import annotations

from typing import Any, cast

from spillover.rest.job import Operation, ServedJob
from spillover.runtime.checkpointing.savepoint_request import SavepointRequest
from spillover.runtime.jobmaster import Executor, JobResult
from spillover.runtime.jobstatus import JobStatusTracker
from spillover.runtime.network.events import BarrierKind


class StandIn:
    """What ServedJob asks of an executor: a savepoint is never taken, a stop leaves
    its savepoint at ``/sp``."""

    job_id = "0123456789abcdef"

    def __init__(self) -> None:
        self.status = JobStatusTracker()
        self.requests: list[SavepointRequest] = []
        self.stop = SavepointRequest(BarrierKind.ALIGNED)

    def trigger_savepoint(self, target: str | None, unaligned: bool = False) -> SavepointRequest:
        self.requests.append(SavepointRequest(BarrierKind.ALIGNED))
        return self.requests[-1]

    def stop_with_savepoint(self, **options: Any) -> SavepointRequest:
        self.stop = SavepointRequest(BarrierKind.ALIGNED)
        return self.stop

    def cancel(self) -> None:
        pass

    def run(self, **options: Any) -> JobResult:
        self.stop.succeeded("/sp")  # as the job master does, before its run returns
        self.status.ended("stopped")
        return JobResult("job", "stopped", 1, 0.0, savepoint="/sp")


def test_a_stop_completes_after_the_end_listeners_ran_and_open_triggers_fail() -> None:
    job = ServedJob(cast(Executor, StandIn()))
    savepoint = job.trigger_savepoint(None, False)
    stop = job.trigger_stop(None, drain=False, unaligned=False)
    assert job.operation(savepoint) == Operation("IN_PROGRESS")
    seen: list[tuple[str, str, bool]] = []

    def listener(j: ServedJob) -> None:  # the registry's update, say
        op = j.operation(stop)
        assert op is not None
        seen.append((op.status, j.executor.status.snapshot().state, j.ended))

    job.on_end(listener)
    job.run()
    # Whoever saw the stop complete finds the job ended in the registry too.
    assert seen == [("IN_PROGRESS", "FINISHED", False)]
    assert job.operation(stop) == Operation("COMPLETED", "/sp")
    op = job.operation(savepoint)
    assert op is not None and op.status == "COMPLETED" and op.location is None
    assert op.failure == "the job ended (stopped) before the savepoint"


def test_commands_are_kept_in_order_and_bounded() -> None:
    job = ServedJob(cast(Executor, StandIn()))
    tid = job.trigger_savepoint("/tmp", True)
    job.trigger_stop(None, drain=True, unaligned=False)
    job.cancel()
    commands = job.commands
    assert [c.command for c in commands] == ["savepoint", "stop", "cancel"]
    assert commands[0].detail == f"target=/tmp unaligned=True trigger={tid}"
    for _ in range(200):
        job.cancel()
    assert len(job.commands) == 100 and job.commands[-1].command == "cancel"
