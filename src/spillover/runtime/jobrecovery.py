"""The job master's durable side: one master per job (a lease), the job event log it
writes, and what a master starting the job finds there (:class:`Resume`).

A job with checkpoint storage keeps both in ``<checkpoint dir>/<job>/_events``.
Starting it again (same job name, same checkpoint directory) after its driver died
resumes the run the log describes from the newest checkpoint the log names; a run
the log says finished is not run again. ``execution.job-recovery.enabled: false``
starts a fresh run instead, and so does an explicit restore
(``execution.state-recovery.path``); the log records either as a new run.

A checkpoint counts as completed once the log says so: the master records it
(flushed) after its metadata is written and before any task is told, so a 2PC
sink never commits a checkpoint that a restarted master would not restore. A
checkpoint directory of the dead run above the newest logged one is half-written
(or never confirmed): it is deleted on resume, and its id is not reused.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from spillover.errors import ConfigError, SpilloverError
from spillover.runtime.checkpointing.checkpoint_meta import CheckpointMetadata
from spillover.runtime.checkpointing.metadata import CheckpointStorage
from spillover.runtime.jobevents import (
    EVENTS_DIR,
    CheckpointCompleted,
    CommandReceived,
    Event,
    GenerationEnded,
    GenerationStarted,
    JobCancelled,
    JobEventLog,
    JobFailed,
    JobFinished,
    JobLease,
    JobLogState,
    JobSubmitted,
    LeaseError,
    LeaseLostError,
    RescaleDecided,
    SavepointCompleted,
    SplitsAssigned,
    StopAbandoned,
    StopRequested,
    TaskFinished,
)
from spillover.storage.location import Publication, publish_in_order

logger = logging.getLogger("spillover.runtime.jobmaster")

START_OVER = (
    "to run it again from the start, set execution.job-recovery.enabled: false, or use "
    "another job name or checkpoint directory"
)


@dataclass(frozen=True)
class Resume:
    """What a master starting the job decided from the log.

    ``fresh``: a new run (the log records it); ``finished``: the log says the run
    finished, nothing is run; otherwise the run goes on from ``checkpoint`` (None:
    from the start, no checkpoint had completed). ``stop``: the stop the previous
    master accepted and did not end, which this one carries out. ``reason`` is for
    people.
    """

    run_id: str
    fresh: bool
    finished: bool
    checkpoint: CheckpointCompleted | None
    first_checkpoint_id: int
    generation: int
    reason: str
    stop: StopRequested | None = None
    # A resumed run's own checkpoint ids start at or above this (see own_checkpoints).
    run_floor: int = 0


class JobRecovery:
    """The lease and the event log of one job's master, from :meth:`begin` to
    :meth:`close`; safe to call from the coordinator's and the master's threads."""

    def __init__(
        self,
        storage: CheckpointStorage,
        *,
        enabled: bool,
        explicit_restore: str | None,
        lease_ttl_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.storage = storage
        self.enabled = enabled
        self.explicit_restore = explicit_restore
        self.directory = storage.location.child(EVENTS_DIR)
        self.lease = JobLease(self.directory, ttl_s=lease_ttl_s, clock=clock)
        self.log: JobEventLog | None = None
        self.resume: Resume | None = None
        self.on_lost: Callable[[LeaseError], None] | None = None
        self.lost: LeaseError | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        # One writer at a time: a savepoint's export records it from its own thread
        # while the coordinator's records checkpoints, and a failed flush discards
        # every pending event, another writer's too.
        self._write = threading.Lock()

    # -- start ----------------------------------------------------------------------

    def begin(
        self,
        *,
        job_name: str,
        fingerprint: str,
        parallelism: int,
        configuration: dict[str, object],
    ) -> Resume:
        """Takes the lease (:class:`~spillover.runtime.jobevents.LeaseHeldError` when
        another master runs the job), reads the log and decides; a fresh run is
        recorded at once. Keeps the lease renewed until :meth:`close`."""
        self.lease.acquire()
        try:
            log = self.log = JobEventLog.open(
                self.directory, lease=self.lease, fsync=self.storage.fsync
            )
            for warning in log.warnings:
                logger.warning("job %s: %s", job_name, warning)
            resume = self.resume = self._decide(log.replay())
            if resume.fresh:
                log.append(
                    JobSubmitted(
                        job_name,
                        fingerprint,
                        parallelism,
                        configuration,
                        run_id=resume.run_id,
                        first_checkpoint_id=resume.first_checkpoint_id,
                    )
                )
                log.flush()
            else:
                self._drop_unconfirmed(log.replay(), resume)
        except BaseException:
            self.lease.release()
            raise
        self._renewer = threading.Thread(target=self._renew, name="job-lease", daemon=True)
        self._renewer.start()
        return resume

    def _decide(self, state: JobLogState) -> Resume:
        # Above every id the dead master may have used: its directories, its last
        # logged checkpoint, and its last generation's first id (that one may have
        # been triggered before any directory of it was made).
        used = [self.storage.highest_id()]
        if state.checkpoint is not None:
            used.append(state.checkpoint.checkpoint_id)
        if state.generation is not None:
            used.append(state.generation.first_checkpoint_id)
        first = max(used) + 1
        generation = state.generation.generation + 1 if state.generation is not None else 0

        def fresh(reason: str) -> Resume:
            return Resume(uuid.uuid4().hex, True, False, None, first, 0, reason)

        if self.explicit_restore is not None:
            return fresh(f"a fresh run, restoring {self.explicit_restore} as asked")
        if state.submitted is None:
            return fresh("a fresh run: the job's event log holds no earlier run")
        if not self.enabled:
            return fresh(
                f"a fresh run: execution.job-recovery.enabled is false (the log's run "
                f"{state.submitted.run_id[:12]} was {_status(state)})"
            )
        run_id = state.submitted.run_id
        if state.status == "finished":
            assert state.terminal is not None
            return Resume(
                run_id, False, True, state.checkpoint, first, generation,
                f"the job already finished ({state.terminal.cause or 'its input ended'}); "
                f"nothing to run ({START_OVER})",
            )  # fmt: skip
        cp = state.checkpoint
        if cp is not None:
            self._check_present(cp)
        where = f"checkpoint {cp.checkpoint_id} ({cp.metadata_path})" if cp else "the start"
        stop = state.stop
        then = "" if stop is None else f"; then it stops, as asked before ({_stop(stop)})"
        return Resume(
            run_id, False, False, cp, first, generation,
            f"resuming run {run_id[:12]} from {where}: {_why(state)}{then}", stop,
            _run_floor(state),
        )  # fmt: skip

    def _check_present(self, cp: CheckpointCompleted) -> None:
        try:
            # read whole: a checkpoint whose metadata a restore cannot read is refused now
            self.storage.read(cp.checkpoint_id)
        except SpilloverError as e:
            raise ConfigError(
                "the job's event log names a checkpoint that cannot be read",
                detail=f"checkpoint {cp.checkpoint_id} at {cp.metadata_path}: {e}",
                hint=f"restore another checkpoint with execution.state-recovery.path; {START_OVER}",
            ) from e

    def _drop_unconfirmed(self, state: JobLogState, resume: Resume) -> None:
        """Deletes the dead run's checkpoint directories the log never confirmed (those
        after its newest logged checkpoint, from its last generation on), and the
        run's incomplete ones below it (aborted checkpoints a late write made again,
        which the dead master's next completion would have swept)."""
        if state.generation is None:
            return
        floor = state.generation.first_checkpoint_id
        logged = state.checkpoint.checkpoint_id if state.checkpoint is not None else 0
        ids, completed = self.storage.listing()
        complete = set(completed)
        stale = [
            c
            for c in ids
            if (c >= floor and c > logged) or (resume.run_floor <= c < logged and c not in complete)
        ]
        for cid in stale:
            self.storage.delete(cid)
        if stale:
            logger.warning(
                "job %s: deleted checkpoint(s) %s the previous master left unconfirmed",
                self.storage.location.name,
                ", ".join(map(str, stale)),
            )

    def own_checkpoints(self, resumed: int) -> list[int]:
        """The resumed run's complete checkpoints up to ``resumed``, oldest first: what
        the dead master retained, and what it had subsumed but not yet deleted when it
        died (its tasks hear of a checkpoint before what it subsumes goes). An earlier
        run's checkpoints are never among them."""
        floor = self.resume.run_floor if self.resume is not None else resumed
        return [c for c in self.storage.completed_ids() if floor <= c <= resumed]

    def latest_metadata(self) -> CheckpointMetadata | None:
        """The metadata of the newest checkpoint of this run the log names, if any:
        what a failover within the run restores."""
        cp = self.log.replay().checkpoint if self.log is not None else None
        if cp is None:
            return None
        return self.storage.read(cp.checkpoint_id)

    # -- the run's events ----------------------------------------------------------------

    def generation_started(
        self,
        generation: int,
        parallelism: int,
        cause: str,
        restore_path: str | None,
        first_checkpoint_id: int,
    ) -> None:
        self._note(
            GenerationStarted(generation, parallelism, cause, restore_path, first_checkpoint_id)
        )

    def generation_ended(self, generation: int, cause: str) -> None:
        self._note(GenerationEnded(generation, cause))

    def checkpoint_completed(self, checkpoint_id: int, metadata: Publication | None = None) -> None:
        """Flushed before returning: the checkpoint is what a restart restores from now.
        ``metadata``: its metadata file, published first in the same ordered group (the
        record is never visible without it; their data costs one sync, not two)."""
        path = self.storage.checkpoint_dir(checkpoint_id)
        self._record(
            CheckpointCompleted(checkpoint_id, path), () if metadata is None else (metadata,)
        )

    def task_finished(
        self,
        uid: str,
        subtask: int,
        generation: int,
        results: tuple[Mapping[str, object], ...],
        parallelism: int,
    ) -> None:
        """A batch task finished with ``results``: flushed before returning, so a
        restarted master reuses them."""
        self._record(TaskFinished(uid, subtask, generation, results, parallelism))

    def splits_assigned(self, uid: str, assignment: Mapping[int, tuple[str, ...]]) -> None:
        """The split assignment of a batch job's source (flushed before it runs)."""
        self._record(SplitsAssigned(uid, dict(assignment)))

    def state(self) -> JobLogState:
        """What the log says now (empty without a log)."""
        return self.log.replay() if self.log is not None else JobLogState()

    def savepoint_completed(self, savepoint_id: int, path: str) -> None:
        self._note(SavepointCompleted(savepoint_id, path))

    def rescale_decided(self, old: int, new: int, cause: str) -> None:
        self._note(RescaleDecided(old, new, cause))

    def command_received(self, command: str, detail: str) -> None:
        """An operator's command the master accepted."""
        self._note(CommandReceived(command, detail))

    def stop_requested(self, drain: bool, unaligned: bool, savepoint_dir: str) -> None:
        """A stop the master accepted: a master resuming the run carries it out."""
        self._note(StopRequested(drain, unaligned, savepoint_dir))

    def stop_abandoned(self, reason: str) -> None:
        """The stop failed and the job goes on: a master resuming the run runs it on."""
        self._note(StopAbandoned(reason[:500]))

    def terminated(self, status: str, cause: str) -> None:
        """The run ended: ``finished`` for good, else ``failed`` or ``cancelled`` (a
        later start resumes those)."""
        kind = {"finished": JobFinished, "failed": JobFailed}.get(status, JobCancelled)
        self._note(kind(cause))

    def _note(self, event: Event) -> None:
        """Records ``event``; failing storage costs the record, not the job (a later
        start then finds less in the log: a generation it must resume)."""
        try:
            self._record(event)
        except (OSError, SpilloverError) as e:
            if isinstance(e, LeaseError):
                raise
            logger.warning("job event log: could not record %s: %s", type(event).KIND, e)

    def _record(self, event: Event, before: Sequence[Publication] = ()) -> None:
        """Appends and flushes ``event``, after publishing ``before`` (in order, in the
        same call); when the flush fails it is forgotten (a checkpoint whose record
        failed is aborted: no later flush may name it)."""
        with self._write:
            if self.log is None or self.lost is not None:
                publish_in_order(before)
                return
            self.log.append(event)
            try:
                self.log.flush(before)
            except BaseException:
                self.log.discard_pending()
                raise

    # -- lease -----------------------------------------------------------------------

    def _renew(self) -> None:
        interval = self.lease.ttl_s / 3
        while not self._stop.wait(interval):
            try:
                self.lease.renew()
            except LeaseLostError as e:
                self.lost = e
                logger.error("job master lost its lease: %s", e)
                if self.on_lost is not None:
                    self.on_lost(e)
                return
            except (OSError, SpilloverError) as e:  # storage hiccup: the expiry decides
                logger.warning("cannot renew the job's lease (will retry): %s", e)

    def close(self) -> None:
        """Stops renewing and gives the lease up (what is pending is flushed)."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=5)
        try:
            if self.log is not None and self.lost is None:
                self.log.flush()
        finally:
            if self.lost is None:
                self.lease.release()


def _run_floor(state: JobLogState) -> int:
    """The lowest id the log's run may have used: its first checkpoint id as recorded
    when it was submitted, else (a log of an earlier version) the lower of its newest
    generation's first id and its newest checkpoint's (a generation restarted after
    that checkpoint starts above it; nothing below both is known to be the run's)."""
    if state.submitted is not None and state.submitted.first_checkpoint_id > 0:
        return state.submitted.first_checkpoint_id
    known = [state.generation.first_checkpoint_id] if state.generation is not None else []
    known += [state.checkpoint.checkpoint_id] if state.checkpoint is not None else []
    return min(known, default=0)


def _status(state: JobLogState) -> str:
    return {"running": "unfinished"}.get(state.status, state.status)


def _stop(stop: StopRequested) -> str:
    how = "drained" if stop.drain else "unaligned" if stop.unaligned else "aligned"
    return f"{how}, savepoint under {stop.savepoint_dir}"


def _why(state: JobLogState) -> str:
    t = state.terminal
    if t is None:
        g = state.generation
        during = f" during generation {g.generation}" if g is not None else ""
        return f"its previous master died{during}"
    return f"the previous run {'was ' if t.STATUS == 'cancelled' else ''}{t.STATUS}" + (
        f" ({t.cause})" if t.cause else ""
    )
