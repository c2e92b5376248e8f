"""Job graphs: chaining, edges that cross the network, refusals, fingerprints, and
custom partitioners."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from spillover.errors import ConfigError
from spillover.runtime.connectors.collecting import CollectingSink
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.graph import StreamEnvironment
from spillover.runtime.operators import KeyedSum


def _source(records: int = 4000, **kw: Any) -> GeneratorSource:
    return GeneratorSource(partitions=4, records_per_partition=records // 4, payload_bytes=16, **kw)


# --- the job graph --------------------------------------------------------------------------


def test_forward_operators_chain_and_other_edges_cross_the_network() -> None:
    env = StreamEnvironment("g", parallelism=2)
    s = env.from_source(_source(), uid="src").map(lambda b: b, uid="m")
    s.key_by("key").process(KeyedSum("key", "seq"), uid="sum").sink(CollectingSink("g"), uid="sink")
    g = env.build()
    assert [[n.uid for n in v.nodes] for v in g.vertices] == [["src", "m"], ["sum", "sink"]]
    assert [(e.source, e.target, e.kind.value) for e in g.edges] == [(0, 1, "key_by")]
    assert g.vertices[1].head.keyed


def test_bad_graphs_fail_when_built() -> None:
    env = StreamEnvironment("g", parallelism=2)
    s = env.from_source(_source(), uid="src")
    with pytest.raises(ConfigError, match="forward edge"):
        s.forward().map(lambda b: b, parallelism=3)
    with pytest.raises(ConfigError, match="used twice"):
        s.map(lambda b: b, uid="src")
    with pytest.raises(ConfigError, match="int64"):
        s.key_by("partition")
    with pytest.raises(ConfigError, match="no field"):
        s.key_by("nope")


def test_fingerprint_changes_with_parallelism_and_uids() -> None:
    def graph(p: int, uid: str) -> str:
        env = StreamEnvironment("g", parallelism=p, max_parallelism=128)
        env.from_source(_source(), uid=uid).sink(CollectingSink("x"), uid="sink")
        return env.build().fingerprint()

    assert graph(2, "a") == graph(2, "a")
    assert graph(2, "a") != graph(3, "a")
    assert graph(2, "a") != graph(2, "b")


# --- custom partitioners --------------------------------------------------------------


def _mod3(keys: Any, n: int) -> Any:
    return np.asarray(keys) % n


def test_a_custom_partitioner_routes_each_record_to_its_pick_in_order() -> None:
    from spillover.records import read_records
    from spillover.runtime.api import EdgeKind
    from spillover.runtime.network.writers import PartitionWriter

    dtype = np.dtype([("key", "<i8"), ("seq", "<i8")])
    sent: dict[int, list[bytes]] = {0: [], 1: [], 2: []}
    writer = PartitionWriter(
        EdgeKind.CUSTOM,
        dtype,
        3,
        0,
        64,
        128,
        "key",
        send=lambda sub, buf: sent[sub].append(bytes(buf)),
        send_all=None,
        partitioner=_mod3,
    )
    batch = np.zeros(100, dtype)
    batch["key"] = np.arange(100) * 7 - 50
    batch["seq"] = np.arange(100)
    writer.emit(batch[:40])
    writer.emit(batch[40:])
    writer.flush()
    for sub, bufs in sent.items():
        got = np.frombuffer(b"".join(read_records(bufs)), dtype)
        want = batch[batch["key"] % 3 == sub]
        assert got.tolist() == want.tolist()  # every pick, in emission order


def test_a_custom_partitioner_that_answers_out_of_range_fails_naming_it() -> None:
    from spillover.runtime.api import EdgeKind
    from spillover.runtime.network.writers import PartitionWriter

    dtype = np.dtype([("key", "<i8")])
    writer = PartitionWriter(
        EdgeKind.CUSTOM,
        dtype,
        2,
        0,
        64,
        128,
        "key",
        send=None,
        send_all=None,
        partitioner=lambda k, n: k + n,
    )
    with pytest.raises(ConfigError, match=r"picked subtask 2, outside 0\.\.1"):
        writer.emit(np.zeros(3, dtype))


def test_partition_custom_refuses_a_bad_key_field_or_partitioner() -> None:
    env = StreamEnvironment("custom", parallelism=2)
    s = env.from_source(_source(), uid="src")
    with pytest.raises(ConfigError, match="no field"):
        s.partition_custom(_mod3, "nope")
    with pytest.raises(ConfigError, match="must be callable"):
        s.partition_custom("mod", "key")  # type: ignore[arg-type]
