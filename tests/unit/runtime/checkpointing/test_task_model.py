"""A whole task against a model of its checkpoints: the real ``Task`` (barrier
handling, in-flight data, snapshots, the end of its input) fed random interleavings
of data (records split across buffers too), backpressure, aligned, unaligned and timing-out
barriers, newer barriers that overtake an older checkpoint, cancellation markers,
ended channels, and completed or aborted notifications, while it runs on its own
thread at its own pace.

What must hold for every checkpoint the task acknowledged, whatever the timing:
each record sent on a channel before that channel's barrier was either processed
before the snapshot (its output is ahead of the checkpoint's cut downstream), or
persisted as the checkpoint's input state, or overtaken by the barrier in the
channel (the upstream's output state), exactly once; and the cut falls between two
records. And no checkpoint whose barriers all arrived is left unanswered."""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

from spillover.records import RecordReader, read_records
from spillover.runtime.checkpointing.messages import (
    NotifyAborted,
    NotifyComplete,
    SwitchToUnaligned,
)
from spillover.runtime.network.events import BarrierKind, CheckpointBarrier
from support.task_harness import DTYPE, Harness, eventually, output_state, persisted_input

CHANNELS = (0, 1)
FINAL = 1_000  # the checkpoint Harness.stop completes once every input ended

Ids = Counter[tuple[int, int]]


def _ids(records: list[bytes]) -> Ids:
    """(channel, seq) of each record: the map passes records through unchanged."""
    rows = np.frombuffer(b"".join(records), DTYPE) if records else np.zeros(0, DTYPE)
    return Counter(zip(rows["partition"].tolist(), rows["seq"].tolist(), strict=True))


class TaskMachine(RuleBasedStateMachine):
    """The model: which records each channel got before each checkpoint's barrier."""

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="spillover-task-model-"))
        self.h = Harness(self.tmp, chained_sink=False)
        self.h.start()
        self.sent: dict[int, int] = dict.fromkeys(CHANNELS, 0)  # records sent per channel
        self.ended: set[int] = set()
        self.next_id = 1
        self.open: tuple[int, BarrierKind] | None = None  # the checkpoint being barriered
        self.cuts: dict[int, dict[int, int]] = {}  # its records before each channel's barrier
        self.kinds: dict[int, BarrierKind] = {}
        # What an unaligned barrier overtook in a channel: the upstream's output state.
        self.upstream: dict[int, dict[int, list[bytes]]] = {}
        self.answer_due: set[int] = set()  # every live channel got its barrier
        self.cancelled: set[int] = set()
        self.notified: set[int] = set()

    # -- what upstream does -------------------------------------------------------------

    @rule(ch=st.sampled_from(CHANNELS), n=st.integers(1, 6))
    def send_data(self, ch: int, n: int) -> None:
        if ch not in self.ended:
            self.h.data(ch, n)
            self.sent[ch] += n

    @rule(ms=st.integers(1, 50))
    def stall_downstream(self, ms: int) -> None:
        """Backpressure: the task's output queues up downstream for a while."""
        self.h.stall(ms / 1000)

    @rule(ch=st.sampled_from(CHANNELS))
    def send_split_record(self, ch: int) -> None:
        """One record in two buffers: the task may have read the head when a barrier
        overtakes the tail (the head is then a begun record of its input state)."""
        if ch not in self.ended:
            _, tail = self.h.split_record(ch)
            self.h.send(ch, tail)
            self.sent[ch] += 1

    @rule(ch=st.sampled_from(CHANNELS), kind=st.sampled_from(BarrierKind))
    def send_barrier(self, ch: int, kind: BarrierKind) -> None:
        """The next barrier on ``ch``: of the open checkpoint, or a new one."""
        if ch in self.ended:
            return
        if self.open is None or ch in self.cuts[self.open[0]]:
            if not self._may_start(kind):
                return
            self.open = (self.next_id, kind)
            self.cuts[self.next_id] = {}
            self.upstream[self.next_id] = {}
            self.kinds[self.next_id] = kind
            self.next_id += 1
        cid, kind = self.open
        self.upstream[cid][ch] = self.h.barrier(ch, cid, kind)
        self.cuts[cid][ch] = self.sent[ch]
        self._close_if_seen(cid)

    def _may_start(self, kind: BarrierKind) -> bool:
        """The coordinator's rule: checkpoints overlap only when all are aligned (an
        unaligned barrier would overtake an aligned one, and an aligned one with a
        timeout may turn unaligned); else the new one waits until the task answered
        every earlier one (a bound on a hang, not a speed)."""
        waiting = [c for c in self.kinds if c not in self.cancelled and not self._answered(c)]
        if kind == BarrierKind.ALIGNED and all(
            self.kinds[c] == BarrierKind.ALIGNED for c in waiting
        ):
            return True
        if any(c not in self.answer_due for c in waiting):
            return False  # its barriers are not all out: it cannot be answered yet
        return eventually(lambda: all(self._answered(c) for c in waiting))

    def _answered(self, cid: int) -> bool:
        coordinator = self.h.coordinator
        with coordinator.lock:
            return cid in coordinator.declines or any(
                a.checkpoint_id == cid for a in coordinator.acks
            )

    @rule(ch=st.sampled_from(CHANNELS))
    def end_channel(self, ch: int) -> None:
        """An upstream finishes (one of the two: the task's own end is teardown's)."""
        if self.ended:
            return
        self.h.end(ch)
        self.ended.add(ch)
        self._ended_without_barrier(ch)
        if self.open is not None:
            self._close_if_seen(self.open[0])

    def _ended_without_barrier(self, ch: int) -> None:
        """Every checkpoint ``ch`` had no barrier of counts all it sent (its end aligns
        it); one overtaken by a newer barrier there is aborted, never acknowledged."""
        for cid, cuts in self.cuts.items():
            if cid not in self.cancelled:
                cuts.setdefault(ch, self.sent[ch])

    @rule()
    def time_out(self) -> None:
        """The open checkpoint's alignment timed out (aligned with a timeout): the
        coordinator switches it to unaligned, and upstreams send theirs unaligned."""
        if self.open is not None and self.open[1] == BarrierKind.ALIGNED_WITH_TIMEOUT:
            cid = self.open[0]
            self.h.task.post(SwitchToUnaligned(cid))
            self.open = (cid, BarrierKind.UNALIGNED)

    @rule(ch=st.sampled_from(CHANNELS))
    def cancel_open(self, ch: int) -> None:
        """An upstream declined the open checkpoint: its cancellation marker."""
        if self.open is None or ch in self.ended:
            return
        cid = self.open[0]
        self.h.cancel(ch, cid)
        self.h.task.post(NotifyAborted(cid))  # the coordinator aborts it
        self.cancelled.add(cid)
        self.open = None

    # -- what the coordinator does ------------------------------------------------------------

    @rule(complete=st.booleans())
    def notify(self, complete: bool) -> None:
        with self.h.coordinator.lock:
            acked = [a.checkpoint_id for a in self.h.coordinator.acks]
        fresh = [cid for cid in acked if cid not in self.notified]
        if fresh:
            cid = fresh[0]
            self.notified.add(cid)
            self.h.task.post(NotifyComplete(cid) if complete else NotifyAborted(cid))

    def _close_if_seen(self, cid: int) -> None:
        for ch in self.ended:  # an ended channel aligns every later checkpoint
            self.cuts[cid].setdefault(ch, self.sent[ch])
        if set(CHANNELS) <= set(self.cuts[cid]):
            self.answer_due.add(cid)
            self.open = None

    # -- the checks, once the task ended ------------------------------------------------------

    def teardown(self) -> None:
        try:
            if self.open is not None:  # the channels without its barrier end now
                self.answer_due.add(self.open[0])
            for ch in CHANNELS:
                self._ended_without_barrier(ch)
            self.h.stop()
            self.h.drainer.join(10)
            assert not self.h.drainer.is_alive(), "downstream never ended"
            self.cuts[FINAL] = dict(self.sent)
            coordinator = self.h.coordinator
            for cid in sorted(self.answer_due - self.cancelled):
                assert eventually(
                    lambda c=cid: (
                        any(a.checkpoint_id == c for a in coordinator.acks)
                        or c in coordinator.declines
                    )
                ), f"checkpoint {cid}: all its barriers arrived, and no answer"
            for ack in coordinator.acks:  # a cancelled one never completes: its ack is moot
                if ack.checkpoint_id not in self.cancelled:
                    self._check_cut(ack)
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _check_cut(self, ack: Any) -> None:
        cid = ack.checkpoint_id
        cuts = self.cuts.get(cid)
        assert cuts is not None, f"checkpoint {cid} acknowledged, but never barriered"
        assert set(cuts) == set(CHANNELS), f"checkpoint {cid} acknowledged early: {cuts}"
        # A channel's state: what the task persisted (a begun record's head first),
        # then what the barrier overtook in the channel, which continues it.
        persisted = persisted_input(ack, self.h.task)
        upstream = self.upstream.get(cid, {})
        ahead = self._output_before_cut(cid, sum(len(bytes(b)) for b in output_state(ack)))
        for ch in CHANNELS:
            expected = Counter((ch, seq) for seq in range(cuts[ch]))
            got = Counter({k: v for k, v in ahead.items() if k[0] == ch})
            got.update(_ids(read_records([*persisted.get(ch, []), *upstream.get(ch, [])])))
            assert got == expected, (
                f"checkpoint {cid}, channel {ch}: missing {sorted(expected - got)[:5]}, "
                f"twice or after the cut {sorted(got - expected)[:5]}"
            )

    def _output_before_cut(self, cid: int, overtaken: int) -> Ids:
        """The records downstream ahead of checkpoint ``cid``'s cut: those before its
        barrier, and the ``overtaken`` bytes after it (its output state)."""
        reader, records, at = RecordReader(), [], 0
        cut: int | None = None
        for item in self.h.stream:
            if isinstance(item, CheckpointBarrier) and item.checkpoint_id == cid:
                cut = at + overtaken
            elif isinstance(item, bytes):
                for batch in reader.feed(np.frombuffer(item, np.uint8)):
                    records += batch.to_list()
                at += len(item)
        assert cut is not None, f"checkpoint {cid}: no barrier downstream"
        within = _record_ends(records)
        assert within[-1] == at, "downstream holds a torn record"
        assert cut in within, f"checkpoint {cid}: its cut at byte {cut} splits a record"
        return _ids(records[: within.index(cut)])


def _record_ends(records: list[bytes]) -> list[int]:
    """The downstream byte offset where each record ends, with 0 first (length prefix
    included, as the stream frames it)."""
    ends, at = [0], 0
    for rec in records:
        at += 4 + len(rec)
        ends.append(at)
    return ends


test_a_task_keeps_every_record_once_per_checkpoint = TaskMachine.TestCase
test_a_task_keeps_every_record_once_per_checkpoint.settings = settings(
    max_examples=100, stateful_step_count=25, deadline=None
)


class TestTheTaskAtLength(TaskMachine.TestCase):  # type: ignore[name-defined,misc]
    """The same, at length (CI's slow group)."""

    settings = settings(max_examples=1000, stateful_step_count=30, deadline=None)


TestTheTaskAtLength = pytest.mark.slow(TestTheTaskAtLength)
