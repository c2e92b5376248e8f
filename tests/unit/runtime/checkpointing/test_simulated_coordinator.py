"""The simulated coordinator at scale (bench/sim_coordinator.py) keeps working: the
real coordinator completes checkpoints of simulated subtasks, aborts a declined one,
and carries exited subtasks' state."""

from __future__ import annotations

from pathlib import Path

from spillover.runtime.checkpointing.checkpoint_meta import CheckpointMetadata
from spillover.runtime.checkpointing.metadata import CheckpointStorage
from spillover.runtime.checkpointing.simulated import (
    MAP,
    SOURCE,
    SimulatedJob,
    Simulation,
    run_checkpoints,
)


def test_twenty_simulated_subtasks_complete_checkpoints(tmp_path: Path) -> None:
    runs = run_checkpoints(SimulatedJob(10), str(tmp_path), checkpoints=2, num_retained=10)
    assert [r.status for r in runs] == ["completed"] * 2 + ["aborted"] + ["completed"] * 2
    assert all(r.metadata_bytes > 0 for r in runs if r.status == "completed")
    storage = CheckpointStorage(str(tmp_path), "sim")
    first, last = runs[0].checkpoint_id, runs[-1].checkpoint_id
    assert storage.completed_ids() == [first, first + 1, first + 3, last]
    meta = CheckpointMetadata.from_json(storage.read_metadata(first))
    assert sorted(meta.tasks) == [MAP, SOURCE]
    for uid, side in ((SOURCE, "output"), (MAP, "input")):
        assert len(meta.operator(uid).subtasks) == 10
        for i in range(10):
            cs = meta.operator(uid).subtask(i).channel_state
            assert cs is not None
            handle = cs.gate(side, 0)
            assert handle is not None and handle.subtask_index == i
    # After the sources exited the maps were the roots; the sources' state is carried.
    after = CheckpointMetadata.from_json(storage.read_metadata(last))
    carried = after.operator(SOURCE).subtasks.values()
    assert len(carried) == 10 and all(s.finished and s.channel_state is None for s in carried)
    finishing = runs[-2].checkpoint_id  # the state they acknowledged last
    assert all(s.operators[SOURCE]["offsets"] == [finishing * 1000] for s in carried)


def test_a_checkpoint_under_tracemalloc_reports_its_peak(tmp_path: Path) -> None:
    with Simulation(SimulatedJob(4), str(tmp_path)) as sim:
        run = sim.checkpoint(trace=True)
    assert run.status == "completed" and run.peak_bytes > 0
