"""Loops in the job graph (``iterate``/``close_with``) and the termination tracker."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillover.errors import ConfigError
from spillover.runtime.connectors.collecting import CollectingSink
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.graph import DataStream, IterativeStream, StreamEnvironment
from spillover.runtime.iteration.termination import LoopTermination
from spillover.runtime.recovery.plan import graph_info


def _source(**kw: Any) -> GeneratorSource:
    return GeneratorSource(partitions=2, records_per_partition=10, payload_bytes=8, **kw)


def _loop(env: StreamEnvironment) -> tuple[IterativeStream, DataStream]:
    it = env.from_source(_source(), uid="src").iterate(uid="head")
    body = it.map(lambda b: b, uid="body").filter(lambda b: b["seq"] > 0, uid="tail")
    return it, body


def test_a_closed_loop_has_a_feedback_edge_into_an_unchained_head() -> None:
    env = StreamEnvironment("g", parallelism=2)
    it, body = _loop(env)
    it.close_with(body.key_by("key"))
    it.filter(lambda b: b["seq"] == 0, uid="exit").sink(CollectingSink("g"), uid="sink")
    g = env.build()
    uids = {v.uid: v for v in g.vertices}
    assert [n.uid for n in uids["head"].nodes] == ["head"]  # never chained
    assert uids["head"].is_iteration_head and uids["head"].loop == "head"
    assert uids["body"].loop == "head" and [n.uid for n in uids["body"].nodes] == ["body", "tail"]
    assert uids["src"].loop is None and uids["exit"].loop is None
    (fb,) = [e for e in g.edges if e.feedback]
    assert (g.vertices[fb.source].uid, g.vertices[fb.target].uid) == ("body", "head")
    assert fb.kind.value == "key_by" and fb.input_index == 1
    # The checkpoint's graph says so: the coordinator skips feedback edges for roots.
    info = graph_info(g)["vertices"]
    assert info["head"]["iteration_head"] and info["body"]["loop"] == "head"
    assert [i.get("feedback", False) for i in info["head"]["inputs"]] == [False, True]


def test_the_fingerprint_tells_a_loop_from_the_same_edges_without_one() -> None:
    env = StreamEnvironment("g", parallelism=2)
    it, body = _loop(env)
    it.close_with(body)
    fingerprints = {env.build().fingerprint()}
    env2 = StreamEnvironment("g", parallelism=2)
    it2, body2 = _loop(env2)
    it2.close_with(body2.key_by("key"))
    fingerprints.add(env2.build().fingerprint())
    assert len(fingerprints) == 2


def test_loops_that_cannot_work_are_refused_with_a_reason() -> None:
    env = StreamEnvironment("g", parallelism=2)
    it, body = _loop(env)
    other = env.from_source(_source(), uid="other")
    with pytest.raises(ConfigError, match="derived from the iterative stream"):
        it.close_with(other)
    with pytest.raises(ConfigError, match="cannot be broadcast"):
        it.close_with(body.broadcast())
    with pytest.raises(ConfigError, match="record type"):
        it.close_with(body.map(lambda b: b[["seq"]], b_dtype(body), uid="narrow"))
    with pytest.raises(ConfigError, match="forward edge"):
        it.close_with(body.map(lambda b: b, uid="wide", parallelism=3).forward())
    it.close_with(body)
    with pytest.raises(ConfigError, match="closed already"):
        it.close_with(body)


def b_dtype(stream: DataStream) -> Any:
    return np.dtype([("seq", np.dtype(stream.dtype)["seq"])])


def test_an_unclosed_loop_is_refused_when_built() -> None:
    env = StreamEnvironment("g", parallelism=2)
    _loop(env)
    with pytest.raises(ConfigError, match="never closed"):
        env.build()


def test_nested_loops_are_refused_and_loops_one_after_another_are_not() -> None:
    env = StreamEnvironment("g", parallelism=2)
    outer = env.from_source(_source(), uid="src").iterate(uid="outer")
    inner = outer.map(lambda b: b, uid="a").iterate(uid="inner")
    inner_body = inner.map(lambda b: b, uid="b")
    inner.close_with(inner_body.rebalance())
    outer.close_with(inner_body.map(lambda b: b, uid="c").rebalance())
    with pytest.raises(ConfigError, match="loops cannot nest"):
        env.build()

    env = StreamEnvironment("g", parallelism=2)
    first = env.from_source(_source(), uid="src").iterate(uid="first")
    first_body = first.map(lambda b: b, uid="a")
    first.close_with(first_body.rebalance())
    second = first.map(lambda b: b, uid="out").iterate(uid="second")
    second.close_with(second.map(lambda b: b, uid="b").rebalance())
    g = env.build()
    assert {v.uid: v.loop for v in g.vertices} == {
        "src": None,
        "first": "first",
        "a": "first",
        "out": None,
        "second": "second",
        "b": "second",
    }


# --- the termination tracker ----------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 4),
    st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30)), max_size=120),
)
def test_a_loop_ends_exactly_when_one_round_was_quiet_at_every_head(
    parallelism: int, reports: list[tuple[int, int]]
) -> None:
    """Heads report quiet rounds in increasing order each; the loop ends at the first
    report that completes a round at every head, never before, and once."""
    tracker = LoopTermination({"loop": parallelism})
    last: dict[int, int] = {}
    quiet: dict[int, set[int]] = {}
    ended = []
    for subtask, gap in reports:
        subtask %= parallelism
        r = last.get(subtask, 0) + gap
        last[subtask] = r
        quiet.setdefault(r, set()).add(subtask)
        done = tracker.quiet("loop", subtask, r)
        complete = len(quiet[r]) == parallelism
        if not ended:
            assert done == complete
        else:
            assert not done
        if done:
            ended.append(r)
    assert len(ended) <= 1
    assert tracker.done.get("loop") == (ended[0] if ended else None)
    assert not tracker.quiet("other", 0, 1)  # not a loop of the job
