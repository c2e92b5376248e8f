"""Restore plans of checkpoints that recorded finished operators (FLIP-147)."""

from __future__ import annotations

from typing import Any

import pytest

from spillover.errors import ConfigError
from spillover.runtime.checkpointing.checkpoint_meta import CheckpointMetadata
from spillover.runtime.checkpointing.metadata import METADATA_FORMAT
from spillover.runtime.connectors.collecting import CollectingSink
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.graph import JobGraph, StreamEnvironment
from spillover.runtime.recovery.plan import graph_info, plan_restore


def _graph(second_source: bool, parallelism: int = 2) -> JobGraph:
    env = StreamEnvironment("finished-plan", parallelism=parallelism, max_parallelism=128)
    a = env.from_source(GeneratorSource(partitions=2, records_per_partition=10), uid="a")
    into: Any = a.rebalance()
    if second_source:
        b = env.from_source(GeneratorSource(partitions=2, records_per_partition=10), uid="b")
        into = into.union(b.rebalance())
    into.map(lambda batch: batch, uid="m").sink(CollectingSink("x"), uid="sink")
    return env.build()


def _meta(g: JobGraph, finished: dict[str, list[bool]]) -> CheckpointMetadata:
    info = graph_info(g)
    tasks = {}
    for uid, v in info["vertices"].items():
        flags = finished.get(uid, [False] * v["parallelism"])
        tasks[uid] = {
            "parallelism": v["parallelism"],
            "finished": "fully" if all(flags) else "partially" if any(flags) else "running",
            "subtasks": {
                str(i): {"operators": {}, "handles": [], "keyed": {}, "finished": f}
                for i, f in enumerate(flags)
            },
        }
    return CheckpointMetadata.from_json(
        {
            "format": METADATA_FORMAT,
            "version": 1,
            "checkpoint_id": 7,
            "settings": {"max-parallelism": 128},
            "graph": info,
            "tasks": tasks,
        }
    )


def test_a_fully_finished_operator_is_restored_finished_at_any_parallelism() -> None:
    g = _graph(second_source=False)
    meta = _meta(g, {"a": [True, True], "m": [True, True]})
    plan = plan_restore(meta, _graph(second_source=False, parallelism=3), validate=False)
    assert all(plan[(uid, i)].finished for uid in ("a", "m") for i in range(3))
    partly = plan_restore(_meta(g, {"a": [True, False]}), g, validate=False)
    assert not partly[("m", 0)].finished  # a running operator runs


def test_a_partially_finished_operator_keeps_its_finished_subtask_finished() -> None:
    g = _graph(second_source=False)
    plan = plan_restore(_meta(g, {"a": [True, False]}), g, validate=False)
    assert plan[("a", 0)].finished and not plan[("a", 1)].finished


def test_a_new_predecessor_of_a_fully_finished_operator_is_refused() -> None:
    old = _graph(second_source=False)
    meta = _meta(old, {"a": [True, True], "m": [True, True]})
    with pytest.raises(ConfigError, match="'m' finished in checkpoint 7"):
        plan_restore(meta, _graph(second_source=True), validate=False)
