"""Unaligned, aligned-with-timeout and max-in-flight checkpoints.

Whole jobs with induced failures must stay exactly-once while in-flight data is
really persisted and replayed; a task driven barrier by barrier must complete or
abort odd barrier orders cleanly and persist exactly the right buffers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spillover.config import NetworkConfig
from spillover.runtime.checkpointing.inflight import InflightAcks, InFlightCheckpoint
from spillover.runtime.failures import FailureInjector
from spillover.runtime.network.events import (
    BarrierKind,
    CancelCheckpointMarker,
    CheckpointBarrier,
    to_buffer,
)
from spillover.runtime.recovery.restore import TaskRestore
from spillover.storage.handle import DataType
from spillover.verify import VerifySpec, verify
from support.task_harness import (
    DTYPE,
    Harness,
    eventually,
    output_state,
    persisted_input,
    wait_for,
)

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
    # The pure unaligned policies must restore in-flight data: their failures wait for
    # a completed checkpoint holding some, which held sinks make certain however
    # starved the sources are. With a timeout, whether a checkpoint switched to
    # unaligned is up to the machine's timing; its failures do not wait.
    pure = policy != "timeout" or timeout_ms == 0
    spec = VerifySpec(
        topology=topology,
        policy=policy,
        aligned_timeout_ms=timeout_ms,
        records=50_000,
        failures=5,
        seed=3,
        rate_per_subtask=50_000,
        interval_ms=60,
        max_inflight_bytes=NetworkConfig.segment_size,  # the smallest bound it allows
        failures_after_inflight=pure,
    )
    report = verify(spec, str(tmp_path))
    assert report.exact, report.text()
    assert len(report.failures_fired) == 5, report.text()
    assert report.inflight_persisted > 0, "no in-flight data was persisted"
    # Restores replay exactly when the checkpoint they restored held in-flight data.
    assert (report.inflight_replayed > 0) == (report.inflight_restored > 0), report.text()
    if pure:
        assert report.inflight_restored > 0, report.text()
        assert report.inflight_replayed > 0, "no in-flight data was replayed"


# --- one task, driven barrier by barrier --------------------------------------------------------


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
        return eventually(lambda: any(isinstance(e, CheckpointBarrier) for e in h.events))

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
    wait_for(lambda: "CheckpointBarrier" in h.arrived, "no barrier downstream")
    ahead = h.arrived[: h.arrived.index("CheckpointBarrier")]
    assert "data" in ahead or sum(len(bytes(b)) for b in output_state(ack)) > 0


def parts_on_the_snapshot_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every operator part goes to the snapshot thread, as one that writes files does
    (the harness's map writes none, so its part would run on the task thread)."""
    from spillover.runtime.checkpointing.snapshot import SnapshotThreads

    real = SnapshotThreads.operator_part
    monkeypatch.setattr(
        SnapshotThreads, "operator_part", lambda self, fn, light: real(self, fn, False)
    )


Done = Callable[[InflightAcks, Any, Any, str | None], tuple[Any, str | None] | None]


def on_operator_part_done(monkeypatch: pytest.MonkeyPatch, hook: Done) -> None:
    """Runs ``hook(acks, inf, ack, error)`` as each operator part ends, on the thread
    it ends on; a tuple it returns replaces ``(ack, error)``."""
    real = InflightAcks.operator_part_done

    def done(self: InflightAcks, inf: Any, ack: Any, error: str | None = None) -> None:
        replaced = hook(self, inf, ack, error)
        if replaced is not None:
            ack, error = replaced
        real(self, inf, ack, error)

    monkeypatch.setattr(InflightAcks, "operator_part_done", done)


def test_channel_state_is_finished_while_the_operator_part_still_runs(
    harness: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unaligned checkpoint's two halves run side by side: its channel-state files
    are finished while the operator part (state files) is still being written, and
    the acknowledgement waits for both and carries both, in checkpoint order."""
    h = harness
    release = threading.Event()
    parts_on_the_snapshot_thread(monkeypatch)
    slowed: list[Any] = []

    def slow(_: InflightAcks, inf: Any, ack: Any, error: str | None) -> None:
        if inf.checkpoint_id == 1:
            slowed.append(inf)
            assert release.wait(10)

    on_operator_part_done(monkeypatch, slow)
    h.barrier(0, 1)
    h.settle()
    b = h.data(1)
    h.settle()
    h.barrier(1, 1)
    wait_for(lambda: slowed, "the operator part never ran")
    inf = slowed[0]
    wait_for(lambda: inf.channel_state is not None, "the channel state waited for it")
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


def test_an_operator_part_with_nothing_to_write_is_done_on_the_task_thread(
    harness: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stateless task's operator part is only its acknowledgement: it is done at the
    barrier on the task's own thread, without waking the snapshot thread, and the
    checkpoint still carries the operator's snapshot and the in-flight data."""
    h = harness
    threads: list[str] = []

    def record(*_: Any) -> None:
        threads.append(threading.current_thread().name)

    on_operator_part_done(monkeypatch, record)
    h.barrier(0, 1)
    h.settle()
    b = h.data(1)
    h.settle()
    h.barrier(1, 1)
    ack = h.coordinator.ack_for(1)
    assert persisted_input(ack, h.task) == {1: [b]}
    assert "map" in ack.operator_state
    assert threads == [h.task.thread.name]


def test_a_light_operator_part_waits_behind_an_outstanding_one(
    harness: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While an earlier checkpoint's operator part is still on the snapshot thread, a
    later one with nothing to write queues behind it instead of running at once, so
    acknowledgements still go out in checkpoint order."""
    from spillover.runtime.checkpointing.snapshot import SnapshotThreads

    h = harness
    release = threading.Event()
    real_part = SnapshotThreads.operator_part
    order: list[tuple[int, str]] = []

    def part(self: SnapshotThreads, fn: Any, light: bool) -> None:
        # Checkpoint 1's part is held on the snapshot thread (as a slow state write).
        first = not order and not release.is_set()
        real_part(self, fn, light and not first)

    def done(_: InflightAcks, inf: Any, ack: Any, error: str | None) -> None:
        order.append((inf.checkpoint_id, threading.current_thread().name))
        if inf.checkpoint_id == 1:
            assert release.wait(10)

    monkeypatch.setattr(SnapshotThreads, "operator_part", part)
    on_operator_part_done(monkeypatch, done)
    h.barrier(0, 1)
    h.barrier(1, 1)
    wait_for(lambda: order, "checkpoint 1's operator part never ran")
    h.barrier(0, 2)
    h.barrier(1, 2)
    h.settle()
    assert [c for c, _ in order] == [1]  # 2 waits behind 1, not run on the task thread
    release.set()
    h.coordinator.ack_for(2)
    assert [c for c, _ in order] == [1, 2]
    assert all(t.startswith("snapshot") for _, t in order), order
    assert [a.checkpoint_id for a in h.coordinator.acks] == [1, 2]
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
    real_close = ChannelStateWriter.close

    def part(_: InflightAcks, inf: Any, ack: Any, error: str | None) -> Any:
        if inf.checkpoint_id == 1 and failing in ("operator", "both"):
            if failing == "both":  # fails after the close failed: both halves fail
                wait_for(lambda: inf.channel_error is not None, "the close never failed")
            return None, "snapshot failed: OSError('disk gone')"
        return None

    def close(self: ChannelStateWriter, quick: bool = False) -> dict[str, Any] | None:
        if self._args[0] == 1 and failing in ("channels", "both"):
            raise OSError("disk gone")
        return real_close(self, quick)

    on_operator_part_done(monkeypatch, part)
    monkeypatch.setattr(ChannelStateWriter, "close", close)
    if failing == "both":
        # Its part waits for the close, which the task thread does: a part that
        # fails late is a state write, and those run on the snapshot thread.
        parts_on_the_snapshot_thread(monkeypatch)
    h.barrier(0, 1)
    h.settle()
    h.data(1)
    h.settle()
    if failing == "operator":
        wait_for(lambda: h.coordinator.declines == [1], "not declined before the barriers")
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
        wait_for(threads.channels_idle, "the channel-state thread never became idle")
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
        wait_for(lambda: len(order) == 3, "the held acknowledgement never went out")
        assert order == ["ack 1", "ack 2", "ack 3"]
    finally:
        closing.set()
        threads.shutdown()


@pytest.mark.parametrize("case", ["small", "large", "own files", "behind an earlier close"])
def test_small_local_channel_state_is_finished_on_the_task_thread(
    case: str, harness: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small channel state staged for a shared file on a local disk is finished by the
    task thread once its inputs' barriers are in (no hand-off to wait for). Whatever
    could make that thread wait goes to the channel-state thread: more than
    QUICK_CLOSE_BYTES, files of its own in the checkpoint directory, or an earlier
    checkpoint's close still going
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
    h.barrier(0, 1)
    h.settle()
    b = h.data(1)
    h.settle()
    h.barrier(1, 1)
    if case == "behind an earlier close":
        h.settle()
        assert closed_on == []
        assert h.coordinator.acks == []
        earlier.set()
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
    wait_for(lambda: "EndOfPartition" in h.arrived, "no EndOfPartition downstream")


@pytest.mark.parametrize("savepoint", ["aborted", "completed"])
def test_a_finished_task_holding_a_stops_savepoint_ends_with_it(
    savepoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chaos 83-224: a task whose data ended took the stop's savepoint 3 before its
    final checkpoint 2 completed. It must stay until the savepoint is decided: ended
    then, it held the savepoint and sent no EndOfPartition, and when the savepoint
    was aborted the tasks behind it waited for the next attempt's barrier, or its
    end, forever. Aborted, it ends as a finished task does (EndOfPartition);
    completed, as every task at a stop does (what follows is in the savepoint)."""
    from spillover.runtime.checkpointing.messages import (
        NotifyAborted,
        NotifyComplete,
        Suspend,
        TriggerCheckpoint,
    )

    h = Harness(tmp_path)
    idled_after_final = threading.Event()
    real_idle = h.task.idle

    def idle() -> None:  # await_final: called once ``may_end`` said no
        if h.task.life.final_done:
            idled_after_final.set()
        real_idle()

    monkeypatch.setattr(h.task, "idle", idle)
    h.start()
    h.end(0)
    h.end(1)
    assert h.coordinator.ended.wait(10)
    now = int(time.time() * 1000)
    h.task.post(TriggerCheckpoint(2, now))  # its final checkpoint (a root: inputs ended)
    assert h.coordinator.ack_for(2).finished
    h.task.post(Suspend(3))  # the stop's savepoint, beside checkpoint 2
    h.task.post(TriggerCheckpoint(3, now, BarrierKind.UNALIGNED))
    h.coordinator.ack_for(3)
    h.task.post(NotifyComplete(2))
    wait_for(lambda: idled_after_final.is_set() or h.done.is_set(), "checkpoint 2 not heard")
    assert not h.done.is_set(), "the task ended holding the stop's savepoint"
    h.task.post(NotifyAborted(3) if savepoint == "aborted" else NotifyComplete(3))
    assert h.done.wait(10)
    h.task.thread.join(5)
    assert h.error is None, repr(h.error)
    assert h.coordinator.exited.is_set()
    ends = ["EndOfPartition"] if savepoint == "aborted" else []
    # The end of time (drained), the end of data, barriers 2 and 3, then its end.
    expected = ["Watermark", "EndOfData", "CheckpointBarrier", "CheckpointBarrier", *ends]
    wait_for(lambda: len(h.arrived) >= len(expected), f"downstream got {h.arrived}")
    assert h.arrived == expected
    assert h.out.finished == (savepoint == "aborted")
    h.close_downstream()
