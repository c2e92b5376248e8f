"""Several subtasks per Spark task (``taskmanager.numberOfTaskSlots``): a worker hosts
k subtasks of each operator, channels between them stay in memory, their in-flight
data shares channel-state files, and keyed jobs on it stay exact through induced
failures, a killed worker and a rescaled restore."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from spillover.deploy.spark import spark_context
from spillover.verify import VerifySpec, verify

pytest.importorskip("pyspark")

pytestmark = pytest.mark.slow

SLOTS = "taskmanager.numberOfTaskSlots"
PER_FILE = "execution.checkpointing.unaligned.max-subtasks-per-channel-state-file"


@pytest.fixture(scope="module")
def sc() -> Any:
    return spark_context()


def _channel_files(root: Path) -> dict[str, int]:
    """Channel-state files per retained checkpoint (``chk-<id>``) under ``root``."""
    files: dict[str, int] = {}
    for chk in root.rglob("chk-*"):
        if chk.is_dir():
            files[str(chk)] = sum(
                1 for p in chk.rglob("*") if p.is_file() and "channels" in p.parts
            )
    return files


# keyed-parallelisms at p runs its second running total at p + 1: the Spark tasks
# of a generation are ceil((p + 1) / k), 3 then 2 for k = 2 (p = 4, then 3), 2 and 2
# for k = 3 (p = 4, then 5).
@pytest.mark.parametrize(("slots", "rescale_to", "workers"), [(2, 3, 3), (3, 5, 2)])
def test_keyed_job_with_several_subtasks_per_spark_task_restores_rescaled_exactly(
    sc: Any, tmp_path: Path, slots: int, rescale_to: int, workers: int
) -> None:
    """A keyed job at parallelism 4 with k subtasks of each operator in each Spark
    task, unaligned checkpoints and an induced failure, restored at another
    parallelism from a checkpoint holding in-flight data: nothing lost, nothing
    duplicated, order per key kept. With a group as large as what a worker hosts,
    a checkpoint writes at most one channel-state file per worker."""
    spec = VerifySpec(
        topology="keyed-parallelisms",
        parallelism=4,
        rescale_to=rescale_to,
        records=30_000,
        failures=1,
        policy="unaligned",
        executor="spark",
        num_retained=3,
        options={SLOTS: slots, PER_FILE: 4 * slots},  # 4 operators
    )
    report = verify(spec, str(tmp_path))
    assert report.exact, report.text()
    assert report.restored_inflight > 0
    files = _channel_files(tmp_path / "with-failures")
    assert files, "no checkpoint retained"
    assert max(files.values()) <= workers, files


def test_killed_worker_hosting_several_subtasks_restarts_the_job_exactly(
    sc: Any, tmp_path: Path
) -> None:
    """SIGKILL of a worker that hosts two subtasks of each operator of a keyed job:
    the job master restarts the generation from the latest checkpoint, exactly."""
    from spillover.verify.chaos import kill_spec, run_killing_a_worker

    spec = kill_spec(parallelism=4)
    spec.options = {SLOTS: 2}
    out = run_killing_a_worker(str(tmp_path), spec=spec, kill_worker=1)
    assert out["killed"], "no checkpoint completed before the job ended: lengthen it"
    assert out["status"] == "finished" and out["attempts"] >= 2, out
    assert out["exact"], out["report"]
