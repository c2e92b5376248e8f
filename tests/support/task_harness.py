"""One map task over two input channels the test feeds, with a drained output: the
real ``Task`` (its barrier handling, checkpoints and lifecycle) driven buffer by
buffer and barrier by barrier, and what it told a recording coordinator."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import spillover
from spillover.records import RecordWriter
from spillover.runtime.checkpointing.messages import NotifyComplete, TriggerCheckpoint
from spillover.runtime.connectors.collecting import CollectingSink
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.failures import FailureInjector
from spillover.runtime.graph import StreamEnvironment
from spillover.runtime.network.buffers import BufferPool
from spillover.runtime.network.errors import ChannelCancelledError
from spillover.runtime.network.events import (
    BarrierKind,
    CancelCheckpointMarker,
    CheckpointBarrier,
    EndOfData,
    deserialize,
)
from spillover.runtime.network.gate import InputGate
from spillover.runtime.network.local import connect
from spillover.runtime.network.partition import ResultPartition
from spillover.runtime.network.writers import Outbox, PartitionWriter
from spillover.runtime.recovery.restore import TaskRestore
from spillover.runtime.task import InputChannelInfo, Task
from spillover.storage.handle import DataType

DTYPE = GeneratorSource.dtype(16)


class FakeCoordinator:
    """Records what a task tells the coordinator."""

    def __init__(self, root: Path) -> None:
        self.storage = object()  # checkpointing is on
        self.acks: list[Any] = []
        self.declines: list[int] = []
        self.root = root
        self.lock = threading.Lock()
        self.ended = threading.Event()
        self.exited = threading.Event()

    def acknowledge(self, ack: Any) -> None:
        with self.lock:
            self.acks.append(ack)

    def decline(self, cid: int, uid: str, subtask: int, reason: str) -> None:
        with self.lock:
            self.declines.append(cid)

    def end_of_data(self, uid: str, subtask: int) -> None:
        self.ended.set()

    def task_exited(self, uid: str, subtask: int) -> None:
        self.exited.set()

    def ack_for(self, cid: int, timeout: float = 10.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                for a in self.acks:
                    if a.checkpoint_id == cid:
                        return a
            time.sleep(0.005)
        raise AssertionError(f"no acknowledgement of checkpoint {cid}")


class Harness:
    """A map task with two input channels fed by the test, and a drained output."""

    def __init__(
        self,
        tmp: Path,
        max_inflight_bytes: int | None = None,
        restore: TaskRestore | None = None,
        chained_sink: bool = True,
    ) -> None:
        env = StreamEnvironment("h", parallelism=1)
        a = env.from_source(GeneratorSource(partitions=1, payload_bytes=16), uid="a")
        b = env.from_source(GeneratorSource(partitions=1, payload_bytes=16), uid="b")
        mapped = a.union(b).map(lambda x: x, uid="map")
        # Chained, the sink takes the records; else they go downstream, to the drain.
        (mapped if chained_sink else mapped.rebalance()).sink(CollectingSink("h"), uid="sink")
        graph = env.build()
        vertex = next(v for v in graph.vertices if v.uid == "map")
        edges = graph.inputs_of(vertex.id)
        self.gate = InputGate(2, floating_buffers=64, name="map", buffers_per_channel=32)
        self.inputs = []
        for ch in range(2):
            pool = BufferPool(1024, 256, f"up{ch}")
            part = ResultPartition(1, pool, name=f"up{ch}")
            connect(part, 0, self.gate, ch)
            self.inputs.append((part, pool))
        out_pool = BufferPool(1024, 64, "out")
        self.out = ResultPartition(1, out_pool, name="out")
        self.out_gate = InputGate(1, name="down")
        connect(self.out, 0, self.out_gate, 0)
        box = Outbox(self.out, out_pool)
        writer = PartitionWriter(
            edges[0].kind.__class__.FORWARD,
            DTYPE,
            1,
            0,
            1024,
            graph.max_parallelism,
            None,
            send=box.send,
            send_all=box.send_all,
        )
        self.coordinator = FakeCoordinator(tmp)
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.task = Task(
            graph=graph,
            vertex=vertex,
            subtask=0,
            attempt=0,
            gate=self.gate,
            channels=[InputChannelInfo(0, e, 0, DTYPE) for e in edges],
            partitions=[self.out],
            outboxes=[box],
            writers=[writer],
            restore=restore,
            coordinator=self.coordinator,
            checkpoint_dir=lambda cid, uid, i: str(tmp / f"chk-{cid}" / f"{uid}-{i}"),
            keyed_backend_factory=None,
            failures=FailureInjector(),
            on_done=self._on_done,
            max_inflight_bytes=max_inflight_bytes,
        )
        self.seq = [0, 0]
        self.ended: set[int] = set()  # channels ended with end()
        self.sent: list[list[bytes]] = [[], []]
        self.events: list[Any] = []
        self.arrived: list[str] = []  # downstream, in order: "data" or an event's name
        self.stream: list[Any] = []  # downstream, in order: data buffers' bytes and events
        self._stalled_until = 0.0
        self.drainer = threading.Thread(target=self._drain, daemon=True)

    def _on_done(self, task: Any, err: BaseException | None) -> None:
        self.error = err
        self.done.set()

    def stall(self, seconds: float) -> None:
        """Downstream stops taking buffers for ``seconds``: they queue up in its
        channel, where an unaligned barrier overtakes them."""
        self._stalled_until = time.monotonic() + seconds

    def _drain(self) -> None:
        while True:
            pause = self._stalled_until - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            try:
                item = self.out_gate.poll(0.05)
            except ChannelCancelledError:  # the harness closed down
                return
            if item is None:
                if self.out_gate.finished:
                    return
                continue
            _, buf = item
            if buf.data_type == DataType.EVENT:
                self.events.append(deserialize(buf))
                self.arrived.append(type(self.events[-1]).__name__)
                self.stream.append(self.events[-1])
            else:
                self.arrived.append("data")
                self.stream.append(bytes(buf))
            buf.release()

    def start(self) -> None:
        self.drainer.start()
        self.task.start()

    def close_downstream(self) -> None:
        """Cancels the drained gate and waits for the drainer: a task that ends at a
        stop sends no EndOfPartition, so nothing else ends the drainer, and its gate
        would hold the task's buffers (and their native pool) past the test."""
        self.out_gate.cancel()
        self.drainer.join(5)
        assert not self.drainer.is_alive(), "the downstream drainer did not end"

    def data(self, ch: int, n: int = 10) -> bytes:
        """Sends one buffer of ``n`` whole records on channel ``ch``; returns its bytes."""
        rows = np.zeros(n, DTYPE)
        rows["partition"] = ch
        rows["seq"] = np.arange(self.seq[ch], self.seq[ch] + n)
        self.seq[ch] += n
        w = RecordWriter(1024)
        offs = np.arange(n + 1, dtype=np.int64) * DTYPE.itemsize
        bufs = w.write_batch(rows.view(np.uint8), offs)
        last = w.flush()
        assert not bufs and last is not None  # one buffer
        part, pool = self.inputs[ch]
        part.emit(0, pool.wrap(last, DataType.DATA))
        self.sent[ch].append(bytes(last))
        return bytes(last)

    def split_record(self, ch: int) -> tuple[bytes, bytes]:
        """One record cut in two buffers: sends the head now (the task reads it and
        waits for the rest); returns both parts, the tail for :meth:`send`."""
        rows = np.zeros(1, DTYPE)
        rows["partition"] = ch
        rows["seq"] = self.seq[ch]
        self.seq[ch] += 1
        w = RecordWriter(DTYPE.itemsize // 2)
        head, *rest = w.write_batch(rows.view(np.uint8), np.array([0, DTYPE.itemsize]))
        last = w.flush()
        tail = b"".join(bytes(b) for b in [*rest, *([last] if last is not None else [])])
        self.send(ch, bytes(head))
        return bytes(head), tail

    def send(self, ch: int, data: bytes) -> None:
        part, pool = self.inputs[ch]
        part.emit(0, pool.wrap(np.frombuffer(data, np.uint8).copy(), DataType.DATA))
        self.sent[ch].append(data)

    def barrier(self, ch: int, cid: int, kind: BarrierKind = BarrierKind.UNALIGNED) -> list[bytes]:
        """Sends a barrier on channel ``ch``; returns the data buffers an unaligned one
        overtook there, which the upstream persists (its output state)."""
        part, _ = self.inputs[ch]
        overtaken = part.broadcast_event(
            CheckpointBarrier(cid, int(time.time() * 1000), kind),
            priority=kind == BarrierKind.UNALIGNED,
        )
        out = []
        for buf in (b for sub in overtaken for b in sub):
            out.append(bytes(buf))
            buf.release()
        return out

    def end(self, ch: int) -> None:
        """Ends channel ``ch`` as an upstream that finished does (EndOfData, then
        EndOfPartition), with no barrier first."""
        part = self.inputs[ch][0]
        part.broadcast_event(EndOfData())
        part.finish()
        self.ended.add(ch)

    def cancel(self, ch: int, cid: int) -> None:
        self.inputs[ch][0].broadcast_event(CancelCheckpointMarker(cid))

    def settle(self) -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if all(ch.queued_buffers == 0 for ch in self.gate.channels):
                time.sleep(0.05)
                return
            time.sleep(0.005)

    def stop(self) -> None:
        """Ends the inputs as an upstream does (EndOfData, then EndOfPartition). When
        every channel ended its data, completes the checkpoint that lets the task end
        (FLIP-147; its inputs all ended, so it is the checkpoint's root); a channel
        the test cut without EndOfData ends the task without finishing it."""
        data_ends = all(
            not part.finished or ch in self.ended for ch, (part, _) in enumerate(self.inputs)
        )
        for part, _ in self.inputs:
            if not part.finished:
                part.broadcast_event(EndOfData())
                part.finish()
        if not data_ends:
            assert self.done.wait(10)
            self.task.thread.join(5)
            assert self.error is None, repr(self.error)
            return
        assert self.coordinator.ended.wait(10)
        final = 1_000
        self.task.post(TriggerCheckpoint(final, int(time.time() * 1000)))
        assert self.coordinator.ack_for(final).finished
        assert not self.done.is_set(), "the task ended before its final checkpoint completed"
        self.task.post(NotifyComplete(final))
        assert self.done.wait(10)
        assert self.coordinator.exited.is_set()
        self.task.thread.join(5)
        assert self.error is None, repr(self.error)


def persisted_input(ack: Any, task: Any) -> dict[int, list[bytes]]:
    """The persisted input buffers per task channel (gate = input edge, channel =
    upstream subtask in the files)."""
    out: dict[int, list[bytes]] = {}
    for h in ack.channel_state.get("input", []):
        handle = spillover.GateStateHandle.from_dict(h)
        for buf in spillover.open_retriever(handle):
            ch = task.cp.offsets[handle.gate_id] + buf.channel_id
            out.setdefault(ch, []).append(bytes(buf))
    return out


def output_state(ack: Any) -> list[Any]:
    return [
        buf
        for h in ack.channel_state.get("output", [])
        for buf in spillover.open_retriever(spillover.GateStateHandle.from_dict(h))
    ]


def eventually(cond: Any, timeout: float = 10.0) -> bool:
    """Whether ``cond()`` holds within ``timeout`` seconds (a bound on a hang, not a
    speed: what is waited for has happened already or is on its way)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)
    return True


def wait_for(cond: Any, what: str, timeout: float = 10.0) -> None:
    assert eventually(cond, timeout), what
