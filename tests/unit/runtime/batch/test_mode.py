"""execution.runtime-mode: streaming by default, batch when asked (bounded sources
only), automatic: batch when every source is bounded."""

from __future__ import annotations

from typing import Any

import pytest

from spillover.config import Config, RuntimeMode
from spillover.errors import ConfigError
from spillover.runtime.batch import runs_as_batch
from spillover.runtime.connectors.collecting import CollectingSink
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.graph import JobGraph, StreamEnvironment


def _graph(records: int | None) -> JobGraph:
    env = StreamEnvironment("mode", parallelism=2)
    src = GeneratorSource(partitions=2, records_per_partition=records, payload_bytes=8)
    env.from_source(src, uid="src").key_by("key").sink(CollectingSink("mode"), uid="sink")
    return env.build()


def _mode(mode: str) -> Config:
    return Config.from_dict({"execution.runtime-mode": mode})


def test_streaming_is_the_default_and_batch_runs_bounded_jobs() -> None:
    assert Config().execution.runtime_mode is RuntimeMode.STREAMING
    assert not runs_as_batch(_graph(10), Config())
    assert runs_as_batch(_graph(10), _mode("batch"))
    assert runs_as_batch(_graph(10), _mode("BATCH"))


def test_automatic_is_batch_only_when_every_source_is_bounded() -> None:
    assert runs_as_batch(_graph(10), _mode("automatic"))
    assert not runs_as_batch(_graph(None), _mode("automatic"))


def test_a_batch_job_with_an_unbounded_source_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as e:
        runs_as_batch(_graph(None), _mode("batch"))
    assert "bounded sources" in str(e.value) and "src" in str(e.value)


def test_batch_keys_parse_and_bad_values_are_refused() -> None:
    cfg = Config.from_dict(
        {
            "execution.runtime-mode": "batch",
            "execution.batch.shuffle-dir": "/tmp/shuffle",
            "execution.batch.job-recovery.enabled": "false",
            "execution.batch.shuffle-compression": "lz4",
        }
    )
    assert cfg.execution.shuffle_dir == "/tmp/shuffle"
    assert not cfg.execution.batch_job_recovery
    assert cfg.execution.shuffle_codec.label == "lz4"
    with pytest.raises(ConfigError, match=r"execution\.runtime-mode"):
        _mode("bulk")


def test_a_batch_job_refuses_a_restore_and_a_savepoint(tmp_path: Any) -> None:
    from spillover.deploy import create_executor

    cfg = _mode("batch").with_options({"state.checkpoints.dir": str(tmp_path)})
    ex = create_executor("local", _graph(10), cfg, restore_checkpoint=3)
    with pytest.raises(ConfigError, match="restores no checkpoint"):
        ex.run(timeout=30)
    with pytest.raises(ConfigError, match="takes no savepoints"):
        create_executor("local", _graph(10), cfg).stop_with_savepoint()
