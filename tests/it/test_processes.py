"""Jobs in worker processes on this machine (``spillover.executor: processes``): the
Spark executor's job master and workers, without Spark. Exactness under failures,
rescaling and a killed worker: tests/it/test_spark.py runs those on both."""

from __future__ import annotations

import pytest

from spillover.config import Config
from spillover.deploy import create_executor
from spillover.deploy.processes import ProcessExecutor
from spillover.errors import ConfigError
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.connectors.throttled import ThrottledSink
from spillover.runtime.graph import StreamEnvironment

pytest.importorskip("pyspark")  # its pickler carries the job to the workers


def test_the_processes_executor_is_chosen_by_name_and_refuses_a_spark_master() -> None:
    env = StreamEnvironment("named", parallelism=1)
    env.from_source(GeneratorSource(partitions=1, records_per_partition=10), uid="s").sink(
        ThrottledSink(1000.0), uid="k"
    )
    assert isinstance(create_executor("processes", env), ProcessExecutor)
    with pytest.raises(ConfigError, match="spark executor"):
        create_executor("processes", env, master="spark://elsewhere:7077")


def test_a_job_in_worker_processes_runs_to_its_end_with_its_output() -> None:
    env = StreamEnvironment("ends", parallelism=2)
    env.from_source(
        GeneratorSource(partitions=2, records_per_partition=5_000), uid="s"
    ).rebalance().sink(ThrottledSink(1e9), uid="k")
    result = create_executor("processes", env).run(timeout=120)
    assert result.status == "finished" and result.attempts == 1
    taken = sum(m["records_in"] for name, m in result.tasks.items() if name.startswith("k#"))
    assert taken == 10_000  # every record reached a sink, over TCP between the workers


def test_debloating_over_tcp_shrinks_the_buffers_into_a_slow_sink_and_loses_nothing() -> None:
    env = StreamEnvironment("debloat", parallelism=2)
    env.from_source(
        GeneratorSource(partitions=2, records_per_partition=20_000, payload_bytes=16), uid="s"
    ).rebalance().sink(ThrottledSink(10_000.0), uid="k")
    cfg = Config.from_dict(
        {
            "taskmanager.network.memory.buffer-debloat.enabled": True,
            "taskmanager.network.memory.buffer-debloat.target": "100 ms",
            # small enough that what is in flight is not the whole job's data
            "taskmanager.memory.segment-size": "32 kb",
        }
    )
    result = create_executor("processes", env, cfg).run(timeout=120)
    assert result.status == "finished", result.failures
    taken = sum(m["records_in"] for name, m in result.tasks.items() if name.startswith("k#"))
    assert taken == 40_000  # every record, once
    # 10,000 records/s of 48 framed bytes per sink, 0.1 s over 2 x 2 + 8 buffers: ~4 KiB,
    # announced in BUFFER_SIZE frames to the sources in the other worker too
    sizes = [m["output_buffer_bytes"] for name, m in result.tasks.items() if name.startswith("s#")]
    assert all(size <= 16 * 1024 for size in sizes), sizes
