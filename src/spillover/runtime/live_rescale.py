"""A live rescale (Flink's ``PUT /jobs/:id/resource-requirements``): the job graph at
the parallelisms asked for, checked before anything is touched, and the request as a
small future any thread can wait on. The job master takes the stop's unaligned
savepoint, then restarts the job from it at the new parallelism in the same process
(``Executor.rescale_live``)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from spillover.errors import ConfigError
from spillover.runtime.api import EdgeKind
from spillover.runtime.graph import JobGraph


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
