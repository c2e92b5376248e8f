"""The public job API in one import: a job written against it alone runs."""

from __future__ import annotations

import spillover.streaming as streaming
from spillover.streaming import (
    CollectingSink,
    Config,
    GeneratorSource,
    KeyedCount,
    StreamEnvironment,
    create_executor,
)


def test_every_exported_name_is_there() -> None:
    assert all(hasattr(streaming, name) for name in streaming.__all__)


def test_the_documented_job_runs_from_the_one_import() -> None:
    env = StreamEnvironment("counts", parallelism=2)
    (
        env.from_source(GeneratorSource(partitions=2, records_per_partition=1_000), uid="src")
        .key_by("key")
        .process(KeyedCount("key"), uid="count")
        .sink(CollectingSink("streaming-doc"), uid="sink")
    )
    result = create_executor("local", env, Config()).run(timeout=60)
    assert result.status == "finished", result.failures
    final: dict[int, int] = {}
    for row in CollectingSink.records("streaming-doc"):  # a key's counts only grow
        final[int(row["key"])] = max(final.get(int(row["key"]), 0), int(row["count"]))
    assert sum(final.values()) == 2_000
