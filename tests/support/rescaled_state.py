"""The old channel state of a key_by edge checkpointed at parallelism 2, each old
channel split between the downstream's input gate and the upstream's output gate, and
the restores of its subtasks at parallelism 4, for tests of a rescaled replay."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

import spillover
from spillover.keygroups import key_groups, operator_index_for_key_group
from spillover.records import RecordWriter
from spillover.rescale import EdgeType, map_edge
from spillover.runtime.recovery.replay_plan import ReplayPlan, RescaledInput
from spillover.runtime.recovery.restore import TaskRestore

MAX_P = 128
OLD, NEW = 2, 4


def old_state(root: Path, n: int = 3000) -> tuple[dict[int, Any], dict[int, Any]]:
    """Per old channel ``u -> d``: records ``(key, u, seq)`` (three int64) of d's key
    groups, the first buffers in d's input gate (channel u), the rest in u's output
    gate (subpartition d). Returns the input and the output gates' handles."""
    rng = np.random.default_rng(3)
    keys = rng.integers(-(2**40), 2**40, n)
    owner = [operator_index_for_key_group(MAX_P, OLD, int(kg)) for kg in key_groups(keys, MAX_P)]
    ins = {d: spillover.open_storage(root / f"in{d}", subtask_index=d) for d in range(OLD)}
    outs = {u: spillover.open_storage(root / f"out{u}", subtask_index=u) for u in range(OLD)}
    in_storers = {d: s.create_storer(0) for d, s in ins.items()}
    out_storers = {u: s.create_storer(0, kind="output") for u, s in outs.items()}
    for u in range(OLD):
        for d in range(OLD):
            w = RecordWriter(256)
            bufs = []
            for i, k in enumerate(keys.tolist()):
                if owner[i] == d and i % OLD == u:
                    bufs += w.write(np.array([k, u, i], "<i8").tobytes())
            last = w.flush()
            bufs += [last] if last is not None else []
            half = len(bufs) // 2
            for b in bufs[:half]:
                in_storers[d].append(u, b)
            for b in bufs[half:]:
                out_storers[u].append(d, b)
    return (
        {d: s.close() for d, s in in_storers.items()},
        {u: s.close() for u, s in out_storers.items()},
    )


def rescaled_restores(root: Path, n: int = 3000) -> dict[tuple[str, int], TaskRestore]:
    """``("keyed", i)``'s restore at parallelism 4 of :func:`old_state`'s edge."""
    inputs, outputs = old_state(root, n)
    m = map_edge(
        EdgeType.KEY_BY,
        old_upstream=OLD,
        old_downstream=OLD,
        new_upstream=NEW,
        new_downstream=NEW,
        max_parallelism=MAX_P,
    )
    item = RescaledInput(0, m, inputs, outputs, key_offset=0)
    return {
        ("keyed", i): TaskRestore(7, channel_state=ReplayPlan(rescaled=(item,))) for i in range(NEW)
    }


def stored_bytes(restores: dict[tuple[str, int], TaskRestore]) -> int:
    """The in-flight bytes the old edge's gates hold (frames' payloads)."""
    item = next(iter(restores.values())).channel_state.rescaled[0]
    handles = [*item.input_handles.values(), *item.output_handles.values()]
    return sum(nbytes for h in handles if h is not None for _, nbytes in h.channels.values())
