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
   the control connection closes.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import sys
import threading
import time
import traceback
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
    SwitchToUnaligned,
    Sync,
    Synced,
    Table,
    TaskExited,
    ToMaster,
    Wired,
)
from spillover.runtime.checkpointing.messages import Ack
from spillover.runtime.failures import FailureInjector
from spillover.runtime.graph import JobGraph
from spillover.runtime.network.errors import NetworkError
from spillover.runtime.network.partition import ResultPartition
from spillover.runtime.network.tcp import ProtocolError, TcpReceiver, connect_tcp
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


class _Relay:
    """The coordinator as the subtasks see it: every call becomes a message."""

    def __init__(self, conn: ControlConnection) -> None:
        self.conn = conn

    def send(self, message: ToMaster) -> None:
        # The master gone: the control thread cancels the subtasks.
        with contextlib.suppress(ControlError):
            self.conn.send(message)

    def acknowledge(self, ack: Ack) -> None:
        self.send(Acknowledge(ack))

    def decline(self, checkpoint_id: int, vertex_uid: str, subtask: int, reason: str) -> None:
        self.send(Decline(checkpoint_id, vertex_uid, subtask, reason))

    def end_of_data(self, vertex_uid: str, subtask: int) -> None:
        self.send(EndOfData(vertex_uid, subtask))

    def task_exited(self, vertex_uid: str, subtask: int) -> None:
        self.send(TaskExited(vertex_uid, subtask))

    def loop_quiet(self, vertex_uid: str, subtask: int, round: int) -> None:
        self.send(LoopQuiet(vertex_uid, subtask, round))


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


def run_worker(spec: WorkerSpec, index: int) -> dict[str, Any]:
    """Runs worker ``index`` of ``spec``'s generation to its end; returns a summary."""
    # Receiving threads wait for the GIL after each socket read; the default 5 ms
    # switch interval would hold a channel to a few hundred buffers a second.
    sys.setswitchinterval(spec.switch_interval)
    conn = connect(spec.control, spec.secret, timeout=spec.connect_timeout)
    fault = spec.network_fault
    if fault is not None:
        conn.fault = fault.counter("control", index, spec.generation)
    receiver: TcpReceiver | None = None
    tasks: dict[tuple[str, int], Task] = {}
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
        return _run(spec, index, conn, receiver, table, tasks)
    finally:
        for t in tasks.values():
            t.cancel()
        settle(tasks.values())  # no late snapshot write once this worker returned
        if receiver is not None:
            receiver.close(timeout=2.0)
        conn.close()


def _run(
    spec: WorkerSpec,
    index: int,
    conn: ControlConnection,
    receiver: TcpReceiver,
    table: dict[int, tuple[str, int]],
    tasks: dict[tuple[str, int], Task],
) -> dict[str, Any]:
    relay = _Relay(conn)
    slots = spec.config.deployment.task_slots
    done: queue.SimpleQueue[tuple[Task, BaseException | None]] = queue.SimpleQueue()
    links: list[tuple[ResultPartition, int, str, int]] = []
    tasks.update(
        build_tasks(
            spec.graph,
            spec.config,
            attempt=spec.generation,
            restore=spec.restore,
            storage=checkpoint_storage(spec.config, spec.graph.name),
            failures=_reporting(spec.failures, relay),
            on_done=lambda t, err: done.put((t, err)),
            flush_interval=spec.flush_interval,
            hosted=lambda i: worker_of(i, slots) == index,
            remote=lambda part, d, gate, ch: links.append((part, d, gate, ch)),
            run_id=spec.run_id,
        )
    )
    for t in tasks.values():
        t.coordinator = relay
        if t.has_input:
            receiver.register(t.gate, on_overtaken=t.overtaken)
    conn.send(Wired(index))
    if not isinstance(conn.recv(), Go):
        return {"index": index, "status": "cancelled before start"}
    fault = spec.network_fault
    counter = None if fault is None else fault.counter("data", index, spec.generation)
    subs = [
        connect_tcp(
            part, d, table[worker_of(d, slots)], gate, ch, spec.secret,
            timeout=spec.connect_timeout,
            heartbeat_interval=spec.config.network.heartbeat_interval_s, fault=counter,
        )
        for part, d, gate, ch in links
    ]  # fmt: skip
    stop = threading.Event()
    control = threading.Thread(
        target=_control_loop, args=(conn, tasks, stop), name="spillover-control", daemon=True
    )
    control.start()
    for t in tasks.values():
        t.start()
    remaining = set(tasks)
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
    for sub in subs:  # finished ones wait for their consumer to read the end
        sub.close(timeout=5.0)
    relay.send(Finished(index))
    stop.set()
    return {"index": index, "status": "failed" if errors else "finished", "subtasks": len(tasks)}


def _control_loop(
    conn: ControlConnection,
    tasks: dict[tuple[str, int], Task],
    stop: threading.Event,
) -> None:
    """Relays the master's messages to the subtasks until the connection ends; a
    message it cannot follow ends the connection as the master closing it does."""
    try:
        while True:
            _follow(conn, conn.recv(), tasks)
    except Exception:  # a ControlError, or a message that is not the protocol's
        conn.close()  # the master sees this worker gone
        if not stop.is_set():  # the master is gone: nothing may run on
            for t in tasks.values():
                t.cancel()


def _follow(
    conn: ControlConnection,
    message: object,
    tasks: dict[tuple[str, int], Task],
) -> None:
    """Carries out one message of the master's for one of this worker's subtasks.
    Anything that is not one of the protocol's messages raises, ending the
    connection."""
    match message:
        case Post(uid=uid, subtask=i, message=mail):
            task = tasks.get((uid, i))
            if task is not None:
                task.post(mail)
        case SwitchToUnaligned(uid=uid, subtask=i, checkpoint_id=cid):
            task = tasks.get((uid, i))
            if task is not None:
                task.request_unaligned(cid)
        case Sync(token=token):
            with contextlib.suppress(ControlError):
                conn.send(Synced(token))
        case CancelAll():
            for t in tasks.values():
                t.cancel()
        case _:
            raise ControlError(f"a malformed control message from the master: {message!r:.200}")
