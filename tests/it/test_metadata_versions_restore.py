"""A checkpoint whose metadata is version 1 (every gate's channel maps inline, no
channel index beside it) still restores, also at another parallelism, and replays
the same in-flight data as the version 2 metadata of the same checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from spillover.deploy.local import LocalExecutor
from spillover.errors import StateFileNotFoundError
from spillover.storage.channel_index import INDEX_FILE
from spillover.verify import VerifySpec, build
from support.checkpoint_golden import as_version_1
from support.checkpointed import checkpointed


@pytest.mark.parametrize("new", [2, 3])
def test_a_version_1_checkpoint_restores_like_version_2(tmp_path: Path, new: int) -> None:
    spec = VerifySpec(policy="unaligned", parallelism=2, records=40_000, rate_per_subtask=20_000)
    cfg, cid = checkpointed(tmp_path / "a", spec)
    chk = tmp_path / "a" / "ckpt" / "job" / f"chk-{cid}"
    raw = json.loads((chk / "_metadata").read_bytes())
    assert raw["version"] == 2 and (chk / INDEX_FILE).exists()
    # The same checkpoint, once more, with version 1 metadata and no index.
    other = tmp_path / "b" / "ckpt" / "job" / f"chk-{cid}"
    shutil.copytree(chk, other)
    shutil.copytree(tmp_path / "a" / "out", tmp_path / "b" / "out")  # the sink's pending files
    old = as_version_1(raw)
    old_text = json.dumps(old).replace(str(tmp_path / "a"), str(tmp_path / "b"))
    (other / "_metadata").write_text(old_text)
    (other / INDEX_FILE).unlink()
    replayed = []
    for side in ("a", "b"):
        side_cfg = cfg.with_options({"state.checkpoints.dir": str(tmp_path / side / "ckpt")})
        env = build(spec, str(tmp_path / side / "out"), "job", new)
        result = LocalExecutor(env, side_cfg, restore_checkpoint=cid).run(timeout=120)
        assert result.status == "finished", result.failures
        replayed.append(result.replayed_bytes)
    assert replayed[0] == replayed[1] > 0


def test_a_missing_channel_index_refuses_the_whole_restore(tmp_path: Path) -> None:
    spec = VerifySpec(policy="unaligned", parallelism=2, records=10**9, rate_per_subtask=20_000)
    cfg, cid = checkpointed(tmp_path, spec)
    index = tmp_path / "ckpt" / "job" / f"chk-{cid}" / INDEX_FILE
    index.unlink()
    env = build(spec, str(tmp_path / "out"), "job", 3)
    with pytest.raises(StateFileNotFoundError) as e:
        LocalExecutor(env, cfg, restore_checkpoint=cid).run(timeout=60)
    assert e.value.path is not None and INDEX_FILE in e.value.path
