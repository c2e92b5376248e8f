"""A task's side of its checkpoints: its barrier handling, snapshot threads and
acknowledgements, and what the barrier states and the snapshot may do to the task
(the ``Controller``, ``SnapshotHost`` and ``AckGateway`` Protocols of
``checkpointing/``), done on the task's chain and output."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Protocol

from spillover.runtime.chain import OperatorChain
from spillover.runtime.checkpointing.barriers.alignment import AlignmentStats
from spillover.runtime.checkpointing.barriers.controller import Channels, RecoveredCut
from spillover.runtime.checkpointing.barriers.handler import BarrierHandler
from spillover.runtime.checkpointing.channel_state import (
    ChannelState,
    ChannelStateGroup,
    ChannelStateWriter,
    CheckpointDir,
    open_channel_state,
)
from spillover.runtime.checkpointing.inflight import InflightAcks, InFlightCheckpoint
from spillover.runtime.checkpointing.messages import Ack, CoordinatorGateway, TriggerCheckpoint
from spillover.runtime.checkpointing.snapshot import Captured, SnapshotThreads, take_snapshot
from spillover.runtime.failures import FailureInjector
from spillover.runtime.graph import JobEdge, Vertex
from spillover.runtime.iteration.head import FeedbackLog
from spillover.runtime.lifecycle import TaskLifecycle
from spillover.runtime.network import events as ev
from spillover.runtime.network.buffers import NetworkBuffer
from spillover.runtime.recovery.restore import TaskRestore
from spillover.runtime.taskoutput import TaskOutput

_log = logging.getLogger(__name__)


class CheckpointedTask(Protocol):
    """The task, as its checkpoints read it."""

    name: str
    vertex: Vertex
    subtask: int
    attempt: int
    failures: FailureInjector
    life: TaskLifecycle
    chain: OperatorChain
    output: TaskOutput
    readers: list[Any]
    replay: Any
    restore_state: TaskRestore | None
    channels: list[Any]

    @property
    def coordinator(self) -> CoordinatorGateway: ...
    @property
    def has_input(self) -> bool: ...
    @property
    def gate(self) -> Any: ...
    def drain_unless_switched(self, cid: int) -> bool: ...


class _NoChannels:
    """A source's (empty) input, for its barrier handling."""

    def block(self, channel: int) -> None: ...
    def unblock(self, channel: int) -> None: ...
    def unblock_all(self) -> None: ...
    def is_blocked(self, channel: int) -> bool:
        return False

    def has_ended(self, channel: int) -> bool:
        return True

    def overtake(self, channel: int, match: Any) -> list[NetworkBuffer] | None:
        return None


class TaskCheckpoints:
    """The checkpoints of one task (``task``), on its thread and its snapshot threads."""

    def __init__(
        self,
        task: CheckpointedTask,
        checkpoint_dir: CheckpointDir | None,
        compression: str | None,
        max_inflight_bytes: int | None,
        feedback: FeedbackLog | None = None,
    ) -> None:
        self.task = task
        self.checkpoint_dir = checkpoint_dir
        self.compression = compression
        self.max_inflight_bytes = max_inflight_bytes
        # The subtasks whose channel state shares files with this one (set by wiring).
        self.channel_group: ChannelStateGroup | None = None
        self.vertex_uid = task.vertex.uid
        self.subtask = task.subtask
        # In-flight state lives per input edge: input gate k, channel = upstream subtask.
        edges: list[JobEdge] = []
        for c in task.channels:
            if c.edge not in edges:
                edges.append(c.edge)
        self.input_edges = edges
        self.gate_of = [(edges.index(c.edge), c.upstream_subtask) for c in task.channels]
        self.offsets = [next(i for i, c in enumerate(task.channels) if c.edge == e) for e in edges]
        # The latest checkpoint this task wrote channel state for, and its writer; the
        # next one's channel state opened ahead, and its id (see completed).
        self._last: tuple[int, ChannelState] | None = None
        self._prepared: tuple[int, ChannelStateWriter] | None = None
        self.snapshots = SnapshotThreads(task.name)
        self.acks = InflightAcks(self.snapshots, self)
        channels: Channels = task.gate if task.has_input else _NoChannels()
        self.feedback = feedback
        self.barriers = BarrierHandler(
            self,
            channels,
            self.acks,
            len(task.channels),
            exempt=feedback.feedback if feedback is not None else frozenset(),
            after=feedback,
        )
        if feedback is not None:
            feedback.bind(self.barriers)

    # -- events, from the task loop ------------------------------------------------------

    def on_data(self, ch: int, buf: NetworkBuffer) -> None:
        if self.feedback is not None:
            self.feedback.on_data(ch, buf)
        self.barriers.on_data(ch, buf)

    def on_barrier(self, ch: int, barrier: ev.CheckpointBarrier) -> None:
        if self.feedback is None or not self.feedback.on_barrier(ch, barrier):
            self.barriers.on_barrier(ch, barrier)

    def on_cancel(self, cid: int) -> None:
        """A cancel marker: aborted upstream; passed on downstream."""
        self.aborted(cid)
        self.cancel_downstream(cid)

    def aborted(self, cid: int) -> None:
        """Checkpoint ``cid`` was cancelled upstream or aborted by the coordinator."""
        if self._prepared is not None and self._prepared[0] == cid:
            self._drop_prepared()
        if self.feedback is not None:
            self.feedback.on_cancel(cid)
        self.barriers.on_cancel(cid)

    def on_end_of_partition(self, ch: int) -> None:
        if self.feedback is not None:
            self.feedback.on_end_of_partition(ch)
        self.barriers.on_end_of_partition(ch)

    def trigger_root(self, trigger: TriggerCheckpoint) -> None:
        if trigger.checkpoint_id <= self.task.life.last_snapshot_id:
            # The checkpoint reached it from upstream before that one exited, and the
            # coordinator, seeing the exit, triggered it again (FLIP-147's race).
            return
        self.barriers.trigger(
            ev.CheckpointBarrier(
                trigger.checkpoint_id,
                trigger.trigger_ms,
                ev.BarrierKind(trigger.kind),
                trigger.timeout_ms,
            )
        )

    def reap(self) -> None:
        self.barriers.reap()
        if self.feedback is not None:
            self.feedback.reap()

    def completed(self, cid: int) -> None:
        """Checkpoint ``cid`` completed: if this task wrote channel state for it, the
        next checkpoint's gates (those it wrote) are opened now, between checkpoints,
        instead of when its barrier comes (``ChannelStateWriter.prepare``: storers,
        staging files, about 0.1 ms each on a worker at rest). Only for a group's shared
        file (``ChannelStateWriter.preparable``), and only while the next id is still
        to come to this task; dropped unused if another checkpoint comes first (an
        aligned one too), on its abort, or at the end. Never fails the task: a
        failure to open leaves the barrier to open it, and to say why."""
        if self._prepared is not None and self._prepared[0] <= cid:
            self._drop_prepared()  # its checkpoint never came here: it is past
        last = self._last
        if last is None or cid < last[0]:
            return  # an older one's completion: the latest's may still come
        self._last = None  # its gates are read once (and never after the end: release)
        if last[0] != cid or self.task.life.may_end:
            return  # not the latest; or the task is about to end
        if not isinstance(last[1], ChannelStateWriter) or not last[1].preparable:
            return
        gates = last[1].gates()
        if not gates or self.barriers.stale(cid + 1):
            return
        writer: ChannelState | None = None
        try:
            # The same group as the last one's: its gates are staged here too.
            writer = self._channel_state(cid + 1)
            if isinstance(writer, ChannelStateWriter) and writer.prepare(gates):
                self._prepared, writer = (cid + 1, writer), None
        except Exception:
            _log.debug(
                "%s: checkpoint %d's channel state not opened ahead",
                self.task.name,
                cid + 1,
                exc_info=True,
            )
        finally:
            if writer is not None:  # not kept: storage failed, or opening it raised
                with contextlib.suppress(Exception):
                    writer.discard()

    def _channel_state(self, cid: int) -> ChannelState:
        """Checkpoint ``cid``'s channel state of this subtask, opened now."""
        return open_channel_state(
            self.checkpoint_dir,
            cid,
            self.vertex_uid,
            self.subtask,
            self.compression,
            self.channel_group,
        )

    def _drop_prepared(self) -> None:
        prepared, self._prepared = self._prepared, None
        if prepared is not None:
            prepared[1].discard()

    def release(self) -> None:
        """The task ends: what unfinished checkpoints hold is let go, and its
        channel-state group waits for it no more."""
        self._last = None  # nothing is opened ahead any more
        with contextlib.suppress(Exception):  # what follows lets go of buffers and credit
            self._drop_prepared()
        self.barriers.release()
        if self.feedback is not None:
            self.feedback.release()
        if self.channel_group is not None:
            self.channel_group.leave((self.vertex_uid, self.subtask))

    # -- Controller ----------------------------------------------------------------------

    def open_inflight(self, barrier: ev.CheckpointBarrier, pending: set[int]) -> InFlightCheckpoint:
        writer: ChannelState
        prepared = self._prepared
        if prepared is not None and prepared[0] == barrier.checkpoint_id:
            self._prepared = None
            writer = prepared[1]
        else:
            self._drop_prepared()  # for another checkpoint: this one came instead
            writer = self._channel_state(barrier.checkpoint_id)
        self._last = (barrier.checkpoint_id, writer)
        return InFlightCheckpoint(
            barrier.checkpoint_id,
            writer,
            set(pending),
            barrier.timestamp_ms,
            time.monotonic(),
            self.gate_of,
            self.max_inflight_bytes,
            taken_at=time.time(),
        )

    def cut_recovered(self) -> RecoveredCut:
        replay = self.task.replay
        if replay is None:
            return RecoveredCut([], frozenset(), False)
        references = replay.references(self.task.readers)
        return RecoveredCut(references, frozenset(replay.recovering_channels()), replay.active)

    def forward_unaligned(self, barrier: ev.CheckpointBarrier, inf: InFlightCheckpoint) -> None:
        if self.checkpoint_dir is not None:
            if inf.forwarded:
                return
            t = time.monotonic()
            if not inf.forwarded_at:  # when the barrier starts to leave
                inf.forwarded_at = time.time()
            self.task.output.forward_unaligned(barrier, inf)
            inf.forward_ms = (time.monotonic() - t) * 1000

    def begun_records(self, skip: frozenset[int]) -> list[tuple[int, bytes]]:
        out = []
        for ch, reader in enumerate(self.task.readers):
            raw = reader.pending_raw() if ch not in skip else b""
            if raw:
                out.append((ch, raw))
        return out

    def snapshot(
        self,
        barrier: ev.CheckpointBarrier,
        stats: AlignmentStats | None,
        inf: InFlightCheckpoint | None,
    ) -> None:
        self.task.life.snapshot_taken(barrier.checkpoint_id)
        prepared = self._prepared
        if inf is None and prepared is not None and prepared[0] <= barrier.checkpoint_id:
            self._drop_prepared()  # an aligned checkpoint came instead: no channel state
        take_snapshot(self, barrier, stats, inf)

    def decline(self, checkpoint_id: int, reason: str) -> None:
        self.task.coordinator.decline(checkpoint_id, self.vertex_uid, self.subtask, reason)

    def acknowledge(self, ack: Ack) -> None:
        ack.metrics["ack_sent_at"] = time.time()  # the acknowledgement's hop, measured
        self.task.coordinator.acknowledge(ack)

    def cancel_downstream(self, checkpoint_id: int) -> None:
        self.task.output.cancel_downstream(checkpoint_id)

    # -- SnapshotHost --------------------------------------------------------------------

    def state_directory(self, cid: int) -> str | None:
        if self.checkpoint_dir is None:
            return None
        return self.checkpoint_dir(cid, self.vertex_uid, self.subtask)

    def check_failure(self, cid: int) -> None:
        t = self.task
        t.failures.check("snapshot", t.attempt, self.vertex_uid, self.subtask, checkpoint=cid)

    def capture(self, cid: int) -> Captured:
        life = self.task.life
        # Restored finished, it is finished whether or not its EndOfData went out yet:
        # nothing of it may run again after a restore of this checkpoint.
        restored = self.task.restore_state if life.restored_finished else None
        return self.task.chain.capture(cid, life.finished_in_checkpoint, restored)

    def flush_writers(self) -> None:
        self.task.output.flush()

    def forward_aligned(self, barrier: ev.CheckpointBarrier) -> None:
        self.task.output.forward_aligned(barrier)

    def drain_unless_switched(self, cid: int) -> bool:
        return self.task.drain_unless_switched(cid)
