"""How a run of a job went (:class:`JobResult`): what the job master's ``run`` returns
and the reports, benchmarks and checks read."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# The checkpoint summaries a result keeps, and a checkpoint coordinator.
MAX_CHECKPOINTS = 10_000


@dataclass
class JobResult:
    """How a run went: status, attempts, per-checkpoint and per-task metrics."""

    job_name: str
    status: str  # finished | stopped | failed | cancelled
    attempts: int
    duration_s: float
    # Each ended checkpoint's summary, every attempt's, oldest first: the newest
    # ``MAX_CHECKPOINTS`` of them (a job that ran longer: ``checkpoints_ended`` counts all).
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    checkpoints_ended: int = 0
    tasks: dict[str, dict[str, float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    tracebacks: list[str] = field(default_factory=list, repr=False)
    restored_from: list[int] = field(default_factory=list)
    replayed_bytes: int = 0  # in-flight bytes replayed by restores, over every attempt
    checkpoint_dir: str | None = None
    # Per restart: seconds from the failure's detection to the next attempt's subtasks
    # running (restore included; the restart strategy's delay too).
    restart_s: list[float] = field(default_factory=list)
    # Stop-with-savepoint: the savepoint's directory (restore it with
    # ``restore_checkpoint=``); ``status`` is ``stopped`` without drain.
    savepoint: str | None = None
    # With checkpoint storage, the run this is (kept when a later start resumes
    # it), and what the master decided from the job's event log, said for people.
    run_id: str | None = None
    recovery: str | None = None
    # The event log said the job had finished already: nothing ran.
    already_finished: bool = False
    # A batch job: the tasks whose results an earlier master left and this run reused.
    reused_tasks: list[str] = field(default_factory=list)

    def add_checkpoints(self, summaries: Iterable[dict[str, Any]], ended: int) -> None:
        """An attempt's ended checkpoints: ``summaries`` (its newest) of ``ended``."""
        self.checkpoints += summaries
        del self.checkpoints[:-MAX_CHECKPOINTS]
        self.checkpoints_ended += ended

    def continues(self, earlier: JobResult) -> None:
        """This run restored from ``earlier``'s checkpoint: its attempts, checkpoints,
        failures, restore points and replayed bytes come first in this result."""
        self.attempts += earlier.attempts
        self.checkpoints = (earlier.checkpoints + self.checkpoints)[-MAX_CHECKPOINTS:]
        self.checkpoints_ended += earlier.checkpoints_ended
        self.failures = earlier.failures + self.failures
        self.restored_from = earlier.restored_from + self.restored_from
        self.replayed_bytes += earlier.replayed_bytes

    def completed_checkpoints(self) -> list[dict[str, Any]]:
        return [c for c in self.checkpoints if c["status"] == "completed"]

    @property
    def persisted_inflight_bytes(self) -> int:
        """In-flight bytes persisted by completed checkpoints, over every attempt."""
        return sum(int(c["inflight_bytes"]) for c in self.completed_checkpoints())

    def to_json(self) -> str:
        return json.dumps(self.__dict__, default=str, indent=1)
