"""A task: one subtask of one vertex (a chain of operators) on its own thread.

The task thread owns the operators: it processes input buffers, runs mailbox
messages (checkpoint triggers for sources, completion notifications,
termination) between buffers, and hands barriers to the checkpoint policies:
``checkpointing/aligned.py`` (aligned), ``checkpointing/unaligned.py`` (unaligned,
aligned with a timeout, bounded in-flight data) and ``checkpointing/snapshot.py``
(the snapshot itself, whose slow part runs on the task's snapshot thread, which
acknowledges the checkpoint when done). A restored task replays its channel state
first (``recovery/channels.py``).

Tasks finish (FLIP-147, ``checkpointing/finishing.py``): once its input ended (or
its source is exhausted) a task runs ``end_input``/``finish``, sends EndOfData and
stays only until a checkpoint it took after finishing completed, so two-phase-commit
sinks commit its last data; then it sends EndOfPartition, tells the coordinator it
exited and ends. A subtask a checkpoint recorded as finished is restored finished:
its operators run nothing (two-phase-commit ones are opened and restored only to
commit what the restored checkpoint pre-committed); it sends EndOfData at once. Its
event time (watermarks, the valve) is ``eventtime/clock.py``'s.

Its size is one thread's state machine: the source loop, the input loop and the
mailbox read and write the same fields on the same thread; the policies, the
snapshot and the finishing steps live in ``checkpointing/``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spillover.records import FixedWidthSerializer, RecordReader
from spillover.runtime.api import Operator, OperatorContext, Output
from spillover.runtime.checkpointing.aligned import AlignmentStats, BarrierHandler
from spillover.runtime.checkpointing.channel_state import ChannelStateGroup, CheckpointDir
from spillover.runtime.checkpointing.finishing import (
    FINAL_WITHOUT_CHECKPOINTS,
    await_final,
    end_of_data,
    end_of_inputs,
)
from spillover.runtime.checkpointing.messages import (
    Ack,
    Cancel,
    CoordinatorGateway,
    LoopDone,
    MailboxMessage,
    NotifyAborted,
    NotifyComplete,
    StopSource,
    Suspend,
    SwitchToUnaligned,
    Terminate,
    TriggerCheckpoint,
    Wake,
)
from spillover.runtime.checkpointing.snapshot import SnapshotThreads, take_snapshot
from spillover.runtime.checkpointing.unaligned import InFlightCheckpoint, UnalignedCheckpoints
from spillover.runtime.eventtime.clock import TaskClock
from spillover.runtime.eventtime.timers import KeyedTimerService
from spillover.runtime.failures import FailureInjector
from spillover.runtime.graph import JobEdge, JobGraph, Vertex
from spillover.runtime.iteration.feedback import FeedbackPartition
from spillover.runtime.iteration.probes import ProbeRelay
from spillover.runtime.lifecycle import TaskLifecycle
from spillover.runtime.network import events as ev
from spillover.runtime.network.buffers import NetworkBuffer, OutputWaker
from spillover.runtime.network.gate import InputGate
from spillover.runtime.network.partition import ResultPartition
from spillover.runtime.network.writers import Outbox, PartitionWriter
from spillover.runtime.outputs import ChainOutput, NetworkOutput
from spillover.runtime.recovery.channels import ChannelStateReplay
from spillover.runtime.recovery.restore import TaskRestore
from spillover.storage.handle import DataType

__all__ = [
    "FINAL_WITHOUT_CHECKPOINTS",
    "Ack",
    "InputChannelInfo",
    "Task",
    "TaskCancelled",
    "TaskRestore",
]


# The longest a backpressured task waits for its output to move before it looks
# again: returned credit and permits wake it at once (OutputWaker), so this only
# bounds a wait no wake reaches.
OUTPUT_WAIT = 0.005
_POLL = 0.005  # seconds an idle input loop waits before it looks around again
_WAKE = Wake()
# What a task holding a stop's savepoint still handles as it comes: what completes or
# aborts checkpoints. Data and every other event are held (``Task._held``) until the
# savepoint completes (the task ends: they are in it) or is aborted (they run then).
_WHILE_SUSPENDED = (ev.CheckpointBarrier, ev.CancelCheckpointMarker, ev.EndOfPartition)


class TaskCancelled(Exception):
    """The task was cancelled (the job is failing over or stopping)."""


@dataclass
class InputChannelInfo:
    """Which logical input and upstream subtask a gate channel carries."""

    input_index: int
    edge: JobEdge
    upstream_subtask: int
    dtype: Any


class Task:
    """Runs one subtask of a vertex. Built by ``wiring.build_tasks``, which wires its
    network; ``coordinator`` is set before ``start``."""

    def __init__(
        self,
        *,
        graph: JobGraph,
        vertex: Vertex,
        subtask: int,
        attempt: int,
        gate: InputGate | None,
        channels: list[InputChannelInfo],
        partitions: list[ResultPartition | FeedbackPartition],
        outboxes: list[Outbox],
        writers: list[PartitionWriter],
        restore: TaskRestore | None,
        coordinator: CoordinatorGateway | None,
        checkpoint_dir: CheckpointDir | None,
        keyed_backend_factory: Callable[[Vertex, int], Any] | None,
        failures: FailureInjector,
        on_done: Callable[[Task, BaseException | None], None],
        flush_interval: float = 0.01,
        channel_compression: str | None = None,
        max_inflight_bytes: int | None = None,
        checkpointing: bool = True,
    ) -> None:
        self.graph = graph
        self.vertex = vertex
        self.subtask = subtask
        self.attempt = attempt
        self._gate = gate
        self.channels = channels
        self.partitions = partitions
        self.outboxes = outboxes
        self.writers = writers
        self.restore_state = restore
        self._coordinator = coordinator
        self.checkpoint_dir = checkpoint_dir
        self.failures = failures
        self.on_done = on_done
        self.flush_interval = flush_interval  # the buffer timeout
        # The longest an input wait lasts before the loop looks around again (mail,
        # written channel state to reap, a buffer to flush): short whatever the timeout.
        self._poll = min(flush_interval, _POLL)
        # Whether the job takes checkpoints (else sinks commit on their own at the end).
        self.checkpointing = checkpointing and checkpoint_dir is not None
        self.name = f"{vertex.uid}#{subtask}"
        self.mailbox: queue.SimpleQueue[MailboxMessage] = queue.SimpleQueue()
        self.cancelled = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"task {self.name}", daemon=True)
        self.snapshots = SnapshotThreads(self.name)
        self.keyed = (
            keyed_backend_factory(vertex, subtask)
            if keyed_backend_factory is not None and vertex.head.keyed
            else None
        )
        self.ops: list[Operator] = [n.instantiate() for n in vertex.nodes]
        self.net_out = NetworkOutput(writers, outboxes)
        # A backpressured task waits for its output's credit to come back, woken by it.
        self.output_waker = OutputWaker(self._output_can_move)
        for box in outboxes:
            box.pool.waker = self.output_waker
            target = box.partition
            if isinstance(target, FeedbackPartition):
                target = target.inner
            target.waker = self.output_waker
        self.clock = TaskClock(self, len(channels))  # event time
        self.records_in = 0
        self.busy_seconds = 0.0
        self.started_at = 0.0
        self.finished_at = 0.0
        self._last_flush = 0.0
        self._data_ended: set[int] = set()
        self._inputs_ended: set[int] = set()
        n_inputs = 1 + max((c.input_index for c in channels), default=0)
        self._input_channels = {
            i: {ch for ch, c in enumerate(channels) if c.input_index == i} for i in range(n_inputs)
        }
        self.readers = [RecordReader() for _ in channels]
        # In-flight state lives per input edge: input gate k, channel = upstream subtask.
        edges: list[JobEdge] = []
        for c in channels:
            if c.edge not in edges:
                edges.append(c.edge)
        self.input_edges = edges
        self.gate_of = [(edges.index(c.edge), c.upstream_subtask) for c in channels]
        self.offsets = [next(i for i, c in enumerate(channels) if c.edge == e) for e in edges]
        self._serializers = [FixedWidthSerializer(c.dtype) for c in channels]
        self._debloater = gate.debloater if gate is not None else None
        self.barriers = (
            BarrierHandler(gate, len(channels), self._on_aligned, self._on_aborted)
            if gate is not None
            else None
        )
        self._cancelled_forwarded: set[int] = set()
        self.channel_compression = channel_compression
        # The subtasks whose channel state shares files with this one (set by wiring).
        self.channel_group: ChannelStateGroup | None = None
        self.max_inflight_bytes = max_inflight_bytes
        self.unaligned = UnalignedCheckpoints(self)
        self.output_wait_seconds = 0.0  # waiting for an outbox to drain: backpressure
        self.replay: ChannelStateReplay | None = None  # recovered channel state
        # FLIP-147: restored finished, the operators run nothing (two-phase-commit ones
        # are opened only to commit what the restored checkpoint left pending).
        self.life = TaskLifecycle.restored(restore is not None and restore.finished)
        self._stop_request: bool | None = None  # a StopSource's drain, until handled
        self.no_drain_channels: set[int] = set()  # channels whose EndOfData said "stop"
        self.deferred_triggers: list[TriggerCheckpoint] = []  # root triggers before the gate ended
        # Taken in while holding a stop's savepoint, neither processed nor dropped:
        # (channel, data bytes or in-line event), in arrival order.
        self._held: list[tuple[int, bytes | ev.Event]] = []
        self._opened = 0
        # In a loop body: passes the loop's termination probes on (runtime/iteration).
        self.probes = (
            ProbeRelay(self) if vertex.loop is not None and not vertex.is_iteration_head else None
        )
        # A batch job's source subtask: the splits the log assigned it (None: its own).
        self.splits: tuple[str, ...] | None = None
        self.batch_run: str | None = None  # a batch job's run id (OperatorContext)
        self.job_run: str | None = None  # the job's run id (OperatorContext)
        # The loop's feedback edge, when this task is its tail: never waits for credit.
        self.feedback_partitions = [p for p in partitions if isinstance(p, FeedbackPartition)]

    @property
    def opened_ops(self) -> list[Operator]:
        """The chain's operators that were opened (none when restored finished)."""
        return self.ops[: self._opened]

    @property
    def has_input(self) -> bool:
        """Whether the task reads an input gate (sources do not)."""
        return self._gate is not None

    @property
    def gate(self) -> InputGate:
        """The input gate (a source task has none: only input paths ask for it)."""
        assert self._gate is not None, f"{self.name} has no input gate"
        return self._gate

    @property
    def coordinator(self) -> CoordinatorGateway:
        assert self._coordinator is not None, f"{self.name} has no coordinator yet"
        return self._coordinator

    @coordinator.setter
    def coordinator(self, value: CoordinatorGateway) -> None:
        self._coordinator = value

    # -- control, from other threads -------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def post(self, message: MailboxMessage) -> None:
        """Queues a mailbox message and wakes the task."""
        self.mailbox.put(message)
        if self._gate is not None:
            self._gate.wake()

    def _output_can_move(self) -> None:
        """From the thread that returned credit or a permit: ends the task's wait."""
        if self._gate is not None:
            self._gate.wake()
        else:
            self.mailbox.put(_WAKE)

    def request_unaligned(self, cid: int) -> None:
        """From the coordinator: checkpoint ``cid``'s alignment timed out. Seen at once
        by a task draining its output for that barrier, and queued for the rest."""
        self.unaligned.request_unaligned(cid)
        self.post(SwitchToUnaligned(cid))

    def overtaken(self, ch: int, event: ev.Event, buffers: list[NetworkBuffer]) -> None:
        """From a TCP receiving thread: what a priority event of channel ``ch``
        overtook in the receive queue (see ``UnalignedCheckpoints.overtaken``)."""
        self.unaligned.overtaken(ch, event, buffers)

    def cancel(self) -> None:
        """Stops the task: wakes it wherever it blocks (emit, poll) with an error."""
        self.cancelled.set()
        self.mailbox.put(Cancel())
        for p in self.partitions:
            p.cancel()
        if self._gate is not None:
            self._gate.cancel()

    # -- the task thread -------------------------------------------------------------

    def _run(self) -> None:
        error: BaseException | None = None
        self.started_at = time.monotonic()
        try:
            self._open()
            if self.vertex.is_source:
                self._run_source()
            else:
                self._run_inputs()
                await_final(self)
            if not self.life.suspended:
                self.drain_blocking()
                for p in self.partitions:
                    p.finish()
                for fp in self.feedback_partitions:
                    fp.pump_blocking()  # the loop ended: its head takes the rest
            # Suspended (an unaligned stop's savepoint completed): what is queued and
            # what would follow is in the savepoint; the tasks around end alike.
        except BaseException as e:  # reported to the executor, which fails over
            error = e if not self.cancelled.is_set() else TaskCancelled(self.name)
        finally:
            self.unaligned.release()
            for fp in self.feedback_partitions:
                fp.close()  # its spill files, on the thread that reads them
            for op in self.opened_ops:
                try:
                    op.close()
                except Exception as e:
                    error = error or e
            self.snapshots.shutdown(wait=error is None)
            self.finished_at = time.monotonic()
        if error is None and self._coordinator is not None:
            # After its acknowledgements (the snapshot thread is done) and its
            # EndOfPartition: the tasks behind it may become checkpoint roots.
            self.coordinator.task_exited(self.vertex.uid, self.subtask)
        self.on_done(self, error)

    def _open(self) -> None:
        r = self.restore_state
        # Restored finished, nothing of the operators runs again (FLIP-147); its keyed
        # state is kept for the next checkpoints, and recovered output state (what the
        # last snapshot's barrier overtook) still goes downstream first.
        if not self.life.restored_finished:
            for i, op in enumerate(self.ops):
                op.open(self._context(i))
                self._opened = i + 1
            if self.splits is not None and self.vertex.is_source:
                self.ops[0].assign_splits(self.splits)
        if r is not None:
            if not self.life.restored_finished:
                self.failures.check("restore", self.attempt, self.vertex.uid, self.subtask)
            if self.keyed is not None:
                self.keyed.restore([h for uid in r.keyed_handles for h in r.keyed_handles[uid]])
            if self.life.restored_finished:  # after the keyed state its operators may read
                self._commit_restored(r)
            for node, op in zip(self.vertex.nodes, self.opened_ops, strict=False):
                if node.uid in r.rescaled_state:
                    op.restore_rescaled(r.rescaled_state[node.uid])
                elif node.uid in r.operator_state:
                    op.restore(r.operator_state[node.uid])
            self.replay = ChannelStateReplay(
                r.channel_state,
                subtask=self.subtask,
                input_edges=self.input_edges,
                offsets=self.offsets,
                outboxes=self.outboxes,
                process=self._process,
            )
        self._last_flush = time.monotonic()

    def _context(self, i: int) -> OperatorContext:
        """The context of the chain's ``i``-th operator."""
        node, op = self.vertex.nodes[i], self.ops[i]
        out: Output = self.net_out if i + 1 == len(self.ops) else ChainOutput(self.ops[i + 1])
        if i == 0 and self.vertex.is_source:
            out = self.clock.source_output(out, node.watermarks, op)
        keyed = self.keyed if node.keyed else None
        return OperatorContext(
            uid=node.uid,
            name=node.name,
            subtask_index=self.subtask,
            parallelism=self.vertex.parallelism,
            max_parallelism=self.graph.max_parallelism,
            attempt=self.attempt,
            output=out,
            keyed=keyed,
            timers=KeyedTimerService(keyed, f"{node.uid}.timers") if keyed is not None else None,
            pacing=True,
            batch_run=self.batch_run,
            job_run=self.job_run,
        )

    def _commit_restored(self, r: TaskRestore) -> None:
        """Restored finished: the restored checkpoint completed, but the notification
        that would have committed what its snapshot pre-committed may never have come
        (the attempt ended between the two). Two-phase-commit operators are opened and
        restored, which commits it, and closed; nothing else of them runs."""
        for i, (node, op) in enumerate(zip(self.vertex.nodes, self.ops, strict=True)):
            rescaled = r.rescaled_state.get(node.uid)
            state = r.operator_state.get(node.uid)
            if not op.commits_on_restore:
                continue
            if state is None and all(st is None for st in rescaled or ()):
                continue  # nothing restored: nothing pending
            op.open(self._context(i))
            try:
                if rescaled is not None:
                    op.restore_rescaled(rescaled)
                else:
                    op.restore(state)
            finally:
                op.close()

    def _replay_step(self) -> None:
        """One block of recovered input state; unaligned barriers may come first."""
        self.take_priority(0.0)
        assert self.replay is not None
        t = time.monotonic()
        self.replay.step()
        self.busy_seconds += time.monotonic() - t
        self._maybe_flush()

    def mail(self, block: bool = False, timeout: float | None = None) -> float:
        """Runs queued mailbox messages; returns the seconds spent waiting for one."""
        waited = 0.0
        while True:
            try:
                if block:
                    t = time.monotonic()
                    message = self.mailbox.get(True, timeout)
                    waited = time.monotonic() - t
                else:
                    message = self.mailbox.get_nowait()
            except queue.Empty:
                return waited + (timeout or 0.0) if block else waited
            block = False
            match message:
                case Cancel():
                    raise TaskCancelled(self.name)
                case TriggerCheckpoint():  # a root: a source, or inputs all ended
                    if self.can_be_root():
                        self.trigger_root(message)
                    else:
                        # An upstream exited but its EndOfPartition is still on the way:
                        # the snapshot comes once every channel ended (no data can
                        # follow an exited upstream's EndOfData).
                        self.deferred_triggers.append(message)
                case SwitchToUnaligned(checkpoint_id=cid):
                    self._release_held()  # before the checkpoint it may start
                    self.unaligned.on_timeout(cid)
                case NotifyComplete(checkpoint_id=cid):
                    self.failures.check(
                        "commit", self.attempt, self.vertex.uid, self.subtask, checkpoint=cid
                    )
                    for op in self.opened_ops:
                        op.notify_checkpoint_complete(cid)
                    self.life.checkpoint_completed(cid)
                case NotifyAborted(checkpoint_id=cid):
                    self.life.checkpoint_aborted(cid)  # a stop's savepoint: go on
                    self.unaligned.on_cancel(cid)
                    for op in self.opened_ops:
                        op.notify_checkpoint_aborted(cid)
                case StopSource(drain=drain):
                    self._stop_request = drain
                case Suspend(checkpoint_id=cid):
                    self.life.suspend_announced(cid)
                case Terminate():
                    self.life.terminate()
                case LoopDone(round=r):
                    self.loop_done(r)
                case Wake():
                    pass

    def can_be_root(self) -> bool:
        """Whether a checkpoint trigger can be taken now: no input channel is left
        that could still bring its barrier (an iteration head: no regular one)."""
        return self._gate is None or self._gate.finished

    def inputs_done(self) -> bool:
        """Whether the input loop is over: every channel ended."""
        return self.gate.finished

    def loop_done(self, round: int) -> None:
        """Iteration heads: the loop is empty (``LoopDone``); other tasks get none."""

    def drain(self) -> bool:
        """Moves output on as credit allows; True when every outbox is empty.

        Left armed when it returns False: credit or a permit coming back from then
        on ends the task's next wait (:meth:`wait_for_output`)."""
        waker = self.output_waker
        waker.arm()  # before the checks: credit returned after them is not missed
        done = True
        for box in self.outboxes:
            done = box.drain() and done
        # A loop's feedback never holds the task up: what has no credit is spilled,
        # and goes on from the spill as credit comes back.
        for p in self.feedback_partitions:
            p.pump()
        if done:
            waker.disarm()
        return done

    def drain_responsive(self) -> None:
        """Hands on all output before an in-line event, taking priority barriers and
        mailbox messages while it waits for credit (a downstream checkpoint may need
        this task's barrier before it gives credit back)."""
        while not self.drain():
            self.unaligned.reap()
            if self._gate is not None:
                self.output_wait_seconds += self.take_priority(OUTPUT_WAIT)
                self.mail()
            else:
                self.output_wait_seconds += self.mail(block=True, timeout=OUTPUT_WAIT)

    def take_priority(self, timeout: float) -> float:
        """Waits up to ``timeout`` for a priority event (an unaligned barrier) and
        handles it; returns the seconds spent waiting."""
        t = time.monotonic()
        item = self.gate.poll(timeout, priority_only=True)
        waited = time.monotonic() - t
        if item is not None:
            ch, buf = item
            try:
                self._on_event(ch, ev.deserialize(buf))
            finally:
                buf.release()
        return waited

    def drain_blocking(self) -> None:
        for box in self.outboxes:
            box.drain_blocking()

    def _maybe_flush(self) -> None:
        now = time.monotonic()
        if now - self._last_flush >= self.flush_interval:
            for w in self.writers:
                w.flush()
            self._last_flush = now

    def _run_source(self) -> None:
        src = self.ops[0]
        exhausted = False
        if self.life.restored_finished:
            exhausted = True
            end_of_data(self)
        while not self.life.may_end:
            self.mail()
            if self.cancelled.is_set():
                raise TaskCancelled(self.name)
            if self._stop_request is not None and not exhausted:
                exhausted = True  # stop-with-savepoint: nothing more is emitted
                end_of_data(self, drain=self._stop_request)
            if not exhausted and self.life.takes_input:
                if not self.drain():
                    # Backpressured: wait a little, staying responsive to the mailbox;
                    # only the waiting counts (messages run meanwhile have their own).
                    self.output_wait_seconds += self.mail(block=True, timeout=OUTPUT_WAIT)
                    continue
                t = time.monotonic()
                more = src.on_timer()
                if more:
                    self.clock.poll_source()
                self.busy_seconds += time.monotonic() - t
                self.failures.check(
                    "operator",
                    self.attempt,
                    self.vertex.uid,
                    self.subtask,
                    records=self.net_out.records,
                )
                if not more:
                    exhausted = True
                    end_of_data(self)
                self._maybe_flush()
            else:
                self.mail(block=True, timeout=0.05)

    def _run_inputs(self) -> None:
        gate = self.gate
        while not self.inputs_done():
            self.mail()
            self.unaligned.reap()
            if self.life.exit_requested:
                break
            if not self.drain():
                # Backpressured: process no new input, but take priority events.
                self.output_wait_seconds += self.take_priority(OUTPUT_WAIT)
                continue
            pause = max((op.ready_at() for op in self.opened_ops), default=0.0)
            pause -= time.monotonic()
            if pause > 0:
                # An operator paces itself: wait, still taking unaligned barriers.
                self.take_priority(min(pause, self._poll))
                self._maybe_flush()
                continue
            if self._held:  # (the check inline: this runs once per buffer)
                self._release_held()
            if self.replay is not None and self.replay.active and not self.life.suspended:
                self._replay_step()
                continue
            item = gate.poll(self._poll)
            if item is None:
                self._maybe_flush()
                continue
            ch, buf = item
            try:
                if buf.data_type == DataType.EVENT:
                    self._on_event(ch, ev.deserialize(buf.data))
                else:
                    t = time.monotonic()
                    self._on_data(ch, buf)
                    self.busy_seconds += time.monotonic() - t
            finally:
                buf.release()
            self._maybe_flush()

    def _on_data(self, ch: int, buf: NetworkBuffer) -> None:
        assert self.barriers is not None
        self.barriers.record_bytes(len(buf))
        if self._debloater is not None:
            self._debloater.consumed(len(buf))
        self.unaligned.on_data(ch, buf)
        if self.life.suspended:
            self._held.append((ch, bytes(buf)))
        else:
            self._process(ch, buf)

    def _process(self, ch: int, buf: Any) -> None:
        info = self.channels[ch]
        # One strided view of the buffer (joined with a record carried over from the
        # previous buffer): one call per buffer keeps batches large (operators cost
        # per call, not per record).
        batch = self._serializers[ch].read_buffer(self.readers[ch], buf)
        if not len(batch):
            return
        self.records_in += len(batch)
        self.ops[0].process(batch, info.input_index)
        self.failures.check(
            "operator", self.attempt, self.vertex.uid, self.subtask, records=self.records_in
        )

    def _on_event(self, ch: int, event: ev.Event) -> None:
        assert self.barriers is not None
        if isinstance(event, ev.CheckpointBarrier):
            self.life.barrier_seen(event.checkpoint_id)
        self._release_held()  # it came before this event: a barrier must follow it
        if self.life.suspended and not isinstance(event, _WHILE_SUSPENDED):
            self._held.append((ch, event))
            return
        if isinstance(event, ev.Watermark | ev.WatermarkStatus):
            self.clock.on_event(ch, event)
        elif isinstance(event, ev.CheckpointBarrier):
            if not self.unaligned.on_barrier(ch, event):
                self.barriers.on_barrier(ch, event)
        elif isinstance(event, ev.CancelCheckpointMarker):
            self.unaligned.on_cancel(event.checkpoint_id)
            self.barriers.on_cancel(event.checkpoint_id)
            self._forward_cancel(event.checkpoint_id)
        elif isinstance(event, ev.EndOfData):
            self.readers[ch].finish()
            self._data_ended.add(ch)
            if not event.drain:
                self.no_drain_channels.add(ch)
            else:  # a drained channel no longer holds the watermark back
                self.clock.channel_ended(ch)
            idx = self.channels[ch].input_index
            if idx not in self._inputs_ended and self._input_channels[idx] <= self._data_ended:
                self._inputs_ended.add(idx)
                drained = not (self._input_channels[idx] & self.no_drain_channels)
                if not self.life.restored_finished and drained:
                    self.ops[0].end_input(idx)
                if len(self._inputs_ended) == len(self._input_channels):
                    end_of_inputs(self)
        elif isinstance(event, ev.LoopProbe):
            if self.probes is not None:
                self.probes.on_probe(ch, event.round)
        elif isinstance(event, ev.EndOfPartition):
            self.gate.channel_finished(ch)
            self.barriers.on_end_of_partition(ch)
            self.unaligned.channel_done(ch)
            if self.probes is not None:
                self.probes.channel_ended(ch)

    def _release_held(self) -> None:
        """Once a stop's savepoint it held was aborted (or superseded): what the task
        took in meanwhile is processed now, in the order it came, as if it had never
        stopped. Called before anything that could start a checkpoint."""
        if not self._held or self.life.suspended:
            return
        held, self._held = self._held, []
        for ch, item in held:
            if isinstance(item, bytes):
                self._process(ch, item)
            else:
                self._on_event(ch, item)

    def _forward_cancel(self, checkpoint_id: int) -> None:
        if checkpoint_id in self._cancelled_forwarded:
            return
        self._cancelled_forwarded.add(checkpoint_id)
        self.drain_blocking()
        for p in self.partitions:
            p.broadcast_event(ev.CancelCheckpointMarker(checkpoint_id))

    def _on_aligned(self, barrier: ev.CheckpointBarrier, stats: AlignmentStats) -> None:
        self.snapshot(barrier.checkpoint_id, barrier.timestamp_ms, stats, barrier)

    def _on_aborted(self, checkpoint_id: int) -> None:
        self.coordinator.decline(checkpoint_id, self.vertex.uid, self.subtask, "alignment aborted")
        self._forward_cancel(checkpoint_id)

    def trigger_root(self, trigger: TriggerCheckpoint) -> None:
        if trigger.checkpoint_id <= self.life.last_snapshot_id:
            # The checkpoint reached it from upstream before that one exited, and the
            # coordinator, seeing the exit, triggered it again (FLIP-147's race).
            return
        barrier = ev.CheckpointBarrier(
            trigger.checkpoint_id,
            trigger.trigger_ms,
            ev.BarrierKind(trigger.kind),
            trigger.timeout_ms,
        )
        if barrier.kind == ev.BarrierKind.UNALIGNED:
            self.unaligned.start(barrier, set(), None)
        else:
            self.snapshot(trigger.checkpoint_id, trigger.trigger_ms, None, barrier)

    def snapshot(
        self,
        cid: int,
        trigger_ms: int,
        stats: AlignmentStats | None,
        barrier: ev.CheckpointBarrier | None = None,
        inflight: InFlightCheckpoint | None = None,
    ) -> None:
        """Snapshots this task for checkpoint ``cid`` (``checkpointing/snapshot.py``)."""
        self.life.snapshot_taken(cid)
        take_snapshot(self, cid, trigger_ms, stats, barrier, inflight)

    @property
    def replayed_bytes(self) -> int:
        return self.replay.replayed_bytes if self.replay is not None else 0

    def metrics(self) -> dict[str, float]:
        wall = (self.finished_at or time.monotonic()) - self.started_at
        # Blocked on credit (the consumer is slow) or on the partition's buffer budget
        # (its buffers are all in flight): both are backpressure.
        bp = self.output_wait_seconds + sum(
            p.backpressured_seconds + p.pool.waited_seconds for p in self.partitions
        )
        # What operators count themselves (e.g. late_records_dropped), summed.
        counted: dict[str, float] = {}
        for op in self.opened_ops:
            for k, v in op.ctx.metrics.items():
                if isinstance(v, int | float):
                    counted[k] = counted.get(k, 0.0) + float(v)
        return {
            **counted,
            "records_in": float(self.records_in),
            "records_out": float(self.net_out.records),
            "busy_seconds": self.busy_seconds,
            "backpressured_seconds": bp,
            "backpressured_share": bp / wall if wall > 0 else 0.0,
            "replayed_bytes": float(self.replayed_bytes),
            # Where its output buffers are cut now (below the segment size: debloated).
            "output_buffer_bytes": float(min((w.buffer_size for w in self.writers), default=0)),
            "feedback_spilled_bytes": float(sum(p.spilled_bytes for p in self.feedback_partitions)),
            "wall_seconds": wall,
        }
