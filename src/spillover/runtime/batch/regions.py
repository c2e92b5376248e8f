"""Pipelined regions: the subtasks linked by pipelined exchanges, which must run
together; blocking exchanges lie between regions, whose producers finish before
their consumers start (Flink's ``PipelinedRegion``).

A forward edge links subtask ``i`` to subtask ``i``; every other edge links every
producer subtask to every consumer subtask. Regions whose blocking exchanges
form a cycle (a region that feeds one it also consumes from) are merged, as Flink
does, so regions always run in some order. In batch mode every exchange between
vertices is blocking: each subtask is a region of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from spillover.runtime.api import EdgeKind
from spillover.runtime.graph import JobEdge, JobGraph

TaskKey = tuple[str, int]
"""``(vertex uid, subtask)``: one subtask, as the rest of the runtime keys them."""


@dataclass(frozen=True)
class Region:
    """Subtasks that run together; ``consumes`` are the subtasks outside it whose
    blocking results it reads (they finish before it starts)."""

    tasks: frozenset[TaskKey]
    consumes: frozenset[TaskKey]

    def __repr__(self) -> str:
        names = ", ".join(f"{u}#{i}" for u, i in sorted(self.tasks))
        return f"Region({names})"


def links(graph: JobGraph, edge: JobEdge) -> Iterator[tuple[TaskKey, TaskKey]]:
    """The subtask-level exchanges of ``edge``: ``(producer, consumer)``."""
    up, down = graph.vertices[edge.source], graph.vertices[edge.target]
    if edge.kind is EdgeKind.FORWARD and up.parallelism == down.parallelism:
        for i in range(up.parallelism):
            yield (up.uid, i), (down.uid, i)
        return
    for u in range(up.parallelism):
        for d in range(down.parallelism):
            yield (up.uid, u), (down.uid, d)


def producers_of(graph: JobGraph, task: TaskKey) -> list[TaskKey]:
    """The subtasks whose output ``task`` reads, in input-channel order."""
    uid = task[0]
    vid = next(v.id for v in graph.vertices if v.uid == uid)
    out: list[TaskKey] = []
    for e in sorted(graph.inputs_of(vid), key=lambda e: e.input_index):
        out += [p for p, c in links(graph, e) if c == task and p not in out]
    return out


def pipelined_regions(
    graph: JobGraph, blocking: Callable[[JobEdge], bool] = lambda e: True
) -> list[Region]:
    """The graph's regions, sorted so that every region comes after those it consumes."""
    tasks = [(v.uid, i) for v in graph.vertices for i in range(v.parallelism)]
    parent = {t: t for t in tasks}

    def find(t: TaskKey) -> TaskKey:
        while parent[t] != t:
            parent[t] = parent[parent[t]]
            t = parent[t]
        return t

    def union(a: TaskKey, b: TaskKey) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    blocked: list[tuple[TaskKey, TaskKey]] = []
    for e in graph.edges:
        for p, c in links(graph, e):
            if blocking(e):
                blocked.append((p, c))
            else:
                union(p, c)
    while True:  # merge regions on a cycle of blocking exchanges until none is left
        deps: dict[TaskKey, set[TaskKey]] = {find(t): set() for t in tasks}
        for p, c in blocked:
            if find(p) != find(c):
                deps[find(c)].add(find(p))
        cycle = _cycle(deps)
        if not cycle:
            break
        for r in cycle[1:]:
            union(cycle[0], r)
    members: dict[TaskKey, set[TaskKey]] = {}
    for t in tasks:
        members.setdefault(find(t), set()).add(t)
    consumes: dict[TaskKey, set[TaskKey]] = {r: set() for r in members}
    for p, c in blocked:
        if find(p) != find(c):
            consumes[find(c)].add(p)
    order = _topological({r: {find(p) for p in consumes[r]} for r in members})
    return [Region(frozenset(members[r]), frozenset(consumes[r])) for r in order]


def _cycle(deps: dict[TaskKey, set[TaskKey]]) -> list[TaskKey]:
    """One cycle of the dependency graph (its nodes), or [] when it has none."""
    state: dict[TaskKey, int] = {}  # 1: on the path, 2: done
    for start in sorted(deps):
        if start in state:
            continue
        path: list[TaskKey] = []
        stack: list[tuple[TaskKey, Iterator[TaskKey]]] = [(start, iter(sorted(deps[start])))]
        state[start] = 1
        path.append(start)
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                path.pop()
                state[node] = 2
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append((nxt, iter(sorted(deps[nxt]))))
    return []


def _topological(deps: dict[TaskKey, set[TaskKey]]) -> list[TaskKey]:
    done: list[TaskKey] = []
    seen: set[TaskKey] = set()
    left = sorted(deps)
    while left:
        ready = [r for r in left if deps[r] <= seen]
        if not ready:
            raise AssertionError(f"regions on a cycle: {left}")  # merged above: never
        done += ready
        seen.update(ready)
        left = [r for r in left if r not in seen]
    return done
