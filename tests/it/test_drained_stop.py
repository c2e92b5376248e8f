"""A drained stop commits every record its sources emitted before the drain ended
them, once: the check holds the committed output against the sources' positions in
the savepoint, so it finds a lost tail, and chaos scenario ``29-60`` (a drain
under storage faults and a commit failure) is held to it."""

from __future__ import annotations

import os
from pathlib import Path

from spillover.runtime.failures import FailureInjector
from spillover.verify import VerifySpec
from spillover.verify.output import _commit_order, output_of
from spillover.verify.run import compare_drained, run_once, run_stopped


def test_the_check_of_a_drain_finds_the_tail_it_lost(tmp_path: Path) -> None:
    """A real drained run is exact; with its last committed file gone (the tail of
    a drain lost), the same check reports exactly that file's records lost."""
    spec = VerifySpec(topology="pipeline", parallelism=1, records=8000, stop="drain")
    base = run_once(spec, str(tmp_path), "baseline", FailureInjector(), executor="local")
    half = 0.5 * base.result.duration_s
    drained = run_stopped(spec, str(tmp_path), "with-stop", FailureInjector(), half)
    report = compare_drained(spec, base, drained)
    assert report.exact and report.records > 0, report.text()
    assert report.drain_emitted == report.records

    assert drained.out_dir is not None
    files = sorted(
        (f for f in os.listdir(drained.out_dir) if f.endswith(".parquet")), key=_commit_order
    )
    last = os.path.join(drained.out_dir, files[-1])
    tail = output_of(spec, drained.result, drained.out_dir, base.max_parallelism).rows
    os.remove(last)
    kept = output_of(spec, drained.result, drained.out_dir, base.max_parallelism)
    lost_rows = len(tail) - len(kept.rows)
    assert lost_rows > 0
    report = compare_drained(spec, base, kept)
    assert not report.exact
    assert len(report.lost) == min(lost_rows, 1000)
    assert report.drain_emitted == len(tail)
