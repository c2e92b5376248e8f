"""A job's savepoints over its attempts (Flink's ``POST /jobs/:id/savepoints``): the
requests taken without a stop, carried across restarts and closed with the run, and
the export that copies a completed checkpoint into a self-contained savepoint
directory (a stop's savepoint ends the same way). The job master composes one."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Protocol

from spillover.errors import StorageError
from spillover.runtime.checkpointing.metadata import CheckpointStorage
from spillover.runtime.checkpointing.savepoint_request import SavepointRequest
from spillover.runtime.network.events import BarrierKind
from spillover.storage.location import Location, delete_tree

logger = logging.getLogger(__name__)

# A savepoint's copy that storage fails is tried this many times, waiting 0.1 s,
# then twice as long each time (about 3 s in all).
EXPORT_ATTEMPTS = 5
EXPORT_BACKOFF_S = 0.1


class SavepointCoordinator(Protocol):
    """What savepoints need of an attempt's checkpoint coordinator."""

    def trigger_savepoint(self, request: SavepointRequest) -> bool: ...

    def keep_exporting(self, requests: Sequence[SavepointRequest]) -> None: ...

    def close_savepoints(self, reason: str = ...) -> None: ...


class ExportedStats(Protocol):
    """Where an export is reported to operators (the checkpoint statistics)."""

    def exported(self, checkpoint_id: int, path: str) -> None: ...


class SavepointLog(Protocol):
    """Where an export is recorded for a later master (the job event log)."""

    def savepoint_completed(self, savepoint_id: int, path: str) -> None: ...


class Savepoints:
    """The savepoints of one job. Requests asked for between attempts wait for the
    next one (:meth:`attempt_started`); every request not yet done is kept, so that a
    later attempt keeps the checkpoint an export still reads; once the run ended
    (:meth:`close`) requests fail at once until the next run :meth:`open`\\ s."""

    def __init__(
        self,
        storage: CheckpointStorage | None,
        stats: ExportedStats,
        job_id: str,
        savepoints_dir: str | None,
    ) -> None:
        self._storage = storage
        self._stats = stats
        self._job_id = job_id
        self._savepoints_dir = savepoints_dir  # state.savepoints.dir
        self._lock = threading.Lock()
        self._coordinator: SavepointCoordinator | None = None  # the running attempt's
        self._waiting: list[SavepointRequest] = []
        self._requests: list[SavepointRequest] = []
        self._closed = False
        self._log: SavepointLog | None = None

    def default_dir(self) -> str:
        """``state.savepoints.dir``, else ``savepoints`` in the job's checkpoint directory."""
        assert self._storage is not None
        return self._savepoints_dir or Location.parse(self._storage.uri).child("savepoints").uri

    def export(self, cid: int, savepoint_dir: str) -> str:
        """Copies completed checkpoint ``cid`` as a savepoint ``savepoint-<job>-<cid>``
        under ``savepoint_dir``; recorded in the statistics and the event log."""
        assert self._storage is not None
        name = f"savepoint-{self._job_id[:6]}-{cid}"
        for attempt in range(EXPORT_ATTEMPTS):
            target = Location.parse(savepoint_dir).child(name)
            try:
                path = self._storage.export(cid, target.uri)
                break
            except (OSError, StorageError) as e:
                # The checkpoint is complete and kept: a storage fault costs the copy,
                # which is tried again (into a new folder if the old one stays).
                if attempt + 1 == EXPORT_ATTEMPTS or "exists already" in str(e):
                    raise
                logger.warning("exporting savepoint %s failed, trying again: %s", name, e)
                delete_tree(target, "partial savepoint")
                time.sleep(EXPORT_BACKOFF_S * 2**attempt)
                if target.exists():
                    name = f"savepoint-{self._job_id[:6]}-{cid}-{attempt + 1}"
        self._stats.exported(cid, path)
        log = self._log
        if log is not None:
            log.savepoint_completed(cid, path)
        return path

    def export_stop(self, cid: int, savepoint_dir: str) -> tuple[str, str | None]:
        """The stop's savepoint, exported as any other. If storage fails every copy,
        the stop's own checkpoint is the restore point (it is complete, and nothing
        deletes it once the run ended): its path, and a note saying why."""
        try:
            return self.export(cid, savepoint_dir), None
        except (OSError, StorageError) as e:
            assert self._storage is not None
            path = self._storage.location.child(f"chk-{cid}").uri
            logger.warning("the stop's savepoint could not be copied; restore %s: %s", path, e)
            return path, f"the savepoint could not be copied ({e}): restore its checkpoint {path}"

    def trigger(self, savepoint_dir: str | None, unaligned: bool) -> SavepointRequest:
        """A savepoint of the running job, exported under ``savepoint_dir`` (default
        :meth:`default_dir`): triggered now, or by the next attempt when none runs."""
        where = savepoint_dir or self.default_dir()
        kind = BarrierKind.UNALIGNED if unaligned else BarrierKind.ALIGNED
        request = SavepointRequest(kind, lambda cid: self.export(cid, where))
        with self._lock:
            if self._closed:
                request.failed("the job has ended")
                return request
            self._requests = [r for r in self._requests if not r.done] + [request]
            coordinator = self._coordinator
            if coordinator is None or not coordinator.trigger_savepoint(request):
                self._waiting.append(request)  # between attempts
        return request

    def open(self, log: SavepointLog | None) -> None:
        """A run starts: requests are taken again; exports are recorded in ``log``."""
        with self._lock:
            self._closed = False
            self._log = log

    def attempt_started(self, coordinator: SavepointCoordinator) -> None:
        """``coordinator``'s attempt is the running one now: it keeps the checkpoints of
        exports an earlier one started, and takes the requests asked for between
        attempts."""
        with self._lock:
            previous, self._coordinator = self._coordinator, coordinator
            waiting, self._waiting = self._waiting, []
            coordinator.keep_exporting([r for r in self._requests if r.exporting is not None])
            for request in waiting:
                if not coordinator.trigger_savepoint(request):
                    request.failed("the job attempt ended")
        if previous is not None and previous is not coordinator:
            previous.close_savepoints()

    def close(self) -> None:
        """The run ended: requests not yet triggered fail, later ones at once, and
        exports under way finish before the run returns (and its event log closes)."""
        with self._lock:
            self._closed = True
            waiting, self._waiting = self._waiting, []
            exporting, self._requests = self._requests, []
            coordinator = self._coordinator
        for request in waiting:
            request.failed("the job ended before its savepoint was triggered")
        if coordinator is not None:
            coordinator.close_savepoints("the job ended")
        for request in exporting:
            if request.exporting is not None:
                request.wait_done()
        with self._lock:
            self._log = None
