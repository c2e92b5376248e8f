"""A real Spark standalone cluster on loopback: a master and two workers started from
the pyspark distribution, checkpoints on an S3 API server. The job on it gives the
exact output of a failure-free run, after one worker's Python process is killed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.s3 import _free_port, s3_uri

pyspark = pytest.importorskip("pyspark")

pytestmark = [pytest.mark.slow, pytest.mark.s3]

SPARK_HOME = os.path.dirname(pyspark.__file__)
TESTS = os.path.dirname(__file__)
SRC = os.path.join(os.path.dirname(os.path.dirname(TESTS)), "src")


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the Spark {what} did not start")
            time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """``spark://127.0.0.1:<port>`` with two workers of 2 cores each."""
    root = tmp_path_factory.mktemp("spark-cluster")
    env = {
        **os.environ,
        "SPARK_HOME": SPARK_HOME,
        "PYSPARK_PYTHON": sys.executable,
        "PYTHONPATH": os.pathsep.join(
            [SRC, os.path.dirname(TESTS), os.environ.get("PYTHONPATH", "")]
        ),
        "SPARK_LOG_DIR": str(root / "logs"),
        "SPARK_WORKER_DIR": str(root / "work"),
        "SPARK_LOCAL_IP": "127.0.0.1",
    }
    spark_class = os.path.join(SPARK_HOME, "bin", "spark-class")
    port, ui = _free_port(), _free_port()
    log = open(root / "cluster.log", "wb")  # noqa: SIM115  (closed below)
    procs = []
    try:
        master = subprocess.Popen(
            [
                spark_class,
                "org.apache.spark.deploy.master.Master",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--webui-port",
                str(ui),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        procs.append(master)
        _wait_port(port, master, "master")
        url = f"spark://127.0.0.1:{port}"
        for _ in range(2):
            procs.append(
                subprocess.Popen(
                    [
                        spark_class,
                        "org.apache.spark.deploy.worker.Worker",
                        "--host",
                        "127.0.0.1",
                        "--cores",
                        "2",
                        "--memory",
                        "1g",
                        "--webui-port",
                        str(_free_port()),
                        url,
                    ],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        yield {"url": url, "log": str(root / "cluster.log"), **env}
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()


def test_job_on_a_standalone_cluster_with_s3_checkpoints_survives_a_killed_worker(
    cluster: dict[str, str], s3_server: dict[str, str], tmp_path: Path
) -> None:
    env = {k: v for k, v in cluster.items() if k not in ("url", "log")}
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(TESTS, "..", "support", "spark_jobs.py"),
            "--master",
            cluster["url"],
            "--workdir",
            str(tmp_path),
            "--checkpoint-dir",
            s3_uri(s3_server, "cluster-ckpt"),
        ],
        env={**env, **{k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}},
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    errors = [ln for ln in out.stderr.splitlines() if "Error" in ln or "error" in ln]
    assert out.returncode == 0 and lines, "\n".join(errors[:30])
    res = json.loads(lines[-1])
    assert res["killed"], "no checkpoint completed before the job ended"
    assert res["status"] == "finished" and res["attempts"] >= 2, res
    assert res["exact"], res["report"]
