"""An S3 server killed while a checkpoint is being written, kept down across several
checkpoint attempts and started again: the checkpoints it missed are declined with
the connection error as their cause, the job goes on, a checkpoint after the restart
completes, and the output is exact."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from spillover.config import Config
from spillover.deploy import create_executor
from spillover.runtime.checkpointing.metadata import CheckpointStorage
from spillover.runtime.connectors import GeneratorSource, ParquetSink
from spillover.runtime.graph import StreamEnvironment
from spillover.storage.location import register_filesystem
from support.s3 import CREDENTIALS, MotoServer

pytestmark = [pytest.mark.s3]

RECORDS = 40_000  # 4 partitions, 10,000 records/s per subtask: 2 s
DOWN_FOR = 2  # checkpoint attempts aborted while the server is down, at least


def _job(out: Path) -> StreamEnvironment:
    env = StreamEnvironment("outage", parallelism=2)
    gen = GeneratorSource(
        partitions=4, records_per_partition=RECORDS // 4, payload_bytes=16, rate_per_subtask=10_000
    )
    env.from_source(gen, uid="src").rebalance().sink(ParquetSink(str(out)), uid="sink")
    return env


def _s3(server: MotoServer) -> Any:
    """The server as a pyarrow filesystem with pyarrow's default retries and timeouts
    (a refused connection is retried for about 2 s per request): no task thread
    waits on it, since channel-state files are created by their writers' threads."""
    return pafs.S3FileSystem(
        access_key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        secret_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        endpoint_override=server.endpoint,
        scheme="http",
        region="us-east-1",
    )


def test_checkpoints_survive_an_s3_server_killed_and_restarted(tmp_path: Path) -> None:
    """The moto server is SIGKILLed while a checkpoint is pending (connections are
    refused), stays down until two more checkpoint attempts were aborted, and is
    started again on the same port.

    Moto keeps its objects in memory, so the restarted server has lost everything
    written before (it gets its bucket back, empty); it has no persistence to turn
    on. What is honest to assert is therefore what does not depend on the old
    objects: the declined checkpoints and their cause, a single attempt, a complete
    checkpoint written after the restart (the one a restore would take), and the
    exact output (the Parquet sink commits to local disk). The job's lease file is
    among the lost objects, and a master that finds its lease gone on renewal
    rightly stops (another master may hold the job): the lease timeout is set long
    enough that no renewal falls within the run. A real S3 keeps its objects over
    an outage of its endpoint; then the lease would simply be renewed."""
    server = MotoServer()
    server.start()
    out = tmp_path / "out"
    register_filesystem("s3", _s3(server))
    try:
        uri = f"s3://{server.bucket}/ckpt"
        config = Config.from_dict(
            {
                "state.checkpoints.dir": uri,
                "execution.checkpointing.interval": "50 ms",
                "execution.checkpointing.unaligned.enabled": "true",
                "execution.checkpointing.tolerable-failed-checkpoints": 1_000_000,
                "execution.job-recovery.lease-timeout": "1 h",
                "restart-strategy.type": "none",  # a failed attempt would fail the test
            }
        )
        ex = create_executor("local", _job(out), config)
        ended = threading.Event()
        window: dict[str, int] = {}

        def outage() -> None:
            while max(ex.completed_ids(), default=0) < 2 or not ex._current.coordinator._pending:
                if ended.wait(0.005):
                    return
            window["killed_after"] = max(ex._current.coordinator._pending)
            server.kill()
            while not ended.wait(0.005):
                aborted = [
                    c
                    for c in list(ex._current.coordinator.history)
                    if c.status == "aborted" and c.checkpoint_id > window["killed_after"]
                ]
                if len(aborted) >= DOWN_FOR:
                    break
            window["restarted_after"] = ex._current.coordinator.next_id - 1
            server.start()

        t = threading.Thread(target=outage, daemon=True)
        t.start()
        try:
            result = ex.run(timeout=180)
        finally:
            ended.set()
            t.join()
            if server.proc is None:  # the job ended while it was down: start it to look
                server.start()
        assert result.status == "finished" and result.attempts == 1, result.failures
        down = [
            c
            for c in result.checkpoints
            if window["killed_after"] <= c["checkpoint_id"] <= window["restarted_after"]
        ]
        aborted = [c for c in down if c["status"] == "aborted"]
        assert len(aborted) >= DOWN_FOR, result.checkpoints
        assert any("Could not connect" in str(c["reason"]) for c in aborted), aborted
        after = [
            c["checkpoint_id"]
            for c in result.checkpoints
            if c["status"] == "completed" and c["checkpoint_id"] > window["restarted_after"]
        ]
        assert after, "a checkpoint completed after the restart"
        # What the server holds now: complete checkpoints only, the newest from after
        # the restart and readable, as a restore would read it.
        storage = CheckpointStorage(uri, "outage")
        assert storage.all_ids() == storage.completed_ids()
        latest = storage.latest()
        assert latest is not None and latest.checkpoint_id == max(after)
    finally:
        register_filesystem("s3", None)
        server.stop()
    t = pq.read_table(str(out))
    ids = t.column("partition").to_numpy().astype(np.int64) * 10**9 + t.column("seq").to_numpy()
    assert len(ids) == len(np.unique(ids)) == RECORDS
