"""A backpressured streaming job for the operating tests (REST API, CLI, dashboard):
an endless paced source and a slower sink, so in-flight data builds up in the
channels. ``spillover run tests/support/rest_jobs.py:backpressured`` runs it (its
sink keeps nothing, so a savepoint restores in another process)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from spillover.config import Config
from spillover.deploy.local import LocalExecutor
from spillover.rest import JobServer, serve
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.connectors.throttled import ThrottledSink
from spillover.runtime.graph import StreamEnvironment

PATH = Path(__file__)


def backpressured(parallelism: int = 2) -> StreamEnvironment:
    env = StreamEnvironment("backpressured", parallelism=parallelism, max_parallelism=128)
    env.from_source(
        GeneratorSource(
            partitions=2, records_per_partition=10**9, payload_bytes=16, rate_per_subtask=3_000
        ),
        uid="source",
    ).rebalance().sink(ThrottledSink(2_000), uid="sink")
    return env


def config(tmp: Path, **extra: Any) -> Config:
    return Config.from_dict(
        {
            "execution.checkpointing.interval": "100 ms",
            "execution.checkpointing.unaligned.enabled": True,
            "state.checkpoints.dir": str(tmp / "ckpt"),
            "state.checkpoints.num-retained": 3,
            **extra,
        }
    )


def poll(client: httpx.Client, path: str, until: Any, timeout: float = 60.0, what: str = "") -> Any:
    """GETs ``path`` until ``until(json)`` holds; fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        body = client.get(path).json()
        if until(body):
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"{what or path} never held; last answer {body}")
        time.sleep(0.05)


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[JobServer]:
    """The backpressured job on the local executor, served and running on a thread
    (import it into a test module to use it); cancelled afterwards if it still runs."""
    monkeypatch.setenv("SPILLOVER_HOME", str(tmp_path / "home"))
    server = serve(LocalExecutor(backpressured(), config(tmp_path)))
    runner = threading.Thread(target=lambda: server.job.run(timeout=180), daemon=True)
    runner.start()
    yield server
    if not server.job.ended:
        server.job.executor.cancel()
    runner.join(timeout=60)
    server.close()
