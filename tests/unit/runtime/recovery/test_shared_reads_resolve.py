"""What a process's shared reads of a rescaled edge resolve (``share_reads``): only the
gates of the old subtasks that two or more new subtasks hosted here read between
them, nothing when none share one (T -> T/2 with a multiple max parallelism), never
every old gate of the edge."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

import spillover.runtime.recovery.replay_plan as replay_plan
import spillover.runtime.recovery.shared_reads as shared_reads
from spillover.rescale import EdgeType, map_edge
from spillover.runtime.recovery.replay_plan import ReplayPlan, RescaledInput
from spillover.runtime.recovery.restore import TaskRestore
from spillover.storage.channel_index import ReadEntries
from spillover.storage.handle import GateKind, GateStateHandle, IndexRef

MAX_P = 128


def _gate(kind: GateKind, subtask: int) -> GateStateHandle:
    """A version 3 gate whose channel maps are in an index entry (never read here)."""
    uri = f"/x/chk-7/channels/{kind.name.lower()}-{subtask}.spill"
    return GateStateHandle(
        uri, 0, kind, 7, subtask, "00" * 16, 128, 1, 0, 0, index=IndexRef(uri, 64, 32)
    )


def _restores(old: int, new: int, hosted: Iterable[int]) -> dict[tuple[str, int], TaskRestore]:
    m = map_edge(
        EdgeType.KEY_BY,
        old_upstream=old,
        old_downstream=old,
        new_upstream=new,
        new_downstream=new,
        max_parallelism=MAX_P,
    )
    item = RescaledInput(
        0,
        m,
        {d: _gate(GateKind.INPUT, d) for d in range(old)},
        {u: _gate(GateKind.OUTPUT, u) for u in range(old)},
        key_offset=0,
    )
    return {
        ("keyed", i): TaskRestore(7, channel_state=ReplayPlan(rescaled=(item,))) for i in hosted
    }


def _resolved_by_sharing(
    monkeypatch: pytest.MonkeyPatch, restores: dict[tuple[str, int], TaskRestore]
) -> tuple[list[tuple[GateKind, int]], list[int]]:
    """The gates ``share_reads`` resolves, and the new subtasks it reads for together."""
    resolved: list[tuple[GateKind, int]] = []
    read_for: list[int] = []

    def resolve_all(handles: Iterable[GateStateHandle], entries: Any = None) -> list[Any]:
        assert isinstance(entries, ReadEntries)  # the attempt's, for the replays after
        out = list(handles)
        resolved.extend((h.gate_kind, h.subtask_index) for h in out)
        return out

    def rescaled_retrievers(mapping: Any, side: Any, subtasks: Any, **_: Any) -> dict[int, Any]:
        read_for.extend(subtasks)
        return {}

    monkeypatch.setattr(replay_plan, "resolve_all", resolve_all)
    monkeypatch.setattr(shared_reads, "rescaled_retrievers", rescaled_retrievers)
    shared_reads.share_reads(restores, lambda task, gate: None, ReadEntries())
    return sorted(resolved), read_for


def test_halving_with_a_multiple_max_parallelism_resolves_nothing_for_sharing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 16 -> 8: new subtask i reads old 2i and 2i+1, no old subtask read twice
    resolved, read_for = _resolved_by_sharing(monkeypatch, _restores(16, 8, range(8)))
    assert resolved == [] and read_for == []


def test_doubling_resolves_only_the_gates_the_sharing_subtasks_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 8 -> 16, hosted 0, 1 (both read old 0) and 4 (reads old 2 alone)
    resolved, read_for = _resolved_by_sharing(monkeypatch, _restores(8, 16, (0, 1, 4)))
    assert read_for == [0, 1]
    # old 0's input gate, and every old upstream's output gate that ends its channels
    assert resolved == [(GateKind.INPUT, 0)] + [(GateKind.OUTPUT, u) for u in range(8)]
