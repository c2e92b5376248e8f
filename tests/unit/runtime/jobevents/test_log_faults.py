"""The job event log on failing storage: a compaction that fails (its listing of the
log's segments, or its snapshot) never undoes the flush that triggered it. The
flushed segment is durable, and a master that took the flush for a failure would
decline a checkpoint the log already names: a restart would then resume from a
checkpoint whose directory is gone."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from spillover.runtime.jobevents import CheckpointCompleted, JobEventLog, JobSubmitted
from support.faults import fail, faulty_dir


@pytest.mark.parametrize(
    ("op", "where"),
    [("list", ""), ("open", "/events-")],
    ids=["listing-the-segments", "writing-the-snapshot"],
)
def test_a_failed_compaction_keeps_the_flush_it_followed(
    op: str, where: str, tmp_path: Path
) -> None:
    with faulty_dir(str(tmp_path)) as (uri, faults):
        log = JobEventLog.open(uri, compact_after=2)
        log.append(JobSubmitted("job", "fp", 2))
        log.flush()
        log.append(CheckpointCompleted(1, "chk-1/_metadata"))
        log.flush()
        rule = fail({op}, where, lambda: OSError(errno.EIO, "Input/output error"))
        if op == "open":  # the segment itself is written; the snapshot after it fails
            opened: list[str] = []

            def snapshot_only(o: str, path: str) -> BaseException | None:
                if o == "open" and "/events-" in path:
                    opened.append(path)
                    return rule(o, path) if len(opened) > 1 else None
                return None

            faults.rules = [snapshot_only]
        else:
            faults.rules = [rule]
        log.append(CheckpointCompleted(2, "chk-2/_metadata"))
        log.flush()  # compaction is due and fails: the flush stands
        assert sum(faults.counts.values()) == 1
        assert log.pending == 0
        faults.rules = []
        reread = JobEventLog.open(uri)
        assert reread.replay().checkpoint == CheckpointCompleted(2, "chk-2/_metadata")
        # A snapshot that was not written is tried again after the next segment.
        log.append(CheckpointCompleted(3, "chk-3/_metadata"))
        log.flush()
        reread = JobEventLog.open(uri)
        assert reread.replay().checkpoint == CheckpointCompleted(3, "chk-3/_metadata")
        assert any(e.snapshot for e in reread.entries())
