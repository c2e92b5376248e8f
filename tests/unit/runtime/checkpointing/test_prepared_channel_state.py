"""The next checkpoint's channel state opened ahead (``TaskCheckpoints.completed``,
``ChannelStateWriter.prepare``): a checkpoint whose gates were opened before its
barrier came holds exactly what one opened at its barrier holds, and a prepared
writer that is not used (another checkpoint came, it was aborted, the task ended)
leaves nothing behind: no staged memory, no file."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from spillover.runtime import taskcheckpoints
from spillover.runtime.checkpointing.channel_state import (
    ChannelStateGroup,
    ChannelStateWriter,
    channel_state_groups,
    open_channel_state,
)
from spillover.runtime.network import events as ev
from spillover.runtime.taskcheckpoints import TaskCheckpoints
from spillover.storage import GateStateHandle, open_retriever
from spillover.storage.shared import STAGING_BUDGET

Append = tuple[str, int, int, bytes]  # (kind, gate, channel, payload)
GATES = [("input", 0), ("input", 1), ("output", 0), ("output", 1)]


def _group(root: Path) -> ChannelStateGroup:
    members = [("op", 0), ("op", 1)]
    groups = channel_state_groups(members, 5, lambda cid: str(root / f"chk-{cid}"))
    return groups[("op", 0)]


def _subtask_dir(root: Path) -> Any:
    return lambda cid, uid, i: str(root / f"chk-{cid}" / f"{uid}-{i}")


def _contents(result: dict[str, Any]) -> dict[tuple[str, int], list[tuple[int, bytes]]]:
    """Each gate the writer closed, read back: ``{(kind, gate): [(channel, bytes)]}``."""
    out = {}
    for kind in ("input", "output"):
        for h in result[kind]:
            handle = GateStateHandle.from_dict(h)
            with open_retriever(handle) as r:
                out[(kind, handle.gate_id)] = [(b.channel_id, bytes(b)) for b in r]
    return out


def _write(w: ChannelStateWriter, appends: list[Append]) -> None:
    for kind, gate, channel, payload in appends:
        if kind == "input":
            w.add_input(gate, channel, payload)
        else:
            w.add_output(gate, channel, payload)


appends_st = st.lists(
    st.tuples(
        st.sampled_from(["input", "output"]),
        st.integers(0, 2),
        st.integers(0, 3),
        st.binary(min_size=1, max_size=64),
    ),
    max_size=12,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(prepared=st.lists(st.sampled_from(GATES), unique=True), appends=appends_st)
def test_a_prepared_checkpoint_holds_what_an_unprepared_one_does(
    tmp_path: Path, prepared: list[tuple[str, int]], appends: list[Append]
) -> None:
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    group = _group(root)
    used = STAGING_BUDGET.used
    ahead = open_channel_state(_subtask_dir(root), 7, "op", 0, None, group)
    plain = open_channel_state(_subtask_dir(root), 8, "op", 0, None, group)
    assert isinstance(ahead, ChannelStateWriter) and ahead.preparable
    assert ahead.prepare(prepared)
    _write(ahead, appends)
    _write(plain, appends)
    got, want = ahead.close(), plain.close()
    assert got is not None and want is not None
    # The same gates, in the same order, with the same buffers; none of the gates
    # opened ahead that got nothing.
    assert [(h["gate_kind"], h["gate_id"]) for h in got["input"] + got["output"]] == [
        (h["gate_kind"], h["gate_id"]) for h in want["input"] + want["output"]
    ]
    assert _contents(got) == _contents(want)
    assert got["bytes"] == want["bytes"]
    assert STAGING_BUDGET.used == used  # every staged gate's memory given back


def test_a_prepared_writer_dropped_leaves_nothing(tmp_path: Path) -> None:
    group = _group(tmp_path)
    used = STAGING_BUDGET.used
    w = open_channel_state(_subtask_dir(tmp_path), 3, "op", 0, None, group)
    assert isinstance(w, ChannelStateWriter)
    assert w.prepare(GATES)
    assert STAGING_BUDGET.used > used or STAGING_BUDGET.per_gate == 0  # staged, in memory
    w.discard()
    assert STAGING_BUDGET.used == used
    assert not (tmp_path / "chk-3" / "channels").exists() or not os.listdir(
        tmp_path / "chk-3" / "channels"
    )


def test_gates_in_files_of_their_own_are_not_opened_ahead(tmp_path: Path) -> None:
    """A group of one writes each gate to a file of its own as it opens: opened ahead,
    an unused one would be a file in a checkpoint that may never come."""
    alone = channel_state_groups([("op", 0)], 5, lambda cid: str(tmp_path / f"chk-{cid}"))
    w = open_channel_state(_subtask_dir(tmp_path), 3, "op", 0, None, alone[("op", 0)])
    assert isinstance(w, ChannelStateWriter) and not w.preparable
    w.discard()


def _task(root: Path) -> TaskCheckpoints:
    """TaskCheckpoints of a task with no inputs (a source), channel state in a group."""
    task: Any = SimpleNamespace(
        name="op#0",
        vertex=SimpleNamespace(uid="op"),
        subtask=0,
        channels=[],
        has_input=False,
        gate=None,
        life=SimpleNamespace(may_end=False, snapshot_taken=lambda cid: None),
    )
    cp = TaskCheckpoints(task, _subtask_dir(root), None, None)
    cp.channel_group = _group(root)
    return cp


class PrepareMachine(RuleBasedStateMachine):
    """A task's checkpoints against a model of the one opened ahead: when the latest
    checkpoint it wrote channel state for completes, the next id is opened with the
    gates it wrote, unless that id was aborted already or one is open; a barrier of
    that id takes it; any other barrier (an aligned one too), a completion at or
    past its id, its abort and the task's end drop it; an older checkpoint's
    completion changes nothing. Whatever happens, the staged memory held is exactly
    that of the gates opened ahead, and every checkpoint holds what was written to
    it."""

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="prepared-"))
        self.cp = _task(self.root)
        self._patch = pytest.MonkeyPatch()
        # An aligned checkpoint's snapshot itself is not what is tested here.
        self._patch.setattr(taskcheckpoints, "take_snapshot", lambda *a: None)
        self.base = STAGING_BUDGET.used
        self.next_id = 1
        self.last: tuple[int, list[tuple[str, int]]] | None = None  # (id, gates written)
        self.prepared: tuple[int, list[tuple[str, int]]] | None = None
        self.aborted: set[int] = set()
        self.ended = False

    def _model_completed(self, cid: int) -> None:
        if self.prepared is not None and self.prepared[0] <= cid:
            self.prepared = None
        if self.last is None or cid < self.last[0]:
            return
        last, self.last = self.last, None
        if last[0] == cid and self.prepared is None and last[1] and cid + 1 not in self.aborted:
            self.prepared = (cid + 1, last[1])

    @precondition(lambda self: not self.ended)
    @rule(skip=st.integers(0, 2), appends=appends_st)
    def checkpoint(self, skip: int, appends: list[Append]) -> None:
        """An unaligned barrier comes (``skip`` ids were taken by checkpoints that never
        reached this task) and its channel state is written and closed."""
        cid = self.next_id + skip
        self.next_id = cid + 1
        barrier = ev.CheckpointBarrier(cid, 0, ev.BarrierKind.UNALIGNED, 0)
        expected = self.cp._prepared[1] if self.cp._prepared is not None else None
        inf = self.cp.open_inflight(barrier, set())
        if self.prepared is not None and self.prepared[0] == cid:
            assert inf.writer is expected  # the one opened ahead
        else:
            assert inf.writer is not expected
        self.prepared = None
        writer = inf.writer
        assert isinstance(writer, ChannelStateWriter)
        _write(writer, appends)
        result = writer.close()
        assert result is not None
        want: dict[tuple[str, int], list[tuple[int, bytes]]] = {}
        for kind, gate, channel, payload in appends:
            want.setdefault((kind, gate), []).append((channel, payload))
        assert _contents(result) == want
        self.last = (cid, sorted(want))

    @precondition(lambda self: not self.ended)
    @rule(skip=st.integers(0, 2))
    def aligned_checkpoint(self, skip: int) -> None:
        """An aligned barrier: no channel state; one opened ahead for it or before goes."""
        cid = self.next_id + skip
        self.next_id = cid + 1
        barrier = ev.CheckpointBarrier(cid, 0, ev.BarrierKind.ALIGNED, 0)
        self.cp.snapshot(barrier, None, None)
        if self.prepared is not None and self.prepared[0] <= cid:
            self.prepared = None

    @precondition(lambda self: not self.ended and self.last is not None)
    @rule()
    def complete_latest(self) -> None:
        assert self.last is not None
        cid = self.last[0]
        self.cp.completed(cid)
        self._model_completed(cid)

    @precondition(lambda self: not self.ended)
    @rule(cid=st.integers(0, 12))
    def complete_another(self, cid: int) -> None:
        """A completion of an older checkpoint, or of one this task never saw."""
        self.cp.completed(cid)
        self._model_completed(cid)

    @precondition(lambda self: not self.ended)
    @rule(ahead=st.integers(-1, 1))
    def abort(self, ahead: int) -> None:
        cid = max(1, self.next_id + ahead)
        self.cp.aborted(cid)
        self.aborted.add(cid)
        if self.prepared is not None and self.prepared[0] == cid:
            self.prepared = None

    @precondition(lambda self: not self.ended)
    @rule()
    def end(self) -> None:
        self.cp.release()
        self.prepared = None
        self.ended = True

    @precondition(lambda self: self.ended)
    @rule()
    def completion_after_the_end(self) -> None:
        """A completion the task still hears of after it ended opens nothing."""
        self.cp.completed(self.next_id - 1)

    @invariant()
    def prepared_as_the_model_says(self) -> None:
        got = self.cp._prepared
        if self.prepared is None:
            assert got is None
        else:
            assert got is not None and got[0] == self.prepared[0]
            assert got[1].gates() == self.prepared[1]

    @invariant()
    def staged_memory_is_the_prepared_gates(self) -> None:
        gates = len(self.prepared[1]) if self.prepared is not None else 0
        assert STAGING_BUDGET.used - self.base == gates * STAGING_BUDGET.per_gate

    def teardown(self) -> None:
        self._patch.undo()
        if not self.ended:
            self.cp.release()
        self.cp.snapshots.shutdown(wait=True)
        assert STAGING_BUDGET.used == self.base
        shutil.rmtree(self.root, ignore_errors=True)


def test_a_failure_to_open_ahead_leaves_nothing_and_fails_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening ahead is only a head start: if it raises (a native writer that cannot
    be made), the task goes on, nothing stays reserved, and the barrier opens the
    checkpoint's channel state itself."""
    cp = _task(tmp_path)
    used = STAGING_BUDGET.used
    barrier = ev.CheckpointBarrier(1, 0, ev.BarrierKind.UNALIGNED, 0)
    inf = cp.open_inflight(barrier, set())
    inf.writer.add_input(0, 0, b"a")
    inf.writer.add_output(0, 1, b"b")
    assert inf.writer.close() is not None
    made = []
    real = ChannelStateWriter._storer

    def storer(self: ChannelStateWriter, *args: Any) -> Any:
        if made:
            raise MemoryError("cannot allocate the writer")
        made.append(1)
        return real(self, *args)

    monkeypatch.setattr(ChannelStateWriter, "_storer", storer)
    cp.completed(1)  # the second gate raises: nothing is kept
    assert cp._prepared is None
    assert STAGING_BUDGET.used == used
    monkeypatch.undo()
    inf = cp.open_inflight(ev.CheckpointBarrier(2, 0, ev.BarrierKind.UNALIGNED, 0), set())
    inf.writer.add_input(0, 0, b"c")
    result = inf.writer.close()
    assert result is not None and _contents(result) == {("input", 0): [(0, b"c")]}
    cp.release()
    cp.snapshots.shutdown(wait=True)
    assert STAGING_BUDGET.used == used


TestPrepareMachine = PrepareMachine.TestCase
TestPrepareMachine.settings = settings(
    max_examples=300,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.fixture(autouse=True)
def _roomy_budget() -> Any:
    """Every gate staged in memory (the machine counts their reservations)."""
    before = STAGING_BUDGET.per_process
    STAGING_BUDGET.configure(1 << 30)
    yield
    STAGING_BUDGET.configure(before)
