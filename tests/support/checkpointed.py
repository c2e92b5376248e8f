"""A verify topology run for a second with unaligned checkpoints, for tests that
restore its last checkpoint (which must hold in-flight data)."""

from __future__ import annotations

from pathlib import Path

from spillover.config import Config
from spillover.deploy.local import LocalExecutor
from spillover.verify import VerifySpec, build


def checkpointed(tmp_path: Path, spec: VerifySpec) -> tuple[Config, int]:
    """Runs ``spec`` for a second under ``tmp_path``; its configuration and the id of
    its last completed checkpoint, one with in-flight data."""
    cfg = Config.from_dict(
        {
            "execution.checkpointing.interval": "50 ms",
            "state.checkpoints.dir": str(tmp_path / "ckpt"),
            **spec.checkpoint_options(),
        }
    )
    r = LocalExecutor(build(spec, str(tmp_path / "out"), "job"), cfg).run(stop_after=1.0)
    done = r.completed_checkpoints()
    assert done and done[-1]["inflight_bytes"] > 0
    return cfg, done[-1]["checkpoint_id"]
