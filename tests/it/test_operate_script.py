"""The operating script of issue 32 (``tools/operate.py``): run detached, watch over
REST and Prometheus, savepoint, live rescale 2 -> 3, stop with drain, move the
savepoint and resume from it, on the local executor; its output is committed and
must come out exactly (``tools/operate.expected``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.mark.slow
def test_the_operating_script_prints_what_is_committed(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(TOOLS / "operate.py"), "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == (TOOLS / "operate.expected").read_text(), out.stderr[-3000:]
