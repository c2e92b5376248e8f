"""A task: one subtask of one vertex (a chain of operators) on its own thread.

The task thread owns the operators: it processes input buffers, runs mailbox
actions (checkpoint triggers for sources, completion notifications,
termination) between buffers, handles barriers through the alignment policy,
and takes snapshots. The slow part of a snapshot (writing keyed state) runs on
the task's snapshot thread, which acknowledges the checkpoint when done.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spillover.records import FixedWidthSerializer, RecordReader
from spillover.runtime.api import Batch, OperatorContext, OperatorSnapshot, Output
from spillover.runtime.checkpointing.aligned import AlignmentStats, BarrierHandler
from spillover.runtime.checkpointing.unaligned import InFlightCheckpoint
from spillover.runtime.failures import FailureInjector
from spillover.runtime.graph import JobEdge, JobGraph, Vertex
from spillover.runtime.recovery import replay as recovery
from spillover.runtime.recovery.replay import (
    InputRecovery,
    Piece,
    StreamRecovery,
    compose_filters,
    filtered_references_of,
    filtered_retriever,
    references_of,
)
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
    channel_state: dict[str, Any] = field(default_factory=dict)  # the replay plan
    # Restored at another parallelism: every old subtask's state, per operator uid.
    rescaled_state: dict[str, list[Any]] = field(default_factory=dict)


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
    channel_state: dict[str, Any] = field(default_factory=dict)


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
        outboxes: list[Any],
        writers: list[Any],
        restore: TaskRestore | None,
        coordinator: Any,
        checkpoint_dir: Callable[[int, str, int], str],
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
        self.gate = gate
        self.channels = channels
        self.partitions = partitions
        self.outboxes = outboxes
        self.writers = writers
        self.restore_state = restore
        self.coordinator = coordinator
        self.checkpoint_dir = checkpoint_dir
        self.failures = failures
        self.on_done = on_done
        self.flush_interval = flush_interval
        # Whether the job takes checkpoints (else sinks commit on their own at the end).
        self.checkpointing = checkpointing
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
        # In-flight state lives per input edge: input gate k, channel = upstream subtask.
        edges: list[Any] = []
        for c in channels:
            if c.edge not in edges:
                edges.append(c.edge)
        self.input_edges = edges
        self._gate_of = [(edges.index(c.edge), c.upstream_subtask) for c in channels]
        self._offset = [next(i for i, c in enumerate(channels) if c.edge == e) for e in edges]
        self._serializers = [FixedWidthSerializer(c.dtype) for c in channels]
        self.barriers = (
            BarrierHandler(gate, len(channels), self._on_aligned, self._on_aborted)
            if gate is not None
            else None
        )
        self._cancelled_forwarded: set[int] = set()
        self.channel_compression = channel_compression
        self.max_inflight_bytes = max_inflight_bytes
        self.inflight: InFlightCheckpoint | None = None
        self._switched: set[int] = set()  # timed out before any of their barriers came
        self.replayed_bytes = 0
        self.output_wait_seconds = 0.0  # waiting for an outbox to drain: backpressure
        self._switch_requested = -1  # the checkpoint whose alignment timed out, if any
        self._done_checkpoints: set[int] = set()
        # Buffers a priority barrier overtook in a remote channel's receive queue, per
        # channel: (checkpoint id, buffers), recorded by the TCP receiver (overtaken).
        self._overtaken: dict[int, deque[tuple[int, list[Any]]]] = {}
        self._overtaken_lock = threading.Lock()
        self._recovery: Any = None  # recovered input state still being replayed
        self._streams: Any = None  # old channels' streams still being replayed (first)

    # -- control, from other threads -------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def post(self, *action: Any) -> None:
        """Queues a mailbox action and wakes the task."""
        self.mailbox.put(action)
        if self.gate is not None:
            self.gate.wake()

    def overtaken(self, ch: int, event: Any, buffers: list[Any]) -> None:
        """From a TCP receiving thread, before a priority event of input channel ``ch``
        can be polled: the data buffers it overtook in the receive queue. For a
        barrier they belong to that checkpoint's input state of ``ch`` (the producer
        could not persist them: they had left it); the task takes them with the event."""
        from spillover.runtime.network.events import CheckpointBarrier

        if not isinstance(event, CheckpointBarrier) or not buffers:
            for b in buffers:
                b.release()
            return
        with self._overtaken_lock:
            self._overtaken.setdefault(ch, deque()).append((event.checkpoint_id, buffers))

    def _take_overtaken(self, ch: int, cid: int) -> list[Any]:
        """The buffers checkpoint ``cid``'s barrier overtook on ``ch`` (older ones are
        stale and released)."""
        if not self._overtaken:
            return []
        out: list[Any] = []
        with self._overtaken_lock:
            q = self._overtaken.get(ch)
            while q and q[0][0] <= cid:
                c, bufs = q.popleft()
                if c == cid:
                    out.extend(bufs)
                else:
                    for b in bufs:
                        b.release()
        return out

    def _release_overtaken(self) -> None:
        with self._overtaken_lock:
            for q in self._overtaken.values():
                for _, bufs in q:
                    for b in bufs:
                        b.release()
            self._overtaken.clear()

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
            # The final checkpoint's completion is posted before the sources end, but
            # the end of the input may be handled first: read the mailbox once more so
            # two-phase-commit sinks publish before the task finishes.
            self._mail()
            self._drain_blocking()
            for p in self.partitions:
                p.finish()
        except BaseException as e:  # reported to the executor, which fails over
            error = e if not self.cancelled.is_set() else TaskCancelled(self.name)
        finally:
            self._release_overtaken()
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
                    pacing=True,
                )
            )
        r = self.restore_state
        if r is not None:
            self.failures.check("restore", self.attempt, self.vertex.uid, self.subtask)
            if self.keyed is not None:
                handles = [h for uid in r.keyed_handles for h in r.keyed_handles[uid]]
                self.keyed.restore(handles)
            for node, op in zip(self.vertex.nodes, self.ops, strict=True):
                if node.uid in r.rescaled_state:
                    op.restore_rescaled(r.rescaled_state[node.uid])
                elif node.uid in r.operator_state:
                    op.restore(r.operator_state[node.uid])
            self._replay(r.channel_state)
        self._last_flush = time.monotonic()

    def _replay(self, plan: dict[str, Any]) -> None:
        """Recovered output state goes out before any new output, recovered input state
        is processed before any new input; input state streams from the files.

        ``plan["outputs"]``/``plan["inputs"]``: this subtask's own files of edges whose
        parallelism did not change. ``plan["rescaled"]``: per rescaled input edge, what
        the filtering retriever reads from the old subtasks (upstreams of a rescaled
        edge replay nothing: the new downstream reads both parts of each old channel).
        """
        from spillover.rescale import rescaled_retriever
        from spillover.storage import GateStateHandle, open_retriever

        # Own output state goes into the outboxes, ahead of any new output: the task
        # loop drains them as credit allows and takes barriers meanwhile; a checkpoint
        # persists what is still there, like any output (it is bounded by credit).
        for h in plan.get("outputs", []):
            handle = GateStateHandle.from_dict(h)
            box = self.outboxes[handle.gate_id]
            with open_retriever(handle) as r:
                for buf in r:
                    self.replayed_bytes += len(buf)
                    box.send(buf.channel_id, np.frombuffer(memoryview(buf), np.uint8).copy())
        # Own input state (and what it references) replays step by step from the task
        # loop, which takes unaligned barriers between steps (runtime/recovery/replay.py).

        gates: dict[int, Any] = {}
        for h in plan.get("inputs", []):
            handle = GateStateHandle.from_dict(h)
            gates[handle.gate_id] = (handle, {})
        # Unfiltered references join their gate; filtered ones are old channels'
        # streams, replayed below.
        for gate in sorted({int(r["gate"]) for r in plan.get("references", [])}):
            refs = references_of(plan, gate)
            if refs:
                gates[gate] = (gates.get(gate, (None, {}))[0], refs)
        if gates:
            self._recovery = InputRecovery(
                gates, lambda gate, ch, buf: self._process(self._offset[gate] + ch, buf)
            )
        # Old channels' streams (rescaled edges, and streams a checkpoint referenced with
        # a filter) replay first, step by step too (runtime/recovery/replay.py).
        parts: list[tuple[int, Any, dict[str, Any]]] = []

        def filtered(gate: int, refs: list[Any], new: dict[str, Any] | None) -> None:
            groups: dict[str, tuple[dict[str, Any], list[Any]]] = {}
            for pieces, flt in refs:
                both = compose_filters(flt, new)
                if both is not None:
                    groups.setdefault(json.dumps(both, sort_keys=True), (both, []))[1].append(
                        (pieces, 0)
                    )
            for both, streams in groups.values():
                r = filtered_retriever(
                    streams,
                    both,
                    partitioner=self.input_edges[gate].partitioner,
                    buffer_size=recovery.JOIN_BYTES,
                )
                parts.append((gate, r, both))

        for gate in sorted({int(r["gate"]) for r in plan.get("references", [])}):
            filtered(gate, filtered_references_of(plan, gate), None)
        for item in plan.get("rescaled", []):
            k = item["edge"]
            edge = self.input_edges[k]
            from spillover.records import FieldKey

            # key_by edges filter by the key group of the edge's int64 key field.
            retriever = rescaled_retriever(
                item["mapping"],
                "input",
                self.subtask,
                input_handles=item["input_handles"],
                output_handles=item["output_handles"],
                key=FieldKey(item["key_offset"] or 0, "int64"),
                # Replayed records are processed here, not sent: large buffers mean
                # fewer, larger batches (the per-batch cost dominates small ones),
                # and a buffer is what a step hands on at least.
                buffer_size=recovery.JOIN_BYTES,
                coalesce=True,
                input_references=item.get("input_references"),
                # custom edges route recovered records with the job's partitioner
                partitioner=edge.partitioner,
            )
            # What the old subtasks referenced with a filter comes first, kept by
            # both their filter and this subtask's.
            filtered(k, item.get("filtered_references", []), retriever.filter)
            parts.append((k, retriever, retriever.filter))
        if parts:
            # Each part's streams end on record boundaries, and parts replay one after
            # the other before any new input: the channels' own readers serve.
            self._streams = StreamRecovery(
                parts, lambda gate, b: self._process(self._offset[gate] + b.channel_id, b)
            )

    def _replay_step(self) -> None:
        """One block of recovered input state; unaligned barriers may come first."""
        self._take_priority(0.0)
        rec = self._streams if self._streams is not None else self._recovery
        if rec is None:
            return
        t = time.monotonic()
        before = rec.replayed_bytes
        more = rec.step()
        self.replayed_bytes += rec.replayed_bytes - before
        self.busy_seconds += time.monotonic() - t
        if not more:
            rec.close()
            if rec is self._streams:
                self._streams = None
            else:
                self._recovery = None
        self._maybe_flush()

    def _mail(self, block: bool = False, timeout: float | None = None) -> float:
        """Runs queued mailbox actions; returns the seconds spent waiting for one."""
        waited = 0.0
        while True:
            try:
                if block:
                    t = time.monotonic()
                    action = self.mailbox.get(True, timeout)
                    waited = time.monotonic() - t
                else:
                    action = self.mailbox.get_nowait()
            except queue.Empty:
                return waited + (timeout or 0.0) if block else waited
            block = False
            kind = action[0]
            if kind == "cancel":
                raise TaskCancelled(self.name)
            if kind == "trigger":  # sources only
                self._trigger_source(*action[1:])
            elif kind == "unaligned":
                self._timeout_switch(action[1])
            elif kind == "complete":
                self.failures.check(
                    "commit", self.attempt, self.vertex.uid, self.subtask, checkpoint=action[1]
                )
                for op in self.ops:
                    op.notify_checkpoint_complete(action[1])
            elif kind == "abort":
                if self.inflight is not None and self.inflight.checkpoint_id == action[1]:
                    self._abort_unaligned()
                for op in self.ops:
                    op.notify_checkpoint_aborted(action[1])
            elif kind == "terminate":
                self._terminate = True

    def _drain(self) -> bool:
        """Moves output on as credit allows; True when every outbox is empty."""
        done = True
        for box in self.outboxes:
            done = box.drain() and done
        return done

    def _drain_responsive(self) -> None:
        """Hands on all output before an in-line event, taking priority barriers and
        mailbox actions while it waits for credit (a downstream checkpoint may need
        this task's barrier before it gives credit back)."""

        while not self._drain():
            if self.inflight is not None:
                self.inflight.writer.reap()
            if self.gate is not None:
                self.output_wait_seconds += self._take_priority(0.0005)
                self._mail()
            else:
                self.output_wait_seconds += self._mail(block=True, timeout=0.0005)

    def _take_priority(self, timeout: float) -> float:
        """Waits up to ``timeout`` for a priority event (an unaligned barrier) and
        handles it; returns the seconds spent waiting."""
        from spillover.runtime.network import events as ev

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

    def _drain_blocking(self) -> None:
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
        while not self._terminate:
            self._mail()
            if self.cancelled.is_set():
                raise TaskCancelled(self.name)
            if not exhausted:
                if not self._drain():
                    # Backpressured: wait a little, staying responsive to the mailbox;
                    # only the waiting counts (actions run meanwhile have their own).
                    self.output_wait_seconds += self._mail(block=True, timeout=0.0005)
                    continue
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
        from spillover.runtime.network.events import EndOfData

        for w in self.writers:
            w.flush()
        self._drain_responsive()
        if not self.checkpointing:
            snaps = [op.snapshot(FINAL_WITHOUT_CHECKPOINTS) for op in self.ops]
            for snap in snaps:
                if snap.finalize is not None:
                    snap.finalize("")
            for op in self.ops:
                op.notify_checkpoint_complete(FINAL_WITHOUT_CHECKPOINTS)
        for p in self.partitions:
            p.broadcast_event(EndOfData())
        # The final checkpoint waits until every task processed all its input.
        self.coordinator.end_of_data(self.vertex.uid, self.subtask)

    def _run_inputs(self) -> None:
        from spillover.runtime.network import events as ev

        gate = self.gate
        while not gate.finished:
            self._mail()
            if self.inflight is not None:
                self.inflight.writer.reap()
            if self._terminate:
                break
            if not self._drain():
                # Backpressured: process no new input, but take priority events.
                self.output_wait_seconds += self._take_priority(0.0005)
                continue
            pause = max(op.ready_at() for op in self.ops) - time.monotonic()
            if pause > 0:
                # An operator paces itself: wait, still taking unaligned barriers.
                self._take_priority(min(pause, self.flush_interval))
                self._maybe_flush()
                continue
            if self._streams is not None or self._recovery is not None:
                self._replay_step()
                continue
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
        assert self.barriers is not None
        self.barriers.record_bytes(len(buf))
        inf = self.inflight
        if inf is not None and ch in inf.pending:
            inf.writer.add_input(*self._gate_of[ch], buf)
            if inf.over_limit():
                inf.limited = True
                for c in inf.pending:
                    self.gate.block(c)
        self._process(ch, buf)

    def _process(self, ch: int, buf: Any) -> None:
        info = self.channels[ch]
        ser = self._serializers[ch]
        parts = [ser.deserialize_batch(rb) for rb in self._readers[ch].feed(buf)]
        if not parts:
            return
        # A record carried over from the previous buffer comes as its own batch: one
        # call per buffer keeps batches large (operators cost per call, not per record).
        batch = parts[0] if len(parts) == 1 else np.concatenate(parts)
        self.records_in += len(batch)
        self.ops[0].process(batch, info.input_index)
        self.failures.check(
            "operator", self.attempt, self.vertex.uid, self.subtask, records=self.records_in
        )

    def _on_event(self, ch: int, event: Any) -> None:
        from spillover.runtime.network import events as ev

        assert self.barriers is not None
        if isinstance(event, ev.CheckpointBarrier):
            cid = event.checkpoint_id
            inf = self.inflight
            overtaken = self._take_overtaken(ch, cid)
            try:
                if inf is not None and inf.checkpoint_id == cid:
                    if ch in inf.pending:
                        for b in overtaken:
                            inf.writer.add_input(*self._gate_of[ch], b)
                    self._channel_done(ch)
                elif event.kind == ev.BarrierKind.UNALIGNED or cid in self._switched:
                    self._go_unaligned(event, ch, overtaken)
                else:
                    self.barriers.on_barrier(ch, event)
            finally:
                for b in overtaken:
                    b.release()
        elif isinstance(event, ev.CancelCheckpointMarker):
            if self.inflight is not None and self.inflight.checkpoint_id == event.checkpoint_id:
                self._abort_unaligned()
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
            if self.inflight is not None:
                self._channel_done(ch)

    def _end_of_data_inputs(self) -> None:
        for i, op in enumerate(self.ops):
            if i > 0:
                op.end_input(0)
            op.finish()
        self._after_finish()

    def _forward_cancel(self, checkpoint_id: int) -> None:
        from spillover.runtime.network.events import CancelCheckpointMarker

        if checkpoint_id in self._cancelled_forwarded:
            return
        self._cancelled_forwarded.add(checkpoint_id)
        self._drain_blocking()
        for p in self.partitions:
            p.broadcast_event(CancelCheckpointMarker(checkpoint_id))

    def _on_aligned(self, barrier: Any, stats: AlignmentStats) -> None:
        self._snapshot(barrier.checkpoint_id, barrier.timestamp_ms, stats, barrier)

    def _on_aborted(self, checkpoint_id: int) -> None:
        self.coordinator.decline(checkpoint_id, self.vertex.uid, self.subtask, "alignment aborted")
        self._forward_cancel(checkpoint_id)

    def _trigger_source(
        self, cid: int, trigger_ms: int, kind: int = 0, timeout_ms: int = 0
    ) -> None:
        from spillover.runtime.network.events import BarrierKind, CheckpointBarrier

        barrier = CheckpointBarrier(cid, trigger_ms, BarrierKind(kind), timeout_ms)
        if barrier.kind == BarrierKind.UNALIGNED:
            self._start_unaligned(barrier, set(), None)
        else:
            self._snapshot(cid, trigger_ms, None, barrier)

    # -- unaligned checkpoints (see unaligned.py) ------------------------------------

    def _go_unaligned(
        self, barrier: Any, first_channel: int | None, overtaken: Sequence[Any] = ()
    ) -> None:
        """The first barrier of an unaligned checkpoint (or a switched one) is here;
        ``overtaken``: what it overtook in ``first_channel``'s receive queue."""
        from spillover.runtime.network import events as ev

        assert self.barriers is not None
        h = self.barriers
        cid = barrier.checkpoint_id
        if cid in self._done_checkpoints or cid < h.latest:
            return  # a straggler of a checkpoint this task is done with
        if self.inflight is not None:
            self._abort_unaligned()  # a newer checkpoint: the older cannot complete
        done: set[int] = set()
        stats = None
        if h.aligning:
            if h.current == cid:
                done |= h.seen  # those channels already delivered their barrier
                stats = h.stats
                h.current, h.seen = -1, set()
                self.gate.unblock_all()
            else:
                h.abort_current()
        h.latest = max(h.latest, cid)
        self._switched.discard(cid)
        if first_channel is not None:
            done.add(first_channel)
        pending = set(range(len(self.channels))) - done - h.ended
        first = (first_channel, overtaken) if first_channel is not None and overtaken else None
        inf = self._start_unaligned(barrier.as_unaligned(), pending, stats, first)
        # Barriers of this checkpoint still queued in line overtake the data ahead.
        for ch in sorted(inf.pending):
            ahead = self.gate.overtake(ch, _is_barrier(cid, ev))
            if ahead is not None:
                for b in ahead:
                    inf.writer.add_input(*self._gate_of[ch], b)
                    b.release()
                self._channel_done(ch)

    def request_unaligned(self, cid: int) -> None:
        """From the coordinator: checkpoint ``cid``'s alignment timed out. Seen at once
        by a task draining its output for that barrier, and queued for the rest."""
        self._switch_requested = cid
        self.post("unaligned", cid)

    def _drain_unless_switched(self, cid: int) -> bool:
        """Drains the outboxes; True when the switch to unaligned came first."""
        while not self._drain():
            if self._switch_requested == cid:
                return True
            if self.gate is not None:
                self.output_wait_seconds += self._take_priority(0.0002)
            else:
                time.sleep(0.0002)
                self.output_wait_seconds += 0.0002
        return False

    def _switched_output_state(self, barrier: Any) -> InFlightCheckpoint:
        """An in-flight checkpoint for a barrier that switched while this task drained:
        its inputs are aligned already, only its output state is left to persist."""
        from spillover.runtime.checkpointing.unaligned import ChannelStateWriter, InFlightCheckpoint

        cid = barrier.checkpoint_id
        uri = self.checkpoint_dir(cid, self.vertex.uid, self.subtask)
        base, sep, query = uri.partition("?")
        writer = ChannelStateWriter(
            f"{base}/channels{sep}{query}", cid, self.subtask, self.channel_compression
        )
        inf = InFlightCheckpoint(
            cid, writer, set(), barrier.timestamp_ms, time.monotonic(), self.max_inflight_bytes
        )
        self.inflight = inf
        return inf

    def _timeout_switch(self, cid: int) -> None:
        """The coordinator's word that checkpoint ``cid``'s alignment timed out."""
        from spillover.runtime.network import events as ev

        if self.vertex.is_source or cid in self._done_checkpoints:
            return
        if self.inflight is not None and self.inflight.checkpoint_id == cid:
            return
        h = self.barriers
        assert h is not None
        if h.aligning and h.current == cid:
            self._go_unaligned(h.barrier, None)
            return
        if cid < h.latest:
            return
        # No barrier of it seen yet: one may be queued behind data.
        for ch in range(len(self.channels)):
            found: list[Any] = []
            ahead = self.gate.overtake(ch, _is_barrier(cid, ev, found))
            if ahead is None:
                continue
            self._go_unaligned(found[0], None)
            inf = self.inflight
            if inf is None or inf.checkpoint_id != cid:
                for b in ahead:  # completed already (its only channel): nothing to add
                    b.release()
                return
            for b in ahead:
                inf.writer.add_input(*self._gate_of[ch], b)
                b.release()
            self._channel_done(ch)
            return
        self._switched.add(cid)

    def _start_unaligned(
        self,
        barrier: Any,
        pending: set[int],
        stats: AlignmentStats | None,
        first: tuple[int, Sequence[Any]] | None = None,
    ) -> InFlightCheckpoint:
        from spillover.runtime.checkpointing.unaligned import ChannelStateWriter, InFlightCheckpoint

        cid = barrier.checkpoint_id
        uri = self.checkpoint_dir(cid, self.vertex.uid, self.subtask)
        base, sep, query = uri.partition("?")
        writer = ChannelStateWriter(
            f"{base}/channels{sep}{query}", cid, self.subtask, self.channel_compression
        )
        # Recovered input state not replayed yet is referenced, not written again:
        # everything joined is processed first, then each channel's rest is cut at
        # the start of the record its reader has begun.
        references: list[dict[str, Any]] = []
        recovering: set[int] = set()
        if self._streams is not None:  # kept records are processed, the rest referenced
            references += self._streams.references()
        rec = self._recovery
        if rec is not None:
            rec.flush()
            references += rec.references(
                lambda g, c: self._readers[self._offset[g] + c].pending_bytes
            )
            recovering = {self._offset[g] + c for g, c in rec.channels}
        # A record begun in a buffer before the cut: its head is state too.
        for ch, reader in enumerate(self._readers):
            raw = reader.pending_raw() if ch not in recovering else b""
            if raw:
                writer.add_input(*self._gate_of[ch], raw)
        if first is not None:  # what the barrier overtook on its channel comes next
            for b in first[1]:
                writer.add_input(*self._gate_of[first[0]], b)
        inf = InFlightCheckpoint(
            cid,
            writer,
            set(pending),
            barrier.timestamp_ms,
            time.monotonic(),
            self.max_inflight_bytes,
        )
        inf.references = references
        inf.recovering = rec is not None or self._streams is not None
        self.inflight = inf
        self._snapshot(cid, barrier.timestamp_ms, stats, barrier, inf)
        if inf.done:
            self._complete_unaligned()
        return inf

    def _channel_done(self, ch: int) -> None:
        inf = self.inflight
        if inf is None or ch not in inf.pending:
            return
        inf.pending.discard(ch)
        if inf.limited:
            self.gate.unblock(ch)
        if inf.done:
            self._complete_unaligned()

    def _complete_unaligned(self) -> None:
        inf = self.inflight
        assert inf is not None
        self.inflight = None
        self._done_checkpoints.add(inf.checkpoint_id)
        self.snapshots.submit(self._ack_unaligned, inf)

    def _abort_unaligned(self) -> None:
        inf = self.inflight
        if inf is None:
            return
        self.inflight = None
        self._done_checkpoints.add(inf.checkpoint_id)
        if inf.limited:
            self.gate.unblock_all()
        self.snapshots.submit(inf.writer.discard)
        self.coordinator.decline(
            inf.checkpoint_id, self.vertex.uid, self.subtask, "unaligned checkpoint aborted"
        )

    def _ack_unaligned(self, inf: Any) -> None:
        """On the snapshot thread: acknowledges, or declines whatever went wrong (an
        exception here would otherwise vanish in the pool and hang the checkpoint)."""
        try:
            self._ack_unaligned_parts(inf)
        except BaseException as e:
            with contextlib.suppress(Exception):
                inf.writer.discard()  # no half-written channel files left behind
            self.coordinator.decline(
                inf.checkpoint_id,
                self.vertex.uid,
                self.subtask,
                f"completing the unaligned checkpoint failed: {type(e).__name__}: {e}",
            )

    def _ack_unaligned_parts(self, inf: Any) -> None:
        parts = inf.metrics.get("parts")
        if parts is None:  # the operator part failed and declined already
            inf.writer.discard()
            return
        try:
            channel_state = inf.writer.close()
        except BaseException as e:
            self.coordinator.decline(
                inf.checkpoint_id,
                self.vertex.uid,
                self.subtask,
                f"persisting in-flight data failed: {e!r}",
            )
            return
        ack = parts
        # Taken while recovered input state was still being replayed (a metric, so
        # tests and operators can tell such checkpoints apart).
        ack.metrics["recovering"] = 1.0 if inf.recovering else 0.0
        if inf.references:
            channel_state["references"] = inf.references
            pieces = [Piece.from_dict(p) for r in inf.references for p in r["pieces"]]
            ack.metrics["referenced_bytes"] = float(sum(max(0, p.nbytes - p.skip) for p in pieces))
        ack.channel_state = channel_state
        ack.metrics["inflight_bytes"] = float(channel_state["bytes"])
        ack.metrics["persist_ms"] = (time.monotonic() - inf.started) * 1000
        self.coordinator.acknowledge(ack)

    def _snapshot(
        self,
        cid: int,
        trigger_ms: int,
        stats: AlignmentStats | None,
        barrier: Any = None,
        inflight: Any = None,
    ) -> None:
        from spillover.runtime.network.events import BarrierKind, CheckpointBarrier

        t0 = time.monotonic()
        if stats is not None:
            first_wall = time.time() - (t0 - stats.first_barrier_at)
            start_delay_ms = max(0.0, first_wall * 1000 - trigger_ms)
        else:
            start_delay_ms = max(0.0, time.time() * 1000 - trigger_ms)
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
        # Aligned with a timeout: wait for the output to drain, unless the alignment
        # times out meanwhile; then the barrier overtakes what is still queued.
        switched = False
        if (
            inflight is None
            and barrier.kind == BarrierKind.ALIGNED_WITH_TIMEOUT
            and self._drain_unless_switched(cid)
        ):
            inflight = self._switched_output_state(barrier)
            barrier = barrier.as_unaligned()
            switched = True
        if inflight is None:
            self._drain_blocking()  # an aligned barrier follows every record before it
            for p in self.partitions:
                p.broadcast_event(barrier)
        else:
            # The barrier goes to the head of every output queue; what it overtook
            # (queued in the channel, then still in the outbox) is output state.
            for index, p in enumerate(self.partitions):
                box = self.outboxes[index]
                for sub, overtaken in enumerate(p.broadcast_event(barrier, priority=True)):
                    for b in overtaken:
                        inflight.writer.add_output(index, sub, b, submit=False)
                        b.release()
                    for array in box.queues[sub]:
                        inflight.writer.add_output(index, sub, array, submit=False)
            inflight.writer.submit()  # one batch, not one hand-off per buffer
        if inflight is None:
            self._done_checkpoints.add(cid)
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
            ack = Ack(
                cid,
                vertex_uid,
                subtask,
                {uid: s.operator_state for uid, s in snaps.items()},
                handles,
                keyed,
                metrics,
            )
            if inflight is None:
                coordinator.acknowledge(ack)
            else:
                inflight.metrics["parts"] = ack  # acked with the channel state once complete

        self.snapshots.submit(finish_async)
        if switched:
            self._complete_unaligned()  # its inputs were aligned: nothing more to wait for

    def metrics(self) -> dict[str, float]:
        wall = (self.finished_at or time.monotonic()) - self.started_at
        # Blocked on credit (the consumer is slow) or on the partition's buffer budget
        # (its buffers are all in flight): both are backpressure.
        bp = self.output_wait_seconds + sum(
            p.backpressured_seconds + p.pool.waited_seconds for p in self.partitions
        )
        return {
            "records_in": float(self.records_in),
            "records_out": float(self.net_out.records),
            "busy_seconds": self.busy_seconds,
            "backpressured_seconds": bp,
            "backpressured_share": bp / wall if wall > 0 else 0.0,
            "replayed_bytes": float(self.replayed_bytes),
            "wall_seconds": wall,
        }


def _is_barrier(cid: int, ev: Any, found: list[Any] | None = None) -> Callable[[Any], bool]:
    """A matcher for ``InputGate.overtake``: checkpoint ``cid``'s barrier."""

    def match(buf: Any) -> bool:
        event = ev.deserialize(buf)
        if isinstance(event, ev.CheckpointBarrier) and event.checkpoint_id == cid:
            if found is not None:
                found.append(event)
            return True
        return False

    return match
