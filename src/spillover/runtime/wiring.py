"""Wiring of one execution attempt: its tasks with their network, their coordinator,
and the job's checkpoint storage; shared by every deployment (local threads, Spark
workers), each of which hosts some of the subtasks."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any, Protocol

from spillover.config import Alignment, Config, NetworkConfig
from spillover.keygroups import key_group_range_for_operator
from spillover.runtime.checkpointing.channel_state import channel_state_groups
from spillover.runtime.checkpointing.coordinator import CheckpointCoordinator
from spillover.runtime.checkpointing.metadata import CheckpointStorage
from spillover.runtime.checkpointing.stats import CheckpointStatsListener
from spillover.runtime.failures import FailureInjector
from spillover.runtime.graph import JobEdge, JobGraph, Vertex
from spillover.runtime.iteration import feedback
from spillover.runtime.network.buffers import BufferPool
from spillover.runtime.network.debloat import BufferDebloater, Debloat
from spillover.runtime.network.events import BarrierKind
from spillover.runtime.network.gate import InputGate
from spillover.runtime.network.local import connect
from spillover.runtime.network.partition import ResultPartition
from spillover.runtime.network.writers import Outbox, PartitionWriter
from spillover.runtime.recovery.plan import graph_info
from spillover.runtime.recovery.restore import TaskRestore
from spillover.runtime.recovery.shared_reads import share_reads
from spillover.runtime.state import HeapKeyedStateBackend
from spillover.runtime.task import InputChannelInfo, Task
from spillover.storage.channel_index import ReadEntries
from spillover.storage.location import Publication
from spillover.storage.shared import STAGING_BUDGET

_BARRIER_KIND = {
    Alignment.ALIGNED: BarrierKind.ALIGNED,
    Alignment.UNALIGNED: BarrierKind.UNALIGNED,
    Alignment.ALIGNED_WITH_TIMEOUT: BarrierKind.ALIGNED_WITH_TIMEOUT,
}


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
    run_id: str | None = None,
) -> dict[tuple[str, int], Task]:
    """The tasks of one execution attempt with their network, keyed ``(uid, subtask)``.

    ``storage`` is the job's checkpoint storage (:func:`checkpoint_storage`), None
    when checkpointing is off: the tasks take both their directories and whether
    they checkpoint from it. ``hosted(i)`` says whether subtask ``i`` of every
    operator runs here (default: all, the local executor); a result partition's
    subpartition for a subtask that runs elsewhere is linked with ``remote``. Input
    gates are named ``uid#i``; the tasks' ``coordinator`` is set by the caller.
    ``run_id`` is the job's run, which the operators see (``OperatorContext.job_run``).
    """
    here = hosted or (lambda i: True)
    net = cfg.network
    checkpoint_dir = storage.subtask_dir if storage is not None else None
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
            gate = gates[(v.id, d)]
            if gate is not None:
                elsewhere = any(not here(c.upstream_subtask) for c in infos)
                gate.debloater = gate_debloater(net, gate, elsewhere)
    for e in g.edges:
        up, down = g.vertices[e.source], g.vertices[e.target]
        first = next(k for k, c in enumerate(channels[(down.id, 0)]) if c.edge == e)
        for u in range(up.parallelism):
            if not here(u):
                continue
            pool = BufferPool(net.segment_size, net.buffers_per_partition, f"{up.uid}#{u}")
            part = ResultPartition(
                down.parallelism,
                pool,
                name=f"{up.uid}#{u}->{down.uid}",
                buffer_size=debloat_start_size(net),
            )
            for d in range(down.parallelism):
                if here(d):
                    connect(part, d, gates[(down.id, d)], first + u)
                elif remote is None:
                    raise ValueError(f"subtask {d} of {down.uid!r} runs elsewhere: give remote")
                else:
                    remote(part, d, f"{down.uid}#{d}", first + u)
            out: ResultPartition | feedback.FeedbackPartition = part
            if e.feedback:  # a loop's feedback: spills instead of waiting for credit
                out = feedback.FeedbackPartition(
                    part,
                    os.path.join(net.tmp_dir or tempfile.gettempdir(), "spillover-feedback"),
                    spilling=feedback.SPILLING,
                )
            partitions.setdefault((up.id, u), []).append(out)
            box = Outbox(out, pool)
            outboxes.setdefault((up.id, u), []).append(box)
            writers.setdefault((up.id, u), []).append(
                edge_writer(g, e, u, net.segment_size, box, part)
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
                keyed_backend_factory=keyed_backend(g),
                failures=failures,
                on_done=on_done,
                flush_interval=flush_interval,
                channel_compression=cfg.checkpointing.codec.label,
                max_inflight_bytes=cfg.checkpointing.max_inflight_bytes,
                checkpointing=storage is not None,
            )
            tasks[(v.uid, i)].chain.job_run = run_id
    # The channel index entries this attempt's restore reads here, each once for the
    # subtasks here: held by the tasks until each has resolved its replay, then gone.
    entries = ReadEntries() if restore else None
    for task in tasks.values():
        if task.restore_state is not None:
            task.read_entries = entries
    # Old channels that several subtasks here replay of a rescaled edge: read once.
    shared = share_reads(
        {k: t.restore_state for k, t in tasks.items()},
        lambda k, gate: tasks[k].cp.input_edges[gate].partitioner,
        entries,
    )
    for key, parts in shared.items():
        tasks[key].shared_reads = parts
    if storage is not None:  # the subtasks hosted here share channel-state files
        STAGING_BUDGET.configure(cfg.checkpointing.staging_memory)
        groups = channel_state_groups(
            list(tasks),
            cfg.checkpointing.max_subtasks_per_channel_state_file,
            storage.checkpoint_dir,
            net.tmp_dir,
        )
        for key, task in tasks.items():
            task.cp.channel_group = groups[key]
    return tasks


def settle(tasks: Any, timeout: float = 30.0) -> None:
    """Waits for cancelled tasks' threads and their snapshot writers: once an attempt
    has ended, nothing of it writes to the checkpoint directory any more (a restore
    right after a stop must not meet a late write)."""
    tasks = list(tasks)
    for t in tasks:
        if t.thread.ident is not None:  # started
            t.thread.join(timeout=timeout)
    for t in tasks:
        t.cp.snapshots.shutdown(wait=True, cancel_futures=True)


class CoordinatedJob(Protocol):
    """What :func:`make_coordinator` reads of the job master (its ``Executor``),
    named here so that wiring, a layer below the master, never imports it."""

    @property
    def graph(self) -> JobGraph: ...
    @property
    def config(self) -> Config: ...
    @property
    def settings(self) -> dict[str, Any]: ...
    @property
    def storage(self) -> CheckpointStorage | None: ...
    @property
    def next_checkpoint_id(self) -> int: ...
    @property
    def metrics_path(self) -> str | None: ...
    @property
    def retained_ids(self) -> list[int]: ...
    @property
    def subsumed_ids(self) -> list[int]: ...
    @property
    def stats(self) -> CheckpointStatsListener: ...
    def checkpoint_completed(self, checkpoint_id: int, metadata: Publication) -> None: ...


def make_coordinator(
    ex: CoordinatedJob,
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
        on_complete=ex.checkpoint_completed,
        retained=ex.retained_ids,
        subsumed=ex.subsumed_ids,
        stats_listener=ex.stats,
    )


def checkpoint_storage(cfg: Config, job_name: str) -> CheckpointStorage | None:
    """The job's checkpoint storage, or None when checkpointing is off: the one place
    that decides it (a directory and checkpointing enabled). The executor keeps it as
    ``Executor.storage``; a Spark worker derives the same from the job's configuration."""
    cdir = cfg.state.checkpoints_dir
    if cdir is None or not cfg.checkpointing.enabled:
        return None
    return CheckpointStorage(cdir, job_name, fsync=cfg.state.fsync_metadata)


def edge_writer(
    g: JobGraph,
    e: JobEdge,
    subtask: int,
    segment_size: int,
    box: Outbox,
    sizes: ResultPartition | None = None,
) -> PartitionWriter:
    """How subtask ``subtask`` of ``e``'s source routes and serializes into ``box``
    (streaming partitions and batch result files alike); with ``sizes`` (a streaming
    edge's partition) it cuts buffers at the sizes debloating consumers announce."""
    return PartitionWriter(
        e.kind,
        e.dtype,
        g.vertices[e.target].parallelism,
        subtask,
        segment_size,
        g.max_parallelism,
        e.key_field,
        send=box.send,
        send_all=box.send_all,
        partitioner=e.partitioner,
        sizes=sizes,
    )


def debloat_start_size(net: NetworkConfig) -> int | None:
    """Where a streaming edge's producers cut buffers before its consumer first
    measured what it takes (None: the segment size, debloating off). The consumer's
    :class:`BufferDebloater` assumes the same size, in this process or another."""
    if not net.debloat_enabled:
        return None
    return min(net.segment_size, max(net.min_segment_size, net.debloat_initial_size))


def gate_debloater(
    net: NetworkConfig, gate: InputGate, remote: bool = False
) -> BufferDebloater | None:
    """Buffer debloating of one input gate (None: off). Its buffers are its channels'
    exclusive ones, and its floating ones unless a channel is ``remote``: a TCP
    channel gets exclusive credit only, so counting them would leave each remote
    channel a fraction of the target."""
    if not net.debloat_enabled:
        return None
    settings = Debloat(
        target_s=net.debloat_target.total_seconds(),
        period_s=net.debloat_period.total_seconds(),
        min_size=net.min_segment_size,
        threshold=net.debloat_threshold_percentages / 100,
        initial_size=debloat_start_size(net),
    )
    buffers = gate.num_channels * net.buffers_per_channel
    if not remote:
        buffers += net.floating_buffers_per_gate
    return BufferDebloater(settings, gate.channels, net.segment_size, buffers)


def keyed_backend(g: JobGraph) -> Any:
    def make(v: Vertex, i: int) -> Any:
        rng = key_group_range_for_operator(g.max_parallelism, v.parallelism, i)
        return HeapKeyedStateBackend(g.max_parallelism, rng)

    return make
