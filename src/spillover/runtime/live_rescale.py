"""A live rescale (Flink's ``PUT /jobs/:id/resource-requirements``): the job graph at
the parallelisms asked for, checked before anything is touched, and the request as a
small future any thread can wait on; and :class:`LiveRescale`, the rescales of one
job, which the job master composes: it takes the stop's unaligned savepoint, then
restarts the job from it at the new parallelism in the same process
(``Executor.rescale_live``)."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from spillover.errors import ConfigError, SpilloverError, StorageError
from spillover.runtime.api import EdgeKind
from spillover.runtime.checkpointing.checkpoint_meta import CheckpointMetadata
from spillover.runtime.checkpointing.metadata import CheckpointStorage
from spillover.runtime.graph import JobGraph
from spillover.runtime.recovery.restore import TaskRestore

logger = logging.getLogger(__name__)


def rescaled_graph(graph: JobGraph, wanted: Mapping[str, int]) -> JobGraph:
    """``graph`` with vertex ``uid`` at ``wanted[uid]`` (the others as they are).
    Refused (ConfigError): an unknown vertex, a parallelism below 1 or above the
    job's max parallelism, a forward edge between different parallelisms, and a
    graph that would not change."""
    by_uid = {v.uid: v for v in graph.vertices}
    unknown = sorted(set(wanted) - set(by_uid))
    if unknown:
        raise ConfigError(
            f"no vertex {unknown[0]!r} in job {graph.name!r}",
            hint=f"the vertices are {', '.join(sorted(by_uid))}",
        )
    for uid, p in wanted.items():
        if not isinstance(p, int) or isinstance(p, bool) or p < 1:
            raise ConfigError(f"the parallelism of {uid} must be at least 1, not {p!r}")
        if p > graph.max_parallelism:
            raise ConfigError(
                f"parallelism {p} of {uid} exceeds the job's max parallelism "
                f"{graph.max_parallelism}",
                hint="the max parallelism (pipeline.max-parallelism) is fixed for the job's life",
            )
    if all(by_uid[uid].parallelism == p for uid, p in wanted.items()):
        now = sorted({v.parallelism for v in graph.vertices})
        raise ConfigError(
            f"job {graph.name!r} runs at that parallelism already ({', '.join(map(str, now))})",
            hint="ask for another parallelism",
        )
    vertices = []
    for v in graph.vertices:
        p = wanted.get(v.uid, v.parallelism)
        nodes = [dataclasses.replace(n, parallelism=p) for n in v.nodes]
        vertices.append(dataclasses.replace(v, nodes=nodes, parallelism=p))
    for e in graph.edges:
        a, b = vertices[e.source], vertices[e.target]
        if e.kind is EdgeKind.FORWARD and a.parallelism != b.parallelism:
            raise ConfigError(
                f"a forward edge needs equal parallelism on both sides: {a.uid} would run "
                f"at {a.parallelism}, {b.uid} at {b.parallelism}",
                hint="rescale both vertices alike",
            )
    return dataclasses.replace(graph, vertices=vertices)


def job_parallelism(graph: JobGraph) -> int:
    """The job's parallelism as the event log and the reports say it: its largest
    vertex's."""
    return max(v.parallelism for v in graph.vertices)


@dataclass(frozen=True)
class RescaleStatus:
    """What an operator reads of a live rescale (``GET /jobs/:id``, the CLI)."""

    request_id: str
    status: str  # IN_PROGRESS | COMPLETED | FAILED
    from_parallelism: int
    to_parallelism: int
    savepoint_id: int | None = None  # the checkpoint the job restarted from
    # Milliseconds from the request to the first record the job processed at the new
    # parallelism (replayed in-flight data counts).
    first_record_ms: float | None = None
    failure: str | None = None


class RescaleRequest:
    """One live rescale, from its request to the first record at the new
    parallelism (or its failure). The job master calls :meth:`restarted` once the
    job runs at the new parallelism, then :meth:`first_record` (or :meth:`failed`);
    :meth:`wait` gives the final :class:`RescaleStatus`."""

    def __init__(self, request_id: str, old: JobGraph, new: JobGraph) -> None:
        self.request_id = request_id
        self.graph = new
        self.requested_at = time.monotonic()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._status = RescaleStatus(
            request_id, "IN_PROGRESS", job_parallelism(old), job_parallelism(new)
        )

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def status(self) -> RescaleStatus:
        with self._lock:
            return self._status

    def restarted(self, savepoint_id: int) -> None:
        """The job restarted from savepoint ``savepoint_id`` at the new parallelism."""
        with self._lock:
            self._status = dataclasses.replace(self._status, savepoint_id=savepoint_id)

    def first_record(self, at: float) -> None:
        """The first record at the new parallelism was processed at ``at``
        (``time.monotonic()``): the rescale is complete."""
        with self._lock:
            if self.done:
                return
            ms = round((at - self.requested_at) * 1000, 1)
            self._status = dataclasses.replace(self._status, status="COMPLETED", first_record_ms=ms)
            self._done.set()

    def failed(self, reason: str) -> None:
        with self._lock:
            if self.done:
                return
            self._status = dataclasses.replace(self._status, status="FAILED", failure=reason)
            self._done.set()

    def wait(self, timeout: float | None = None) -> RescaleStatus:
        """The final status (COMPLETED or FAILED); the current one if ``timeout`` passed."""
        self._done.wait(timeout)
        return self.status()


Restore = dict[tuple[str, int], TaskRestore] | None
"""What each subtask of an attempt restores (None: nothing)."""

Planner = Callable[[CheckpointMetadata, JobGraph], Restore]
"""The job master's restore plan of a checkpoint at a job graph; raises when the
checkpoint does not fit."""


class StoppingCoordinator(Protocol):
    """What a rescale needs of the running attempt's coordinator: the stop's
    unaligned savepoint, and word if it gives up."""

    def request_stop(
        self, kind: int = ..., on_failed: Callable[[str], None] | None = None
    ) -> None: ...


class RunningAttempt(Protocol):
    """What the first-record watch reads of the attempt at the new parallelism."""

    @property
    def running_at(self) -> float | None: ...

    def task_metrics(self) -> Mapping[str, Mapping[str, float]]: ...


class RescaleLog(Protocol):
    """Where a rescale is recorded for a later master (the job event log)."""

    def rescale_decided(self, old: int, new: int, reason: str) -> None: ...


@dataclass(frozen=True)
class RescaleRestart:
    """The attempt after a live rescale's savepoint: the savepoint it restores, the
    job graph it runs (the old one when the savepoint does not restore at the new
    parallelism) and what each subtask restores."""

    meta: CheckpointMetadata
    graph: JobGraph
    restore: Restore


class LiveRescale:
    """The live rescales of one job: at most one under way, from its request (which
    asks the running attempt for the stop's savepoint), through the restart from
    that savepoint at the new parallelism, to the first record the job processed
    there (or its failure)."""

    def __init__(self, storage: CheckpointStorage | None) -> None:
        self._storage = storage
        self._lock = threading.Lock()
        self._request: RescaleRequest | None = None  # the one under way
        self._last: RescaleRequest | None = None

    @property
    def under_way(self) -> RescaleRequest | None:
        return self._request

    @property
    def last(self) -> RescaleRequest | None:
        """The latest rescale asked for (None before any)."""
        return self._last

    def check_restorable(self, plan: Callable[[CheckpointMetadata], object]) -> None:
        """Refuses (what ``plan`` raises) a rescale that no checkpoint of the job could
        restore, before its savepoint: ``plan`` of the latest completed checkpoint at
        the new graph (a forward edge that does not rescale, say)."""
        assert self._storage is not None
        storage = self._storage
        while True:
            latest = storage.latest()
            if latest is None:
                return
            try:
                plan(latest.metadata)
                return
            except StorageError:
                # Retention removed its files meanwhile (a newer checkpoint completed
                # and subsumed it): the newer one is the one to check.
                newer = storage.latest()
                if newer is None or newer.checkpoint_id == latest.checkpoint_id:
                    raise

    def start(
        self, old: JobGraph, new: JobGraph, coordinator: StoppingCoordinator
    ) -> RescaleRequest:
        """A rescale from ``old`` to ``new``: the running attempt (``coordinator``'s)
        takes the stop's savepoint. Refused (ConfigError) while one is under way."""
        with self._lock:
            if self._request is not None:
                raise ConfigError(
                    "the job is rescaling already", hint="wait for that rescale to end"
                )
            request = RescaleRequest(uuid.uuid4().hex, old, new)
            self._request = self._last = request
            self.ask_stop(coordinator)
        return request

    def ask_stop(self, coordinator: StoppingCoordinator) -> None:
        """Asks ``coordinator`` for the rescale's savepoint. If its attempts fail
        beyond the tolerated ones, the rescale fails and the job goes on as it was,
        at its parallelism, without a restart."""
        coordinator.request_stop(on_failed=self.fail)

    def fail(self, reason: str, request: RescaleRequest | None = None) -> None:
        """``request`` (default: the one under way, if any) failed for ``reason``; no
        rescale is under way now."""
        with self._lock:
            under_way, self._request = self._request, None
        request = request or under_way
        if request is not None:
            request.failed(reason)

    def restart_from(
        self,
        request: RescaleRequest,
        savepoint_id: int,
        current: JobGraph,
        plan: Planner,
        log: RescaleLog | None,
    ) -> RescaleRestart:
        """The next attempt of ``request``: the job at the new parallelism, restoring
        the savepoint the last one ended with, recorded in ``log``. A plan the
        savepoint does not allow fails the rescale and keeps ``current``."""
        assert self._storage is not None
        meta = self._storage.read(savepoint_id)
        try:
            restore = plan(meta, request.graph)
        except SpilloverError as e:
            self.fail(f"the savepoint does not restore at the new parallelism: {e}", request)
            return RescaleRestart(meta, current, plan(meta, current))
        old, new = job_parallelism(current), job_parallelism(request.graph)
        if log is not None:
            log.rescale_decided(old, new, "live rescale")
        logger.info("job %s: rescaled from %d to %d", current.name, old, new)
        request.restarted(savepoint_id)
        return RescaleRestart(meta, request.graph, restore)

    def watch_first_record(self, run: RunningAttempt, request: RescaleRequest) -> threading.Event:
        """Completes ``request`` once the attempt ``run`` (the job at the new
        parallelism) processed its first record, by its subtasks' live counters,
        polled every few milliseconds; set the answer when the attempt ended."""
        ended = threading.Event()

        def watch() -> None:
            while not ended.is_set() and not request.done:
                metrics = run.task_metrics() if run.running_at is not None else {}
                if any(
                    m.get("records_in", 0) + m.get("records_out", 0) > 0 for m in metrics.values()
                ):
                    with self._lock:
                        if self._request is request:
                            self._request = None
                    request.first_record(time.monotonic())
                    return
                ended.wait(0.002)

        threading.Thread(target=watch, name="rescale-first-record", daemon=True).start()
        return ended
