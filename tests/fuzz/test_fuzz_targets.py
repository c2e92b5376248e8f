"""A short budget of every fuzz target in CI: each runs under atheris in its own
process for a few thousand inputs and must exit 0 (no foreign exception, no oracle
failure, no hang). ``make fuzz`` runs about a million (docs/fuzzing.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip(
    "atheris",
    reason="atheris cannot be imported (a dev dependency on Linux x86_64 CPython 3.11 only)",
    exc_type=ImportError,
)

FUZZ_DIR = Path(__file__).resolve().parents[2] / "fuzz"
TARGETS = ["native_reader", "reference_reader", "handle", "metadata", "event_log", "lease"]
RUNS = 2000


@pytest.mark.parametrize("name", TARGETS)
def test_target_runs_clean(name: str, tmp_path: Path) -> None:
    corpus, artifacts = tmp_path / "corpus", tmp_path / "artifacts"
    corpus.mkdir()
    artifacts.mkdir()
    seeds = [FUZZ_DIR / kind / name for kind in ("corpus", "regressions")]
    proc = subprocess.run(
        [
            sys.executable,
            str(FUZZ_DIR / f"fuzz_{name}.py"),
            f"-runs={RUNS}",
            f"-artifact_prefix={artifacts}/",
            "-print_final_stats=1",
            str(corpus),
            *(str(d) for d in seeds if any(p.name[0] != "." for p in d.glob("*"))),
        ],
        cwd=tmp_path,
        env={**os.environ, "SPILLOVER_FUZZ_SCRATCH": str(tmp_path / "scratch")},
        capture_output=True,
        text=True,
        errors="replace",
        timeout=600,
    )
    tail = "\n".join(proc.stdout.splitlines()[-40:] + proc.stderr.splitlines()[-40:])
    assert proc.returncode == 0, f"fuzz_{name}.py exited {proc.returncode}:\n{tail}"
    assert not list(artifacts.iterdir()), f"fuzz_{name}.py left failing inputs:\n{tail}"
    executed = re.findall(r"stat::number_of_executed_units: (\d+)", proc.stderr)
    assert executed and int(executed[-1]) == RUNS, tail
