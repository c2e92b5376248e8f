"""The job master on the Spark driver: one barrier stage per generation.

:class:`SparkExecutor` is an :class:`~spillover.runtime.jobmaster.Executor`: the same
restart loop, restore planning and checkpoint coordinator as the local executor,
but each execution attempt (a *generation*) runs as one PySpark barrier stage of
``n`` tasks, ``n`` the largest parallelism of the job divided by its slots per
worker (``taskmanager.numberOfTaskSlots``, ``k``, default 1); Spark task ``w`` is
one Python worker process hosting subtasks ``w * k`` to ``w * k + k - 1`` of every
operator (:mod:`spillover.deploy.spark.worker`). The master talks to the workers over its control
endpoint (:mod:`spillover.deploy.spark.control`); the workers exchange data over TCP.

Restarts are the master's, not Spark's: when a subtask fails or a worker is lost,
the master fails the generation, aborts its pending checkpoints, tells every
worker to cancel, cancels the stage's job group if it does not end on its own,
and submits generation + 1 with the checkpoint to restore in its closure.

An operator failure with every worker still there restarts *in place* instead
(``spillover.restart-in-place.enabled``, on by default): the workers cancel the
generation's subtasks and confirm it, the stage and its control connections stay
(:class:`_Stage`, handed from one attempt to the next), and generation + 1 is built
in the same workers from the restore sent over those connections (docs/spark.md).
A lost worker, a broken or silent connection, a rescale, or a worker that does
not confirm the cancel within ``cancel_grace_s`` ends the stage as above.

One module for one generation's life on the driver (stage, control endpoint,
event loop, failure causes): its parts share the generation's state and threads.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import secrets
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spillover.config import Config, RestartStrategy
from spillover.deploy.spark.control import (
    ControlConnection,
    ControlError,
    ControlServer,
    ControlSilence,
)
from spillover.deploy.spark.logs import new_context
from spillover.deploy.spark.messages import (
    Acknowledge,
    CancelAll,
    CoordinatorFailed,
    Decline,
    Done,
    EndOfData,
    Finished,
    Fired,
    Go,
    Hello,
    LoopQuiet,
    MasterEvent,
    Metrics,
    Post,
    Rebuild,
    Reset,
    ResetTo,
    StageEnded,
    SubtaskDone,
    SwitchToUnaligned,
    Sync,
    Synced,
    Table,
    TaskExited,
    ToWorker,
    Wired,
    WorkerJoined,
    WorkerLost,
)
from spillover.deploy.spark.worker import WorkerSpec, run_worker, worker_of, workers_for
from spillover.errors import ConfigError
from spillover.runtime.batch.launch import Launcher
from spillover.runtime.checkpointing.messages import MailboxMessage, StopSource, Terminate
from spillover.runtime.graph import JobGraph, StreamEnvironment
from spillover.runtime.jobmaster import Executor, StopWhen, next_event
from spillover.runtime.network.tcp.faults import NetworkFault
from spillover.runtime.recovery.restore import TaskRestore
from spillover.runtime.wiring import make_coordinator

__all__ = [
    "SparkExecutor",
    "SubtaskFailedError",
    "WorkerLostError",
    "rescale_to_available_slots",
    "spark_context",
]

logger = logging.getLogger(__name__)

DEFAULT_LOCAL_SLOTS = 32
# After a stage ended normally: how long the workers' last messages may take to arrive.
STAGE_END_GRACE_S = 1.0
# After the final checkpoint: how long every worker has to confirm it holds the
# completion before the sources end (else the generation fails).
SYNC_TIMEOUT_S = 10.0
_CONTEXT_LOCK = threading.Lock()
_ROUTE = threading.Lock()  # an event goes to the stage's owner, not one it just left


class SubtaskFailedError(RuntimeError):
    """A subtask failed in a Spark worker; the message and traceback are the worker's."""

    def __init__(
        self, message: str, remote_type: str, remote_traceback: str, broken_channel: bool = False
    ) -> None:
        super().__init__(message)
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback
        self.broken_channel = broken_channel  # likely a consequence of a peer's failure


class WorkerLostError(RuntimeError):
    """A worker's process or its control connection is gone."""


def spark_context(
    master: str | None = None,
    slots: int = 1,
    app_name: str = "spillover",
    log_file: str | None = None,
) -> Any:
    """The active SparkContext, or a new one: ``master`` (default the embedded
    ``local[max(32, slots)]``) set up for spillover's barrier stages. An active context
    with another master, or with fewer than ``slots`` task slots, is refused.

    ``log_file`` (default ``$SPILLOVER_SPARK_LOG_FILE``; unset: the terminal): where a
    new context's JVM writes its log4j lines and everything else it prints, its
    Python workers' output included (level ``$SPILLOVER_SPARK_LOG_LEVEL``, default
    WARN in a file, ERROR on the terminal). One context serves a process: an active
    one keeps its logging (:func:`~spillover.deploy.spark.logs.spark_log_file` tells
    where it goes).
    """
    from pyspark import SparkConf, SparkContext

    with _CONTEXT_LOCK:
        active = SparkContext._active_spark_context
        if active is not None:
            if master is not None and active.master != master:
                raise ConfigError(
                    f"a SparkContext with master {active.master!r} is running",
                    detail=f"asked for {master!r}",
                    hint="stop it first, or pass that context (spark_context=)",
                )
            return active
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
        url = master or f"local[{max(DEFAULT_LOCAL_SLOTS, slots)}]"
        conf = (
            SparkConf()
            .setMaster(url)
            .setAppName(app_name)
            .set("spark.ui.showConsoleProgress", "false")
            .set("spark.python.worker.reuse", "true")
            .set("spark.python.task.killTimeout", "300ms")
            # A barrier stage with more tasks than slots fails fast, not after minutes.
            .set("spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures", "1")
            .set("spark.scheduler.barrier.maxConcurrentTasksCheck.interval", "1s")
            .set("spark.task.maxFailures", "1")
        )
        if url.startswith("local"):
            conf.set("spark.driver.host", "127.0.0.1").set("spark.driver.bindAddress", "127.0.0.1")
        return new_context(conf, log_file)


def _slots(sc: Any) -> int:
    """Tasks the cluster runs at once now: what Spark's barrier check counts (0 on a
    cluster before its executors registered)."""
    try:
        jsc = sc._jsc.sc()
        profile = jsc.resourceProfileManager().defaultResourceProfile()
        return int(jsc.maxNumConcurrentTasks(profile))
    except Exception:  # another Spark version: its default parallelism
        return int(sc.defaultParallelism)


_WARM: set[tuple[int, int]] = set()


def _import_runtime(_: Any) -> list[int]:
    import spillover.deploy.spark.worker  # noqa: F401  (what a worker imports, done once)

    return [os.getpid()]


def warm_up(sc: Any, tasks: int) -> None:
    """Starts ``tasks`` Python workers and imports the runtime in them (reused by later
    stages), so that a job's first generation does not pay for it. Once per context
    and size."""
    key = (id(sc), tasks)
    if key in _WARM:
        return
    sc.setJobGroup("spillover-warm-up", "spillover: start Python workers", False)
    try:
        sc.parallelize(range(tasks), tasks).barrier().mapPartitions(_import_runtime).collect()
    finally:
        sc.setJobGroup("", "", False)
    _WARM.add(key)


class _RemoteTask:
    """A subtask as the coordinator sees it: its mailbox is on the worker that hosts it."""

    def __init__(self, run: _SparkAttempt, worker: int, uid: str, subtask: int) -> None:
        self.run = run
        self.worker = worker
        self.uid = uid
        self.subtask = subtask

    def post(self, message: MailboxMessage) -> None:
        self.run.send(self.worker, Post(self.uid, self.subtask, message, self.run.generation))

    def request_unaligned(self, cid: int) -> None:
        self.run.send(
            self.worker, SwitchToUnaligned(self.uid, self.subtask, cid, self.run.generation)
        )


@dataclass(eq=False)
class _Stage:
    """A running barrier stage and the driver's control endpoint its workers talk to,
    owned by one attempt at a time: the one that submitted it, then, restarted in
    place, the attempt after it (``owner``, replaced at each restart in place, so no
    attempt before the current one stays reachable but the submitter).
    ``submitter``'s ``_force_end`` ends it."""

    server: ControlServer
    submitter: _SparkAttempt
    graph: JobGraph
    n: int
    owner: _SparkAttempt
    thread: threading.Thread | None = None


class _SparkAttempt:
    """One generation: a barrier stage, its control connections and the coordinator."""

    def __init__(
        self,
        ex: SparkExecutor,
        generation: int,
        restore: dict[tuple[str, int], TaskRestore] | None,
        restored_id: int | None,
    ) -> None:
        self.ex = ex
        self.generation = generation
        self.restore = restore
        g = ex.graph
        self.n = ex.slots  # Spark tasks of this generation
        self.events: queue.SimpleQueue[MasterEvent] = queue.SimpleQueue()
        self.conns: dict[int, ControlConnection] = {}
        self.workers: dict[int, dict[str, Any]] = {}
        self._finished: set[int] = set()
        self._going = False  # the workers were told to go
        self._stop_request: bool | None = None
        self._synced: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self.metrics: dict[str, dict[str, float]] = {}
        k = ex.config.deployment.task_slots
        self.proxies = {
            (v.uid, i): _RemoteTask(self, worker_of(i, k), v.uid, i)
            for v in g.vertices
            for i in range(v.parallelism)
        }
        self.coordinator = make_coordinator(
            ex, self.proxies, restored_id, self._terminate_sources, self._coordinator_failed
        )
        self.stopped = False
        self.running_at: float | None = None
        self.failed_at: float | None = None
        self.stage_error: BaseException | None = None
        self.group = f"spillover-{ex.job_id[:12]}-gen-{generation}"
        # The stage this attempt submitted: its workers' messages and the stage's
        # events go to the stage's owner (this attempt, or one restarted in place).
        self.stage: _Stage | None = None
        self.in_place = False  # this attempt runs in the previous one's stage

    def _owner(self) -> _SparkAttempt:
        """The attempt that owns this one's stage now (itself, or a later one)."""
        stage = self.stage
        return self if stage is None else stage.owner

    def _route(self, ev: MasterEvent) -> None:
        """Puts an event of the stage (a worker's, the stage's end) on its owner's queue."""
        with _ROUTE:
            self._owner().events.put(ev)

    # -- messages ------------------------------------------------------------------

    def send(self, worker: int, message: ToWorker) -> None:
        conn = self.conns.get(worker)
        if conn is None:
            return
        try:
            conn.send(message)
        except ControlError as e:
            if worker not in self._finished:
                self.events.put(WorkerLost(worker, str(e)))

    def _on_connect(self, conn: ControlConnection) -> None:
        threading.Thread(
            target=self._serve, args=(conn,), name=f"spillover-master {conn.peer}", daemon=True
        ).start()

    def _serve(self, conn: ControlConnection) -> None:
        index = -1
        try:
            hello = conn.recv()
            if not isinstance(hello, Hello) or hello.generation != self._owner().generation:
                conn.close()  # a straggler of another generation
                return
            index, address, pid, host = hello.index, hello.address, hello.pid, hello.host
            with self._lock:
                if not 0 <= index < self.n or index in self.conns:
                    conn.close()
                    return
                self.conns[index] = conn
                self.workers[index] = {"address": address, "pid": pid, "host": host}
            self._route(WorkerJoined("hello", index))
            # A running worker sends metrics twice a second: one silent for
            # heartbeat.timeout hangs, or its connection does (not before the
            # generation goes, nor once the worker finished).
            conn.watch(self.ex.config.network.heartbeat_timeout_s)
            while True:
                try:
                    m = conn.recv()
                except ControlSilence:
                    owner = self._owner()
                    if owner._going and index not in owner._finished:
                        raise
                    continue
                self._owner()._dispatch(index, m)
        except Exception as e:  # a ControlError, or a message that is not the protocol's
            conn.close()  # the worker sees its master gone and cancels its subtasks
            if not isinstance(e, ControlError):
                e = ControlError(f"a malformed control message: {type(e).__name__}: {e}")
            if index >= 0 and index not in self._owner()._finished:
                w = self.workers.get(index, {})
                self._route(
                    WorkerLost(
                        index,
                        f"worker {index} (pid {w.get('pid')} on {w.get('host')}) is gone: {e}",
                    )
                )

    def _dispatch(self, index: int, m: object) -> None:
        co = self.coordinator
        match m:
            case Acknowledge(ack=ack):
                # When the master's reading thread had it: the acknowledgement's hop
                # split between the wire and the hand-off to the coordinator's thread.
                ack.metrics["ack_read_at"] = time.time()
                co.acknowledge(ack)
            case Decline(checkpoint_id=cid, vertex_uid=uid, subtask=subtask, reason=reason):
                co.decline(cid, uid, subtask, reason)
            case EndOfData(vertex_uid=uid, subtask=subtask):
                co.end_of_data(uid, subtask)
            case TaskExited(vertex_uid=uid, subtask=subtask):
                co.task_exited(uid, subtask)
            case LoopQuiet(vertex_uid=uid, subtask=subtask, round=r):
                co.loop_quiet(uid, subtask, r)
            case Metrics(metrics=metrics):
                self.metrics.update(metrics)
            case Fired(index=fired, attempt=attempt):
                self.ex.failures.mark_fired(fired, attempt)
            case Done(uid=uid, subtask=i, error=err, metrics=metrics):
                self.metrics[f"{uid}#{i}"] = metrics
                self.events.put(SubtaskDone((uid, i), err))
            case Synced(token=token):
                ev = self._synced.get(token)
                if ev is not None:
                    ev.set()
            case Wired(generation=gen):
                if gen == self.generation:  # not a straggler of a generation reset before
                    self.events.put(WorkerJoined("wired", index))
            case Reset(generation=gen):
                if gen == self.generation:
                    self.events.put(WorkerJoined("reset", index))
            case Finished():
                self._finished.add(index)
                self.events.put(WorkerJoined("finished", index))
            case _:
                raise ControlError(f"a malformed control message: {m!r:.200}")

    def stop_sources(self, drain: bool) -> None:
        """Stop-with-savepoint: every source subtask stops emitting. Asked before the
        workers are wired (a restarting generation), it is sent with ``Go``."""
        self._stop_request = drain
        if not self._going:
            return
        sources = {v.uid for v in self.ex.graph.vertices if v.is_source}
        for (uid, _), proxy in self.proxies.items():
            if uid in sources:
                proxy.post(StopSource(drain))

    def _terminate_sources(self) -> None:
        """After the final checkpoint: the workers hold its completion in every
        subtask's mailbox before any source ends (a sink publishes before it ends)."""
        waits = []
        for w in list(self.conns):
            token = f"{w}-{len(self._synced)}"
            ev = self._synced[token] = threading.Event()
            self.send(w, Sync(token))
            waits.append((w, ev))
        until = time.monotonic() + SYNC_TIMEOUT_S
        for w, ev in waits:
            if not ev.wait(max(0.0, until - time.monotonic())):
                # Ending the sources now could let a sink end without the final
                # completion (and commit nothing, or the next attempt twice).
                self.events.put(
                    WorkerLost(
                        w,
                        f"worker {w} did not answer a sync within {SYNC_TIMEOUT_S:g} s "
                        "before the sources end",
                    )
                )
                return
        sources = {v.uid for v in self.ex.graph.vertices if v.is_source}
        for (uid, _), proxy in self.proxies.items():
            if uid in sources:
                proxy.post(Terminate())

    def _coordinator_failed(self, e: BaseException) -> None:
        self.events.put(CoordinatorFailed(e))

    # -- the generation --------------------------------------------------------------

    def _submit(self, sc: Any, spec: WorkerSpec) -> None:
        from pyspark import BarrierTaskContext

        def work(_: Any) -> Any:
            summary = run_worker(spec, BarrierTaskContext.get().partitionId())
            return [summary]

        try:
            sc.setJobGroup(
                self.group,
                f"{self.ex.graph.name} generation {self.generation}",
                interruptOnCancel=True,
            )
            sc.parallelize(range(self.n), self.n).barrier().mapPartitions(work).collect()
        except BaseException as e:
            self.stage_error = e
        self._route(StageEnded(self.stage_error))

    def _wait(self, kind: str, deadline: float) -> BaseException | None:
        """Waits until every worker sent ``kind``; an error when something failed first."""
        seen: set[int] = set()
        while len(seen) < self.n:
            try:
                ev = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(self.n)) - seen)
                return WorkerLostError(
                    f"workers {missing} of generation {self.generation} did not report "
                    f"{kind!r} within {self.ex.register_timeout:g} s"
                )
            if isinstance(ev, WorkerJoined) and ev.kind == kind:
                seen.add(ev.index)
            elif (error := _failure(ev, self.generation)) is not None:
                return error
        return None

    def run(
        self,
        deadline: float | None,
        stop_at: float | None = None,
        stop_when: StopWhen | None = None,
    ) -> BaseException | None:
        ex = self.ex
        sc = ex.context()
        stage = ex._take_stage(self, sc)
        error: BaseException | None = None
        raised = True  # until run returns: an exception ends the stage, cancelled
        try:  # from here on, the stage and its endpoint are ended or kept at the end
            if stage is not None:
                error = self._rebuild(stage)
                if error is not None:
                    # No subtask of this generation ran: end the kept stage and start
                    # a new one in this attempt, which costs no restart.
                    kept, stage, error = stage, None, None
                    self._leave(sc, kept)
            if stage is None:
                stage = self._start(sc)
                limit = time.monotonic() + ex.register_timeout
                error = self._wait("hello", limit)
                if error is None:
                    table = {i: w["address"] for i, w in self.workers.items()}
                    for i in range(self.n):
                        self.send(i, Table(table))
                    error = self._wait("wired", limit)
            if error is None:
                for i in range(self.n):
                    self.send(i, Go())
                self._going = True
                if self._stop_request is not None:
                    self.stop_sources(self._stop_request)
                self.running_at = time.monotonic()
                self.coordinator.start()
                error = self._loop(deadline, stop_at, stop_when)
            if error is not None:
                self.failed_at = time.monotonic()
            raised = False
        finally:
            self._finish(sc, stage, error, raised)
        return error

    def _finish(
        self, sc: Any, stage: _Stage | None, error: BaseException | None, raised: bool
    ) -> None:
        """Stops the coordinator, then keeps the stage for a restart in place or ends
        it: each step runs whatever the one before raised (then the stage is cancelled)."""
        kept = False
        try:
            self.coordinator.stop()
            kept = (
                stage is not None
                and not raised
                and error is not None
                and self._may_restart_in_place(error, stage)
                and self._reset()
            )
        except BaseException:
            raised = True
            raise
        finally:
            if stage is not None:
                if kept:
                    self.ex._keep_stage(stage)
                else:
                    self._end(sc, stage, cancel=raised or error is not None or self.stopped)

    def _leave(self, sc: Any, stage: _Stage) -> None:
        """Ends a kept stage whose rebuild failed before ``Go``, and forgets it: what its
        workers say later reaches this attempt no more, which starts a stage anew."""
        logger.info(
            "generation %d: the stage kept for a restart in place failed before it ran; "
            "starting a new stage",
            self.generation,
        )
        try:
            self._end(sc, stage, cancel=True)
        finally:
            with _ROUTE:
                stage.owner = stage.submitter  # late words go to a finished attempt
                self.conns, self.workers = {}, {}
                self._finished = set()
                self.in_place = False
                while True:  # what the old stage said: none of this stage's doing
                    try:
                        self.events.get_nowait()
                    except queue.Empty:
                        break

    def _start(self, sc: Any) -> _Stage:
        """Opens the control endpoint and submits the barrier stage."""
        ex = self.ex
        server = ControlServer(ex.secret, self._on_connect, host=ex.driver_host(sc))
        stage = self.stage = _Stage(server, self, ex.graph, self.n, self)
        try:
            spec = WorkerSpec(
                graph=ex.graph,
                config=ex.config,
                generation=self.generation,
                control=server.address,
                secret=ex.secret,
                restore=self.restore,
                failures=ex.failures,
                flush_interval=ex.flush_interval,
                run_id=ex.run_id,
                network_fault=ex.network_fault,
            )
            if ex._shippable is not ex.graph:  # once per job graph, not every generation
                _check_shippable(spec)
                ex._shippable = ex.graph
            stage.thread = threading.Thread(
                target=self._submit,
                args=(sc, spec),
                name=f"spillover-stage {self.group}",
                daemon=True,
            )
            stage.thread.start()
        except BaseException:
            server.close()
            raise
        return stage

    # -- restart in place --------------------------------------------------------------

    def _may_restart_in_place(self, error: BaseException, stage: _Stage) -> bool:
        """Whether the next attempt may run in this one's stage: an operator's own
        failure (not a broken channel, a lost or silent worker), every worker still
        connected and none finished, the stage alive, no stop, cancel or rescale."""
        ex = self.ex
        return (
            ex.config.deployment.restart_in_place
            and ex.config.restart_strategy is not RestartStrategy.NONE
            and isinstance(error, SubtaskFailedError)
            and not error.broken_channel
            and self._going
            and not self.stopped
            and not ex._cancelled
            and ex._rescaling is None
            and not self._finished
            and len(self.conns) == self.n
            and stage.thread is not None
            and stage.thread.is_alive()
        )

    def _reset(self) -> bool:
        """Tells every worker to cancel this generation's subtasks and keep the rest;
        True once each confirmed within ``cancel_grace_s``, False if one did not, or
        a worker or the stage was lost first (then the stage ends as ever)."""
        self._going = False
        for i in range(self.n):
            self.send(i, ResetTo(self.generation))
        until = time.monotonic() + self.ex.cancel_grace_s
        seen: set[int] = set()
        while len(seen) < self.n:
            try:
                ev = self.events.get(timeout=max(0.0, until - time.monotonic()))
            except queue.Empty:
                return False
            if isinstance(ev, WorkerJoined) and ev.kind == "reset":
                seen.add(ev.index)
            elif isinstance(ev, WorkerLost | StageEnded) or (
                isinstance(ev, WorkerJoined) and ev.kind == "finished"
            ):
                return False  # a worker that finished rebuilds nothing
        return True

    def _rebuild(self, stage: _Stage) -> BaseException | None:
        """Takes over ``stage`` from the attempt that reset it, and has its workers
        build this generation's subtasks; an error if one did not wire in time."""
        from pyspark import cloudpickle

        old = stage.owner
        self.in_place = True
        with _ROUTE:
            self.conns, self.workers = old.conns, old.workers
            old.conns = {}  # a late word of the old coordinator reaches no worker
            stage.owner = self
            while True:  # what reached the old attempt since its reset: a lost worker
                try:
                    ev = old.events.get_nowait()
                except queue.Empty:
                    break
                if isinstance(ev, WorkerLost | StageEnded):
                    self.events.put(ev)
        payload = cloudpickle.dumps((self.restore, self.ex.failures))  # type: ignore[no-untyped-call]
        for i in range(self.n):
            self.send(i, Rebuild(self.generation, payload))
        return self._wait("wired", time.monotonic() + self.ex.register_timeout)

    def _loop(
        self,
        deadline: float | None,
        stop_at: float | None,
        stop_when: StopWhen | None,
    ) -> BaseException | None:
        remaining = set(self.proxies)
        grace: float | None = None  # set when the stage ended with subtasks remaining
        while remaining:
            graced = grace is not None and (deadline is None or grace < deadline)
            until = grace if graced else deadline
            what, ev = next_event(self.events, self.coordinator, until, stop_at, stop_when)
            if what == "stop":
                self.stopped = True
                return None
            if what == "timeout":
                if graced:
                    return _stage_failure(None, self.generation)
                return TimeoutError("the job did not finish in time")
            if isinstance(ev, SubtaskDone) and ev.error is None:
                remaining.discard(ev.key)
            elif isinstance(ev, StageEnded) and ev.error is None:
                # The workers returned, but their last done/finished messages come over
                # the control connections and may still be on their way: the stage
                # ended early only if they do not arrive within a moment.
                grace = time.monotonic() + STAGE_END_GRACE_S
            elif (error := _failure(ev, self.generation)) is not None:
                return error if isinstance(ev, StageEnded) else self._root_cause(error)
        return None

    def _root_cause(self, first: BaseException) -> BaseException:
        """A subtask failing fails its peers' channels: prefer an error that is not a
        network error, if one arrives within a moment."""
        if not _is_consequence(first):
            return first
        best = first
        until = time.monotonic() + 0.3
        while (left := until - time.monotonic()) > 0:
            try:
                ev = self.events.get(timeout=left)
            except queue.Empty:
                break
            if not isinstance(ev, SubtaskDone | WorkerLost):
                continue
            if (e := _failure(ev, self.generation)) is None:
                continue
            if not _is_consequence(e):
                return e
            if isinstance(e, WorkerLostError) and not isinstance(best, WorkerLostError):
                best = e  # a lost worker explains its peers' broken channels
        return best

    def _end(self, sc: Any, stage: _Stage, cancel: bool) -> None:
        """Ends ``stage``: its workers told to cancel (``cancel``) or left to return,
        then ended by force if they do not; its connections and endpoint closed."""
        try:
            thread = stage.thread
            if thread is not None:
                if cancel:
                    for i in list(self.conns):
                        self.send(i, CancelAll())
                thread.join(timeout=self.ex.cancel_grace_s if cancel else 30.0)
                if thread.is_alive():
                    stage.submitter._force_end(sc)
                    thread.join(timeout=60.0)
            for conn in list(self.conns.values()):
                conn.close()
        finally:
            stage.server.close()

    def _force_end(self, sc: Any) -> None:
        """Ends a stage whose workers did not end when told to."""
        sc.cancelJobGroup(self.group)

    def task_metrics(self) -> dict[str, dict[str, float]]:
        return dict(self.metrics)


def _check_shippable(spec: WorkerSpec) -> None:
    """Refuses, before any stage starts, a job that cannot travel to the workers."""
    from pyspark import cloudpickle

    try:
        cloudpickle.dumps(spec)  # type: ignore[no-untyped-call]
    except Exception as e:
        raise ConfigError(
            f"job {spec.graph.name!r} cannot be shipped to Spark workers",
            detail=f"{type(e).__name__}: {e}",
            hint="operators, functions and their attributes must pickle with cloudpickle "
            "(no open files, locks or sockets: create those in open())",
        ) from e


def _is_consequence(e: BaseException) -> bool:
    return isinstance(e, WorkerLostError) or (
        isinstance(e, SubtaskFailedError) and e.broken_channel
    )


def _subtask_error(key: tuple[str, int], err: tuple[str, str, str, bool]) -> SubtaskFailedError:
    name, message, tb, broken = err
    return SubtaskFailedError(
        f"subtask {key[0]}#{key[1]} failed: {name}: {message}", name, tb, broken
    )


def _failure(ev: MasterEvent, generation: int) -> BaseException | None:
    """The failure an event of a generation reports, or None (a hello, a subtask that
    finished, ...). The stage's end is a failure here: it ended before what the
    caller waits for (a caller that expects it to end says so first)."""
    match ev:
        case SubtaskDone(key=key, error=err):
            return None if err is None else _subtask_error(key, err)
        case StageEnded(error=err):
            return _stage_failure(err, generation)
        case WorkerLost(reason=reason):
            return WorkerLostError(reason)
        case CoordinatorFailed(error=err):
            return err
    return None


_MISSING_MODULE = re.compile(r"ModuleNotFoundError: No module named '([^']+)'")


def _stage_failure(e: BaseException | None, generation: int) -> BaseException:
    if e is None:
        return WorkerLostError(f"the Spark stage of generation {generation} ended early")
    missing = _MISSING_MODULE.search(str(e))
    if missing:  # no restart heals this
        return ConfigError(
            f"the Spark workers cannot import module {missing.group(1)!r}, which the job uses",
            hint="install it in the workers' Python environment (spark.pyspark.python), "
            "or keep the job's own code in a module spillover ships by value "
            "(pyspark.cloudpickle.register_pickle_by_value)",
        )
    text = str(e).strip().splitlines()
    return WorkerLostError(
        f"the Spark stage of generation {generation} failed: "
        + (text[0][:500] if text else type(e).__name__)
    )


class SparkExecutor(Executor):
    """Runs a job on Spark: the job master here, one barrier stage per generation.

    ``master``: a Spark master URL (default: the embedded ``local[32]``);
    ``spark_context``: an existing SparkContext to use instead. Other options are
    those of :class:`~spillover.deploy.local.LocalExecutor`.
    """

    def __init__(
        self,
        job: JobGraph | StreamEnvironment,
        config: Config | None = None,
        *,
        master: str | None = None,
        spark_context: Any = None,
        register_timeout: float = 120.0,
        cancel_grace_s: float = 2.0,
        network_fault: NetworkFault | None = None,
        **options: Any,
    ) -> None:
        super().__init__(job, config, **options)
        self.network_fault = network_fault  # a test hook (runtime/network/tcp/faults.py)
        self.master = master
        self._sc = spark_context
        self.register_timeout = register_timeout
        self.cancel_grace_s = cancel_grace_s
        self.secret = secrets.token_bytes(32)
        self._shippable: JobGraph | None = None  # the graph _check_shippable passed
        self._starting: threading.Thread | None = None  # start_cluster's
        self._start_error: BaseException | None = None
        self._kept: _Stage | None = None  # a failed attempt's stage, for the next one

    def _keep_stage(self, stage: _Stage) -> None:
        """Keeps a reset stage for the next attempt to restart in place."""
        self._kept = stage

    def _take_stage(self, run: _SparkAttempt, sc: Any) -> _Stage | None:
        """The stage the previous attempt kept, if ``run`` fits it (the same job graph,
        so the same parallelism and placement); one that does not fit is ended."""
        stage, self._kept = self._kept, None
        if stage is None:
            return None
        alive = stage.thread is not None and stage.thread.is_alive()
        if alive and stage.graph is self.graph and stage.n == run.n:
            return stage
        stage.owner._end(sc, stage, cancel=True)
        return None

    def _release(self) -> None:
        """Ends a stage kept for a restart that did not come (the job ended)."""
        stage, self._kept = self._kept, None
        if stage is not None:
            stage.owner._end(self._sc, stage, cancel=True)

    @property
    def slots(self) -> int:
        """Spark task slots a generation takes: one per worker, the job's largest
        parallelism over ``taskmanager.numberOfTaskSlots`` rounded up (one barrier
        stage); a batch job runs each task as a Spark job of its own, so one."""
        if self.batch:
            return 1
        return workers_for(max(v.parallelism for v in self.graph.vertices), self.task_slots)

    @property
    def task_slots(self) -> int:
        """Subtasks of each operator one worker hosts (``taskmanager.numberOfTaskSlots``)."""
        return self.config.deployment.task_slots

    def available_slots(self) -> int:
        """Tasks the cluster runs at once now (after prepare or a run)."""
        return _slots(self._sc) if self._sc is not None else 0

    def context(self) -> Any:
        """The SparkContext, created (embedded by default) on first use; it must have a
        slot for every task of the stage."""
        if self._sc is None:
            self._sc = spark_context(self.master, self.slots)
        have = _slots(self._sc)
        if have < self.slots and not str(self._sc.master).startswith("local"):
            # A cluster's executors register after the context starts: wait for them.
            until = time.monotonic() + self.register_timeout
            while have < self.slots and time.monotonic() < until:
                time.sleep(0.25)
                have = _slots(self._sc)
        if have < self.slots:
            raise ConfigError(
                f"the Spark cluster has {have} task slots; job {self.graph.name!r} needs "
                f"{self.slots} (its largest parallelism) in one barrier stage",
                hint="add executors or cores, or lower the job's parallelism",
            )
        warm_up(self._sc, self.slots)
        return self._sc

    def workers(self) -> dict[int, dict[str, Any]]:
        """The running generation's workers: ``{index: {"pid", "host", "address"}}``."""
        run = self._current
        return {} if run is None else {i: dict(w) for i, w in run.workers.items()}

    def prepare(self) -> None:
        """Creates (or checks) the SparkContext and starts its Python workers."""
        self.context()

    def start_cluster(self) -> None:
        """Creates the SparkContext and starts its Python workers on a thread (the
        JVM's start is most of a new driver's), while the job master replays its
        log and checks the results it reuses."""
        if self._starting is not None:
            return

        def start() -> None:
            try:
                self.context()
            except BaseException as e:  # raised where the context is needed
                self._start_error = e

        self._starting = threading.Thread(target=start, name="spark-context", daemon=True)
        self._starting.start()

    def cluster_started(self) -> None:
        """Waits for ``start_cluster``'s thread; raises what it failed with."""
        starting, self._starting = self._starting, None
        if starting is not None:
            starting.join()
        error, self._start_error = self._start_error, None
        if error is not None:
            raise error

    def driver_host(self, sc: Any) -> str:
        """The address the control endpoint binds to: the driver's."""
        host = sc.getConf().get("spark.driver.host")
        return str(host) if host else "127.0.0.1"

    supports_batch = True

    def _batch_launcher(self) -> Launcher:
        """A batch job: each region a one-task Spark job (``deploy/spark/batch.py``)."""
        from spillover.deploy.spark.batch import SparkLauncher

        self.cluster_started()
        return SparkLauncher(self.context(), self.graph.name)

    def _attempt(
        self,
        attempt: int,
        restore: dict[tuple[str, int], TaskRestore] | None,
        restored_id: int | None,
    ) -> _SparkAttempt:
        return _SparkAttempt(self, attempt, restore, restored_id)


def rescale_to_available_slots(
    make_job: Callable[[int], JobGraph | StreamEnvironment],
    wait_s: float = 10.0,
) -> Callable[[Any, int, BaseException], JobGraph | StreamEnvironment | None]:
    """A rescale policy for :class:`SparkExecutor`: when the cluster has fewer task slots
    than the job needs after a failure (an executor is gone), the next generation runs
    ``make_job(parallelism)`` instead of waiting for the lost capacity, the
    parallelism the remaining slots host (``taskmanager.numberOfTaskSlots`` subtasks
    each); with enough slots it keeps the job. ``wait_s``: how long to give lost
    executors to come back first."""

    def policy(ex: Any, attempt: int, error: BaseException) -> JobGraph | StreamEnvironment | None:
        until = time.monotonic() + wait_s
        have = ex.available_slots()
        while have < ex.slots and time.monotonic() < until:
            time.sleep(0.25)
            have = ex.available_slots()
        if have >= ex.slots or have < 1:
            return None
        return make_job(have * ex.task_slots)

    return policy
