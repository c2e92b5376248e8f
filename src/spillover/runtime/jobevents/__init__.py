"""The job master's durable memory: the job event log and the one-master-per-job lease.

A master takes the lease first, then opens the log beside the job's checkpoints::

    events = checkpoint_storage.location.child(EVENTS_DIR)  # <dir>/<job>/_events
    lease = JobLease(events)
    lease.acquire()                          # LeaseHeldError: another master runs
    log = JobEventLog.open(events, lease=lease)
    state = log.replay()                     # what the previous master left
    log.append(GenerationStarted(...)); log.flush()

and renews the lease well within its time to live (``lease.renew()``).
"""

from spillover.runtime.jobevents.events import (
    CheckpointCompleted,
    CommandReceived,
    Event,
    GenerationEnded,
    GenerationStarted,
    JobCancelled,
    JobFailed,
    JobFinished,
    JobLogState,
    JobSubmitted,
    JobTerminated,
    LogEntry,
    RescaleDecided,
    SavepointCompleted,
    SplitsAssigned,
    StopAbandoned,
    StopRequested,
    TaskFinished,
)
from spillover.runtime.jobevents.lease import (
    JobLease,
    Lease,
    LeaseError,
    LeaseHeldError,
    LeaseHolder,
    LeaseLostError,
)
from spillover.runtime.jobevents.log import EVENTS_DIR, JobEventLog, is_event_log

__all__ = [
    "EVENTS_DIR",
    "CheckpointCompleted",
    "CommandReceived",
    "Event",
    "GenerationEnded",
    "GenerationStarted",
    "JobCancelled",
    "JobEventLog",
    "JobFailed",
    "JobFinished",
    "JobLease",
    "JobLogState",
    "JobSubmitted",
    "JobTerminated",
    "Lease",
    "LeaseError",
    "LeaseHeldError",
    "LeaseHolder",
    "LeaseLostError",
    "LogEntry",
    "RescaleDecided",
    "SavepointCompleted",
    "SplitsAssigned",
    "StopAbandoned",
    "StopRequested",
    "TaskFinished",
    "is_event_log",
]
