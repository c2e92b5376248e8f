"""A job restored 2 -> 4 on a key_by edge: the new subtasks of one process share one
read of each old channel (``share_reads``), and each, replaying its part step by step
as a restored task does (``ChannelStateReplay``), gets exactly the records of its key
groups, in order per old channel."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from spillover.keygroups import key_groups, operator_index_for_key_group
from spillover.records import RecordReader
from spillover.rescale import KeyGroupFilter, Piece, Reference
from spillover.runtime.recovery.channels import ChannelStateReplay
from spillover.runtime.recovery.replay_plan import ReplayPlan, RescaledInput
from spillover.runtime.recovery.restore import TaskRestore
from spillover.runtime.recovery.shared_reads import share_reads
from support.rescaled_state import MAX_P, NEW, OLD, rescaled_restores


def _replay(restores: dict[tuple[str, int], TaskRestore], shared: Any) -> dict[int, list[Any]]:
    """Every subtask's replay, stepped in turn as the task threads would; records each
    replayed record ``(key, old upstream, seq)``."""
    got: dict[int, list[Any]] = {}
    replays = {}
    for (_, i), r in restores.items():
        readers: dict[int, RecordReader] = {}
        got[i] = []

        def process(
            ch: int, buf: Any, i: int = i, readers: dict[int, RecordReader] = readers
        ) -> None:
            for batch in readers.setdefault(ch, RecordReader()).feed(buf):
                got[i] += [tuple(np.frombuffer(x, "<i8").tolist()) for x in batch.to_list()]

        replays[i] = ChannelStateReplay(
            r.channel_state,
            subtask=i,
            input_edges=[SimpleNamespace(partitioner=None)],  # type: ignore[list-item]
            offsets=[0],
            outboxes=[],
            process=process,
            shared=shared.get(("keyed", i), {}),
        )
    while any(rep.active for rep in replays.values()):
        for rep in replays.values():
            rep.step()
    return got


def _expected(got: dict[int, list[Any]]) -> None:
    every = [x for recs in got.values() for x in recs]
    assert len(every) == len(set(every)) == 3000  # nothing lost, nothing twice
    for i, recs in got.items():
        kgs = key_groups(np.array([k for k, _, _ in recs], np.int64), MAX_P).tolist()
        assert {operator_index_for_key_group(MAX_P, NEW, kg) for kg in kgs} <= {i}
        for u in range(OLD):  # in order per old channel
            seqs = [s for _, up, s in recs if up == u]
            assert seqs == sorted(seqs)


def test_subtasks_of_one_process_share_each_old_channel_and_replay_exactly(
    tmp_path: Path,
) -> None:
    restores = rescaled_restores(tmp_path)
    shared = share_reads(restores, lambda task, gate: None)
    assert sorted(shared) == [("keyed", i) for i in range(NEW)]
    reads = {i: shared[("keyed", i)][0]._shared for i in range(NEW)}
    # New subtasks 0 and 1 split old subtask 0's key groups, 2 and 3 old subtask 1's.
    assert reads[0] is reads[1] and reads[2] is reads[3] and reads[0] is not reads[2]
    assert [shared[("keyed", i)][0].filter for i in range(NEW)] == [
        KeyGroupFilter(32 * i, 32 * i + 31, MAX_P, 0) for i in range(NEW)
    ]
    _expected(_replay(restores, shared))
    assert reads[0].blocks_read > 0 and reads[2].blocks_read > 0


def test_a_subtask_here_alone_or_finished_or_with_filtered_references_reads_alone(
    tmp_path: Path,
) -> None:
    restores = rescaled_restores(tmp_path)
    only = {k: r for k, r in restores.items() if k[1] in (0, 2)}
    assert share_reads(only, lambda task, gate: None) == {}  # no sharer hosted here
    item = restores[("keyed", 1)].channel_state.rescaled[0]
    ref = Reference(0, 0, (Piece(item.input_handles[0], 0),), KeyGroupFilter(0, 63, MAX_P, 0))
    restores[("keyed", 1)] = TaskRestore(
        7,
        channel_state=ReplayPlan(
            rescaled=(
                RescaledInput(
                    0,
                    item.mapping,
                    item.input_handles,
                    item.output_handles,
                    0,
                    filtered_references=(ref,),
                ),
            )
        ),
    )
    restores[("keyed", 3)] = TaskRestore(
        7, channel_state=restores[("keyed", 3)].channel_state, finished=True
    )
    assert share_reads(restores, lambda task, gate: None) == {}
