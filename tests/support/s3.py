"""An S3 API server (moto) on loopback, for the storage contract and cluster tests."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def s3_server() -> Iterator[dict[str, str]]:
    """A moto S3 server in its own process on loopback, with one bucket."""
    exe = shutil.which("moto_server", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.fail("moto_server is missing: install the test extra (pip install -e '.[test]')")
    port = _free_port()
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail("the moto S3 server did not start")
                time.sleep(0.1)
        import boto3

        boto3.client(
            "s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1"
        ).create_bucket(Bucket="spillover-test")
        yield {"endpoint": f"127.0.0.1:{port}", "bucket": "spillover-test"}
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def s3_uri(server: dict[str, str], prefix: str) -> str:
    return (
        f"s3://{server['bucket']}/{prefix}"
        f"?endpoint_override={server['endpoint']}&scheme=http&region=us-east-1"
    )
