"""A checkpoint whose metadata is version 1 (every gate's channel maps inline) or
version 2 (the maps in a channel index beside ``_metadata``) still restores, also at
another parallelism, and replays the same in-flight data as the version 3 metadata
of the same checkpoint (the maps in entries the tasks wrote beside their state):
every byte the checkpoint persisted, once, in each subtask alike."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from spillover.deploy.local import LocalExecutor
from spillover.errors import CorruptIndexError
from spillover.runtime.checkpointing.checkpoint_meta import CheckpointMetadata
from spillover.storage.channel_index import INDEX_FILE
from spillover.verify import VerifySpec, build
from support.checkpoint_golden import as_version_1, as_version_2
from support.checkpointed import checkpointed


@pytest.mark.parametrize("new", [2, 3])
def test_versions_1_and_2_restore_like_version_3(tmp_path: Path, new: int) -> None:
    spec = VerifySpec(policy="unaligned", parallelism=2, records=40_000, rate_per_subtask=20_000)
    cfg, cid = checkpointed(tmp_path / "a", spec)
    chk = tmp_path / "a" / "ckpt" / "job" / f"chk-{cid}"
    raw = json.loads((chk / "_metadata").read_bytes())
    assert raw["version"] == 3 and not (chk / INDEX_FILE).exists()
    meta = CheckpointMetadata.from_json(raw)
    persisted = sum(
        int(st.metrics.get("inflight_bytes", 0))
        for op in meta.tasks.values()
        for st in op.subtasks.values()
    )
    # The same checkpoint, twice more, with version 1 and version 2 metadata.
    for side, version in (("b", 1), ("c", 2)):
        other = tmp_path / side / "ckpt" / "job" / f"chk-{cid}"
        shutil.copytree(chk, other)
        shutil.copytree(tmp_path / "a" / "out", tmp_path / side / "out")  # sink's pending files
        if version == 1:
            old = as_version_1(raw)
        else:
            old, index = as_version_2(raw, str(chk / INDEX_FILE))
            (other / INDEX_FILE).write_bytes(index)
        old_text = json.dumps(old).replace(str(tmp_path / "a"), str(tmp_path / side))
        (other / "_metadata").write_text(old_text)
    replayed, per_task = [], []
    for side in ("a", "b", "c"):
        side_cfg = cfg.with_options({"state.checkpoints.dir": str(tmp_path / side / "ckpt")})
        env = build(spec, str(tmp_path / side / "out"), "job", new)
        result = LocalExecutor(env, side_cfg, restore_checkpoint=cid).run(timeout=120)
        assert result.status == "finished", result.failures
        replayed.append(result.replayed_bytes)
        per_task.append({k: m.get("replayed_bytes", 0.0) for k, m in result.tasks.items()})
    # Checkpoints taken during the replay (whenever they come) change none of it.
    assert replayed == [persisted] * 3 and persisted > 0
    assert per_task[0] == per_task[1] == per_task[2]


def test_a_cut_entry_refuses_the_whole_restore(tmp_path: Path) -> None:
    spec = VerifySpec(policy="unaligned", parallelism=2, records=10**9, rate_per_subtask=20_000)
    cfg, cid = checkpointed(tmp_path, spec)
    chk = tmp_path / "ckpt" / "job" / f"chk-{cid}"
    meta = CheckpointMetadata.from_json(json.loads((chk / "_metadata").read_bytes()))
    refs = [
        h.index
        for op in meta.tasks.values()
        for st in op.subtasks.values()
        if st.channel_state is not None
        for h in (*st.channel_state.input, *st.channel_state.output)
        if h.index is not None
    ]
    assert refs, "the checkpoint holds in-flight data"
    last = max(refs, key=lambda r: (r.uri, r.offset))
    with open(last.uri, "r+b") as f:  # the file's last entry loses its last byte
        f.truncate(last.offset + last.length - 1)
    env = build(spec, str(tmp_path / "out"), "job", 3)
    with pytest.raises(CorruptIndexError) as e:
        LocalExecutor(env, cfg, restore_checkpoint=cid).run(timeout=60)
    assert e.value.path == last.uri
