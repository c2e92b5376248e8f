"""A restored subtask's ``replayed_bytes`` (a task metric, summed into
``JobResult.replayed_bytes``) counts each recovered byte it handed on once, whether a
replay step or a checkpoint taken during the replay handed it on: the figure of one
checkpoint's restore does not depend on when checkpoints came."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from spillover.runtime.recovery.channels import ChannelStateReplay
from spillover.runtime.recovery.shared_reads import share_reads
from support.rescaled_state import rescaled_restores, stored_bytes


@pytest.mark.parametrize("shared", [True, False], ids=["shared-read", "read-alone"])
@pytest.mark.parametrize("every", [0, 1, 3], ids=["no-checkpoint", "every-step", "every-3rd"])
def test_each_replayed_byte_counts_once_whenever_checkpoints_come(
    tmp_path: Path, shared: bool, every: int
) -> None:
    restores = rescaled_restores(tmp_path)
    parts = share_reads(restores, lambda task, gate: None) if shared else {}
    handed: dict[int, int] = {}
    replays: dict[int, ChannelStateReplay] = {}
    for (_, i), r in restores.items():
        handed[i] = 0

        def process(ch: int, buf: Any, i: int = i) -> None:
            handed[i] += len(buf)

        replays[i] = ChannelStateReplay(
            r.channel_state,
            subtask=i,
            input_edges=[SimpleNamespace(partitioner=None)],  # type: ignore[list-item]
            offsets=[0],
            outboxes=[],
            process=process,
            shared=parts.get(("keyed", i), {}),
        )
    steps = 0
    while any(rep.active for rep in replays.values()):
        for rep in replays.values():
            # Subtask 0 steps first: with a shared read, it reads blocks whose buffers
            # wait for its sharers, which a checkpoint then cuts out of their queues.
            rep.step()
            if every and steps % every == 0 and rep.active:
                rep.references([])  # a checkpoint during the replay
        steps += 1
    assert {i: rep.replayed_bytes for i, rep in replays.items()} == handed
    assert sum(handed.values()) == stored_bytes(restores)  # each stored byte once
