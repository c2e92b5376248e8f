"""One Spark task of a generation: hosts its slots' subtasks of every operator.

Worker ``w`` hosts subtasks ``w * k`` to ``w * k + k - 1`` of every operator that
has them, ``k`` the job's ``taskmanager.numberOfTaskSlots`` (:func:`worker_of`):
channels between them stay in memory, and they share channel-state files.

Runs inside a PySpark barrier task, though :func:`run_worker` uses nothing of Spark:
the runner passes the task's partition id as the worker index. The protocol with
the job master (docs/spark.md):

1. connect to the master's control endpoint with the job secret; start a
   :class:`~spillover.runtime.network.tcp.TcpReceiver` on the address that reaches
   the master; send ``hello``;
2. get the address table; build this worker's subtasks and their network (input
   gates registered with the receiver, subpartitions for other workers linked over
   TCP once every worker is ready); send ``wired``; on ``go``, link and start;
3. relay: the coordinator's mailbox actions to the subtasks; their acks, declines,
   end-of-data, failures, induced-failure reports and metrics to the master;
4. end when every subtask ended, or cancel them all when the master says so or
   the control connection closes;
5. restart in place: on ``reset`` cancel this generation's subtasks, unregister
   its gates, answer ``reset`` and wait; on ``rebuild`` go back to 2 with the next
   generation (same address table, receiver and control connection); its gates are
   served under names of their generation (:func:`fenced`), so nothing of the old
   generation's connections reaches the new subtasks.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spillover.config import Config
from spillover.deploy.spark.control import ControlConnection, ControlError, connect
from spillover.deploy.spark.messages import (
    Acknowledge,
    CancelAll,
    Decline,
    Done,
    EndOfData,
    Finished,
    Fired,
    Go,
    Hello,
    LoopQuiet,
    Metrics,
    Post,
    Rebuild,
    Reset,
    ResetTo,
    SwitchToUnaligned,
    Sync,
    Synced,
    Table,
    TaskExited,
    ToMaster,
    Wired,
)
from spillover.runtime.affinity import allowed_cpus, cpu_for, pin
from spillover.runtime.checkpointing.messages import Ack, TriggerCheckpoint
from spillover.runtime.failures import FailureInjector
from spillover.runtime.graph import JobGraph
from spillover.runtime.network.buffers import NetworkBuffer
from spillover.runtime.network.errors import NetworkError
from spillover.runtime.network.events import CheckpointBarrier, Event
from spillover.runtime.network.partition import ResultPartition
from spillover.runtime.network.tcp import (
    OvertakenHandler,
    ProtocolError,
    TcpReceiver,
    connect_tcp,
)
from spillover.runtime.network.tcp.faults import NetworkFault
from spillover.runtime.recovery.restore import TaskRestore
from spillover.runtime.task import Task, TaskCancelled
from spillover.runtime.wiring import build_tasks, checkpoint_storage, settle

__all__ = ["WorkerSpec", "run_worker", "worker_of", "workers_for"]


def worker_of(subtask: int, slots: int) -> int:
    """The worker that hosts ``subtask`` of any operator when each worker has
    ``slots`` slots: consecutive subtasks share a worker, as Flink fills a
    TaskManager's slots, so forward edges and the subtasks of one slot stay local."""
    return subtask // slots


def workers_for(parallelism: int, slots: int) -> int:
    """Workers (Spark tasks) a job whose largest parallelism is ``parallelism`` takes."""
    return -(-parallelism // slots)


@dataclass
class WorkerSpec:
    """Everything a worker of one generation needs; shipped in the stage's closure.
    The checkpoint storage is not in it: the worker derives it from ``config`` and
    the job's name as the executor does (:func:`checkpoint_storage`)."""

    graph: JobGraph
    config: Config
    generation: int
    control: tuple[str, int]
    secret: bytes
    restore: dict[tuple[str, int], TaskRestore] | None = None
    failures: FailureInjector = field(default_factory=FailureInjector)
    flush_interval: float = 0.005
    metrics_interval: float = 0.5
    connect_timeout: float = 30.0
    switch_interval: float = float(os.environ.get("SPILLOVER_SWITCH_INTERVAL", "0.0005"))
    run_id: str | None = None  # the job's run (OperatorContext.job_run)
    network_fault: NetworkFault | None = None  # a test hook: a connection reset or stalled


class _Arrivals:
    """When this worker's threads took a checkpoint's word for a subtask, in wall-clock
    time, added to its acknowledgement's metrics: the control thread a root's trigger
    (``trigger_in_at``, as it hands it to the task's mailbox), a TCP receiving thread
    the first unaligned (priority) barrier over the network (``barrier_in_at``; an
    aligned one travels in line with the data and is not stamped). With the task's
    own stamps they split the trigger and a barrier's hop between the wire and its
    thread, and the task's wake-up (``bench/checkpoint_breakdown.py``). And from the
    checkpoint's first trigger on this worker to each acknowledgement, the time and
    the CPU time of the whole process (``worker_wall_ms``, ``worker_cpu_ms``): at the
    worker's last acknowledgement, how busy its core was with the checkpoint; beside
    it, the same share from the worker's acknowledgement before to that trigger
    (``worker_busy_before``), its baseline. One stamp per checkpoint and subtask;
    nothing per buffer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._at: dict[tuple[str, int, int], dict[str, float]] = {}
        # id -> (monotonic, process CPU) at its first trigger here, and the CPU share
        # since the acknowledgement before (None: the worker's first)
        self._began: dict[int, tuple[float, float, float | None]] = {}
        self._last_ack: tuple[float, float] | None = None  # (monotonic, process CPU)

    def stamp(self, key: tuple[str, int], checkpoint_id: int, what: str) -> None:
        now = time.time()
        trigger = what == "trigger_in_at"
        wall, cpu = (time.monotonic(), time.process_time()) if trigger else (0.0, 0.0)
        with self._lock:
            self._at.setdefault((*key, checkpoint_id), {}).setdefault(what, now)
            if trigger and checkpoint_id not in self._began:
                last = self._last_ack
                before = (cpu - last[1]) / (wall - last[0]) if last and wall > last[0] else None
                self._began[checkpoint_id] = (wall, cpu, before)

    def taken(self, ack: Ack) -> dict[str, float]:
        wall, cpu = time.monotonic(), time.process_time()
        cid = ack.checkpoint_id
        with self._lock:
            for k in [k for k in self._at if k[2] < cid - 8]:
                del self._at[k]  # aborted ones, never acknowledged
            for old in [c for c in self._began if c < cid - 8]:
                del self._began[old]
            self._last_ack = (wall, cpu)
            at = self._at.pop((ack.vertex_uid, ack.subtask, cid), {})
            began = self._began.get(cid)
        if began is not None:
            at["worker_wall_ms"] = (wall - began[0]) * 1000
            at["worker_cpu_ms"] = (cpu - began[1]) * 1000
            if began[2] is not None:
                at["worker_busy_before"] = began[2]
        return at

    def watching(self, task: Task) -> OvertakenHandler:
        """``task.overtaken``, stamping a checkpoint barrier's arrival first."""
        key, overtaken = (task.vertex.uid, task.subtask), task.overtaken

        def handler(ch: int, event: Event, buffers: list[NetworkBuffer]) -> None:
            if isinstance(event, CheckpointBarrier):
                self.stamp(key, event.checkpoint_id, "barrier_in_at")
            overtaken(ch, event, buffers)

        return handler


class _Relay:
    """The coordinator as one generation's subtasks see it: every call becomes a
    message. Closed when the generation is reset: a late word of one of its subtasks
    (a snapshot's acknowledgement) is dropped, never sent after the :class:`Reset`."""

    def __init__(self, conn: ControlConnection, arrivals: _Arrivals) -> None:
        self.conn = conn
        self.arrivals = arrivals
        self._lock = threading.Lock()
        self._closed = False

    def send(self, message: ToMaster) -> None:
        # The master gone: the control thread cancels the subtasks.
        with self._lock, contextlib.suppress(ControlError):
            if not self._closed:
                self.conn.send(message)

    def close(self) -> None:
        with self._lock:
            self._closed = True

    def acknowledge(self, ack: Ack) -> None:
        ack.metrics.update(self.arrivals.taken(ack))
        self.send(Acknowledge(ack))

    def decline(self, checkpoint_id: int, vertex_uid: str, subtask: int, reason: str) -> None:
        self.send(Decline(checkpoint_id, vertex_uid, subtask, reason))

    def end_of_data(self, vertex_uid: str, subtask: int) -> None:
        self.send(EndOfData(vertex_uid, subtask))

    def task_exited(self, vertex_uid: str, subtask: int) -> None:
        self.send(TaskExited(vertex_uid, subtask))

    def loop_quiet(self, vertex_uid: str, subtask: int, round: int) -> None:
        self.send(LoopQuiet(vertex_uid, subtask, round))


class _Current:
    """The generation whose subtasks run on this worker now, as the control thread
    sees it: a message of another generation finds nothing here."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.generation = -1
        self.tasks: dict[tuple[str, int], Task] = {}
        self.reset = False  # the master asked to cancel them for a restart in place
        self.arrivals = _Arrivals()

    def begin(self, generation: int, tasks: dict[tuple[str, int], Task]) -> None:
        with self._lock:
            self.generation, self.tasks, self.reset = generation, tasks, False

    def task(self, generation: int, key: tuple[str, int]) -> Task | None:
        with self._lock:
            return self.tasks.get(key) if generation == self.generation else None

    def cancel(self, generation: int | None = None) -> None:
        """Cancels the subtasks (of ``generation`` only, for a reset: then marked)."""
        with self._lock:
            if generation is not None:
                if generation != self.generation:
                    return  # a stale reset
                self.reset = True
            tasks = list(self.tasks.values())
        for t in tasks:
            t.cancel()


def fenced(gate: str, generation: int) -> str:
    """The name a generation's input gate is served under by the worker's TCP receiver:
    a producer of another generation names another gate and is refused, so no frame
    of an attempt reaches the next one's gate (a restart in place keeps the receiver)."""
    return f"{gate}@{generation}"


def _reporting(failures: FailureInjector, relay: _Relay) -> FailureInjector:
    """The master's failure script (this worker's copy), reporting each failure that
    fires here before the subtask fails, so the next generation does not fire it."""
    failures.on_fire = lambda index, attempt: relay.send(Fired(index, attempt))
    return failures


def _error_info(err: BaseException | None) -> tuple[str, str, str, bool] | None:
    """``(type, message, traceback, broken channel)``: the last says the error is a
    channel that broke (most likely because a peer failed), not a cause of its own."""
    if err is None:
        return None
    broken = isinstance(err, NetworkError) and not isinstance(err, ProtocolError)
    return (type(err).__name__, str(err), "".join(traceback.format_exception(err)), broken)


def _pin_worker(index: int, table: dict[int, Any]) -> Callable[[], None] | None:
    """Every thread of this worker, and those it starts, on one CPU: the worker's
    rank among the workers of its host (by their receivers' addresses) picks it,
    round-robin over the CPUs the process may use (runtime/affinity.py)."""
    host = table[index][0]
    rank = sorted(i for i, a in table.items() if a[0] == host).index(index)
    cpu = cpu_for(rank, allowed_cpus())
    return None if cpu is None else pin(cpu)


def run_worker(spec: WorkerSpec, index: int) -> dict[str, Any]:
    """Runs worker ``index`` of ``spec``'s generation to its end, and the generations
    the master restarts in place after it; returns a summary."""
    # Receiving threads wait for the GIL after each socket read; the default 5 ms
    # switch interval would hold a channel to a few hundred buffers a second.
    sys.setswitchinterval(spec.switch_interval)
    conn = connect(spec.control, spec.secret, timeout=spec.connect_timeout)
    fault = spec.network_fault
    if fault is not None:
        conn.fault = fault.counter("control", index, spec.generation)
    receiver: TcpReceiver | None = None
    current = _Current()
    stop = threading.Event()
    unpin: Callable[[], None] | None = None
    try:
        host = conn.sock.getsockname()[0]
        receiver = TcpReceiver(
            spec.secret, host=host, port=0, silence_timeout=spec.config.network.heartbeat_timeout_s
        )
        conn.send(
            Hello(spec.generation, index, receiver.address, os.getpid(), socket.gethostname())
        )
        message = conn.recv()
        if not isinstance(message, Table):
            return {"index": index, "status": "cancelled before start"}
        table = message.addresses
        if spec.config.deployment.cpu_pinning:
            unpin = _pin_worker(index, table)
        inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        threading.Thread(
            target=_control_loop,
            args=(conn, current, stop, inbox),
            name="spillover-control",
            daemon=True,
        ).start()
        generation, restore, failures = spec.generation, spec.restore, spec.failures
        while True:
            step = _Step(generation, restore, failures)
            summary = _run(spec, index, conn, receiver, table, current, inbox, step)
            if summary is not None:
                return summary
            message = inbox.get()  # reset: the next generation, or the end
            if not isinstance(message, Rebuild):
                return {"index": index, "status": "cancelled after a reset"}
            generation = message.generation
            restore, failures = pickle.loads(message.payload)
            if fault is not None:  # a control fault counts in the generation it names
                conn.fault = fault.counter("control", index, generation)
    finally:
        stop.set()
        current.cancel()
        settle(current.tasks.values())  # no late snapshot write once this worker returned
        if unpin is not None:  # Spark reuses the process
            unpin()
        if receiver is not None:
            receiver.close(timeout=2.0)
        conn.close()


@dataclass(frozen=True)
class _Step:
    """What one generation on this worker is built from."""

    generation: int
    restore: dict[tuple[str, int], TaskRestore] | None
    failures: FailureInjector


def _run(
    spec: WorkerSpec,
    index: int,
    conn: ControlConnection,
    receiver: TcpReceiver,
    table: dict[int, tuple[str, int]],
    current: _Current,
    inbox: queue.SimpleQueue[object],
    step: _Step,
) -> dict[str, Any] | None:
    """One generation on this worker: its summary, or None once the master reset it
    (its subtasks ended, its gates unregistered, :class:`Reset` sent)."""
    relay = _Relay(conn, current.arrivals)
    slots = spec.config.deployment.task_slots
    gen = step.generation
    done: queue.SimpleQueue[tuple[Task, BaseException | None]] = queue.SimpleQueue()
    links: list[tuple[ResultPartition, int, str, int]] = []
    tasks = build_tasks(
        spec.graph,
        spec.config,
        attempt=gen,
        restore=step.restore,
        storage=checkpoint_storage(spec.config, spec.graph.name),
        failures=_reporting(step.failures, relay),
        on_done=lambda t, err: done.put((t, err)),
        flush_interval=spec.flush_interval,
        hosted=lambda i: worker_of(i, slots) == index,
        remote=lambda part, d, gate, ch: links.append((part, d, gate, ch)),
        run_id=spec.run_id,
    )
    gates: list[str] = []
    for t in tasks.values():
        t.coordinator = relay
        if t.has_input:
            gates.append(fenced(t.gate.name, gen))
            receiver.register(t.gate, gates[-1], on_overtaken=current.arrivals.watching(t))
    current.begin(gen, tasks)
    conn.send(Wired(index, gen))
    if not isinstance(inbox.get(), Go):
        return {"index": index, "status": "cancelled before start"}
    fault = spec.network_fault
    counter = None if fault is None else fault.counter("data", index, gen)
    subs = []
    try:
        for part, d, gate, ch in links:
            subs.append(
                connect_tcp(
                    part, d, table[worker_of(d, slots)], fenced(gate, gen), ch, spec.secret,
                    timeout=spec.connect_timeout,
                    heartbeat_interval=spec.config.network.heartbeat_interval_s, fault=counter,
                )
            )  # fmt: skip
    except NetworkError:
        if not current.reset:  # a peer reset before this worker linked: no error of its own
            raise
    started = not current.reset
    if started:
        for t in tasks.values():
            t.start()
    remaining = set(tasks) if started else set()
    last_metrics = 0.0
    errors = 0
    while remaining:
        try:
            item: tuple[Task, BaseException | None] | None = done.get(timeout=0.1)
        except queue.Empty:
            item = None
        now = time.monotonic()
        if item is not None:
            t, err = item
            key = (t.vertex.uid, t.subtask)
            remaining.discard(key)
            cancelled = isinstance(err, TaskCancelled)
            errors += err is not None and not cancelled
            relay.send(Done(*key, None if cancelled else _error_info(err), t.metrics()))
        if now - last_metrics >= spec.metrics_interval and remaining:
            last_metrics = now
            relay.send(Metrics({f"{u}#{i}": tasks[(u, i)].metrics() for u, i in remaining}))
    if current.reset:
        for sub in subs:  # cancelled: their consumers are told, nothing waits for an end
            sub.close(timeout=1.0)
        settle(tasks.values())
        for name in gates:
            receiver.unregister(name)
        relay.close()  # nothing of this generation's follows the reset
        with contextlib.suppress(ControlError):  # the master gone: the control thread tells
            conn.send(Reset(index, gen))
        return None
    for sub in subs:  # finished ones wait for their consumer to read the end
        sub.close(timeout=5.0)
    relay.send(Finished(index))
    return {"index": index, "status": "failed" if errors else "finished", "subtasks": len(tasks)}


def _control_loop(
    conn: ControlConnection,
    current: _Current,
    stop: threading.Event,
    inbox: queue.SimpleQueue[object],
) -> None:
    """Relays the master's messages to the subtasks until the connection ends, and
    those for the worker itself (go, rebuild) to ``inbox``, None at the end; a
    message it cannot follow ends the connection as the master closing it does."""
    try:
        while True:
            message = conn.recv()
            if isinstance(message, Go | Rebuild):
                inbox.put(message)
            elif isinstance(message, CancelAll):
                current.cancel()
                inbox.put(None)
            else:
                _follow(conn, message, current)
    except Exception:  # a ControlError, or a message that is not the protocol's
        conn.close()  # the master sees this worker gone
        if not stop.is_set():  # the master is gone: nothing may run on
            current.cancel()
        inbox.put(None)


def _follow(conn: ControlConnection, message: object, current: _Current) -> None:
    """Carries out one message of the master's for one of this worker's subtasks (of
    the generation it names: one of another is dropped). Anything that is not one of
    the protocol's messages raises, ending the connection."""
    match message:
        case Post(uid=uid, subtask=i, message=mail, generation=gen):
            task = current.task(gen, (uid, i))
            if task is not None:
                if isinstance(mail, TriggerCheckpoint):
                    current.arrivals.stamp((uid, i), mail.checkpoint_id, "trigger_in_at")
                task.post(mail)
        case SwitchToUnaligned(uid=uid, subtask=i, checkpoint_id=cid, generation=gen):
            task = current.task(gen, (uid, i))
            if task is not None:
                task.request_unaligned(cid)
        case Sync(token=token):
            with contextlib.suppress(ControlError):
                conn.send(Synced(token))
        case ResetTo(generation=gen):
            current.cancel(gen)
        case _:
            raise ControlError(f"a malformed control message from the master: {message!r:.200}")
