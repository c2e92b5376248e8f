"""execution.buffer-timeout.interval: how long a task lets a partly filled buffer wait."""

from __future__ import annotations

from spillover.config import Config
from spillover.deploy import create_executor
from spillover.runtime.connectors.collecting import CollectingSink
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.graph import StreamEnvironment


def _env() -> StreamEnvironment:
    env = StreamEnvironment("timeout", parallelism=1)
    env.from_source(GeneratorSource(1, 10), uid="src").sink(CollectingSink("t"), uid="sink")
    return env


def test_executors_flush_at_the_configured_interval_unless_told_otherwise() -> None:
    cfg = Config.from_dict({"execution.buffer-timeout.interval": "40 ms"})
    default = Config().network.buffer_timeout.total_seconds()
    for kind in ("local", "processes"):
        assert create_executor(kind, _env(), cfg).flush_interval == 0.04
        assert create_executor(kind, _env()).flush_interval == default
        assert create_executor(kind, _env(), cfg, flush_interval=0.002).flush_interval == 0.002
