"""The stop-with-savepoint benchmark (``spillover.benchmark.stop``) runs: short stops
of each kind, their summary and table. No timing is asserted."""

from __future__ import annotations

from pathlib import Path

import pytest

from spillover.benchmark.stop import STOP_KINDS, stop_once, summarise, to_markdown, variants
from spillover.errors import ConfigError
from support.benchmarks import short_spec


@pytest.mark.parametrize("pure", [False, True])
def test_each_kind_of_stop_is_timed_and_summarised(tmp_path: Path, pure: bool) -> None:
    spec = short_spec(tmp_path)
    results = [stop_once(spec, kind, "local", pure=pure, timeout_s=120) for kind in STOP_KINDS]
    for r in results:
        assert r.status == "stopped", r.line()
        assert r.checkpoints_before >= 2
        assert r.complete_ms is not None and r.returned_ms is not None
        assert r.savepoint_files > 0 and r.savepoint_bytes > 0
        assert r.raw_write_ms is not None and r.raw_write_fsync_ms is not None
    aligned, unaligned = results
    assert aligned.inflight_bytes == 0  # processed before the savepoint
    assert unaligned.inflight_bytes > 0  # the backpressured buffers went into it
    summary = summarise(results)
    names = [f"local{' pure' if pure else ''} {k}" for k in STOP_KINDS]
    assert list(summary) == names
    assert ("target_met" in summary[names[1]]) is not pure
    table = to_markdown(summary)
    assert all(f"| {n} | 1 |" in table for n in names)
    assert list(tmp_path.iterdir()) == []  # checkpoints and savepoints removed


def test_variants_alternate_every_kind_on_every_executor() -> None:
    assert variants(["local", "spark"]) == [
        ("local", "aligned", False),
        ("local", "unaligned", False),
        ("spark", "aligned", False),
        ("spark", "unaligned", False),
        ("local", "aligned", True),
        ("local", "unaligned", True),
    ]


def test_bad_stops_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown stop"):
        stop_once(short_spec(tmp_path), "drain")
    with pytest.raises(ConfigError, match="local executor only"):
        stop_once(short_spec(tmp_path), "unaligned", "spark", pure=True)
