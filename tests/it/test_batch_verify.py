"""``spillover verify --runtime-mode batch --kill-driver N`` end to end: a batch run
whose driver is SIGKILLed and started again is exact, and the report says, per
start, how many tasks had finished and how many of them ran again."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from spillover.cli import main


def test_verify_batch_with_driver_kills_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["verify", "--runtime-mode", "batch", "--kill-driver", "2", "--records", "20000"]
    argv += ["--rate", "5000", "--workdir", str(tmp_path / "work")]
    assert main([*argv, "--json", str(tmp_path / "report.json")]) == 0
    out = capsys.readouterr().out
    assert "EXACT" in out and "NOT EXACT" not in out, out
    starts = json.loads((tmp_path / "report.json").read_text())["driver_starts"]
    assert len(starts) >= 2 and any("killed" in s for s in starts), starts
    pattern = re.compile(
        r"finished tasks in the log (\d+) -> (\d+) of (\d+): it re-ran (\d+) of the "
        r"(\d+) finished at its start and finished (\d+) more"
    )
    counts = [pattern.search(s) for s in starts]
    assert all(counts), starts
    for m in counts:
        assert m is not None
        before, after, _, rerun, same, more = map(int, m.groups())
        assert before == same and rerun == 0  # a finished task never ran again
        assert after == before + more
    last = counts[-1]
    assert last is not None and last.group(2) == last.group(3)  # every task finished
