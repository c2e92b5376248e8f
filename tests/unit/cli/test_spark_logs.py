"""Spark's and the JVM's log lines go to a file, never into the terminal's progress
bar or report, unless ``--verbose``.

Each command runs in a fresh process: one SparkContext serves a process, and its
logging is decided when it starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

# What Spark's JVM prints when its lines reach the terminal.
JVM_LINES = (" WARN ", " INFO ", " ERROR ", "log4j", "WARNING: Using incubator modules")


def _spillover(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPILLOVER_")}
    return subprocess.run(
        [sys.executable, "-m", "spillover.cli", *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=600,
    )


def _terminal_is_clean(out: subprocess.CompletedProcess[str]) -> None:
    for text in (out.stdout, out.stderr):
        assert not [ln for ln in text.splitlines() if any(j in ln for j in JVM_LINES)], text


def test_bench_on_spark_logs_to_the_results_folder(tmp_path: Path) -> None:
    results = tmp_path / "results"
    argv = ["bench", "--policies", "none", "--compare-local", "off", "--repeat", "1"]
    out = _spillover(
        *argv, "--duration", "1", "--warmup", "0.2", "--out", str(results), cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    _terminal_is_clean(out)
    log = results / "spark.log"
    assert log.stat().st_size > 0
    assert f"Spark's log lines in {log}" in out.stdout and "spark.log" in out.stdout


def test_verify_on_spark_logs_to_its_work_directory(tmp_path: Path) -> None:
    work = tmp_path / "work"
    argv = ["verify", "--executor", "spark", "--records", "2000", "--failures", "1"]
    out = _spillover(*argv, "--workdir", str(work), cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    _terminal_is_clean(out)
    log = work / "spark.log"
    assert log.stat().st_size > 0
    assert out.stderr.strip().splitlines() == [f"Spark's log lines: {log} (--verbose: here)"]
