"""One read of a rescaled edge's old channels for the new subtasks a process hosts.

When a keyed edge is restored at a higher parallelism, several new subtasks replay
the same old channel, each keeping its own key groups. Alone, each reads and hashes
the channel itself (2→4: every old channel read twice). :func:`share_reads` gives
the subtasks of one process (all of them on the local executor, a worker's on
Spark) that share old channels of an edge one
:class:`~spillover.rescale.SharedReplay`, through
:func:`~spillover.rescale.rescaled_retrievers`: each old channel is read and hashed
once per process, and each subtask replays its :class:`~spillover.rescale.SharedReplayPart`
(``ChannelStateReplay``, ``channels.py``). See docs/rescaling.md, "One read for
several new subtasks".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from spillover.errors import SpilloverError
from spillover.rescale import SharedReplayPart, rescaled_retrievers
from spillover.runtime.recovery import replay
from spillover.runtime.recovery.replay_plan import ReplayPlan, RescaledInput
from spillover.runtime.recovery.restore import TaskRestore
from spillover.storage.channel_index import ReadEntries

__all__ = ["SharedReads", "share_reads"]

TaskKey = tuple[str, int]
"""``(operator uid, subtask)``."""

SharedReads = dict[TaskKey, dict[int, SharedReplayPart]]
"""Per hosted subtask, per input gate, its part of a read shared with others here."""


def share_reads(
    restores: Mapping[TaskKey, TaskRestore | None],
    partitioner: Callable[[TaskKey, int], Any],
    entries: ReadEntries | None = None,
) -> SharedReads:
    """The shared reads of the subtasks ``restores`` names (those hosted here), per
    rescaled input edge that several of them filter by key group from the same old
    channels. ``partitioner(task, gate)`` is the edge's custom partitioner, if any.

    A subtask shares no read of an edge whose old subtasks referenced filtered
    streams it replays first (a checkpoint taken meanwhile must not process the
    shared records ahead of them), nor one restored finished (it replays nothing, so
    its part would hold the others back). The parts are read at the first poll; a
    task closes its parts when it ends, so a part nobody drains any more stops
    holding the others back. ``entries`` is the attempt's channel index entries read
    here (the subtasks' replays read them again from it, not from storage)."""
    by_edge: dict[TaskKey, dict[int, RescaledInput]] = {}
    for (uid, i), restore in restores.items():
        if restore is None or restore.finished:
            continue
        for item in restore.channel_state.rescaled:
            if not item.filtered_references:
                by_edge.setdefault((uid, item.gate), {})[i] = item
    out: SharedReads = {}
    for (uid, gate), items in sorted(by_edge.items()):
        first = items[min(items)]
        # One plan_restore gives every new subtask of an edge the same old state.
        same = sorted(i for i, item in items.items() if item == first)
        # Only those reading an old subtask another here reads too share anything
        # (T -> T/2 with a multiple max parallelism: none); only what they read is
        # resolved (the blocks say, before any entry is read).
        sharing = first.shared_by(same)
        if len(sharing) < 2:
            continue
        try:
            edge = ReplayPlan(rescaled=(first,)).resolved(sharing, entries).rescaled[0]
            parts = rescaled_retrievers(
                edge.mapping,
                "input",
                sharing,
                partitioner=partitioner((uid, same[0]), gate),
                **replay.rescaled_read(edge),
            )
        except (SpilloverError, OSError):
            # Each subtask meets it in its own replay, and fails there as before.
            continue
        for i, part in parts.items():
            if isinstance(part, SharedReplayPart):
                out.setdefault((uid, i), {})[gate] = part
            else:
                part.close()  # not shared (opened nothing yet): the subtask reads alone
    return out
