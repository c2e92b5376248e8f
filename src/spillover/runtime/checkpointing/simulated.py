"""Simulated subtasks that speak the checkpoint coordinator's real messages, so that
the real :class:`CheckpointCoordinator` and the metadata it writes can be measured
at thousands of subtasks without running them (``bench/sim_coordinator.py``,
docs/scaling.md).

The job is two operators at parallelism p joined by key_by: ``source`` (subtasks
with one output gate of p subpartitions) and ``map`` (keyed, one input gate of p
channels), T = 2p subtasks. Each subtask's acknowledgement is what a real unaligned
checkpoint at that parallelism acknowledges: its gate's handle from the
channel-state writer (:func:`~spillover.runtime.checkpointing.channel_state.gate_entry`)
for a gate with a frame count, byte count and range for every channel that held
data (a section of its group's shared file, five subtasks a file), the map's
keyed-state handle for its key-group range, the source's operator state, and the
metrics a task reports. As a real task does, each simulated subtask writes its
gate's channel index entry into its group's file, right after its section (a
sparse file: the sections' frames are not written), and its handle names that
entry. Entries are written and acknowledgements built and pickled before the
trigger, off the coordinator's thread (that is the tasks' work, not the driver's);
a relay thread unpickles them and hands them to the coordinator, as the driver's
control endpoint does on Spark.
"""

from __future__ import annotations

import os
import pickle
import queue
import threading
import time
import tracemalloc
from dataclasses import dataclass, field, replace
from typing import Any

from spillover.keygroups import key_group_range_for_operator
from spillover.runtime.checkpointing.channel_state import gate_entry
from spillover.runtime.checkpointing.checkpoint_meta import CheckpointMetadata
from spillover.runtime.checkpointing.coordinator import CheckpointCoordinator
from spillover.runtime.checkpointing.messages import (
    Ack,
    MailboxMessage,
    NotifyAborted,
    NotifyComplete,
    TriggerCheckpoint,
)
from spillover.runtime.checkpointing.metadata import METADATA_FILE, CheckpointStorage
from spillover.runtime.state import FORMAT_NAME, FORMAT_VERSION
from spillover.storage.channel_index import encode_entry
from spillover.storage.handle import Codec, GateKind, GateStateHandle, IndexRef
from spillover.storage.location import Publication
from spillover.storage.shared import write_at

SOURCE, MAP = "source", "map"
GROUP = 5  # subtasks per shared channel-state file (the default)
FRAME_BYTES = 32 * 1024  # one network buffer


@dataclass(frozen=True, slots=True)
class SimulatedJob:
    """The simulated job's shape. ``fill``: the share of a gate's channels that held
    in-flight data at the barrier (1.0 under backpressure on every channel, the
    worst case); ``frames``: buffers per such channel."""

    parallelism: int
    max_parallelism: int = 4096
    fill: float = 1.0
    frames: int = 2

    @property
    def subtasks(self) -> int:
        return 2 * self.parallelism

    def subtask_keys(self) -> list[tuple[str, int]]:
        p = self.parallelism
        return [(SOURCE, i) for i in range(p)] + [(MAP, i) for i in range(p)]

    def graph(self) -> dict[str, Any]:
        """The coordinator's graph (``graph_info``'s shape)."""
        p = self.parallelism
        return {
            "vertices": {
                SOURCE: {
                    "parallelism": p,
                    "nodes": [SOURCE],
                    "inputs": [],
                    "outputs": [MAP],
                },
                MAP: {
                    "parallelism": p,
                    "nodes": [MAP],
                    "inputs": [
                        {
                            "source": SOURCE,
                            "kind": "key_by",
                            "input_index": 0,
                            "key_field": "key",
                            "key_offset": 12,
                            "partition": 0,
                        }
                    ],
                    "outputs": [],
                },
            }
        }

    def _channels(self, subtask: int) -> list[int]:
        p = self.parallelism
        if self.fill >= 1.0:
            return list(range(p))
        n = max(1, round(p * self.fill))
        return sorted({(subtask * 7919 + k * 104729) % p for k in range(n)})

    def gate(self, checkpoint_dir: str, uid: str, subtask: int, offset: int) -> GateStateHandle:
        """The handle a subtask's one gate closes with: a section of its group's file."""
        chans = self._channels(subtask)
        frames, per = self.frames, self.frames * FRAME_BYTES
        ranges, pos = {}, 64
        for c in chans:
            end = pos + frames * (24 + FRAME_BYTES)
            ranges[c] = (pos, end)
            pos = end
        first = subtask - subtask % GROUP
        return GateStateHandle(
            uri=f"{checkpoint_dir}/channels/{uid}-{first}.spill",
            gate_id=0,
            gate_kind=GateKind.OUTPUT if uid == SOURCE else GateKind.INPUT,
            checkpoint_id=int(checkpoint_dir.rsplit("chk-", 1)[1]),
            subtask_index=subtask,
            file_id=f"{subtask:032x}",
            size=pos + 64,
            frame_count=frames * len(chans),
            raw_bytes=per * len(chans),
            stored_bytes=per * len(chans),
            codec=Codec.NONE,
            channels={c: (frames, per) for c in chans},
            channel_ranges=ranges,
            offset=offset,
        )

    def placed(
        self, checkpoint_dir: str, uid: str, first: int
    ) -> list[tuple[GateStateHandle, bytes]]:
        """The gates of the group whose first member is ``first``, each at its place in
        the group's file and naming its entry, the index section right after it, and
        that entry's bytes."""
        out = []
        at = 0
        for member in range(first, min(first + GROUP, self.parallelism)):
            handle = self.gate(checkpoint_dir, uid, member, at)
            entry = encode_entry(handle)
            ref = IndexRef(handle.uri, at + handle.size, len(entry))
            out.append((replace(handle, index=ref), entry))
            at += handle.size + len(entry)
        return out

    def ack(
        self,
        storage: CheckpointStorage,
        checkpoint_id: int,
        key: tuple[str, int],
        gate: GateStateHandle | None = None,
    ) -> Ack:
        """Subtask ``key``'s acknowledgement of checkpoint ``checkpoint_id``; ``gate``:
        its gate's handle, as :meth:`placed` gives it (made here if not given)."""
        uid, subtask = key
        chk = storage.checkpoint_dir(checkpoint_id)
        first = subtask - subtask % GROUP
        handle = gate or self.placed(chk, uid, first)[subtask - first][0]
        entry = gate_entry(handle)
        inflight = handle.raw_bytes
        channel_state = {
            "input": [entry] if uid == MAP else [],
            "output": [entry] if uid == SOURCE else [],
            "bytes": inflight,
        }
        keyed: dict[str, Any] = {}
        operators: dict[str, Any] = {}
        if uid == MAP:
            rng = key_group_range_for_operator(self.max_parallelism, self.parallelism, subtask)
            sdir = storage.subtask_dir(checkpoint_id, uid, subtask)
            name = f"keyed-kg{rng.start:05d}-{rng.end:05d}-000-sum.arrow"
            keyed[MAP] = {
                "format": FORMAT_NAME,
                "version": FORMAT_VERSION,
                "max_parallelism": self.max_parallelism,
                "key_group_range": [rng.start, rng.end],
                "bytes": 4096,
                "states": [
                    {
                        "name": "sum",
                        "kind": "value",
                        "dtype": {"fields": [["key", "<i8"], ["sum", "<i8"]]},
                        "uri": f"{sdir}/{name}",
                        "rows": 256,
                        "bytes": 4096,
                    }
                ],
            }
        else:
            operators[SOURCE] = {"partitions": [subtask], "offsets": [checkpoint_id * 1000]}
        return Ack(
            checkpoint_id=checkpoint_id,
            vertex_uid=uid,
            subtask=subtask,
            operator_state=operators,
            handles={},
            keyed=keyed,
            metrics={
                "start_delay_ms": 1.0,
                "alignment_ms": 0.0,
                "bytes_during_alignment": 0.0,
                "state_bytes": 4096.0 if uid == MAP else 64.0,
                "inflight_bytes": float(inflight),
                "sync_ms": 0.2,
                "async_ms": 3.0,
            },
            channel_state=channel_state,
        )


@dataclass
class CheckpointRun:
    """What one simulated checkpoint cost the driver."""

    checkpoint_id: int
    status: str = "pending"
    wall_s: float = 0.0  # from trigger_now() to the completion's notification
    coordinator_cpu_s: float = 0.0  # the coordinator thread, trigger to completion
    relay_cpu_s: float = 0.0  # unpickling the acknowledgements (the control endpoint)
    write_s: float = 0.0  # the metadata file built and published
    metadata_bytes: int = 0
    peak_bytes: int = 0  # tracemalloc's peak (``Simulation.checkpoint(trace=True)``)
    done: threading.Event = field(default_factory=threading.Event, repr=False)
    cpu_start: float = -1.0


class TimedStorage(CheckpointStorage):
    """Checkpoint storage that times the building of its metadata files (their
    publishing is timed by :meth:`Simulation._on_complete`)."""

    write_s = 0.0

    def metadata_file(
        self, checkpoint_id: int, metadata: CheckpointMetadata, *, relative: bool = False
    ) -> Publication:
        t = time.perf_counter()
        try:
            return super().metadata_file(checkpoint_id, metadata, relative=relative)
        finally:
            self.write_s = time.perf_counter() - t


class SimulatedTask:
    """A subtask as the coordinator sees it (:class:`TaskGateway`): a trigger at a
    root sends its barrier on (the relay acknowledges for every running subtask)."""

    def __init__(self, sim: Simulation, key: tuple[str, int]) -> None:
        self.sim = sim
        self.key = key
        self.completed: list[int] = []

    def post(self, message: MailboxMessage) -> None:
        match message:
            case TriggerCheckpoint(checkpoint_id=cid):
                self.sim._triggered(cid)
            case NotifyComplete(checkpoint_id=cid):
                self.completed.append(cid)
                if self.key == self.sim.last_key:
                    self.sim._ended(cid, "completed")
            case NotifyAborted(checkpoint_id=cid):
                if self.key == self.sim.last_key:
                    self.sim._ended(cid, "aborted")
            case _:
                pass

    def request_unaligned(self, checkpoint_id: int) -> None:
        pass


class Simulation:
    """The real coordinator with ``job.subtasks`` simulated subtasks: trigger
    checkpoints, decline one, let sources finish and exit, and time each."""

    def __init__(
        self,
        job: SimulatedJob,
        directory: str,
        *,
        num_retained: int = 1,
        graph: dict[str, Any] | None = None,
    ) -> None:
        self.job = job
        self.storage = TimedStorage(directory, "sim")
        keys = job.subtask_keys()
        self.last_key = keys[-1]
        self.tasks = {k: SimulatedTask(self, k) for k in keys}
        self.exited: set[tuple[str, int]] = set()
        self.finished: set[tuple[str, int]] = set()
        self.failures: list[BaseException] = []
        self.runs: dict[int, CheckpointRun] = {}
        self._prepared: dict[int, list[bytes]] = {}
        self._decline: set[int] = set()
        self._relay: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self.coordinator = CheckpointCoordinator(
            job_name="sim",
            fingerprint="sim",
            settings={"max-parallelism": job.max_parallelism},
            storage=self.storage,
            tasks=self.tasks,
            sources=[k for k in keys if k[0] == SOURCE],
            interval_s=None,
            num_retained=num_retained,
            tolerable_failures=1 << 30,  # a declined checkpoint costs only itself
            on_final=lambda: None,
            on_failure=self.failures.append,
            graph=graph or job.graph(),
            on_complete=self._on_complete,
        )
        self._relay_thread = threading.Thread(target=self._relay_loop, name="sim-relay")

    def __enter__(self) -> Simulation:
        self.coordinator.start()
        self._relay_thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._relay.put(None)
        self._relay_thread.join()
        self.coordinator.stop()

    def running(self) -> list[tuple[str, int]]:
        return [k for k in self.tasks if k not in self.exited]

    def prepare(self, decline: bool = False) -> int:
        """Writes the next checkpoint's channel index entries and builds and pickles its
        acknowledgements (the tasks' work); with ``decline`` the last subtask
        declines it instead."""
        cid = self.coordinator.next_id
        chk = self.storage.checkpoint_dir(cid)
        os.makedirs(os.path.join(chk, "channels"), exist_ok=True)
        groups: dict[tuple[str, int], list[tuple[GateStateHandle, bytes]]] = {}
        acks = []
        for key in self.running():
            uid, subtask = key
            first = subtask - subtask % GROUP
            group = groups.get((uid, first))
            if group is None:
                group = groups[(uid, first)] = self.job.placed(chk, uid, first)
            gate, entry = group[subtask - first]
            assert gate.index is not None
            write_at(gate.uri, gate.index.offset, entry, create=True)
            ack = self.job.ack(self.storage, cid, key, gate)
            ack.finished = key in self.finished
            acks.append(pickle.dumps(ack, protocol=pickle.HIGHEST_PROTOCOL))
        self._prepared[cid] = acks
        if decline:
            self._decline.add(cid)
        return cid

    def checkpoint(
        self, decline: bool = False, *, trace: bool = False, timeout_s: float = 600.0
    ) -> CheckpointRun:
        """Triggers one checkpoint and waits until every subtask heard how it ended;
        with ``trace``, ``peak_bytes`` is tracemalloc's peak over it (every thread's
        allocations from the trigger on, the unpickled acknowledgements included)."""
        cid = self.prepare(decline)
        run = self.runs[cid] = CheckpointRun(cid)
        if trace:
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
        start = time.perf_counter()
        self.coordinator.trigger_now()
        ended = run.done.wait(timeout_s)
        run.wall_s = time.perf_counter() - start
        if trace:
            run.peak_bytes = tracemalloc.get_traced_memory()[1] - base
            tracemalloc.stop()
        if not ended:
            raise TimeoutError(f"simulated checkpoint {cid} did not end in {timeout_s} s")
        if self.failures:
            raise self.failures[0]
        if run.status == "completed":
            meta = self.storage.location.child(f"chk-{cid}", METADATA_FILE)
            run.metadata_bytes = os.path.getsize(meta.path)
        return run

    def finish_sources(self) -> None:
        """Every source reaches the end of its data (the next checkpoint records
        them finished; after it they exit, FLIP-147)."""
        for key in self.tasks:
            if key[0] == SOURCE:
                self.finished.add(key)
                self.coordinator.end_of_data(*key)

    def exit_finished(self) -> None:
        """The finished subtasks exit: later checkpoints start at the maps."""
        for key in sorted(self.finished - self.exited):
            self.exited.add(key)
            self.coordinator.task_exited(*key)

    # -- the coordinator's thread --------------------------------------------------------

    def _triggered(self, cid: int) -> None:
        run = self.runs.get(cid)
        if run is not None and run.cpu_start < 0:
            run.cpu_start = time.thread_time()
            self._relay.put(cid)

    def _on_complete(self, cid: int, metadata: Publication) -> None:
        t = time.perf_counter()
        metadata.publish()
        run = self.runs[cid]
        run.coordinator_cpu_s = time.thread_time() - run.cpu_start
        run.write_s = self.storage.write_s + time.perf_counter() - t

    def _ended(self, cid: int, status: str) -> None:
        run = self.runs.get(cid)
        if run is not None:
            run.status = status
            run.done.set()

    # -- the relay (the driver's control endpoint) ----------------------------------------

    def _relay_loop(self) -> None:
        while (cid := self._relay.get()) is not None:
            run = self.runs[cid]
            acks = self._prepared.pop(cid)
            declined = cid in self._decline
            t = time.thread_time()
            for i, data in enumerate(acks):
                ack: Ack = pickle.loads(data)
                if declined and i == len(acks) - 1:
                    self.coordinator.decline(cid, ack.vertex_uid, ack.subtask, "simulated")
                else:
                    self.coordinator.acknowledge(ack)
            run.relay_cpu_s = time.thread_time() - t


def run_checkpoints(
    job: SimulatedJob,
    directory: str,
    checkpoints: int = 3,
    *,
    graph: dict[str, Any] | None = None,
    num_retained: int = 1,
) -> list[CheckpointRun]:
    """The simulation's script: ``checkpoints`` completed checkpoints, one declined,
    one after the sources finished, one after they exited (the maps are its roots)."""
    runs: list[CheckpointRun] = []
    with Simulation(job, directory, graph=graph, num_retained=num_retained) as sim:
        for _ in range(checkpoints):
            runs.append(sim.checkpoint())
        runs.append(sim.checkpoint(decline=True))
        sim.finish_sources()
        runs.append(sim.checkpoint())
        sim.exit_finished()
        runs.append(sim.checkpoint())
    return runs
