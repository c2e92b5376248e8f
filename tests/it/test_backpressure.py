"""Real backpressure: an unthrottled source paces down to a throttled sink."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spillover.config import Config
from spillover.deploy.local import LocalExecutor
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.connectors.throttled import ThrottledSink
from spillover.runtime.graph import StreamEnvironment


def _source(records: int = 4000, **kw: Any) -> GeneratorSource:
    return GeneratorSource(partitions=4, records_per_partition=records // 4, payload_bytes=16, **kw)


# --- backpressure ---------------------------------------------------------------------------------


def test_slow_sink_backpressures_the_source(tmp_path: Path) -> None:
    """An unthrottled source paces down to what the throttled sink takes; buffers stay bounded."""
    rate, p, records = 20_000, 2, 60_000
    env = StreamEnvironment("bp", parallelism=p)
    env.from_source(_source(records), uid="src").key_by("key").sink(ThrottledSink(rate), uid="sink")
    cfg = Config.from_dict({"taskmanager.network.memory.buffers-per-partition": 4})
    result = LocalExecutor(env, cfg).run(timeout=60)
    assert result.status == "finished", result.failures
    assert result.duration_s >= 0.8 * records / (rate * p)
    src = [m for name, m in result.tasks.items() if name.startswith("src#")]
    assert all(m["backpressured_share"] > 0.3 for m in src), src
    assert all(m["records_out"] == records / p for m in src)


def test_a_slow_sink_debloats_the_buffers_that_feed_it() -> None:
    """Buffers shrink to what the sink takes in the debloat target, and the records
    still arrive exactly; with debloating off they stay at the segment size."""
    rate, p, records = 20_000, 2, 40_000
    sizes = {}
    for enabled in (True, False):
        env = StreamEnvironment("debloat", parallelism=p)
        env.from_source(_source(records), uid="src").key_by("key").sink(
            ThrottledSink(rate), uid="sink"
        )
        cfg = Config.from_dict(
            {
                "taskmanager.network.memory.buffer-debloat.enabled": enabled,
                "taskmanager.network.memory.buffer-debloat.target": "100 ms",
                # small enough that what is in flight is not the whole job's data
                "taskmanager.memory.segment-size": "32 kb",
            }
        )
        result = LocalExecutor(env, cfg).run(timeout=60)
        assert result.status == "finished", result.failures
        sink = [m for name, m in result.tasks.items() if name.startswith("sink#")]
        assert sum(m["records_in"] for m in sink) == records
        sizes[enabled] = [m["output_buffer_bytes"] for n, m in result.tasks.items() if "src#" in n]
    # 20,000 records/s of 36 framed bytes per sink, 0.1 s over 2 + 8 buffers: ~7 KiB
    assert all(s <= 16 * 1024 for s in sizes[True]), sizes
    assert sizes[False] == [32 * 1024] * p
