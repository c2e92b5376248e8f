"""Objects per checkpoint on S3 (issue 35): the backpressured job of
``bench_files.py`` with its checkpoints on an S3 API server on loopback (moto's
``ThreadedMotoServer``), at ``max-subtasks-per-channel-state-file`` 1 (one object per
gate), 5 (the default) and the job's task count (one group per process).

Run: ``PYTHONPATH=src .venv/bin/python -m pytest bench/bench_s3_files.py --benchmark-only -q -s``

Per run, medians over the completed checkpoints: channel-state objects and their
bytes, every object of the checkpoint (with ``_metadata`` and ``_channel_index``),
and the checkpoint's duration. The requests moto served (PUT and POST: one upload
is a PUT, or a POST, PUTs of its parts and a POST) per checkpoint are what an
object store charges for. ``SPILLOVER_BENCH_S3_PARALLELISM`` (default 4) and
``SPILLOVER_BENCH_S3_SECONDS`` (default 4) set the size.
"""

from __future__ import annotations

import os
import re
import socket
import statistics
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench_files import backpressured_job, per_file_sweep
from spillover.config import Config
from spillover.deploy.local import LocalExecutor

PARALLELISM = int(os.environ.get("SPILLOVER_BENCH_S3_PARALLELISM", "4"))
SECONDS = float(os.environ.get("SPILLOVER_BENCH_S3_SECONDS", "4"))
BUCKET = "bench"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
_CHECKPOINT = re.compile(r"^(.*?/chk-\d+)(?:/|$)")


class _Counting:
    """moto's WSGI application, counting writes (PUT, POST) per checkpoint directory."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app
        self.writes: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        found = _CHECKPOINT.match(environ.get("PATH_INFO", ""))
        if environ["REQUEST_METHOD"] in ("PUT", "POST") and found is not None:
            with self._lock:
                self.writes[found.group(1)] += 1
        return self.app(environ, start_response)


@pytest.fixture(scope="module")
def s3() -> Iterator[tuple[str, _Counting, Any]]:
    import boto3
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    os.environ.update(CREDENTIALS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    app = _Counting(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", port, app, True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"127.0.0.1:{port}"
    client = boto3.client(
        "s3",
        endpoint_url=f"http://{endpoint}",
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    client.create_bucket(Bucket=BUCKET)
    try:
        yield endpoint, app, client
    finally:
        server.shutdown()
        thread.join()


def _objects(client: Any, prefix: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        for o in page.get("Contents", []):
            if not o["Key"].endswith("/"):
                out[o["Key"]] = int(o["Size"])
    return out


def _run(tmp: Path, s3: tuple[str, _Counting, Any], per_file: int) -> dict[str, Any]:
    endpoint, app, client = s3
    prefix = f"ckpt-{PARALLELISM}-{per_file}"
    uri = f"s3://{BUCKET}/{prefix}?endpoint_override={endpoint}&scheme=http&region=us-east-1"
    cfg = Config.from_dict(
        {
            "execution.checkpointing.interval": "300 ms",
            "execution.checkpointing.unaligned.enabled": True,
            "execution.checkpointing.unaligned.max-subtasks-per-channel-state-file": per_file,
            "state.checkpoints.dir": uri,
            "state.checkpoints.num-retained": 1000,
            "execution.job-recovery.lease-timeout": "1 h",
        }
    )
    env = backpressured_job(str(tmp / f"out-{per_file}"), PARALLELISM)
    r = LocalExecutor(env, cfg).run(timeout=SECONDS * 10 + 120, stop_after=SECONDS)
    done = [c for c in r.checkpoints if c["status"] == "completed" and not c["final"]]
    objects = _objects(client, prefix + "/")
    rows: list[tuple[int, int, int, int]] = []
    for c in done:
        chk = f"/chk-{c['checkpoint_id']}/"
        mine = {k: n for k, n in objects.items() if chk in k}
        spill = [n for k, n in mine.items() if k.endswith(".spill")]
        writes = sum(
            w
            for d, w in app.writes.items()
            if d.startswith(f"/{BUCKET}/{prefix}/") and d.endswith(chk.rstrip("/"))
        )
        rows.append((len(spill), sum(spill), len(mine), writes))
    durations = sorted(c["duration_ms"] for c in done)

    def med(i: int) -> float:
        return float(statistics.median(r[i] for r in rows)) if rows else 0.0

    return {
        "parallelism": PARALLELISM,
        "per_file": per_file,
        "checkpoints": len(done),
        "channel_objects_per_checkpoint": med(0),
        "channel_bytes_per_checkpoint": med(1),
        "objects_per_checkpoint": med(2),
        "write_requests_per_checkpoint": med(3),
        "duration_ms_median": statistics.median(durations) if durations else 0,
    }


def test_objects_per_checkpoint(
    benchmark: Any, tmp_path: Path, s3: tuple[str, _Counting, Any]
) -> None:
    per_file_sweep(benchmark, lambda per_file: _run(tmp_path, s3, per_file), 2 * PARALLELISM)
