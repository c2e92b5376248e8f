"""The recovery and rescale benchmarks (``spillover.benchmark.recovery``,
``bench/flink/run.py --recovery`` / ``--rescale``) run and report their figures. No
timing is asserted."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from spillover.benchmark.recovery import (
    SinkBatch,
    recover_once,
    rescale_once,
    summarise,
    to_markdown,
    window_start,
)
from support.benchmarks import short_spec

RUN_PY = Path(__file__).resolve().parents[3] / "bench" / "flink" / "run.py"
FLINK_JARS = Path.home() / ".cache" / "spillover" / "flink" / "jars-2.3.0" / ".complete"


def _batches(*points: tuple[float, int]) -> list[SinkBatch]:
    return [SinkBatch(t, n, 1, 2) for t, n in points]


def test_throughput_is_back_where_a_full_window_starts() -> None:
    slow_then_fast = _batches((0.0, 1), (0.5, 1), (1.0, 10), (1.2, 10), (1.4, 10), (1.6, 1))
    assert window_start(slow_then_fast, rate=40, window_s=0.5) == 1.0
    assert window_start(slow_then_fast, rate=1000, window_s=0.5) is None
    assert window_start(_batches((0.0, 100)), rate=1, window_s=0.5) is None  # not over yet


def test_a_recovery_round_reports_the_restart_from_the_failure(tmp_path: Path) -> None:
    r = recover_once(short_spec(tmp_path), "local", after_s=1.0, timeout_s=120)
    assert r.status == "ok", r.line()
    assert r.restored_checkpoint is not None
    assert r.first_record_ms is not None and r.first_record_ms > 0
    assert r.running_ms is not None and r.sink_opened_ms is not None
    assert r.steady_rps > 0
    # What the restored checkpoint persisted of the backpressured channels was replayed.
    assert r.replayed_bytes == r.restored_inflight_bytes > 0
    summary = summarise([{**r.to_dict(), "variant": "local recovery"}], ["first_record_ms"])
    assert summary["local recovery"]["rounds"] == 1
    assert "| local recovery | 1 |" in to_markdown(summary, [("first_record_ms", "first")])
    assert list(tmp_path.iterdir()) == []  # checkpoints and stamps removed


def test_a_live_rescale_round_reports_the_first_sink_record_at_3(tmp_path: Path) -> None:
    r = rescale_once(short_spec(tmp_path), "local", 3, timeout_s=120)
    assert r.status == "ok", r.line()
    assert (r.from_parallelism, r.to_parallelism) == (2, 3)
    assert r.first_sink_record_ms is not None and r.first_sink_record_ms > 0
    assert r.savepoint_ms is not None and r.running_ms is not None
    assert r.first_record_ms is not None  # the runtime's own figure


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("java") is None or not FLINK_JARS.is_file(), reason="Flink 2.3 is not cached"
)
@pytest.mark.parametrize("mode", ["recovery", "rescale"])
def test_flink_reports_the_same_figures(tmp_path: Path, mode: str) -> None:
    out = tmp_path / "flink.json"
    cmd = [sys.executable, str(RUN_PY), f"--{mode}", "1", "--warmup", "1"]
    cmd += ["--policies", "unaligned", "--out", str(out)]
    cmd += ["--after", "2"] if mode == "recovery" else []
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (run,) = json.loads(out.read_text())["runs"]
    (row,) = run["rounds"]
    assert row["first_record_ms"] is not None and row["first_record_ms"] > 0
    if mode == "recovery":
        assert row["replayed_bytes"] is not None and row["restored_checkpoint"] >= 1
    else:
        assert row["restored_is_savepoint"] and row["savepoint_ms"] > 0
