"""Shared channel-state objects on S3 (moto's server in this process), with faults.

The subtasks of a group write one object per checkpoint, published once every part
has closed (storage/shared_objects.py). Each test ends in one of two ways a user
can rely on: a complete checkpoint whose every section restores exactly (read by
offset, with ranged GETs), or a declined one that leaves no object behind and is
followed by a complete one. Never a missing or corrupt section."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spillover.errors import StorageError
from spillover.runtime.checkpointing.channel_state import (
    ChannelState,
    ChannelStateGroup,
    channel_state_groups,
    open_channel_state,
)
from spillover.storage import GateStateHandle, open_retriever
from spillover.storage.channel_index import resolve_all
from spillover.storage.location import Location
from support import s3_faults as faults
from support.s3_faults import Fault, FaultyMotoServer

faulty_s3 = faults.faulty_s3  # the module's server (a fixture)
s3_faults = faults.s3_faults  # it, without faults before and after each test (a fixture)

pytestmark = [pytest.mark.s3]

# (gate kind, gate, [(channel, payload), ...]) of one subtask's part
Gates = list[tuple[str, int, list[tuple[int, bytes]]]]


@dataclass
class Job:
    """A group of subtasks writing channel state under one S3 prefix."""

    server: FaultyMotoServer
    size: int
    wait: float = 30.0
    root: Location = field(init=False)
    groups: dict[tuple[str, int], ChannelStateGroup] = field(init=False)

    def __post_init__(self) -> None:
        self.root = Location.parse(self.server.fresh_uri())
        members = [("op", i) for i in range(self.size)]
        self.groups = channel_state_groups(
            members, self.size, self.checkpoint_dir, publish_wait=self.wait
        )

    def checkpoint_dir(self, cid: int) -> str:
        return self.root.child(f"chk-{cid}").uri

    def subtask_dir(self, cid: int, uid: str, i: int) -> str:
        return self.root.child(f"chk-{cid}", f"{uid}-{i}").uri

    def writer(self, cid: int, i: int, gates: Gates) -> ChannelState:
        w = open_channel_state(self.subtask_dir, cid, "op", i, None, self.groups[("op", i)])
        for kind, gate, buffers in gates:
            for channel, payload in buffers:
                if kind == "input":
                    w.add_input(gate, channel, payload)
                else:
                    w.add_output(gate, channel, payload)
        return w

    def keys(self, cid: int) -> list[str]:
        prefix = self.root.child(f"chk-{cid}").path.partition("/")[2]
        return self.server.keys(prefix + "/")


def gates_of(i: int, sizes: list[int]) -> Gates:
    """Subtask ``i``'s gates: an input gate with one buffer per size, an output gate."""
    ins = [(ch, bytes([i + 1]) * n + b"|%d|%d" % (i, ch)) for ch, n in enumerate(sizes)]
    return [("input", 0, ins), ("output", 0, [(0, b"out-%d" % i)])]


def restored(state: dict[str, Any]) -> Gates:
    """What a part's handles read back: every gate's (kind, gate, buffers)."""
    out: Gates = []
    for kind in ("input", "output"):
        for d in state[kind]:
            h = GateStateHandle.from_dict(d)
            assert h.offset is not None, "a shared object's section has an offset"
            # its channel maps: the index section right after it, in the same object
            assert h.index is not None and h.index.uri == h.uri
            assert h.index.offset == h.offset + h.size
            (full,) = resolve_all([h])
            with open_retriever(h) as rd:
                buffers = [(b.channel_id, bytes(b)) for b in rd]
            assert set(full.channels) == {c for c, _ in buffers}
            out.append((kind, h.gate_id, buffers))
    return out


class Closing:
    """A part's close on a thread of its own (a channel-state thread waits for the
    group's publish): ``state`` once it returned, ``error`` once it raised."""

    def __init__(self, writer: ChannelState) -> None:
        self.writer = writer
        self.state: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.state = self.writer.close()
        except BaseException as e:
            self.error = e

    def join(self) -> Closing:
        self.thread.join(60)
        assert not self.thread.is_alive(), "a close never returned"
        return self


def settled(group: ChannelStateGroup, cid: int, n: int) -> Callable[[], bool]:
    f = group.file(cid)
    return lambda: len(getattr(f, "_settled", ())) >= n


def wait_until(cond: Callable[[], bool]) -> None:
    done = threading.Event()
    for _ in range(3000):
        if cond():
            return
        done.wait(0.01)
    raise AssertionError("condition never held")


def complete_checkpoint(job: Job, cid: int) -> None:
    """A clean checkpoint of the whole group: one object, every section exact."""
    parts = [gates_of(i, [100 + i, 3]) for i in range(job.size)]
    closings = [Closing(job.writer(cid, i, parts[i])) for i in range(job.size)]
    for i, c in enumerate(closings):
        c.join()
        assert c.error is None, c.error
        assert c.state is not None and restored(c.state) == parts[i]
    assert job.keys(cid) == [f"{job.root.path.partition('/')[2]}/chk-{cid}/channels/op-0.spill"]


def test_one_object_published_after_every_part_closed(s3_faults: FaultyMotoServer) -> None:
    job = Job(s3_faults, 3)
    parts = [gates_of(i, [1000 * (i + 1), 17, 0]) for i in range(3)]
    writers = [job.writer(1, i, parts[i]) for i in range(3)]
    first = [Closing(writers[i]) for i in (2, 0)]
    wait_until(settled(job.groups[("op", 0)], 1, 2))
    # Two parts closed, the third is open: nothing published, nobody acknowledged.
    assert job.keys(1) == []
    assert all(c.state is None and c.error is None for c in first)
    last = Closing(writers[1]).join()
    for c in first:
        c.join()
    states = {i: c.state for i, c in zip((2, 0, 1), [*first, last], strict=True)}
    assert job.keys(1) == [f"{job.root.path.partition('/')[2]}/chk-1/channels/op-0.spill"]
    s3_faults.faulty.requests.clear()  # type: ignore[union-attr]
    for i in range(3):
        assert states[i] is not None and restored(states[i]) == parts[i]
    # Restore read sections by offset: ranged GETs, never the whole object.
    gets = [r for r in s3_faults.faulty.requests if r[0] == "GET"]  # type: ignore[union-attr]
    assert gets and all(r[2].startswith("bytes=") for r in gets if "op-0.spill" in r[1])


def test_a_failing_put_declines_and_the_next_checkpoint_completes(
    s3_faults: FaultyMotoServer,
) -> None:
    """An S3 that answers the object's PUTs with 500 (pyarrow retries, then gives up)."""
    job = Job(s3_faults, 3)
    s3_faults.faults.append(Fault(key="/chk-1/channels/", method="PUT", status=500))
    closings = [Closing(job.writer(1, i, gates_of(i, [5000, 1]))) for i in range(3)]
    for c in closings:
        c.join()
        assert isinstance(c.error, StorageError) and c.state is None
    assert job.keys(1) == []
    s3_faults.faults.clear()
    complete_checkpoint(job, 2)


def test_a_failing_upload_part_of_a_large_object_declines(s3_faults: FaultyMotoServer) -> None:
    """Over pyarrow's multipart threshold (5 MiB per part): one failing upload part
    aborts the whole upload and no object appears."""
    job = Job(s3_faults, 2)
    s3_faults.faults.append(Fault(key="/chk-1/channels/", method="PUT"))
    big = [gates_of(i, [3 << 20, 2 << 20]) for i in range(2)]
    closings = [Closing(job.writer(1, i, big[i])) for i in range(2)]
    for c in closings:
        c.join()
        assert isinstance(c.error, StorageError)
    assert job.keys(1) == []
    s3_faults.faults.clear()
    closings = [Closing(job.writer(2, i, big[i])) for i in range(2)]
    for i, c in enumerate(closings):
        c.join()
        assert c.state is not None and restored(c.state) == big[i]


def test_a_slow_upload_holds_every_acknowledgement(s3_faults: FaultyMotoServer) -> None:
    job = Job(s3_faults, 2)
    fault = Fault(key="/chk-1/channels/", method="PUT", fail=False, release=threading.Event())
    s3_faults.faults.append(fault)
    parts = [gates_of(i, [300, 7]) for i in range(2)]
    closings = [Closing(job.writer(1, i, parts[i])) for i in range(2)]
    assert fault.started.wait(30)
    # The upload is under way: no part returned a handle to an object not there yet.
    assert all(c.state is None and c.error is None for c in closings)
    assert job.keys(1) == []
    assert fault.release is not None
    fault.release.set()
    for i, c in enumerate(closings):
        c.join()
        assert c.state is not None and restored(c.state) == parts[i]


def test_a_slow_part_goes_into_the_groups_next_object(s3_faults: FaultyMotoServer) -> None:
    """A member later than the group's wait: the others publish without it, its part
    becomes the group's second object, and every section restores."""
    job = Job(s3_faults, 3, wait=0.2)
    parts = [gates_of(i, [64, 64]) for i in range(3)]
    slow = job.writer(1, 2, parts[2])  # open, written, not closed yet
    early = [Closing(job.writer(1, i, parts[i])) for i in range(2)]
    assert [c.join().error for c in early] == [None, None]
    late = Closing(slow).join()
    assert late.error is None
    prefix = f"{job.root.path.partition('/')[2]}/chk-1/channels/"
    assert job.keys(1) == [prefix + "op-0.1.spill", prefix + "op-0.spill"]
    for i, c in enumerate([*early, late]):
        assert c.state is not None and restored(c.state) == parts[i]


def test_a_checkpoint_aborted_while_parts_are_open(s3_faults: FaultyMotoServer) -> None:
    job = Job(s3_faults, 3)
    writers = [job.writer(1, i, gates_of(i, [900, 9])) for i in range(3)]
    waiting = [Closing(writers[i]) for i in range(2)]
    wait_until(settled(job.groups[("op", 0)], 1, 2))
    writers[2].discard()  # the coordinator aborted checkpoint 1
    for c in waiting:
        c.join()
        assert isinstance(c.error, StorageError) and c.state is None
    assert job.keys(1) == []
    complete_checkpoint(job, 2)


def test_a_subtask_that_dies_before_closing_its_part(s3_faults: FaultyMotoServer) -> None:
    """Its task thread is gone without a word: the others publish after the group's
    wait (their sections are whole), the checkpoint lacks its acknowledgement and is
    declined by the coordinator, and the next checkpoint completes. When the dying
    task lets go of its part (its release discards it), the others decline at once."""
    job = Job(s3_faults, 3, wait=0.2)
    parts = [gates_of(i, [128]) for i in range(3)]
    job.writer(1, 2, parts[2])  # never closed nor discarded
    closed = [Closing(job.writer(1, i, parts[i])) for i in range(2)]
    for i, c in enumerate(closed):
        c.join()
        assert c.state is not None and restored(c.state) == parts[i]
    released = job.writer(2, 2, parts[2])
    waiting = [Closing(job.writer(2, i, parts[i])) for i in range(2)]
    released.discard()
    for c in waiting:
        assert isinstance(c.join().error, StorageError)
    assert job.keys(2) == []
    complete_checkpoint(job, 3)


def test_a_member_whose_task_ended_is_not_waited_for(s3_faults: FaultyMotoServer) -> None:
    """A finished task leaves its group: the others publish one object as soon as
    they closed, in this checkpoint and the next, without the group's wait."""
    job = Job(s3_faults, 3)  # a 30 s wait: the test would time out on it
    parts = [gates_of(i, [50]) for i in range(2)]
    waiting = [Closing(job.writer(1, i, parts[i])) for i in range(2)]
    wait_until(settled(job.groups[("op", 0)], 1, 2))
    job.groups[("op", 2)].leave(("op", 2))
    for cid in (1, 2):
        if cid == 2:
            waiting = [Closing(job.writer(2, i, parts[i])) for i in range(2)]
        for i, c in enumerate(waiting):
            c.join()
            assert c.state is not None and restored(c.state) == parts[i]
        assert len(job.keys(cid)) == 1


FATES = st.sampled_from(["close", "close", "close", "discard", "die"])


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    data=st.data(),
    size=st.integers(2, 5),
    upload_fails=st.booleans(),
)
def test_outcome_matches_the_model(
    s3_faults: FaultyMotoServer, data: st.DataObject, size: int, upload_fails: bool
) -> None:
    """Random group sizes, part sizes, fates (close, discard: a failed or aborted part,
    die: never closes) and an upload that fails, in a random order. The model:

    - a discard or a failed upload declines the checkpoint and leaves no object,
      and the group's next checkpoint completes;
    - otherwise every part that closed reads back exactly through its handles (a
      part that died leaves the checkpoint unacknowledged, never corrupt);
    - with every part closed and no fault, the group wrote exactly one object."""
    s3_faults.faults.clear()
    fates = data.draw(st.lists(FATES, min_size=size, max_size=size), label="fates")
    sizes = data.draw(
        st.lists(
            st.lists(st.integers(0, 5000), min_size=1, max_size=3), min_size=size, max_size=size
        ),
        label="sizes",
    )
    order = data.draw(st.permutations(range(size)), label="order")
    job = Job(s3_faults, size, wait=0.3)
    if upload_fails:
        s3_faults.faults.append(
            Fault(key=job.root.path.partition("/")[2] + "/chk-1/", method="PUT")
        )
    parts = [gates_of(i, sizes[i]) for i in range(size)]
    writers = [job.writer(1, i, parts[i]) for i in range(size)]
    closings: dict[int, Closing] = {}
    rng = random.Random(data.draw(st.integers(0, 2**16), label="seed"))
    for i in order:
        if fates[i] == "close":
            closings[i] = Closing(writers[i])
        elif fates[i] == "discard":
            writers[i].discard()
        if rng.random() < 0.3:
            threading.Event().wait(0.05)
    for c in closings.values():
        c.join()
    declined = "discard" in fates or (upload_fails and bool(closings))
    if declined:
        assert job.keys(1) == []
        s3_faults.faults.clear()
        complete_checkpoint(job, 2)  # the group's next checkpoint is whole
    else:
        for i, c in closings.items():
            assert c.error is None, c.error
            assert c.state is not None and restored(c.state) == parts[i]
        if "die" not in fates:
            assert len(job.keys(1)) == 1
    s3_faults.faults.clear()
