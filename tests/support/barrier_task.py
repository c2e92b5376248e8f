"""A task as its barrier handling sees it, recording what is done to it: the
``Controller``, the acknowledgements (``InflightAcks``' role) and still input
channels, for driving ``BarrierHandler`` and its states without a real task."""

from __future__ import annotations

from typing import Any

from spillover.runtime.checkpointing.barriers.controller import RecoveredCut
from spillover.runtime.checkpointing.barriers.handler import AfterAlignment, BarrierHandler
from spillover.runtime.checkpointing.inflight import InFlightCheckpoint
from spillover.runtime.network.events import CheckpointBarrier


class StillChannels:
    """Input channels that only record which are blocked (nothing is queued)."""

    def __init__(self) -> None:
        self.blocked: set[int] = set()

    def block(self, channel: int) -> None:
        self.blocked.add(channel)

    def unblock(self, channel: int) -> None:
        self.blocked.discard(channel)

    def unblock_all(self) -> None:
        self.blocked.clear()

    def is_blocked(self, channel: int) -> bool:
        return channel in self.blocked

    def has_ended(self, channel: int) -> bool:
        return False

    def overtake(self, channel: int, match: Any) -> None:
        return None


class RecordingWriter:
    """A channel-state writer keeping the input it is given, per channel."""

    def __init__(self) -> None:
        self.inputs: dict[int, list[Any]] = {}
        self.input_bytes = 0

    def add_input(self, gate: int, channel: int, buf: Any) -> None:
        self.inputs.setdefault(channel, []).append(buf)


class RecordingTask:
    """``log``: ``(what, checkpoint id)`` in order: ``snapshot`` (no in-flight part),
    ``snapshot+inflight``, ``forwarded`` (an unaligned barrier sent ahead),
    ``declined``, ``completed``; ``persisted``: each completed checkpoint's input
    state per channel."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self.persisted: dict[int, dict[int, list[Any]]] = {}

    def of(self, what: str) -> list[int]:
        return [cid for w, cid in self.log if w == what]

    # Controller
    def open_inflight(self, barrier: CheckpointBarrier, pending: set[int]) -> InFlightCheckpoint:
        gate_of = [(0, ch) for ch in range(64)]
        writer: Any = RecordingWriter()
        return InFlightCheckpoint(barrier.checkpoint_id, writer, set(pending), 0, 0.0, gate_of)

    def cut_recovered(self) -> RecoveredCut:
        return RecoveredCut([], frozenset(), False)

    def forward_unaligned(self, barrier: CheckpointBarrier, inf: Any) -> None:
        self.log.append(("forwarded", barrier.checkpoint_id))

    def begun_records(self, skip: frozenset[int]) -> list[tuple[int, bytes]]:
        return []

    def snapshot(self, barrier: CheckpointBarrier, stats: Any, inf: Any) -> None:
        what = "snapshot" if inf is None else "snapshot+inflight"
        self.log.append((what, barrier.checkpoint_id))

    def decline(self, checkpoint_id: int, reason: str) -> None:
        self.log.append(("declined", checkpoint_id))

    def cancel_downstream(self, checkpoint_id: int) -> None: ...

    # acknowledgements
    def complete(self, inf: InFlightCheckpoint) -> None:
        self.log.append(("completed", inf.checkpoint_id))
        self.persisted[inf.checkpoint_id] = dict(inf.writer.inputs)  # type: ignore[attr-defined]

    def abort(self, inf: InFlightCheckpoint) -> None:
        self.log.append(("declined", inf.checkpoint_id))


def recording_handler(
    channels: int,
    exempt: frozenset[int] = frozenset(),
    after: AfterAlignment | None = None,
) -> tuple[BarrierHandler, StillChannels, RecordingTask]:
    """A real handler over ``channels`` still channels, acting on a recording task."""
    task, still = RecordingTask(), StillChannels()
    h = BarrierHandler(task, still, task, channels, exempt=exempt, after=after)  # type: ignore[arg-type]
    return h, still, task
