"""A task: one subtask of one vertex (a chain of operators) on its own thread.

The task thread owns the operators: it processes input buffers, runs mailbox
actions (checkpoint triggers for sources, completion notifications,
termination) between buffers, handles barriers through the alignment policy,
and takes snapshots. The slow part of a snapshot (writing keyed state) runs on
the task's snapshot thread, which acknowledges the checkpoint when done.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spillover.records import FixedWidthSerializer, RecordReader
from spillover.runtime.alignment import AlignmentStats, BarrierHandler
from spillover.runtime.api import Batch, OperatorContext, OperatorSnapshot, Output
from spillover.runtime.failures import FailureInjector
from spillover.runtime.graph import JobEdge, JobGraph, Vertex
from spillover.storage.handle import DataType

# The id operators see when a job without checkpointing commits at its end.
FINAL_WITHOUT_CHECKPOINTS = 2**62


class TaskCancelled(Exception):
    """The task was cancelled (the job is failing over or stopping)."""


@dataclass
class InputChannelInfo:
    """Which logical input and upstream subtask a gate channel carries."""

    input_index: int
    edge: JobEdge
    upstream_subtask: int
    dtype: Any


@dataclass
class TaskRestore:
    """What a task restores: per operator uid, its operator state and keyed handles."""

    checkpoint_id: int
    operator_state: dict[str, Any] = field(default_factory=dict)
    keyed_handles: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


@dataclass
class Ack:
    """A subtask's part of a checkpoint, sent to the coordinator."""

    checkpoint_id: int
    vertex_uid: str
    subtask: int
    operator_state: dict[str, Any]
    handles: dict[str, Any]
    keyed: dict[str, Any]
    metrics: dict[str, float]


class ChainOutput:
    """Output of a chained operator: the next operator's input."""

    def __init__(self, op: Any) -> None:
        self.op = op

    def emit(self, batch: Batch) -> None:
        if len(batch):
            self.op.process(batch, 0)


class NetworkOutput:
    """Output of a chain's tail: every outgoing edge's writer."""

    def __init__(self, writers: list[Any]) -> None:
        self.writers = writers
        self.records = 0

    def emit(self, batch: Batch) -> None:
        if len(batch):
            self.records += len(batch)
            for w in self.writers:
                w.emit(batch)


class Task:
    """Runs one subtask of a vertex. Built by the executor, which wires its network."""

    def __init__(
        self,
        *,
        graph: JobGraph,
        vertex: Vertex,
        subtask: int,
        attempt: int,
        gate: Any,
        channels: list[InputChannelInfo],
        partitions: list[Any],
        writers: list[Any],
        restore: TaskRestore | None,
        coordinator: Any,
        checkpoint_dir: Callable[[int, str, int], str],
        keyed_backend_factory: Callable[[Vertex, int], Any] | None,
        failures: FailureInjector,
        on_done: Callable[[Task, BaseException | None], None],
        flush_interval: float = 0.01,
    ) -> None:
        self.graph = graph
        self.vertex = vertex
        self.subtask = subtask
        self.attempt = attempt
        self.gate = gate
        self.channels = channels
        self.partitions = partitions
        self.writers = writers
        self.restore_state = restore
        self.coordinator = coordinator
        self.checkpoint_dir = checkpoint_dir
        self.failures = failures
        self.on_done = on_done
        self.flush_interval = flush_interval
        self.name = f"{vertex.uid}#{subtask}"
        self.mailbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.cancelled = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"task {self.name}", daemon=True)
        self.snapshots = concurrent.futures.ThreadPoolExecutor(1, f"snapshot {self.name}")
        self.keyed = (
            keyed_backend_factory(vertex, subtask)
            if keyed_backend_factory is not None and vertex.head.keyed
            else None
        )
        self.ops = [n.instantiate() for n in vertex.nodes]
        self.net_out = NetworkOutput(writers)
        self.records_in = 0
        self.busy_seconds = 0.0
        self.started_at = 0.0
        self.finished_at = 0.0
        self._last_flush = 0.0
        self._terminate = False
        self._data_ended: set[int] = set()
        self._inputs_ended: set[int] = set()
        n_inputs = 1 + max((c.input_index for c in channels), default=0)
        self._input_channels = {
            i: {ch for ch, c in enumerate(channels) if c.input_index == i} for i in range(n_inputs)
        }
        self._readers = [RecordReader() for _ in channels]
        self._serializers = [FixedWidthSerializer(c.dtype) for c in channels]
        self.barriers = (
            BarrierHandler(gate, len(channels), self._on_aligned, self._on_aborted)
            if gate is not None
            else None
        )
        self._cancelled_forwarded: set[int] = set()

    # -- control, from other threads -------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def post(self, *action: Any) -> None:
        """Queues a mailbox action and wakes the task."""
        self.mailbox.put(action)
        if self.gate is not None:
            self.gate.wake()

    def cancel(self) -> None:
        """Stops the task: wakes it wherever it blocks (emit, poll) with an error."""
        self.cancelled.set()
        self.mailbox.put(("cancel",))
        for p in self.partitions:
            p.cancel()
        if self.gate is not None:
            self.gate.cancel()

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
            for p in self.partitions:
                p.finish()
        except BaseException as e:  # reported to the executor, which fails over
            error = e if not self.cancelled.is_set() else TaskCancelled(self.name)
        finally:
            for op in self.ops:
                try:
                    op.close()
                except Exception as e:
                    error = error or e
            self.snapshots.shutdown(wait=error is None)
            self.finished_at = time.monotonic()
        self.on_done(self, error)

    def _open(self) -> None:
        for i, (node, op) in enumerate(zip(self.vertex.nodes, self.ops, strict=True)):
            out: Output = ChainOutput(self.ops[i + 1]) if i + 1 < len(self.ops) else self.net_out
            op.open(
                OperatorContext(
                    uid=node.uid,
                    name=node.name,
                    subtask_index=self.subtask,
                    parallelism=self.vertex.parallelism,
                    max_parallelism=self.graph.max_parallelism,
                    attempt=self.attempt,
                    output=out,
                    keyed=self.keyed if node.keyed else None,
                )
            )
        r = self.restore_state
        if r is not None:
            self.failures.check("restore", self.attempt, self.vertex.uid, self.subtask)
            if self.keyed is not None:
                handles = [h for uid in r.keyed_handles for h in r.keyed_handles[uid]]
                self.keyed.restore(handles)
            for node, op in zip(self.vertex.nodes, self.ops, strict=True):
                if node.uid in r.operator_state:
                    op.restore(r.operator_state[node.uid])
        self._last_flush = time.monotonic()

    def _mail(self, block: bool = False, timeout: float | None = None) -> None:
        """Runs queued mailbox actions."""
        while True:
            try:
                action = self.mailbox.get(block, timeout) if block else self.mailbox.get_nowait()
            except queue.Empty:
                return
            block = False
            kind = action[0]
            if kind == "cancel":
                raise TaskCancelled(self.name)
            if kind == "trigger":  # sources only
                self._snapshot(action[1], action[2], None)
            elif kind == "complete":
                self.failures.check(
                    "commit", self.attempt, self.vertex.uid, self.subtask, checkpoint=action[1]
                )
                for op in self.ops:
                    op.notify_checkpoint_complete(action[1])
            elif kind == "abort":
                for op in self.ops:
                    op.notify_checkpoint_aborted(action[1])
            elif kind == "terminate":
                self._terminate = True

    def _maybe_flush(self) -> None:
        now = time.monotonic()
        if now - self._last_flush >= self.flush_interval:
            for w in self.writers:
                w.flush()
            self._last_flush = now

    def _run_source(self) -> None:
        src = self.ops[0]
        exhausted = False
        while not self._terminate:
            self._mail()
            if self.cancelled.is_set():
                raise TaskCancelled(self.name)
            if not exhausted:
                t = time.monotonic()
                more = src.on_timer()
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
                    self._end_of_data()
                    self.coordinator.source_finished(self.vertex.uid, self.subtask)
                self._maybe_flush()
            else:
                self._mail(block=True, timeout=0.05)

    def _end_of_data(self) -> None:
        """All input ended (or the source is exhausted): finish the chain, tell downstream."""
        if self.vertex.is_source:
            self.ops[0].finish()
            rest = self.ops[1:]
        else:
            rest = self.ops
        for i, op in enumerate(rest):
            if i > 0 or self.vertex.is_source:
                op.end_input(0)
            op.finish()
        self._after_finish()

    def _after_finish(self) -> None:
        """Flushes and tells downstream that data ended. Without checkpointing there
        is no final checkpoint to commit two-phase-commit sinks, and no recovery a
        commit could break, so the operators commit here on their own."""
        from spillover.runtime.events import EndOfData

        for w in self.writers:
            w.flush()
        if getattr(self.coordinator, "storage", None) is None:
            snaps = [op.snapshot(FINAL_WITHOUT_CHECKPOINTS) for op in self.ops]
            for snap in snaps:
                if snap.finalize is not None:
                    snap.finalize("")
            for op in self.ops:
                op.notify_checkpoint_complete(FINAL_WITHOUT_CHECKPOINTS)
        for p in self.partitions:
            p.broadcast_event(EndOfData())

    def _run_inputs(self) -> None:
        from spillover.runtime import events as ev

        gate = self.gate
        while not gate.finished:
            self._mail()
            if self._terminate:
                break
            item = gate.poll(self.flush_interval)
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

    def _on_data(self, ch: int, buf: Any) -> None:
        info = self.channels[ch]
        assert self.barriers is not None
        self.barriers.record_bytes(len(buf.data))
        head = self.ops[0]
        for rb in self._readers[ch].feed(buf.data):
            batch = self._serializers[ch].deserialize_batch(rb)
            self.records_in += len(batch)
            head.process(batch, info.input_index)
        self.failures.check(
            "operator", self.attempt, self.vertex.uid, self.subtask, records=self.records_in
        )

    def _on_event(self, ch: int, event: Any) -> None:
        from spillover.runtime import events as ev

        assert self.barriers is not None
        if isinstance(event, ev.CheckpointBarrier):
            self.barriers.on_barrier(ch, event)
        elif isinstance(event, ev.CancelCheckpointMarker):
            self.barriers.on_cancel(event.checkpoint_id)
            self._forward_cancel(event.checkpoint_id)
        elif isinstance(event, ev.EndOfData):
            self._readers[ch].finish()
            self._data_ended.add(ch)
            idx = self.channels[ch].input_index
            if idx not in self._inputs_ended and self._input_channels[idx] <= self._data_ended:
                self._inputs_ended.add(idx)
                self.ops[0].end_input(idx)
                if len(self._inputs_ended) == len(self._input_channels):
                    self._end_of_data_inputs()
        elif isinstance(event, ev.EndOfPartition):
            self.gate.channel_finished(ch)
            self.barriers.on_end_of_partition(ch)

    def _end_of_data_inputs(self) -> None:
        for i, op in enumerate(self.ops):
            if i > 0:
                op.end_input(0)
            op.finish()
        self._after_finish()

    def _forward_cancel(self, checkpoint_id: int) -> None:
        from spillover.runtime.events import CancelCheckpointMarker

        if checkpoint_id in self._cancelled_forwarded:
            return
        self._cancelled_forwarded.add(checkpoint_id)
        for p in self.partitions:
            p.broadcast_event(CancelCheckpointMarker(checkpoint_id))

    def _on_aligned(self, barrier: Any, stats: AlignmentStats) -> None:
        self._snapshot(barrier.checkpoint_id, barrier.timestamp_ms, stats, barrier)

    def _on_aborted(self, checkpoint_id: int) -> None:
        self.coordinator.decline(checkpoint_id, self.vertex.uid, self.subtask, "alignment aborted")
        self._forward_cancel(checkpoint_id)

    def _snapshot(
        self, cid: int, trigger_ms: int, stats: AlignmentStats | None, barrier: Any = None
    ) -> None:
        from spillover.runtime.events import CheckpointBarrier

        t0 = time.monotonic()
        start_delay_ms = (
            max(0.0, time.time() * 1000 - trigger_ms)
            if stats is None
            else max(0.0, (stats.first_barrier_at - t0) * 1000 + time.time() * 1000 - trigger_ms)
        )
        self.failures.check("snapshot", self.attempt, self.vertex.uid, self.subtask, checkpoint=cid)
        for w in self.writers:
            w.flush()
        snaps: dict[str, OperatorSnapshot] = {
            n.uid: op.snapshot(cid) for n, op in zip(self.vertex.nodes, self.ops, strict=True)
        }
        keyed_write = self.keyed.snapshot() if self.keyed is not None else None
        state_bytes = float(self.keyed.state_bytes()) if self.keyed is not None else 0.0
        if barrier is None:
            barrier = CheckpointBarrier(cid, trigger_ms)
        for p in self.partitions:
            p.broadcast_event(barrier)
        sync_ms = (time.monotonic() - t0) * 1000
        metrics = {
            "start_delay_ms": start_delay_ms,
            "alignment_ms": stats.alignment_seconds * 1000 if stats else 0.0,
            "bytes_during_alignment": float(stats.bytes_during_alignment) if stats else 0.0,
            "sync_ms": sync_ms,
            "state_bytes": state_bytes,
            "inflight_bytes": 0.0,
        }
        directory = self.checkpoint_dir(cid, self.vertex.uid, self.subtask)
        vertex_uid, subtask, coordinator = self.vertex.uid, self.subtask, self.coordinator
        key_uid = next((n.uid for n in self.vertex.nodes if n.keyed), None)

        def finish_async() -> None:
            t1 = time.monotonic()
            try:
                handles = {
                    uid: s.finalize(directory) for uid, s in snaps.items() if s.finalize is not None
                }
                keyed = {key_uid: keyed_write(directory)} if keyed_write and key_uid else {}
            except BaseException as e:
                coordinator.decline(cid, vertex_uid, subtask, f"snapshot failed: {e!r}")
                return
            metrics["async_ms"] = (time.monotonic() - t1) * 1000
            coordinator.acknowledge(
                Ack(
                    cid,
                    vertex_uid,
                    subtask,
                    {uid: s.operator_state for uid, s in snaps.items()},
                    handles,
                    keyed,
                    metrics,
                )
            )

        self.snapshots.submit(finish_async)

    def metrics(self) -> dict[str, float]:
        wall = (self.finished_at or time.monotonic()) - self.started_at
        # Blocked on credit (the consumer is slow) or on the partition's buffer budget
        # (its buffers are all in flight): both are backpressure.
        bp = sum(p.backpressured_seconds + p.pool.waited_seconds for p in self.partitions)
        return {
            "records_in": float(self.records_in),
            "records_out": float(self.net_out.records),
            "busy_seconds": self.busy_seconds,
            "backpressured_seconds": bp,
            "backpressured_share": bp / wall if wall > 0 else 0.0,
            "wall_seconds": wall,
        }
