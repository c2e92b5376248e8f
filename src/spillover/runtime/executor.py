"""The local executor: runs a job graph on this machine, one thread per subtask.

It wires the network of each execution attempt, starts the coordinator and the
tasks, and on a failure cancels the attempt and restarts the job from the
latest completed checkpoint, as the restart strategy allows.
"""

from __future__ import annotations

import json
import queue
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spillover.config import Alignment, Config, RestartStrategy
from spillover.errors import ConfigError
from spillover.keygroups import key_group_range_for_operator
from spillover.runtime.buffers import BufferPool
from spillover.runtime.checkpoints import CheckpointStorage
from spillover.runtime.coordinator import CheckpointCoordinator
from spillover.runtime.events import BarrierKind
from spillover.runtime.failures import FailureInjector
from spillover.runtime.graph import JobGraph, StreamEnvironment, Vertex
from spillover.runtime.network import InputGate, ResultPartition, connect
from spillover.runtime.restore import graph_info, plan_restore
from spillover.runtime.task import InputChannelInfo, Task, TaskCancelled, TaskRestore
from spillover.runtime.writers import Outbox, PartitionWriter

_BARRIER_KIND = {
    Alignment.ALIGNED: BarrierKind.ALIGNED,
    Alignment.UNALIGNED: BarrierKind.UNALIGNED,
    Alignment.ALIGNED_WITH_TIMEOUT: BarrierKind.ALIGNED_WITH_TIMEOUT,
}


class JobFailedError(RuntimeError):
    """The job failed and the restart strategy allows no more attempts."""


@dataclass
class JobResult:
    """How a run went: status, attempts, per-checkpoint and per-task metrics."""

    job_name: str
    status: str  # finished | stopped | failed
    attempts: int
    duration_s: float
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    tasks: dict[str, dict[str, float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    tracebacks: list[str] = field(default_factory=list, repr=False)
    restored_from: list[int] = field(default_factory=list)
    replayed_bytes: int = 0  # in-flight bytes replayed by restores, over every attempt
    checkpoint_dir: str | None = None
    # Per restart: seconds from the failure's detection to the next attempt's subtasks
    # running (restore included; the restart strategy's delay too).
    restart_s: list[float] = field(default_factory=list)

    def completed_checkpoints(self) -> list[dict[str, Any]]:
        return [c for c in self.checkpoints if c["status"] == "completed"]

    @property
    def persisted_inflight_bytes(self) -> int:
        """In-flight bytes persisted by completed checkpoints, over every attempt."""
        return sum(int(c["inflight_bytes"]) for c in self.completed_checkpoints())

    def to_json(self) -> str:
        return json.dumps(self.__dict__, default=str, indent=1)


RemoteConnect = Callable[[ResultPartition, int, str, int], None]
"""``(partition, subpartition, gate name, channel)``: links a subpartition to an input
channel of a subtask that runs elsewhere (see :func:`build_tasks`)."""


def build_tasks(
    g: JobGraph,
    cfg: Config,
    *,
    attempt: int,
    restore: dict[tuple[str, int], TaskRestore] | None,
    storage: CheckpointStorage | None,
    failures: FailureInjector,
    on_done: Callable[[Task, BaseException | None], None],
    flush_interval: float,
    hosted: Callable[[int], bool] | None = None,
    remote: RemoteConnect | None = None,
) -> dict[tuple[str, int], Task]:
    """The tasks of one execution attempt with their network, keyed ``(uid, subtask)``.

    ``storage`` is the job's checkpoint storage (:func:`checkpoint_storage`), None
    when checkpointing is off: the tasks take both their directories and whether
    they checkpoint from it. ``hosted(i)`` says whether subtask ``i`` of every
    operator runs here (default: all, the local executor); a result partition's
    subpartition for a subtask that runs elsewhere is linked with ``remote``. Input
    gates are named ``uid#i``; the tasks' ``coordinator`` is set by the caller.
    """
    here = hosted or (lambda i: True)
    net = cfg.network
    checkpoint_dir = storage.subtask_dir if storage is not None else _no_checkpoint_dir
    gates: dict[tuple[int, int], Any] = {}
    channels: dict[tuple[int, int], list[InputChannelInfo]] = {}
    partitions: dict[tuple[int, int], list[Any]] = {}
    outboxes: dict[tuple[int, int], list[Outbox]] = {}
    writers: dict[tuple[int, int], list[Any]] = {}
    for v in g.vertices:
        ins = sorted(g.inputs_of(v.id), key=lambda e: e.input_index)
        for d in range(v.parallelism):
            infos = [
                InputChannelInfo(e.input_index, e, u, e.dtype)
                for e in ins
                for u in range(g.vertices[e.source].parallelism)
            ]
            channels[(v.id, d)] = infos
            gates[(v.id, d)] = (
                InputGate(
                    len(infos),
                    buffers_per_channel=net.buffers_per_channel,
                    floating_buffers=net.floating_buffers_per_gate,
                    name=f"{v.uid}#{d}",
                )
                if infos and here(d)
                else None
            )
    for e in g.edges:
        up, down = g.vertices[e.source], g.vertices[e.target]
        first = next(k for k, c in enumerate(channels[(down.id, 0)]) if c.edge == e)
        for u in range(up.parallelism):
            if not here(u):
                continue
            pool = BufferPool(net.segment_size, net.buffers_per_partition, f"{up.uid}#{u}")
            part = ResultPartition(down.parallelism, pool, name=f"{up.uid}#{u}->{down.uid}")
            for d in range(down.parallelism):
                if here(d):
                    connect(part, d, gates[(down.id, d)], first + u)
                elif remote is None:
                    raise ValueError(f"subtask {d} of {down.uid!r} runs elsewhere: give remote")
                else:
                    remote(part, d, f"{down.uid}#{d}", first + u)
            partitions.setdefault((up.id, u), []).append(part)
            box = Outbox(part, pool)
            outboxes.setdefault((up.id, u), []).append(box)
            writers.setdefault((up.id, u), []).append(
                PartitionWriter(
                    e.kind,
                    e.dtype,
                    down.parallelism,
                    u,
                    net.segment_size,
                    g.max_parallelism,
                    e.key_field,
                    send=box.send,
                    send_all=box.send_all,
                    partitioner=e.partitioner,
                )
            )
    tasks: dict[tuple[str, int], Task] = {}
    for v in g.vertices:
        for i in range(v.parallelism):
            if not here(i):
                continue
            tasks[(v.uid, i)] = Task(
                graph=g,
                vertex=v,
                subtask=i,
                attempt=attempt,
                gate=gates[(v.id, i)],
                channels=channels[(v.id, i)],
                partitions=partitions.get((v.id, i), []),
                outboxes=outboxes.get((v.id, i), []),
                writers=writers.get((v.id, i), []),
                restore=(restore or {}).get((v.uid, i)),
                coordinator=None,
                checkpoint_dir=checkpoint_dir,
                keyed_backend_factory=_keyed_backend(g),
                failures=failures,
                on_done=on_done,
                flush_interval=flush_interval,
                channel_compression=cfg.checkpointing.codec.label,
                max_inflight_bytes=cfg.checkpointing.max_inflight_bytes,
                checkpointing=storage is not None,
            )
    return tasks


StopWhen = Callable[[list[dict[str, Any]]], bool]


def next_event(
    events: queue.SimpleQueue[Any],
    coordinator: CheckpointCoordinator,
    deadline: float | None,
    stop_at: float | None,
    stop_when: StopWhen | None,
) -> tuple[str, Any]:
    """``("event", item)``: the attempt's next event; ``("stop", None)`` once ``stop_at``
    passed or ``stop_when`` holds for the checkpoint summaries (polled every 20 ms);
    ``("timeout", None)`` once ``deadline`` passed, whichever comes first."""
    while True:
        ends = [x for x in (deadline, stop_at) if x is not None]
        timeout = None if not ends else max(0.0, min(ends) - time.monotonic())
        if stop_when is not None:
            timeout = 0.02 if timeout is None else min(timeout, 0.02)
        try:
            return "event", events.get(timeout=timeout)
        except queue.Empty:
            pass
        now = time.monotonic()
        if (stop_at is not None and now >= stop_at) or (
            stop_when is not None and stop_when([c.summary() for c in coordinator.history])
        ):
            return "stop", None
        if deadline is not None and now >= deadline:
            return "timeout", None


class _Attempt:
    """One execution attempt: the tasks, their network and the coordinator."""

    def __init__(
        self,
        ex: Executor,
        attempt: int,
        restore: dict[tuple[str, int], TaskRestore] | None,
        restored_id: int | None,
    ) -> None:
        self.ex = ex
        self.attempt = attempt
        self.done: queue.SimpleQueue[tuple[Task, BaseException | None]] = queue.SimpleQueue()
        self.coordinator_error: BaseException | None = None
        self.running_at: float | None = None
        self.failed_at: float | None = None
        g, cfg = ex.graph, ex.config
        self.tasks = build_tasks(
            g,
            cfg,
            attempt=attempt,
            restore=restore,
            storage=ex.storage,
            failures=ex.failures,
            on_done=lambda t, err: self.done.put((t, err)),
            flush_interval=ex.flush_interval,
        )
        self.coordinator = make_coordinator(
            ex, self.tasks, restored_id, self._terminate_sources, self._coordinator_failed
        )
        for t in self.tasks.values():
            t.coordinator = self.coordinator

    def _terminate_sources(self) -> None:
        for (_uid, _i), t in self.tasks.items():
            if t.vertex.is_source:
                t.post("terminate")

    def _coordinator_failed(self, e: BaseException) -> None:
        self.coordinator_error = e
        # Wake the executor's wait with a synthetic failure.
        any_task = next(iter(self.tasks.values()))
        self.done.put((any_task, e))

    def run(
        self,
        deadline: float | None,
        stop_at: float | None = None,
        stop_when: StopWhen | None = None,
    ) -> BaseException | None:
        """Runs until every task finished (None) or one failed (its error); at
        ``stop_at`` the job is stopped (cancelled, not failed: returns None)."""
        self.coordinator.start()
        for t in self.tasks.values():
            t.start()
        self.running_at = time.monotonic()
        remaining = set(self.tasks)
        error: BaseException | None = None
        self.stopped = False
        while remaining:
            what, item = next_event(self.done, self.coordinator, deadline, stop_at, stop_when)
            if what == "stop":
                self.stopped = True
                self._cancel_all()
                break
            if what == "timeout":
                error = TimeoutError("the job did not finish in time")
                break
            task, err = item
            if err is not None and not isinstance(err, TaskCancelled):
                error = err
                self.failed_at = time.monotonic()
                break
            remaining.discard((task.vertex.uid, task.subtask))
        if error is not None:
            self._cancel_all()
        self.coordinator.stop()
        return error

    def _cancel_all(self) -> None:
        for t in self.tasks.values():
            t.cancel()
        settle(self.tasks.values())

    def task_metrics(self) -> dict[str, dict[str, float]]:
        """Each subtask's metrics (``uid#i``), live while the attempt runs."""
        return {f"{uid}#{i}": t.metrics() for (uid, i), t in self.tasks.items()}


def settle(tasks: Any, timeout: float = 30.0) -> None:
    """Waits for cancelled tasks' threads and their snapshot writers: once an attempt
    has ended, nothing of it writes to the checkpoint directory any more (a restore
    right after a stop must not meet a late write)."""
    tasks = list(tasks)
    for t in tasks:
        if t.thread.ident is not None:  # started
            t.thread.join(timeout=timeout)
    for t in tasks:
        t.snapshots.shutdown(wait=True, cancel_futures=True)


def make_coordinator(
    ex: Executor,
    tasks: dict[tuple[str, int], Any],
    restored_id: int | None,
    on_final: Callable[[], None],
    on_failure: Callable[[BaseException], None],
) -> CheckpointCoordinator:
    """The checkpoint coordinator of one attempt over ``tasks`` (anything with
    ``post(*action)`` and ``request_unaligned(cid)``)."""
    g, cp = ex.graph, ex.config.checkpointing
    return CheckpointCoordinator(
        job_name=g.name,
        fingerprint=g.fingerprint(),
        settings=ex.settings,
        graph=graph_info(g),
        storage=ex.storage,
        tasks=tasks,
        sources=[(v.uid, i) for v in g.vertices if v.is_source for i in range(v.parallelism)],
        interval_s=cp.interval_s,
        timeout_s=cp.timeout_s,
        min_pause_s=cp.min_pause_s,
        max_concurrent=cp.max_concurrent_checkpoints,
        num_retained=ex.config.state.num_retained,
        tolerable_failures=cp.tolerable_failed_checkpoints,
        # Ids are never reused: an aborted checkpoint's late writes must not land
        # in a later checkpoint's directory.
        first_id=max(ex.next_checkpoint_id, restored_id + 1 if restored_id else 1),
        on_final=on_final,
        on_failure=on_failure,
        metrics_path=ex.metrics_path,
        barrier_kind=_BARRIER_KIND[cp.alignment],
        alignment_timeout_s=cp.aligned_checkpoint_timeout_s,
    )


def checkpoint_storage(cfg: Config, job_name: str) -> CheckpointStorage | None:
    """The job's checkpoint storage, or None when checkpointing is off: the one place
    that decides it (a directory and checkpointing enabled). The executor keeps it as
    ``Executor.storage``; a Spark worker derives the same from the job's configuration."""
    cdir = cfg.state.checkpoints_dir
    if cdir is None or not cfg.checkpointing.enabled:
        return None
    return CheckpointStorage(cdir, job_name)


def _no_checkpoint_dir(cid: int, uid: str, subtask: int) -> str:
    raise RuntimeError("checkpointing is off: state.checkpoints.dir is not set")


def _keyed_backend(g: JobGraph) -> Any:
    from spillover.runtime.state import HeapKeyedStateBackend

    def make(v: Vertex, i: int) -> Any:
        rng = key_group_range_for_operator(g.max_parallelism, v.parallelism, i)
        return HeapKeyedStateBackend(g.max_parallelism, rng)

    return make


RescalePolicy = Callable[["Executor", int, BaseException], "JobGraph | StreamEnvironment | None"]
"""``(executor, failed attempt, its error)`` → the job to run the next attempt with
(another parallelism: the restore rescales state and in-flight data), or None to
keep it. Called before each restart."""


class Executor:
    """Runs a job graph, restarting it on failures; subclasses say where subtasks run.

    A subclass gives ``_attempt(attempt, restore, restored_id)``: an object with
    ``run(deadline, stop_at, stop_when)`` (the error that ended it, or None),
    ``coordinator``, ``stopped``, ``task_metrics()``, and the ``time.monotonic()``
    instants ``running_at`` (its subtasks started) and ``failed_at`` (it detected its
    failure), each None until then; ``JobResult.restart_s`` is timed from them.
    """

    def __init__(
        self,
        job: JobGraph | StreamEnvironment,
        config: Config | None = None,
        *,
        failures: FailureInjector | None = None,
        metrics_path: str | None = None,
        restore_checkpoint: int | str | None = None,
        flush_interval: float = 0.005,
        allow_non_restored_state: bool | None = None,
        ignore_inflight: bool | None = None,
        force_forward_rescale: bool | None = None,
        rescale: RescalePolicy | None = None,
    ) -> None:
        self.graph = job.build() if isinstance(job, StreamEnvironment) else job
        self.rescale = rescale
        self.config = config or Config()
        self.failures = failures or FailureInjector()
        self.metrics_path = metrics_path
        self.flush_interval = flush_interval
        rec = self.config.recovery
        self.restore_checkpoint = restore_checkpoint if restore_checkpoint is not None else rec.path
        self.allow_non_restored_state = (
            rec.ignore_unclaimed_state
            if allow_non_restored_state is None
            else allow_non_restored_state
        )
        # True: drop in-flight data of whatever checkpoint is restored (the records are lost).
        self.ignore_inflight = bool(ignore_inflight)
        self.force_forward_rescale = (
            rec.force_forward_rescale if force_forward_rescale is None else force_forward_rescale
        )
        self.settings = {
            **self.config.restore_critical(),
            "max-parallelism": self.graph.max_parallelism,
        }
        self.storage = checkpoint_storage(self.config, self.graph.name)
        self.next_checkpoint_id = 1
        self.job_id = uuid.uuid4().hex
        self._current: Any = None  # the running attempt

    def _attempt(
        self,
        attempt: int,
        restore: dict[tuple[str, int], TaskRestore] | None,
        restored_id: int | None,
    ) -> Any:
        raise NotImplementedError

    def completed_ids(self) -> list[int]:
        """The checkpoints the running attempt completed so far."""
        run = self._current
        return [] if run is None else list(run.coordinator.completed_ids)

    def prepare(self) -> None:
        """Gets the cluster ready (a no-op here), so that timing ``run`` measures the job."""

    def live_metric(self, uid: str, metric: str = "records_in") -> float:
        """The sum of ``metric`` over the subtasks of operator ``uid`` in the running
        attempt (0 before it starts); safe to call from any thread."""
        run = self._current
        if run is None:
            return 0.0
        prefix = f"{uid}#"
        return float(
            sum(m.get(metric, 0.0) for k, m in run.task_metrics().items() if k.startswith(prefix))
        )

    def _restore_point(self) -> dict[str, Any] | None:
        """The metadata of the checkpoint to restore: the one asked for (an id in this
        job's checkpoint directory, or a checkpoint directory's path), else the latest."""
        rc = self.restore_checkpoint
        if isinstance(rc, str):
            base, _, name = rc.rstrip("/").rpartition("/")
            job, _, chk = base.rpartition("/")
            if not name.startswith("chk-"):
                raise ConfigError(f"not a checkpoint directory: {rc!r}", hint="give .../chk-<id>")
            return CheckpointStorage(job, chk).read_metadata(int(name[4:]))
        if self.storage is None:
            return None
        if isinstance(rc, int):
            return self.storage.read_metadata(rc)
        latest = self.storage.latest()
        return latest.metadata if latest is not None else None

    def _use_graph(self, job: JobGraph | StreamEnvironment) -> None:
        """The job at other parallelisms, for the next attempt (a rescale policy's
        answer): the same job name and max parallelism, or it is refused."""
        graph = job.build() if isinstance(job, StreamEnvironment) else job
        if graph.name != self.graph.name or graph.max_parallelism != self.graph.max_parallelism:
            raise ConfigError(
                "a rescale policy must keep the job's name and max parallelism",
                detail=f"{self.graph.name!r}/{self.graph.max_parallelism} became "
                f"{graph.name!r}/{graph.max_parallelism}",
                hint="build the job with the same name and pipeline.max-parallelism",
            )
        self.graph = graph

    def _plan(self, meta: dict[str, Any] | None) -> dict[tuple[str, int], TaskRestore] | None:
        if meta is None:
            return None
        cid = int(meta["checkpoint_id"])
        return plan_restore(
            meta,
            self.graph,
            allow_non_restored_state=self.allow_non_restored_state,
            ignore_inflight=self.ignore_inflight
            or cid == self.config.recovery.without_channel_state_checkpoint,
            force_forward=self.force_forward_rescale,
        )

    def run(
        self,
        timeout: float | None = None,
        *,
        stop_after: float | None = None,
        stop_when: StopWhen | None = None,
    ) -> JobResult:
        """Runs the job to its end, restarting it on failures as the strategy allows.

        ``timeout``: give up (status ``failed``) after that many seconds.
        ``stop_after``: stop an unbounded job after that many seconds (status
        ``stopped``; the checkpoints taken until then are kept). ``stop_when``: stop
        as soon as it returns True for the current attempt's checkpoint summaries.
        """
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        stop_at = None if stop_after is None else started + stop_after
        strategy = self.config.restart_strategy
        rs = self.config.restart
        failure_times: deque[float] = deque()
        result = JobResult(
            self.graph.name,
            "failed",
            0,
            0.0,
            checkpoint_dir=self.storage.uri if self.storage else None,
        )
        attempt = 0
        failed_at: float | None = None
        meta = self._restore_point() if self.restore_checkpoint is not None else None
        restore = self._plan(meta)  # refuses a checkpoint that does not fit, before starting
        while True:
            restored_id = int(meta["checkpoint_id"]) if meta is not None else None
            if restored_id is not None:
                result.restored_from.append(restored_id)
            run = self._current = self._attempt(attempt, restore, restored_id)
            error = run.run(deadline, stop_at, stop_when)
            if failed_at is not None and run.running_at is not None:
                result.restart_s.append(round(run.running_at - failed_at, 4))
            failed_at = run.failed_at or time.monotonic()
            result.attempts = attempt + 1
            result.checkpoints += [c.summary() for c in run.coordinator.history]
            for name, m in run.task_metrics().items():
                result.tasks[name] = m
                result.replayed_bytes += int(m.get("replayed_bytes", 0))
            self.next_checkpoint_id = run.coordinator.next_id
            if error is None:
                result.status = "stopped" if run.stopped else "finished"
                break
            result.failures.append(f"attempt {attempt}: {type(error).__name__}: {error}")
            result.tracebacks.append("".join(traceback.format_exception(error)))
            now = time.monotonic()
            if strategy is RestartStrategy.NONE or isinstance(error, TimeoutError | ConfigError):
                break  # a configuration error does not heal on a restart
            if strategy is RestartStrategy.FIXED_DELAY:
                if attempt >= rs.fixed_delay_attempts:
                    break
                delay = rs.fixed_delay_delay_s
            else:
                failure_times.append(now)
                while failure_times and now - failure_times[0] > rs.failure_rate_interval_s:
                    failure_times.popleft()
                if len(failure_times) > rs.failure_rate_max_failures_per_interval:
                    break
                delay = rs.failure_rate_delay_s
            time.sleep(delay)
            if self.rescale is not None:
                changed = self.rescale(self, attempt, error)
                if changed is not None:
                    self._use_graph(changed)
            attempt += 1
            self.restore_checkpoint = None  # failover: the latest completed checkpoint
            meta = self._restore_point()
            restore = self._plan(meta)
        result.duration_s = time.monotonic() - started
        return result


class LocalExecutor(Executor):
    """Runs a job graph with one thread per subtask, restarting it on failures."""

    def _attempt(
        self,
        attempt: int,
        restore: dict[tuple[str, int], TaskRestore] | None,
        restored_id: int | None,
    ) -> _Attempt:
        return _Attempt(self, attempt, restore, restored_id)


EXECUTORS = ("local", "spark")


def create_executor(
    kind: str | None,
    job: JobGraph | StreamEnvironment,
    config: Config | None = None,
    *,
    master: str | None = None,
    **options: Any,
) -> Executor:
    """An executor by name: ``local`` (threads in this process) or ``spark`` (a barrier
    stage per attempt on ``master``, default the embedded local master). None takes
    both from the configuration (``spillover.executor``, ``spillover.spark.master``).
    ``options`` are those of :class:`LocalExecutor`."""
    if kind is None:
        dep = (config or Config()).deployment
        kind = dep.executor.value
        if kind == "spark" and master is None:
            master = dep.spark_master
    if kind == "local":
        if master is not None:
            raise ConfigError("--master needs the spark executor", hint="add --executor spark")
        return LocalExecutor(job, config, **options)
    if kind == "spark":
        from spillover.spark import SparkExecutor

        return SparkExecutor(job, config, master=master, **options)
    raise ConfigError(f"unknown executor {kind!r}", hint=f"choose one of {', '.join(EXECUTORS)}")
