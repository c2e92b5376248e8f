"""The job graph a live rescale asks for: the parallelisms changed where asked, the
rest kept, and every impossible request refused before the job is touched."""

from __future__ import annotations

import pytest

from spillover.errors import ConfigError
from spillover.runtime.connectors.collecting import CollectingSink
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.graph import JobGraph, StreamEnvironment
from spillover.runtime.live_rescale import RescaleRequest, job_parallelism, rescaled_graph


def _graph() -> JobGraph:
    env = StreamEnvironment("g", parallelism=2, max_parallelism=16)
    src = env.from_source(GeneratorSource(partitions=2), uid="src")
    m = src.key_by("key").map(lambda b: b, uid="m")
    m.forward().sink(CollectingSink("g"), uid="fwd")  # two consumers: a network forward edge
    m.rebalance().sink(CollectingSink("g"), uid="other")
    return env.build()


def test_every_vertex_or_some_change_and_the_rest_stay() -> None:
    g = _graph()
    wide = rescaled_graph(g, {v.uid: 3 for v in g.vertices})
    assert [v.parallelism for v in wide.vertices] == [3, 3, 3, 3]
    assert all(n.parallelism == 3 for v in wide.vertices for n in v.nodes)
    assert [v.parallelism for v in g.vertices] == [2, 2, 2, 2], "the old graph is untouched"
    assert job_parallelism(wide) == 3 and wide.fingerprint() != g.fingerprint()
    some = rescaled_graph(g, {"src": 5, "other": 1})
    assert {v.uid: v.parallelism for v in some.vertices} == {
        "src": 5,
        "m": 2,
        "fwd": 2,
        "other": 1,
    }


@pytest.mark.parametrize(
    ("wanted", "message"),
    [
        ({"src": 2}, "runs at that parallelism already"),
        ({"src": 0}, "must be at least 1"),
        ({"src": 17}, "exceeds the job's max parallelism 16"),
        ({"nope": 3}, "no vertex 'nope'"),
        ({"m": 3}, "a forward edge needs equal parallelism"),
    ],
)
def test_impossible_rescales_are_refused(wanted: dict[str, int], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        rescaled_graph(_graph(), wanted)


def test_a_request_completes_once_with_the_time_to_its_first_record() -> None:
    g = _graph()
    r = RescaleRequest("r1", g, rescaled_graph(g, {v.uid: 3 for v in g.vertices}))
    assert r.status().status == "IN_PROGRESS" and not r.done
    r.restarted(7)
    r.first_record(r.requested_at + 0.25)
    r.failed("too late")  # the first answer stands
    st = r.wait(0)
    assert (st.status, st.savepoint_id, st.first_record_ms, st.failure) == (
        "COMPLETED",
        7,
        250.0,
        None,
    )
    assert (st.from_parallelism, st.to_parallelism) == (2, 3)
