"""An S3 API server (moto) on loopback, for the storage contract, cluster and
storage-fault tests."""

from __future__ import annotations

import contextlib
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


CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


class MotoServer:
    """A moto S3 server in its own process on loopback, with one bucket. ``kill``
    SIGKILLs it (connections are refused from then on); ``start`` again serves the
    same port. Moto keeps its state in memory: a restarted server has only the
    bucket, made anew."""

    def __init__(self, bucket: str = "spillover-test") -> None:
        exe = shutil.which("moto_server", path=os.path.dirname(sys.executable))
        if exe is None:
            pytest.fail("moto_server is missing: install the test extra (pip install -e '.[test]')")
        self.exe, self.bucket, self.port = exe, bucket, _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    pytest.fail("the moto S3 server did not start")
                time.sleep(0.1)
        import boto3

        boto3.client(
            "s3",
            endpoint_url=f"http://{self.endpoint}",
            region_name="us-east-1",
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        ).create_bucket(Bucket=self.bucket)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture(scope="session")
def s3_server() -> Iterator[dict[str, str]]:
    """A moto S3 server in its own process on loopback, with one bucket."""
    server = MotoServer()
    with aws_credentials():
        try:
            server.start()
            yield {"endpoint": server.endpoint, "bucket": server.bucket}
        finally:
            server.stop()


@contextlib.contextmanager
def aws_credentials() -> Iterator[None]:
    """The test :data:`CREDENTIALS` in ``os.environ`` while inside, the old values back after."""
    old = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    try:
        yield
    finally:
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
