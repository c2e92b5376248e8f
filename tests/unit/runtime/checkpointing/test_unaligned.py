"""Unaligned, aligned-with-timeout and max-in-flight checkpoints.

Whole jobs with induced failures must stay exactly-once while in-flight data is
really persisted and replayed; a task driven barrier by barrier must complete or
abort odd barrier orders cleanly and persist exactly the right buffers.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import spillover
from spillover.records import RecordWriter
from spillover.runtime.checkpointing.inflight import InflightAcks, InFlightCheckpoint
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
    to_buffer,
)
from spillover.runtime.network.gate import InputGate
from spillover.runtime.network.local import connect
from spillover.runtime.network.partition import ResultPartition
from spillover.runtime.network.writers import Outbox, PartitionWriter
from spillover.runtime.recovery.restore import TaskRestore
from spillover.runtime.task import InputChannelInfo, Task
from spillover.storage.handle import DataType
from spillover.verify import VerifySpec, verify

CASES = [
    ("pipeline", "unaligned", 0),
    ("pipeline", "timeout", 0),
    ("pipeline", "timeout", 1),
    ("pipeline", "timeout", 5),
    ("pipeline", "max-inflight", 0),
    ("multi-input", "unaligned", 0),
    ("multi-input", "timeout", 1),
    ("union", "unaligned", 0),
    ("union", "max-inflight", 0),
]


@pytest.mark.parametrize(("topology", "policy", "timeout_ms"), CASES)
def test_exactly_once_with_inflight_data(
    topology: str, policy: str, timeout_ms: int, tmp_path: Path
) -> None:
    spec = VerifySpec(
        topology=topology,
        policy=policy,
        aligned_timeout_ms=timeout_ms,
        records=50_000,
        failures=5,
        seed=3,
        rate_per_subtask=50_000,
        interval_ms=60,
        max_inflight_bytes=128 * 1024,
    )
    report = verify(spec, str(tmp_path))
    assert report.exact, report.text()
    assert len(report.failures_fired) == 5, report.text()
    assert report.inflight_persisted > 0, "no in-flight data was persisted"
    # Restores replay exactly when the checkpoint they restored held in-flight data;
    # with a timeout, whether a restored checkpoint had switched to unaligned is up to
    # the machine's timing, so only the pure unaligned policies must have held some.
    assert (report.inflight_replayed > 0) == (report.inflight_restored > 0), report.text()
    if policy != "timeout" or timeout_ms == 0:
        assert report.inflight_replayed > 0, "no in-flight data was replayed"


# --- one task, driven barrier by barrier --------------------------------------------------------

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
    ) -> None:
        env = StreamEnvironment("h", parallelism=1)
        a = env.from_source(GeneratorSource(partitions=1, payload_bytes=16), uid="a")
        b = env.from_source(GeneratorSource(partitions=1, payload_bytes=16), uid="b")
        a.union(b).map(lambda x: x, uid="map").sink(CollectingSink("h"), uid="sink")
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
        self.drainer = threading.Thread(target=self._drain, daemon=True)

    def _on_done(self, task: Any, err: BaseException | None) -> None:
        self.error = err
        self.done.set()

    def _drain(self) -> None:
        while True:
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
            else:
                self.arrived.append("data")
            buf.release()

    def start(self) -> None:
        self.drainer.start()
        self.task.start()

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

    def barrier(self, ch: int, cid: int, kind: BarrierKind = BarrierKind.UNALIGNED) -> None:
        part, _ = self.inputs[ch]
        part.broadcast_event(
            CheckpointBarrier(cid, int(time.time() * 1000), kind),
            priority=kind == BarrierKind.UNALIGNED,
        )

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


@pytest.fixture
def harness(tmp_path: Path) -> Any:
    h = Harness(tmp_path)
    h.start()
    yield h
    h.stop()


def test_unaligned_persists_exactly_the_buffers_before_each_channels_barrier(harness: Any) -> None:
    h = harness
    h.data(0)
    h.data(1)
    h.settle()
    h.barrier(0, 1)  # first barrier: snapshot now; channel 1 is still open
    h.settle()
    b1 = h.data(1)
    b2 = h.data(1)
    h.settle()
    h.data(0)  # after channel 0's barrier: not state
    h.barrier(1, 1)
    h.settle()
    h.data(1)  # after channel 1's barrier: not state
    ack = h.coordinator.ack_for(1)
    assert persisted_input(ack, h.task) == {1: [b1, b2]}
    assert ack.metrics["inflight_bytes"] == len(b1) + len(b2)
    assert h.coordinator.declines == []
    assert any(isinstance(e, CheckpointBarrier) and e.checkpoint_id == 1 for e in h.events)


def test_an_unaligned_barrier_leaves_before_the_task_persists_or_snapshots_anything(
    harness: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Downstream starts on an unaligned barrier while this task is still busy with
    it: the barrier is downstream before the task persists the first input state (the
    head of a record it had begun) or snapshots its operators."""
    h = harness
    head, tail = h.split_record(1)
    h.settle()
    out: dict[str, bool] = {}

    def barrier_downstream() -> bool:
        return _eventually(lambda: any(isinstance(e, CheckpointBarrier) for e in h.events))

    real_add = InFlightCheckpoint.add_input

    def add_input(self: InFlightCheckpoint, channel: int, buffer: Any) -> None:
        out.setdefault("input state", barrier_downstream())
        real_add(self, channel, buffer)

    op = h.task.chain.ops[0]
    real_snapshot = op.snapshot

    def snapshot(cid: int) -> Any:
        out.setdefault("operators", barrier_downstream())
        return real_snapshot(cid)

    monkeypatch.setattr(InFlightCheckpoint, "add_input", add_input)
    monkeypatch.setattr(op, "snapshot", snapshot)
    h.barrier(0, 1)
    h.settle()
    h.send(1, tail)
    h.settle()
    h.barrier(1, 1)
    ack = h.coordinator.ack_for(1)
    assert out == {"input state": True, "operators": True}
    assert persisted_input(ack, h.task) == {1: [head, tail]}


def test_output_a_checkpoint_makes_from_recovered_state_goes_out_before_its_barrier(
    harness: Any,
) -> None:
    """Taken while recovered input state is replaying, a checkpoint first processes
    what was joined (its references then leave it out): the output of those records
    is ahead of the barrier (overtaken, so output state of this checkpoint), never
    behind it and so in no state."""
    h = harness
    rows = np.zeros(3, DTYPE)
    rows["seq"] = [7, 8, 9]

    class Replay:
        """Recovered input state whose joined records are processed at the cut."""

        active = False

        def references(self, readers: Any) -> list[dict[str, Any]]:
            h.task.output.writers[0].emit(rows)  # what processing them emits
            return []

        def recovering_channels(self) -> set[int]:
            return set()

    h.task.replay = Replay()
    h.barrier(0, 1)
    h.barrier(1, 1)
    ack = h.coordinator.ack_for(1)
    h.task.replay = None
    _wait_for(lambda: "CheckpointBarrier" in h.arrived, "no barrier downstream")
    ahead = h.arrived[: h.arrived.index("CheckpointBarrier")]
    assert "data" in ahead or sum(len(bytes(b)) for b in _output_state(ack)) > 0


def _output_state(ack: Any) -> list[Any]:
    return [
        buf
        for h in ack.channel_state.get("output", [])
        for buf in spillover.open_retriever(spillover.GateStateHandle.from_dict(h))
    ]


def _eventually(cond: Any, timeout: float = 10.0) -> bool:
    """Whether ``cond()`` holds within ``timeout`` seconds (a bound on a hang, not a
    speed: what is waited for has happened already or is on its way)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)
    return True


def _wait_for(cond: Any, what: str, timeout: float = 10.0) -> None:
    assert _eventually(cond, timeout), what


def test_channel_state_is_finished_while_the_operator_part_still_runs(
    harness: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unaligned checkpoint's two halves run side by side: its channel-state files
    are finished while the operator part (state files) is still being written, and
    the acknowledgement waits for both and carries both, in checkpoint order."""
    h = harness
    release = threading.Event()
    real = InflightAcks.operator_part_done
    slowed: list[Any] = []

    def slow(self: InflightAcks, inf: Any, ack: Any, error: str | None = None) -> None:
        if inf.checkpoint_id == 1:
            slowed.append(inf)
            assert release.wait(10)
        real(self, inf, ack, error)

    monkeypatch.setattr(InflightAcks, "operator_part_done", slow)
    h.barrier(0, 1)
    h.settle()
    b = h.data(1)
    h.settle()
    h.barrier(1, 1)
    _wait_for(lambda: slowed, "the operator part never ran")
    inf = slowed[0]
    _wait_for(lambda: inf.channel_state is not None, "the channel state waited for it")
    assert inf.writer.closed
    assert h.coordinator.acks == []  # not without the operator part
    h.barrier(0, 2)  # the next checkpoint queues behind it on both threads
    h.barrier(1, 2)
    release.set()
    first, second = h.coordinator.ack_for(1), h.coordinator.ack_for(2)
    assert persisted_input(first, h.task) == {1: [b]}
    assert "map" in first.operator_state and first.metrics["close_ms"] >= 0
    assert [a.checkpoint_id for a in h.coordinator.acks] == [1, 2]
    assert second.channel_state is not None
    assert h.coordinator.declines == []


@pytest.mark.parametrize("failing", ["operator", "channels", "both"])
def test_a_failed_half_declines_the_unaligned_checkpoint_once(
    failing: str, harness: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Either half failing declines the checkpoint exactly once (a failed operator
    part at once, before the inputs' barriers), acknowledges nothing of it, and the
    next checkpoint completes."""
    from spillover.runtime.checkpointing.channel_state import ChannelStateWriter

    h = harness
    real_part = InflightAcks.operator_part_done
    real_close = ChannelStateWriter.close

    def part(self: InflightAcks, inf: Any, ack: Any, error: str | None = None) -> None:
        if inf.checkpoint_id == 1 and failing in ("operator", "both"):
            if failing == "both":  # fails after the close failed: both halves fail
                _wait_for(lambda: inf.channel_error is not None, "the close never failed")
            ack, error = None, "snapshot failed: OSError('disk gone')"
        real_part(self, inf, ack, error)

    def close(self: ChannelStateWriter, quick: bool = False) -> dict[str, Any] | None:
        if self._args[0] == 1 and failing in ("channels", "both"):
            raise OSError("disk gone")
        return real_close(self, quick)

    monkeypatch.setattr(InflightAcks, "operator_part_done", part)
    monkeypatch.setattr(ChannelStateWriter, "close", close)
    h.barrier(0, 1)
    h.settle()
    h.data(1)
    h.settle()
    if failing == "operator":
        _wait_for(lambda: h.coordinator.declines == [1], "not declined before the barriers")
    h.barrier(1, 1)
    h.barrier(0, 2)
    h.barrier(1, 2)
    assert h.coordinator.ack_for(2).channel_state is not None
    assert h.coordinator.declines == [1]
    assert [a.checkpoint_id for a in h.coordinator.acks] == [2]


def test_a_subtask_restored_finished_is_recorded_finished_before_its_end_of_data(
    tmp_path: Path,
) -> None:
    """Restored finished, its upstreams' EndOfData still to come: an unaligned
    checkpoint taken now records it finished, or a restore of that checkpoint would
    run its ``finish()`` a second time."""
    h = Harness(tmp_path, restore=TaskRestore(checkpoint_id=7, finished=True))
    h.start()
    h.barrier(0, 8)
    h.barrier(1, 8)
    ack = h.coordinator.ack_for(8)
    assert ack.finished, "a subtask restored finished was recorded running"
    assert not h.coordinator.ended.is_set(), "the barrier came before any EndOfData"
    h.stop()


def test_barrier_of_the_next_checkpoint_aborts_the_one_in_progress(harness: Any) -> None:
    """Barriers of n+1 on one channel before n on the other: n aborts, n+1 completes with
    only the buffers between n+1's start and the other channel's barrier n+1."""
    h = harness
    h.barrier(0, 1)
    h.settle()
    h.data(1)  # persisted for checkpoint 1, which will not complete
    h.settle()
    h.barrier(0, 2)  # n+1 overtakes: n is given up
    h.settle()
    b = h.data(1)
    h.settle()
    h.barrier(1, 1)  # the straggler of the aborted checkpoint: ignored
    h.settle()
    c = h.data(1)
    h.settle()  # processed before its channel's barrier: state
    h.data(1)
    h.barrier(1, 2)  # overtakes the last one: the upstream's output state, not ours
    ack = h.coordinator.ack_for(2)
    assert 1 in h.coordinator.declines
    assert all(a.checkpoint_id != 1 for a in h.coordinator.acks)
    assert persisted_input(ack, h.task) == {1: [b, c]}


def test_cancelled_checkpoint_with_barriers_still_travelling(harness: Any, tmp_path: Path) -> None:
    h = harness
    h.barrier(0, 1)
    h.settle()
    h.data(1)
    h.settle()
    h.cancel(1, 1)  # cancelled upstream while channel 1's barrier is still on its way
    h.settle()
    h.barrier(1, 1)  # arrives after the cancel: must not restart checkpoint 1
    h.settle()
    h.data(1)
    h.settle()
    assert 1 in h.coordinator.declines
    assert all(a.checkpoint_id != 1 for a in h.coordinator.acks)
    assert any(isinstance(e, CancelCheckpointMarker) for e in h.events)
    # Its files were dropped: nothing of checkpoint 1 is left behind.
    time.sleep(0.1)
    assert not list((tmp_path / "chk-1").rglob("*.spill"))


def test_aligned_barrier_while_a_previous_checkpoint_is_still_aligning(harness: Any) -> None:
    h = harness
    h.barrier(0, 1, BarrierKind.ALIGNED)
    h.settle()
    h.barrier(1, 2, BarrierKind.ALIGNED)  # 2 arrives while 1 is aligning
    h.settle()
    h.barrier(0, 2, BarrierKind.ALIGNED)
    ack = h.coordinator.ack_for(2)
    assert 1 in h.coordinator.declines
    assert ack.channel_state == {} and ack.metrics["inflight_bytes"] == 0


def test_end_of_partition_completes_a_pending_unaligned_checkpoint(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.start()
    h.barrier(0, 1)
    h.settle()
    b = h.data(1)
    h.settle()
    h.inputs[1][0].finish()  # channel 1 ends without a barrier
    ack = h.coordinator.ack_for(1)
    assert persisted_input(ack, h.task) == {1: [b]}
    h.stop()
    assert h.out.finished


def test_a_bounded_checkpoint_completes_when_a_blocked_channel_ends_without_its_barrier(
    tmp_path: Path,
) -> None:
    """The bound blocks the channels whose barrier has not come; one whose upstream
    exited without taking the checkpoint (FLIP-147: it finished, and an earlier
    checkpoint covers it) never brings it. Its queued data and EndOfPartition must
    still come through, as input state, or the checkpoint (and the job) hangs."""
    h = Harness(tmp_path, max_inflight_bytes=1)
    h.start()
    h.barrier(0, 1)
    h.settle()
    b1 = h.data(1)  # over the bound: channel 1 is blocked from here
    deadline = time.monotonic() + 10  # the task processes it on its own thread
    while not h.gate.is_blocked(1):
        assert time.monotonic() < deadline, "the bound did not block channel 1"
        time.sleep(0.005)
    b2 = h.data(1)
    h.end(1)  # the upstream ends without barrier 1
    ack = h.coordinator.ack_for(1)
    assert persisted_input(ack, h.task) == {1: [b1, b2]}
    assert h.coordinator.declines == []
    h.stop()
    assert h.out.finished


def test_to_buffer_is_an_event() -> None:
    assert to_buffer(CheckpointBarrier(1, 0)).data_type == DataType.EVENT


@pytest.mark.parametrize("policy", ["unaligned", "aligned"])
def test_every_record_is_committed_at_the_end(policy: str, tmp_path: Path) -> None:
    """The final checkpoint's completion reaches every sink even when the end of its
    input is handled first (a race that once dropped the last file)."""
    from spillover.verify import run_once

    for i in range(6):
        spec = VerifySpec(
            policy=policy,
            parallelism=1,
            records=20_000,
            failures=0,
            rate_per_subtask=30_000,
            seed=i,
        )
        out = run_once(spec, str(tmp_path / str(i)), "b", FailureInjector())
        assert out.result.status == "finished"
        assert len(out.rows) == spec.records


def test_a_failure_while_completing_an_unaligned_checkpoint_declines_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Completing an unaligned checkpoint runs on the snapshot thread; an error there
    must decline the checkpoint (aborted, the next one goes on), not leave it pending
    until its timeout."""
    real = InflightAcks._acknowledge_parts
    calls: list[int] = []
    failed: list[Any] = []

    def flaky(self: InflightAcks, inf: Any) -> None:
        calls.append(inf.checkpoint_id)
        if len(calls) == 1:
            failed.append(inf)
            raise KeyError("boom")
        real(self, inf)

    monkeypatch.setattr(InflightAcks, "_acknowledge_parts", flaky)
    from spillover.verify import run_once

    spec = VerifySpec(topology="pipeline", records=20_000, failures=0, policy="unaligned")
    out = run_once(spec, str(tmp_path), "flaky", FailureInjector())
    assert out.result.status == "finished", out.result.failures
    by_id = {c["checkpoint_id"]: c for c in out.result.checkpoints}
    first = by_id[calls[0]]
    assert first["status"] == "aborted"
    assert "completing the unaligned checkpoint failed: KeyError" in first["reason"]
    assert failed[0].writer.closed  # its channel files discarded, not left half-written
    assert any(c["status"] == "completed" for c in by_id.values())  # the next ones go on


def test_a_task_that_fails_mid_checkpoint_lets_go_of_its_channel_state(tmp_path: Path) -> None:
    """The task ends (cancelled, as on any failure) while an unaligned checkpoint
    persists: its writer is discarded then, not left holding open files, staged
    sections and network buffers for as long as the task object lives."""
    import os

    h = Harness(tmp_path)
    h.start()
    h.barrier(0, 1)
    h.settle()
    h.data(1)
    h.settle()
    inf = h.task.cp.barriers.inflight
    assert inf is not None and inf.writer.input_bytes > 0
    h.task.cancel()
    assert h.done.wait(10)
    h.task.thread.join(5)
    assert inf.writer.closed
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(tmp_path / "chk-1")):
            held.append(target)
    assert held == []
    assert not list((tmp_path / "chk-1").rglob("*.spill"))


def test_an_acknowledgement_held_behind_a_close_keeps_the_channel_thread_busy() -> None:
    """A close that just ended does not make the channel-state thread idle while an
    acknowledgement held behind it has still to go out: a later checkpoint's close
    on the task thread would otherwise overtake it."""
    from spillover.runtime.checkpointing.snapshot import SnapshotThreads

    threads = SnapshotThreads("t")
    closing, held = threading.Event(), threading.Event()
    try:
        assert threads.channels_idle()
        close = threads.submit_channels(closing.wait, 10)
        threads.after_channels(held.wait, 10)  # queued behind the close
        closing.set()
        assert close.result(10)  # the close is done; the held acknowledgement waits
        assert not threads.channels_idle()
        held.set()
        _wait_for(threads.channels_idle, "the channel-state thread never became idle")
    finally:
        closing.set()
        held.set()
        threads.shutdown()


def test_an_acknowledgement_without_channel_state_waits_behind_an_earlier_close() -> None:
    """An aligned checkpoint's acknowledgement (an iteration head's, with several
    checkpoints in flight) never overtakes an earlier checkpoint's whose channel
    state is still being closed: acknowledgements reach the coordinator in order."""
    from spillover.runtime.checkpointing.snapshot import SnapshotThreads

    threads = SnapshotThreads("t")
    order: list[str] = []
    closing = threading.Event()
    try:
        threads.after_channels(order.append, "ack 1")  # nothing outstanding: at once
        assert order == ["ack 1"]
        threads.submit_channels(lambda: (closing.wait(10), order.append("ack 2")))
        acked = threads.submit(threads.after_channels, order.append, "ack 3")
        acked.result(10)
        assert order == ["ack 1"]  # held behind checkpoint 2's close
        closing.set()
        _wait_for(lambda: len(order) == 3, "the held acknowledgement never went out")
        assert order == ["ack 1", "ack 2", "ack 3"]
    finally:
        closing.set()
        threads.shutdown()


@pytest.mark.parametrize(
    "case", ["small", "large", "own files", "file busy", "behind an earlier close"]
)
def test_small_local_channel_state_is_finished_on_the_task_thread(
    case: str, harness: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small channel state staged for a shared file on a local disk is finished by the
    task thread once its inputs' barriers are in (no hand-off to wait for). Whatever
    could make that thread wait goes to the channel-state thread: more than
    QUICK_CLOSE_BYTES, files of its own in the checkpoint directory, another subtask
    appending to the shared file, or an earlier checkpoint's close still going
    (acknowledgements stay in order). Either way the acknowledgement carries it."""
    from spillover.runtime.checkpointing import channel_state
    from spillover.runtime.checkpointing.channel_state import ChannelStateGroup, ChannelStateWriter

    h = harness
    if case != "own files":
        directory = lambda cid: str(tmp_path / f"chk-{cid}")  # noqa: E731
        group = ChannelStateGroup("map-0", [("map", 0), ("other", 0)], directory, str(tmp_path))
        h.task.cp.channel_group = group
    if case == "large":
        monkeypatch.setattr(channel_state, "QUICK_CLOSE_BYTES", 0)
    real_close = ChannelStateWriter._close
    closed_on: list[str] = []

    def close(self: ChannelStateWriter) -> dict[str, Any]:
        closed_on.append(threading.current_thread().name)
        return real_close(self)

    monkeypatch.setattr(ChannelStateWriter, "_close", close)
    earlier = threading.Event()
    if case == "behind an earlier close":
        h.task.cp.snapshots.submit_channels(earlier.wait, 10)
    if case == "file busy":  # another subtask of the group appends (from this thread)
        assert group.file(1) is not None and group.file(1).hold()  # type: ignore[union-attr]
    h.barrier(0, 1)
    h.settle()
    b = h.data(1)
    h.settle()
    h.barrier(1, 1)
    if case in ("behind an earlier close", "file busy"):
        h.settle()
        assert closed_on == [] or case == "file busy"
        assert h.coordinator.acks == []
        earlier.set()
        if case == "file busy":
            group.file(1).release()  # type: ignore[union-attr]
    ack = h.coordinator.ack_for(1)
    assert persisted_input(ack, h.task) == {1: [b]}
    expected = "task " if case == "small" else "channel state "
    assert len(closed_on) == 1 and closed_on[0].startswith(expected), closed_on


def test_a_finished_task_closes_its_operators_before_it_sends_end_of_partition(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As Flink ends a task: ``close()`` runs while downstream still waits for this
    task, so what close flushes or fails on is never behind an EndOfPartition that
    told downstream everything had come."""
    h = Harness(tmp_path)
    op = h.task.chain.ops[0]
    real_close = op.close
    at_close: list[bool] = []

    def close() -> None:
        at_close.append(h.out.finished)
        real_close()

    monkeypatch.setattr(op, "close", close)
    h.start()
    h.data(0)
    h.stop()
    assert at_close == [False], "EndOfPartition went out before the operators closed"
    _wait_for(lambda: "EndOfPartition" in h.arrived, "no EndOfPartition downstream")
