"""What barrier handling may do to its task: the ``Controller`` and ``Channels``
Protocols. The states never see the task itself; the task implements both."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from spillover.rescale.pieces import Reference
from spillover.runtime.checkpointing.barriers.alignment import AlignmentStats
from spillover.runtime.checkpointing.inflight import InFlightCheckpoint
from spillover.runtime.network import events as ev
from spillover.runtime.network.buffers import NetworkBuffer


class Channels(Protocol):
    """The task's input channels (its input gate), as barrier handling steers them."""

    def block(self, channel: int) -> None: ...
    def unblock(self, channel: int) -> None: ...
    def unblock_all(self) -> None: ...
    def is_blocked(self, channel: int) -> bool: ...
    def has_ended(self, channel: int) -> bool: ...
    def overtake(self, channel: int, match: Callable[[Any], bool]) -> list[NetworkBuffer] | None:
        """The buffers queued ahead of the first event ``match`` accepts, which is
        taken out of the queue; None (nothing changed) if none is queued."""
        ...


@dataclass(frozen=True)
class RecoveredCut:
    """Recovered input state at a checkpoint's cut: what is referenced rather than
    written again, the channels still replaying it, and whether replay is on."""

    references: list[Reference]
    recovering: frozenset[int]
    active: bool


class Controller(Protocol):
    """The task, as its barrier handling acts on it."""

    def open_inflight(self, barrier: ev.CheckpointBarrier, pending: set[int]) -> InFlightCheckpoint:
        """Opens checkpoint ``barrier``'s channel state, the ``pending`` channels' input
        state still to come."""
        ...

    def cut_recovered(self) -> RecoveredCut:
        """Processes what recovered input state has joined and references the rest."""
        ...

    def forward_unaligned(self, barrier: ev.CheckpointBarrier, inf: InFlightCheckpoint) -> None:
        """Sends ``barrier`` ahead of every output queue; what it overtook is output state."""
        ...

    def begun_records(self, skip: frozenset[int]) -> list[tuple[int, bytes]]:
        """Per channel (except ``skip``), the bytes of a record the task began reading."""
        ...

    def snapshot(
        self,
        barrier: ev.CheckpointBarrier,
        stats: AlignmentStats | None,
        inf: InFlightCheckpoint | None,
    ) -> None:
        """Snapshots the task's operators and forwards ``barrier`` (``snapshot.py``)."""
        ...

    def decline(self, checkpoint_id: int, reason: str) -> None: ...

    def cancel_downstream(self, checkpoint_id: int) -> None:
        """Sends a cancel marker for ``checkpoint_id`` downstream (once)."""
        ...


class AfterAlignment(Protocol):
    """What happens once every channel's aligned barrier came (or a root trigger):
    a snapshot, or an iteration head's snapshot that logs its feedback."""

    def aligned(
        self, barrier: ev.CheckpointBarrier, stats: AlignmentStats | None, seen: frozenset[int]
    ) -> None: ...
