"""What one restored subtask restores, as ``plan_restore`` worked it out."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spillover.runtime.recovery.replay_plan import ReplayPlan

__all__ = ["TaskRestore"]


@dataclass(frozen=True, slots=True)
class TaskRestore:
    """What a task restores from checkpoint ``checkpoint_id``, per operator uid.

    ``operator_state``: its own operator state (the operator's snapshot, opaque
    here) when the parallelism is unchanged; ``rescaled_state``: every old
    subtask's, for ``Operator.restore_rescaled``, when it changed.
    ``keyed_handles``: the keyed-state handles of every old subtask (the keyed
    backend's own records, checked by it; it keeps its key groups).
    ``channel_state``: the recovered channel state to replay. ``finished``: the
    checkpoint recorded its operators as finished, so they are not run again."""

    checkpoint_id: int
    operator_state: Mapping[str, Any] = field(default_factory=dict)
    keyed_handles: Mapping[str, list[dict[str, Any]]] = field(default_factory=dict)
    channel_state: ReplayPlan = field(default_factory=ReplayPlan)
    rescaled_state: Mapping[str, list[Any]] = field(default_factory=dict)
    finished: bool = False
