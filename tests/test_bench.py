"""``spillover bench``: a short run of two policies, the report's layout, bad flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spillover.bench import BenchSpec, run, to_markdown, trigger_offsets
from spillover.cli import main
from spillover.errors import ConfigError


def test_aligned_and_unaligned_short_run(tmp_path: Path) -> None:
    spec = BenchSpec(
        policies=["aligned", "unaligned"],
        duration_s=2.0,
        warmup_s=0.5,
        interval_ms=200,
        sink_rate=20_000,  # a shorter backlog, so aligned checkpoints complete in 2 s
        checkpoint_dir=str(tmp_path),
    )
    lines: list[str] = []
    results = json.loads(json.dumps(run(spec, progress=lines.append)))
    assert set(results) == {"spec", "machine", "policies", "comparison"}
    assert list(results["policies"]) == ["aligned", "unaligned"] and len(lines) == 2
    assert set(results["comparison"]) >= {
        "aligned_to_unaligned_median_duration",
        "unaligned_to_none_throughput",
    }
    for name, r in results["policies"].items():
        assert r["status"] == "stopped" and r["throughput_rps"] > 0, (name, r["failures"])
        assert r["checkpoints"] >= 1, name
        assert set(r["checkpoint_duration_ms"]) == {"median", "p90", "max"}
        assert set(r["inflight_bytes"]) == {"median", "max"}
        assert all("trigger_s" in c for c in r["checkpoint_list"])
    assert results["policies"]["aligned"]["inflight_bytes"]["max"] == 0
    assert results["policies"]["unaligned"]["inflight_bytes"]["max"] > 0
    table = to_markdown(results)
    rows = [ln for ln in table.splitlines() if ln.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["aligned", "unaligned"]


def test_trigger_offsets_rebuilt_from_the_schedule() -> None:
    cps = [
        {"checkpoint_id": 2, "duration_ms": 300.0},
        {"checkpoint_id": 1, "duration_ms": 2500.0},  # longer than the interval
        {"checkpoint_id": 3, "duration_ms": 10.0},
    ]
    offsets, exact = trigger_offsets(cps, 1.0, 0.0)
    assert not exact and offsets == [3.5, 1.0, 4.5]
    exact_offsets, exact = trigger_offsets([{"checkpoint_id": 1, "trigger_ms": 12_500}], 1.0, 10.0)
    assert exact and exact_offsets == [2.5]


@pytest.mark.parametrize(
    "argv",
    [
        ["--duration", "0"],
        ["--executor", "spark"],
        ["--policies", "aligned,sideways"],
        ["--max-inflight-bytes", "plenty"],
    ],
)
def test_bad_flags_fail_before_running(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *argv]) == 1
    assert "ConfigError" in capsys.readouterr().err


def test_spec_checks_policies() -> None:
    with pytest.raises(ConfigError):
        BenchSpec(policies=["aligned", "aligned"])
