"""The operating script of issue 32 (``tools/operate.py``): run detached, watch over
REST and Prometheus, savepoint, live rescale 2 -> 3, stop with drain, move the
savepoint and resume from it, on the local executor and on Spark's embedded local
master; its output is committed and must come out exactly, the same on both
(``tools/operate.expected``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["local", "spark"])
def test_the_operating_script_prints_what_is_committed(tmp_path: Path, executor: str) -> None:
    if executor == "spark":
        pytest.importorskip("pyspark")
    script = [sys.executable, str(TOOLS / "operate.py"), "--executor", executor]
    out = subprocess.run(
        [*script, "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == (TOOLS / "operate.expected").read_text(), out.stderr[-3000:]
