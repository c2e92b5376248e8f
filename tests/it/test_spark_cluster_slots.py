"""A Spark standalone cluster of 4 workers on loopback (``bench/spark_cluster.py``):
``spillover verify``'s keyed pipeline at parallelism 8, two subtasks of each operator
per Spark task, unaligned checkpoints and an induced failure, is exact, and every
checkpoint writes at most one channel-state file per worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_parallelism_8_on_4_workers_writes_at_most_a_file_per_worker(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    # The driver runs in a process of its own: one SparkContext a process.
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "spark_cluster.py"),
            "--workers",
            "4",
            "--cores",
            "1",
            "--runs",
            "2:6",
            "--json",
            str(out),
        ],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["exact"], row["report"]
    assert row["worker_processes"] == 4
    assert row["checkpoints_with_data"] > 0
    assert row["files_max"] <= 4, row
