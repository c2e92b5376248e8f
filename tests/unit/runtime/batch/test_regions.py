"""Pipelined regions of random job graphs: every exchange lies inside a region or is
blocking between two, and regions come after the regions they consume."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from spillover.runtime.api import EdgeKind, Operator
from spillover.runtime.batch import pipelined_regions, producers_of
from spillover.runtime.batch.regions import links
from spillover.runtime.graph import JobEdge, JobGraph, Node, Vertex

KINDS = [EdgeKind.FORWARD, EdgeKind.KEY_BY, EdgeKind.REBALANCE, EdgeKind.BROADCAST]


@st.composite
def graphs(draw: st.DrawFn) -> tuple[JobGraph, set[int]]:
    """A random DAG of up to 6 vertices and the indices of its blocking edges."""
    n = draw(st.integers(1, 6))
    vertices = []
    for i in range(n):
        p = draw(st.integers(1, 3))
        node = Node(i, f"v{i}", f"v{i}", Operator(), p, None)
        vertices.append(Vertex(i, [node], p))
    edges = []
    for i in range(1, n):
        for src in sorted(set(draw(st.lists(st.integers(0, i - 1), min_size=1, max_size=2)))):
            kind = draw(st.sampled_from(KINDS))
            if kind is EdgeKind.FORWARD and vertices[src].parallelism != vertices[i].parallelism:
                kind = EdgeKind.REBALANCE
            edges.append(JobEdge(src, i, kind, 0, None, None))
    blocking = set(draw(st.sets(st.integers(0, max(len(edges) - 1, 0)))))
    return JobGraph("g", vertices, edges, 128), blocking


@settings(max_examples=200, deadline=None)
@given(graphs())
def test_every_exchange_is_inside_a_region_or_blocking_between_two(
    case: tuple[JobGraph, set[int]],
) -> None:
    g, blocking = case
    regions = pipelined_regions(g, lambda e: g.edges.index(e) in blocking)
    where = {t: k for k, r in enumerate(regions) for t in r.tasks}
    assert len(where) == sum(v.parallelism for v in g.vertices)  # each subtask once
    for index, e in enumerate(g.edges):
        for p, c in links(g, e):
            if index not in blocking:
                assert where[p] == where[c]  # pipelined: one region
            elif where[p] != where[c]:
                assert p in regions[where[c]].consumes
                assert where[p] < where[c]  # producers' regions come first
    for k, r in enumerate(regions):
        assert not (r.consumes & r.tasks)
        assert all(where[p] < k for p in r.consumes)


@given(graphs())
def test_in_batch_mode_every_subtask_is_a_region_reading_its_producers(
    case: tuple[JobGraph, set[int]],
) -> None:
    g, _ = case
    regions = pipelined_regions(g)
    assert all(len(r.tasks) == 1 for r in regions)
    for r in regions:
        (task,) = r.tasks
        assert r.consumes == frozenset(producers_of(g, task))
