"""The checkpoint coordinator after tasks finish (FLIP-147): where a checkpoint is
triggered, whom it waits for, what a subtask exiting does to a pending checkpoint,
and what the metadata records of finished operators."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from spillover.rescale import Piece, Reference
from spillover.runtime import jobresult
from spillover.runtime.checkpointing import coordinator
from spillover.runtime.checkpointing.checkpoint_meta import (
    ChannelStateMeta,
    OperatorMeta,
    SubtaskMeta,
)
from spillover.runtime.checkpointing.coordinator import CheckpointCoordinator
from spillover.runtime.checkpointing.messages import (
    Ack,
    MailboxMessage,
    NotifyAborted,
    NotifyComplete,
    TriggerCheckpoint,
)
from spillover.runtime.checkpointing.metadata import CheckpointStorage, new_metadata
from spillover.runtime.jobresult import JobResult
from spillover.storage.handle import GateKind, GateStateHandle
from support.threads import eventually

# a -> b -> d and c -> d: two sources, d has two inputs.


def _vertex(parallelism: int, *sources: str, kind: str = "rebalance") -> dict[str, Any]:
    """A vertex as the checkpoint's graph records it (``VertexInfo.to_json``)."""
    inputs = [
        {
            "source": s,
            "kind": kind,
            "input_index": i,
            "key_field": None,
            "key_offset": None,
            "partition": 0,
        }
        for i, s in enumerate(sources)
    ]
    return {"parallelism": parallelism, "nodes": [], "inputs": inputs, "outputs": []}


GRAPH = {
    "vertices": {
        "a": _vertex(2),
        "b": _vertex(2, "a"),
        "c": _vertex(1),
        "d": _vertex(2, "b", "c"),
    }
}
TASKS = [(uid, i) for uid, v in GRAPH["vertices"].items() for i in range(v["parallelism"])]


class RecordingTask:
    """A task gateway that records the coordinator's messages."""

    def __init__(self) -> None:
        self.messages: list[MailboxMessage] = []
        self.lock = threading.Lock()

    def post(self, message: MailboxMessage) -> None:
        with self.lock:
            self.messages.append(message)

    def request_unaligned(self, checkpoint_id: int) -> None:
        pass

    def of(self, kind: type) -> list[Any]:
        with self.lock:
            return [m for m in self.messages if isinstance(m, kind)]


class Harness:
    def __init__(
        self,
        tmp: Path,
        graph: dict[str, Any] = GRAPH,
        num_retained: int = 10,
        max_concurrent: int = 1,
        interval_s: float | None = None,
    ) -> None:
        tasks = [(uid, i) for uid, v in graph["vertices"].items() for i in range(v["parallelism"])]
        self.tasks = {key: RecordingTask() for key in tasks}
        self.failures: list[BaseException] = []
        self.storage = CheckpointStorage(str(tmp), "job")
        self.co = CheckpointCoordinator(
            job_name="job",
            fingerprint="f",
            settings={},
            storage=self.storage,
            tasks=self.tasks,
            sources=[k for k in tasks if not graph["vertices"][k[0]]["inputs"]],
            interval_s=interval_s,
            on_final=lambda: None,
            on_failure=self.failures.append,
            graph=graph,
            num_retained=num_retained,
            max_concurrent=max_concurrent,
        )
        self.co.start()

    def trigger(self) -> int:
        before = {k: len(t.of(TriggerCheckpoint)) for k, t in self.tasks.items()}
        self.co.trigger_now()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            fresh = [
                t.of(TriggerCheckpoint)[-1]
                for k, t in self.tasks.items()
                if len(t.of(TriggerCheckpoint)) > before[k]
            ]
            if fresh:
                return int(fresh[0].checkpoint_id)
            time.sleep(0.002)
        raise AssertionError("nothing was triggered")

    def trigger_final(self, after: int) -> int:
        """Waits for the coordinator to trigger a checkpoint after ``after`` on its own."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for t in self.tasks.values():
                ids = [m.checkpoint_id for m in t.of(TriggerCheckpoint) if m.checkpoint_id > after]
                if ids:
                    return int(ids[0])
            time.sleep(0.002)
        raise AssertionError("no checkpoint was triggered")

    def roots_of(self, cid: int) -> list[tuple[str, int]]:
        return sorted(
            k
            for k, t in self.tasks.items()
            if any(m.checkpoint_id == cid for m in t.of(TriggerCheckpoint))
        )

    def ack(self, cid: int, key: tuple[str, int], finished: bool = False) -> None:
        state = {key[0]: {"n": key[1]}}
        keyed = {key[0]: {"uri": f"{self.storage.subtask_dir(cid, *key)}/keyed"}}
        self.co.acknowledge(Ack(cid, key[0], key[1], state, {}, keyed, {}, finished=finished))

    def wait_for(self, key: tuple[str, int], kind: type, cid: int) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if any(m.checkpoint_id == cid for m in self.tasks[key].of(kind)):
                return
            time.sleep(0.002)
        raise AssertionError(f"{key} got no {kind.__name__} of {cid}")

    def stop(self) -> None:
        self.co.stop()
        assert not self.failures, self.failures


@pytest.fixture
def h(tmp_path: Path) -> Any:
    harness = Harness(tmp_path)
    yield harness
    harness.stop()


def test_a_checkpoint_starts_at_the_sources_while_everything_runs(h: Harness) -> None:
    cid = h.trigger()
    assert h.roots_of(cid) == [("a", 0), ("a", 1), ("c", 0)]


def test_roots_move_behind_operators_whose_subtasks_all_exited(h: Harness) -> None:
    h.co.task_exited("a", 0)
    cid = h.trigger()
    assert h.roots_of(cid) == [("a", 1), ("c", 0)]  # one running subtask keeps b behind
    for key in TASKS:
        if key != ("a", 0):
            h.ack(cid, key)
    h.wait_for(("b", 0), NotifyComplete, cid)
    h.co.task_exited("a", 1)
    cid = h.trigger()
    assert h.roots_of(cid) == [("b", 0), ("b", 1), ("c", 0)]
    for key in TASKS:
        if key[0] != "a":
            h.ack(cid, key)
    h.wait_for(("d", 0), NotifyComplete, cid)
    h.co.task_exited("c", 0)
    for key in [("b", 0), ("b", 1)]:
        h.co.task_exited(*key)
    cid = h.trigger()
    assert h.roots_of(cid) == [("d", 0), ("d", 1)]  # d's inputs all ended


def test_behind_a_forward_edge_a_subtask_is_a_root_once_its_own_upstream_exited(
    tmp_path: Path,
) -> None:
    """A forward edge feeds subtask i from upstream subtask i alone: once that one
    exited, no barrier can reach subtask i, even while other upstream subtasks run."""
    graph = {
        "vertices": {
            "a": _vertex(2),
            "e": _vertex(2, "a", kind="forward"),
        }
    }
    h = Harness(tmp_path, graph)
    try:
        h.co.task_exited("a", 0)
        cid = h.trigger()
        assert h.roots_of(cid) == [("a", 1), ("e", 0)]
    finally:
        h.stop()


def test_roots_that_exit_before_taking_their_trigger_pass_it_to_the_subtasks_behind(
    h: Harness,
) -> None:
    """A trigger posted to a subtask that then exits without taking it: no barrier
    leaves it, so the subtasks that become roots by its exit are triggered instead,
    and the checkpoint completes instead of hanging."""
    first = h.trigger()
    for key in TASKS:
        h.ack(first, key, finished=key[0] == "a")
    h.wait_for(("a", 0), NotifyComplete, first)
    cid = h.trigger()
    assert h.roots_of(cid) == [("a", 0), ("a", 1), ("c", 0)]
    h.co.task_exited("a", 0)
    h.co.task_exited("a", 1)  # neither took the trigger
    h.wait_for(("b", 0), TriggerCheckpoint, cid)
    h.wait_for(("b", 1), TriggerCheckpoint, cid)
    for key in TASKS:
        if key[0] != "a":
            h.ack(cid, key)
    h.wait_for(("d", 0), NotifyComplete, cid)
    assert h.roots_of(cid) == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("c", 0)]


def test_a_subtask_that_never_completed_a_checkpoint_aborts_one_by_exiting(h: Harness) -> None:
    """Without a state of its own to stand for it, the checkpoint it left cannot
    complete: aborted, not counted as a failure (the harness fails on a failure)."""
    cid = h.trigger()
    for key in TASKS:
        if key != ("b", 1):
            h.ack(cid, key)
    h.co.task_exited("b", 1)
    h.wait_for(("a", 0), NotifyAborted, cid)
    assert h.storage.completed_ids() == []
    nxt = h.trigger()  # the next one goes on without b#1
    for key in TASKS:
        if key != ("b", 1):
            h.ack(nxt, key)
    h.wait_for(("a", 0), NotifyComplete, nxt)


def test_metadata_records_finished_subtasks_and_operators(h: Harness) -> None:
    first = h.trigger()
    for key in TASKS:
        h.ack(first, key, finished=key[0] == "a" or key == ("b", 0))
    h.wait_for(("a", 0), NotifyComplete, first)
    h.co.task_exited("a", 0)
    h.co.task_exited("a", 1)
    second = h.trigger()
    for key in TASKS:
        if key[0] != "a":
            h.ack(second, key, finished=key == ("b", 0))
    h.wait_for(("d", 0), NotifyComplete, second)
    meta = h.storage.read_metadata(second)
    status = {uid: t["finished"] for uid, t in meta["tasks"].items()}
    assert status == {"a": "fully", "b": "partially", "c": "running", "d": "running"}
    a0 = meta["tasks"]["a"]["subtasks"]["0"]
    # An exited subtask keeps the state of the checkpoint it finished in, and that
    # checkpoint's files are kept for it.
    assert a0["finished"] and a0["operators"] == {"a": {"n": 0}} and a0["channel_state"] == {}
    assert f"chk-{first}/" in a0["keyed"]["a"]["uri"]
    assert meta["references"] == [first] and h.storage.read(second).references == (first,)
    assert meta["tasks"]["a"]["parallelism"] == 2 and not meta["final"]


def test_a_checkpoint_in_which_everything_finished_is_final(h: Harness) -> None:
    cid = h.trigger()
    for key in TASKS:
        h.ack(cid, key, finished=True)
    h.wait_for(("d", 1), NotifyComplete, cid)
    assert h.storage.read_metadata(cid)["final"]


def test_a_pending_checkpoint_completes_with_the_state_an_exited_subtask_left(
    h: Harness,
) -> None:
    """A subtask that finished, completed a checkpoint and exited before it
    acknowledged the next one: that one completes with its last state."""
    first = h.trigger()
    for key in TASKS:
        h.ack(first, key, finished=key[0] == "c")
    h.wait_for(("c", 0), NotifyComplete, first)
    second = h.trigger()
    h.co.task_exited("c", 0)  # before its acknowledgement of the second
    for key in TASKS:
        if key != ("c", 0):
            h.ack(second, key)
    h.wait_for(("a", 0), NotifyComplete, second)
    meta = h.storage.read_metadata(second)
    c0 = meta["tasks"]["c"]["subtasks"]["0"]
    assert c0["finished"] and c0["operators"] == {"c": {"n": 0}}
    assert meta["tasks"]["c"]["finished"] == "fully"
    assert not h.tasks[("a", 0)].of(NotifyAborted)


def test_an_unaligned_stop_suspends_every_task_then_triggers_its_savepoint(h: Harness) -> None:
    """The savepoint supersedes a pending aligned checkpoint (aborted, no failure);
    every task hears it is the stop's savepoint before the roots are triggered, and
    the savepoint is unaligned."""
    from spillover.runtime.checkpointing.messages import Suspend

    pending = h.trigger()  # aligned (the harness's default kind), never acknowledged
    h.co.request_stop()
    h.wait_for(("a", 0), NotifyAborted, pending)
    deadline = time.monotonic() + 10
    while h.co.stop_id is None and time.monotonic() < deadline:
        time.sleep(0.002)
    sp = h.co.stop_id
    assert sp is not None and sp > pending
    for key, task in h.tasks.items():
        kinds = [type(m) for m in task.messages if getattr(m, "checkpoint_id", None) == sp]
        assert kinds[0] is Suspend, (key, kinds)
    trigger = next(m for m in h.tasks[("a", 0)].of(TriggerCheckpoint) if m.checkpoint_id == sp)
    assert trigger.kind == 1  # unaligned
    for key in TASKS:
        h.ack(sp, key)
    h.wait_for(("d", 1), NotifyComplete, sp)
    assert h.co.completed_ids[-1] == sp


def test_no_final_checkpoint_is_triggered_while_the_stops_savepoint_is_pending(
    tmp_path: Path,
) -> None:
    """Chaos ``29-35``: every task's data ended (a job restored from its final
    checkpoint) while an aligned stop's savepoint was pending, with slots for more
    checkpoints. The final checkpoint was triggered beside the savepoint: its barrier
    made the tasks behind the sources let go of the savepoint they held, the sources
    held on, and when the savepoint completed the sources ended suspended, without
    EndOfPartition, and the rest waited for it forever. The savepoint goes first:
    nothing newer is triggered while it is pending, and once every operator
    finished in it, it is the final checkpoint too."""
    from spillover.runtime.checkpointing.messages import Suspend

    h = Harness(tmp_path, max_concurrent=4)
    try:
        h.co.request_stop(kind=0)  # aligned
        deadline = time.monotonic() + 10
        while h.co.stop_id is None and time.monotonic() < deadline:
            time.sleep(0.002)
        sp = h.co.stop_id
        assert sp is not None
        for key in TASKS:
            h.co.end_of_data(*key)
        for key in TASKS:  # after the ends of data: the coordinator sees them first
            h.ack(sp, key, finished=True)
        h.wait_for(("d", 1), NotifyComplete, sp)
        h.co.stop()
        for key, task in h.tasks.items():
            got = [(type(m).__name__, m.checkpoint_id) for m in task.messages]
            expected = (
                [("Suspend", sp), ("TriggerCheckpoint", sp)]
                if key in h.roots_of(sp)
                else [("Suspend", sp)]
            )
            assert got == [*expected, ("NotifyComplete", sp)], key
        assert [(c.checkpoint_id, c.status, c.savepoint, c.final) for c in h.co.history] == [
            (sp, "completed", True, True)
        ]
        assert all(isinstance(t.messages[0], Suspend) for t in h.tasks.values())
    finally:
        h.stop()


def test_checkpoints_after_the_stops_savepoint_never_delete_it_or_what_it_references(
    tmp_path: Path,
) -> None:
    """The stop's savepoint is exported once the attempt ended: a checkpoint that
    completes after it (here the final one, the data having ended meanwhile) must
    not subsume it, nor the checkpoint whose files it references, out of storage,
    whatever ``num-retained`` says."""
    h = Harness(tmp_path, num_retained=1)
    try:
        first = h.trigger()
        for key in TASKS:
            h.ack(first, key, finished=key[0] == "c")
        h.wait_for(("c", 0), NotifyComplete, first)
        h.co.task_exited("c", 0)  # its state is carried: later checkpoints reference first
        h.co.request_stop()
        deadline = time.monotonic() + 10
        while h.co.stop_id is None and time.monotonic() < deadline:
            time.sleep(0.002)
        sp = h.co.stop_id
        assert sp is not None
        for key in TASKS:
            if key != ("c", 0):
                h.ack(sp, key)
        h.wait_for(("a", 0), NotifyComplete, sp)
        assert h.storage.read_metadata(sp)["references"] == [first]
        for key in TASKS:  # every task's data ended: the final checkpoint follows
            if key != ("c", 0):
                h.co.end_of_data(*key)
        final = h.trigger_final(after=sp)
        for key in TASKS:
            if key != ("c", 0):
                h.ack(final, key, finished=True)
        h.wait_for(("d", 1), NotifyComplete, final)
        assert sp in h.storage.completed_ids() and first in h.storage.completed_ids()
        target = str(tmp_path / "savepoint")
        h.storage.export(sp, target)  # every file it points to is still there
    finally:
        h.stop()


def _complete(h: Harness, n: int) -> int:
    """Triggers a checkpoint, acknowledges it everywhere and waits until it is the
    ``n``-th ended."""
    cid = h.trigger()
    for key in TASKS:
        h.ack(cid, key)
    deadline = time.monotonic() + 10
    while h.co.ended < n and time.monotonic() < deadline:
        time.sleep(0.002)
    assert h.co.ended == n
    return cid


def test_a_long_running_job_keeps_the_newest_checkpoints_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory stays bounded however long a job runs: every subtask's metrics of the
    newest checkpoints (1.2 kB a subtask each), the summaries of more of them, and a
    count of all; a result over several attempts keeps the newest summaries too."""
    monkeypatch.setattr(coordinator, "HISTORY_SIZE", 3)
    monkeypatch.setattr(coordinator, "MAX_CHECKPOINTS", 5)
    h = Harness(tmp_path)
    ids = []
    try:
        for n in range(1, 9):
            ids.append(_complete(h, n))
    finally:
        h.stop()
    assert h.co.ended == 8
    assert [s.checkpoint_id for s in h.co.history] == ids[-3:]
    assert all(len(s.subtasks) == len(TASKS) for s in h.co.history)
    summaries = list(h.co.summaries)
    assert [c["checkpoint_id"] for c in summaries] == ids[-5:]
    assert all(c["status"] == "completed" and "subtasks" not in c for c in summaries)

    monkeypatch.setattr(jobresult, "MAX_CHECKPOINTS", 7)
    result = JobResult("job", "finished", 2, 1.0)
    result.add_checkpoints(summaries, h.co.ended)  # two attempts
    result.add_checkpoints(summaries, h.co.ended)
    assert result.checkpoints == (summaries + summaries)[-7:]
    assert result.checkpoints_ended == 16
    # A run restored from that one (spillover verify's second run) comes after it.
    later = JobResult("job", "finished", 1, 1.0, checkpoints=summaries[:2], checkpoints_ended=2)
    later.continues(result)
    assert later.checkpoints == (result.checkpoints + summaries[:2])[-7:]
    assert later.checkpoints_ended == 18 and later.attempts == 3


def test_the_next_checkpoints_folders_are_made_between_checkpoints(tmp_path: Path) -> None:
    """A periodic checkpoint's folders are made as the one before completes, so that
    no task makes one on its checkpoint's path: those the last one wrote its files
    in, under the next one's directory, empty and not complete. The next checkpoint
    completes in them; the job ending before the one after, its folders go."""
    h = Harness(tmp_path, interval_s=3600)  # triggered by hand only
    folders = sorted(f"{u}-{i}" for u, i in TASKS)

    def made(cid: int) -> bool:  # (after the completion is counted, on its thread)
        ahead = Path(h.storage.checkpoint_dir(cid))
        return ahead.is_dir() and sorted(p.name for p in ahead.iterdir()) == folders

    try:
        first = _complete(h, 1)
        eventually(lambda: made(first + 1))
        ahead = Path(h.storage.checkpoint_dir(first + 1))
        assert not any(any(p.iterdir()) for p in ahead.iterdir())
        assert h.storage.completed_ids() == [first]
        second = _complete(h, 2)
        assert second == first + 1
        eventually(lambda: made(second + 1))
    finally:
        h.stop()
    assert h.storage.all_ids() == h.storage.completed_ids() == [first, second]


def test_checkpoints_triggered_only_by_hand_make_nothing_ahead(h: Harness) -> None:
    """Without a checkpoint interval nothing says another checkpoint comes."""
    first = _complete(h, 1)
    assert h.storage.all_ids() == [first]


def _gate(uri: str) -> GateStateHandle:
    return GateStateHandle(uri, 0, GateKind.INPUT, 0, 0, "f", 4, 0, 0, 0)


def test_prepared_folders_are_those_a_checkpoint_wrote_its_own_files_in(tmp_path: Path) -> None:
    """Its gates' shared file, its keyed state and other handles, nested or not;
    not the folders of older checkpoints' files it references, nor the files."""
    storage = CheckpointStorage(str(tmp_path), "j")
    chk3, chk1 = Path(storage.checkpoint_dir(3)), Path(storage.checkpoint_dir(1))
    channel_state = ChannelStateMeta(
        input=(_gate(str(chk3 / "channels" / "worker-0.spill")),),
        bytes=4,
        references=(Reference(0, 0, (Piece(_gate(str(chk1 / "old" / "in.spill")), 0),)),),
    )
    subtask = SubtaskMeta(
        keyed={"count": {"states": [{"uri": str(chk3 / "count-0" / "keyed.arrow")}]}},
        handles={"sink": {"files": [str(chk3 / "sink-0" / "part" / "f.parquet")]}},
        channel_state=channel_state,
    )
    meta = new_metadata(
        job_name="j",
        checkpoint_id=3,
        trigger_ms=1,
        fingerprint="f",
        settings={"max-parallelism": 128},
        tasks={"m": OperatorMeta({0: subtask}, 1)},
        final=False,
    )
    assert storage.prepare(4, meta)
    chk4 = Path(storage.checkpoint_dir(4))
    made = sorted(str(p.relative_to(chk4)) for p in chk4.rglob("*"))
    assert made == ["channels", "count-0", "sink-0", "sink-0/part"]
    assert storage.all_ids() == [4]  # chk-3 and chk-1 were never made here
