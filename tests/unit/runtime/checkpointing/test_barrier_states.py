"""A task's barrier handling driven through random interleavings of data, aligned,
unaligned and timing-out barriers, cancel markers, timeouts and ended channels,
against a model of its input channels. What must hold, for every checkpoint:

- it is acknowledged or declined, never both, and none hangs: once every barrier
  was sent and everything deliverable delivered, each checkpoint is settled;
- an acknowledged checkpoint is an exact cut of every channel: the records sent
  before its barrier are each either processed before the snapshot, persisted by
  this task as input state, or persisted upstream (what an unaligned barrier
  overtook), exactly once; no record sent after it is in it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from spillover.runtime.checkpointing.barriers.controller import RecoveredCut
from spillover.runtime.checkpointing.barriers.handler import BarrierHandler
from spillover.runtime.checkpointing.inflight import InFlightCheckpoint
from spillover.runtime.network.events import BarrierKind, CheckpointBarrier, to_buffer
from support.barrier_task import StillChannels

CHANNELS = 3


@dataclass
class Buf:
    """A data buffer holding one record, identified by its sequence number."""

    seq: int

    def __len__(self) -> int:
        return 1

    def release(self) -> None: ...
    def retain(self) -> Buf:
        return self


@dataclass
class Item:
    kind: str  # "data", "barrier" or "end"
    seq: int = -1
    barrier: CheckpointBarrier | None = None


class ModelChannels(StillChannels):
    """The input channels: one FIFO queue each; an unaligned barrier jumps the data
    queued ahead of it (never an earlier event)."""

    def __init__(self) -> None:
        super().__init__()
        self.queues: list[list[Item]] = [[] for _ in range(CHANNELS)]
        self.ended: set[int] = set()  # EndOfPartition queued or delivered

    def has_ended(self, channel: int) -> bool:
        return channel in self.ended

    def overtake(self, channel: int, match: Any) -> list[Any] | None:
        q = self.queues[channel]
        for i, item in enumerate(q):
            if item.kind == "barrier" and match(to_buffer(item.barrier)):
                del q[i]
                return [Buf(it.seq) for it in q[:i] if it.kind == "data"]
        return None


class Writer:
    """Records the input state persisted, per channel."""

    def __init__(self) -> None:
        self.inputs: dict[int, list[int]] = {}
        self.input_bytes = 0

    def add_input(self, gate: int, channel: int, buf: Any) -> None:
        self.inputs.setdefault(channel, []).append(buf.seq)


@dataclass
class Outcome:
    processed: dict[int, set[int]] = field(default_factory=dict)  # at the snapshot
    persisted: dict[int, list[int]] = field(default_factory=dict)
    acked: bool = False
    declined: bool = False


class Task:
    """The task side: snapshots record what was processed, acks what completes."""

    def __init__(self, machine: BarrierMachine) -> None:
        self.m = machine

    # Controller
    def open_inflight(self, barrier: CheckpointBarrier, pending: set[int]) -> InFlightCheckpoint:
        gate_of = [(0, ch) for ch in range(CHANNELS)]
        return InFlightCheckpoint(barrier.checkpoint_id, Writer(), set(pending), 0, 0.0, gate_of)  # type: ignore[arg-type]

    def cut_recovered(self) -> RecoveredCut:
        return RecoveredCut([], frozenset(), False)

    def forward_unaligned(self, barrier: CheckpointBarrier, inf: Any) -> None: ...
    def begun_records(self, skip: frozenset[int]) -> list[tuple[int, bytes]]:
        return []

    def snapshot(self, barrier: CheckpointBarrier, stats: Any, inf: Any) -> None:
        out = self.m.outcome(barrier.checkpoint_id)
        assert not out.processed, f"checkpoint {barrier.checkpoint_id} snapshot twice"
        out.processed = {ch: set(p) for ch, p in enumerate(self.m.processed)}
        if inf is None:
            out.acked = True

    def decline(self, checkpoint_id: int, reason: str) -> None:
        self.m.outcome(checkpoint_id).declined = True

    def cancel_downstream(self, checkpoint_id: int) -> None: ...

    # acks
    def complete(self, inf: InFlightCheckpoint) -> None:
        out = self.m.outcome(inf.checkpoint_id)
        out.persisted = dict(inf.writer.inputs)  # type: ignore[attr-defined]
        out.acked = True

    def abort(self, inf: InFlightCheckpoint) -> None:
        self.m.outcome(inf.checkpoint_id).declined = True


POLICIES = ["aligned", "unaligned", "timeout"]


class BarrierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.channels = ModelChannels()
        self.task = Task(self)
        self.handler = BarrierHandler(
            self.task,  # type: ignore[arg-type]
            self.channels,
            self.task,  # type: ignore[arg-type]
            CHANNELS,
        )
        self.seq = 0
        self.processed: list[set[int]] = [set() for _ in range(CHANNELS)]
        self.checkpoints: list[int] = []
        self.sent_barriers: list[int] = [0] * CHANNELS  # checkpoints sent per channel
        # Per checkpoint and channel: the records sent before its barrier; what its
        # unaligned barrier overtook (persisted upstream).
        self.sent: list[list[int]] = [[] for _ in range(CHANNELS)]
        self.before: dict[int, dict[int, set[int]]] = {}
        self.upstream: dict[int, dict[int, set[int]]] = {}
        self.timed_out: set[int] = set()
        self.cancelled: set[int] = set()
        self.outcomes: dict[int, Outcome] = {}
        self.policy = "aligned"

    def outcome(self, cid: int) -> Outcome:
        return self.outcomes.setdefault(cid, Outcome())

    @initialize(policy=st.sampled_from(POLICIES))
    def choose_policy(self, policy: str) -> None:
        self.policy = policy

    @precondition(lambda self: len(self.channels.ended) < CHANNELS)
    @rule(ch=st.integers(0, CHANNELS - 1), n=st.integers(1, 4))
    def send_data(self, ch: int, n: int) -> None:
        if ch in self.channels.ended:
            return
        for _ in range(n):
            self.seq += 1
            self.channels.queues[ch].append(Item("data", self.seq))
            self.sent[ch].append(self.seq)

    @precondition(lambda self: len(self.checkpoints) < 6)
    @rule()
    def trigger(self) -> None:
        if self.policy != "aligned" and not all(self._settled(c) for c in self.checkpoints):
            # max-concurrent-checkpoints is 1 with unaligned checkpoints: the next one
            # comes once this task settled the last, or the coordinator aborted it.
            return
        self.checkpoints.append(len(self.checkpoints) + 1)

    def _settled(self, cid: int) -> bool:
        out = self.outcomes.get(cid)
        return cid in self.cancelled or (out is not None and (out.acked or out.declined))

    @rule(ch=st.integers(0, CHANNELS - 1), switched=st.booleans())
    def send_barrier(self, ch: int, switched: bool) -> None:
        n = self.sent_barriers[ch]
        if n >= len(self.checkpoints) or ch in self.channels.ended:
            return
        cid = self.checkpoints[n]
        self.sent_barriers[ch] += 1
        kind = self._kind()
        if kind == BarrierKind.ALIGNED_WITH_TIMEOUT and cid in self.timed_out and switched:
            kind = BarrierKind.UNALIGNED  # the upstream switched
        barrier = CheckpointBarrier(cid, 0, kind)
        self.before.setdefault(cid, {})[ch] = set(self.sent[ch])
        q = self.channels.queues[ch]
        if kind == BarrierKind.UNALIGNED:
            at = max((i + 1 for i, it in enumerate(q) if it.kind != "data"), default=0)
            jumped = {it.seq for it in q[at:] if it.kind == "data"}
            self.upstream.setdefault(cid, {})[ch] = jumped
            q.insert(at, Item("barrier", barrier=barrier))
        else:
            q.append(Item("barrier", barrier=barrier))

    def _kind(self) -> BarrierKind:
        return {
            "aligned": BarrierKind.ALIGNED,
            "unaligned": BarrierKind.UNALIGNED,
            "timeout": BarrierKind.ALIGNED_WITH_TIMEOUT,
        }[self.policy]

    @rule(ch=st.integers(0, CHANNELS - 1), go=st.integers(0, 3))
    def end_channel(self, ch: int, go: int) -> None:
        if ch in self.channels.ended or go:  # rarer than the rest
            return
        self.channels.queues[ch].append(Item("end"))
        self.channels.ended.add(ch)

    @rule(ch=st.integers(0, CHANNELS - 1), n=st.integers(1, 4))
    def deliver(self, ch: int, n: int) -> None:
        for _ in range(n):
            self._deliver(ch)

    @precondition(lambda self: bool(self.checkpoints))
    @rule(data=st.data())
    def time_out(self, data: st.DataObject) -> None:
        if self.policy != "timeout":
            return
        cid = data.draw(st.sampled_from(self.checkpoints))
        self.timed_out.add(cid)
        self.handler.on_timeout(cid)

    @precondition(lambda self: bool(self.checkpoints))
    @rule(data=st.data(), go=st.integers(0, 3))
    def cancel(self, data: st.DataObject, go: int) -> None:
        if go:  # rarer than the rest
            return
        cid = data.draw(st.sampled_from(self.checkpoints))
        self.cancelled.add(cid)
        self.handler.on_cancel(cid)

    def _deliver(self, ch: int) -> bool:
        q = self.channels.queues[ch]
        if not q or ch in self.channels.blocked:
            return False
        item = q.pop(0)
        if item.kind == "data":
            buf = Buf(item.seq)
            self.handler.on_data(ch, buf)  # type: ignore[arg-type]
            self.processed[ch].add(item.seq)
        elif item.kind == "barrier":
            assert item.barrier is not None
            self.handler.on_barrier(ch, item.barrier)
        else:
            self.handler.on_end_of_partition(ch)
        return True

    @invariant()
    def acknowledged_checkpoints_are_exact_cuts(self) -> None:
        for cid, out in self.outcomes.items():
            assert not (out.acked and out.declined) or cid in self.cancelled, (
                f"checkpoint {cid} acknowledged and declined"
            )
            if not out.acked:
                continue
            for ch in range(CHANNELS):
                sent_before = self.before.get(cid, {}).get(ch)
                if sent_before is None:  # the channel ended without this barrier
                    sent_before = set(self.sent[ch])
                processed = out.processed.get(ch, set())
                persisted = out.persisted.get(ch, [])
                upstream = self.upstream.get(cid, {}).get(ch, set())
                assert len(persisted) == len(set(persisted)), f"{cid}/{ch}: persisted twice"
                parts = [processed, set(persisted), upstream]
                assert sum(len(p) for p in parts) == len(set().union(*parts)), (
                    f"checkpoint {cid}, channel {ch}: a record is in it twice: {parts}"
                )
                assert set().union(*parts) == sent_before, (
                    f"checkpoint {cid}, channel {ch}: {parts} is not {sent_before}"
                )

    def teardown(self) -> None:
        # Liveness: every barrier sent, everything deliverable delivered; then each
        # checkpoint not cancelled is settled, and no channel is left blocked.
        for _ in range(len(self.checkpoints) + 1):
            for ch in range(CHANNELS):
                while ch not in self.channels.ended and self.sent_barriers[ch] < len(
                    self.checkpoints
                ):
                    self.send_barrier(ch, True)
            while any(self._deliver(ch) for ch in range(CHANNELS)):
                pass
        assert not any(self.channels.queues), "input left blocked: a checkpoint hangs"
        for cid in self.checkpoints:  # every input ended first: the task is its root
            if cid not in self.before and cid not in self.cancelled:
                self.handler.trigger(CheckpointBarrier(cid, 0, self._kind()))
        self.acknowledged_checkpoints_are_exact_cuts()
        for cid in self.checkpoints:
            assert self._settled(cid), f"checkpoint {cid} hangs"


TestBarrierStates = BarrierMachine.TestCase
TestBarrierStates.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)


class BarrierStatesAtLength(BarrierMachine):
    """CI's slow group: many more interleavings."""


BarrierStatesAtLength.TestCase.settings = settings(
    max_examples=2_000, stateful_step_count=80, deadline=None
)
test_barrier_states_at_length = pytest.mark.slow(BarrierStatesAtLength.TestCase)
