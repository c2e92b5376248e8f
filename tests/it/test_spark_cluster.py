"""A real Spark standalone cluster on loopback: a master and two workers started from
the pyspark distribution, checkpoints on an S3 API server. The job on it gives the
exact output of a failure-free run, after one worker's Python process is killed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from spillover.deploy.spark.standalone import StandaloneCluster, standalone_cluster
from support.s3 import s3_uri

pytest.importorskip("pyspark")

pytestmark = [pytest.mark.slow, pytest.mark.s3]

TESTS = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    """``spark://127.0.0.1:<port>`` with two workers of 2 cores each."""
    root = tmp_path_factory.mktemp("spark-cluster")
    with standalone_cluster(str(root), 2, 2, pythonpath=[os.path.dirname(TESTS)]) as c:
        yield c


def test_job_on_a_standalone_cluster_with_s3_checkpoints_survives_a_killed_worker(
    cluster: StandaloneCluster, s3_server: dict[str, str], tmp_path: Path
) -> None:
    env = cluster.env
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(TESTS, "..", "support", "spark_jobs.py"),
            "--master",
            cluster.url,
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
