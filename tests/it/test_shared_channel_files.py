"""Whole jobs whose subtasks share channel-state files (5 per file, the default as in
Flink): exactly-once through induced failures and a restore at another parallelism."""

from __future__ import annotations

import json
from pathlib import Path

from spillover.verify import VerifySpec, verify


def test_shared_files_exactly_once_and_rescaled(tmp_path: Path) -> None:
    spec = VerifySpec(
        topology="pipeline",
        policy="unaligned",
        parallelism=3,
        rescale_to=2,
        records=30_000,
        failures=2,
        rate_per_subtask=30_000,
        seed=15,
        num_retained=3,
        checkpoint_dir=str(tmp_path / "ckpt"),
        options={"execution.checkpointing.unaligned.max-subtasks-per-channel-state-file": 5},
    )
    report = verify(spec, str(tmp_path))
    assert report.exact, report.text()
    assert report.restored_inflight > 0 and report.inflight_replayed > 0, report.text()
    # The checkpoints kept hold their gates as sections of shared files.
    sections = []
    for meta_path in (tmp_path / "ckpt").rglob("_metadata"):
        meta = json.loads(meta_path.read_text())
        for entry in meta["tasks"].values():
            for st in entry["subtasks"].values():
                cs = st.get("channel_state") or {}
                sections += [h for h in cs.get("input", []) + cs.get("output", [])]
    assert sections, "no checkpoint kept in-flight data"
    # A group of one keeps files of its own, without offsets (the pipeline's 6
    # subtasks at p = 2 make groups of 5 and 1); every other gate is a section of its
    # group's file.
    files = {h["uri"] for h in sections}
    assert len(files) < len(sections)
    for h in sections:
        together = [o for o in sections if o["uri"] == h["uri"]]
        assert ("offset" in h) or together == [h], h
    assert any("offset" in h and "/channels/" in h["uri"] for h in sections)
    for uri in files:
        assert Path(uri).stat().st_size >= sum(h["size"] for h in sections if h["uri"] == uri)
