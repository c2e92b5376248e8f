"""One subtask of a batch job with its blocking network: a reader thread feeding its
input gate from its producers' result files, and a result partition per output edge
whose subpartitions write to this subtask's own result files."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from spillover.config import Config
from spillover.runtime.batch.results import (
    BlockingSubpartition,
    InputResult,
    ResultHandle,
    ResultReader,
    ResultWriter,
    edge_key,
)
from spillover.runtime.checkpointing.messages import Ack
from spillover.runtime.failures import FailureInjector
from spillover.runtime.graph import JobEdge, JobGraph, Vertex
from spillover.runtime.network.buffers import BufferPool
from spillover.runtime.network.gate import InputGate
from spillover.runtime.network.partition import ResultPartition
from spillover.runtime.network.writers import Outbox, PartitionWriter
from spillover.runtime.task import InputChannelInfo, Task
from spillover.runtime.wiring import edge_writer, keyed_backend
from spillover.storage import Storage
from spillover.storage.location import Location


class NoCheckpoints:
    """The coordinator of a batch task: there are no checkpoints to tell anything."""

    def acknowledge(self, ack: Ack) -> None:
        pass

    def decline(self, checkpoint_id: int, vertex_uid: str, subtask: int, reason: str) -> None:
        pass

    def end_of_data(self, vertex_uid: str, subtask: int) -> None:
        pass

    def task_exited(self, vertex_uid: str, subtask: int) -> None:
        pass

    def loop_quiet(self, vertex_uid: str, subtask: int, round: int) -> None:
        pass


@dataclass
class BatchTask:
    """A subtask of a batch job: its task, the reader of its inputs (None for a
    source) and the writers of its results, one per output edge."""

    task: Task
    reader: ResultReader | None
    writers: list[tuple[JobEdge, ResultWriter]] = field(default_factory=list)
    location: Location | None = None  # the directory of its result files

    def start(self) -> None:
        self.task.start()
        if self.reader is not None:
            self.reader.start()

    def cancel(self) -> None:
        self.task.cancel()

    def join(self, timeout: float = 30.0) -> None:
        self.task.thread.join(timeout)
        if self.reader is not None:
            self.reader.thread.join(timeout)

    def results(self, graph: JobGraph) -> tuple[ResultHandle, ...]:
        """The finished task's results (every file closed)."""
        out = []
        for e, w in self.writers:
            assert w.handle is not None, "a finished task closed its result files"
            producer, consumer, index = edge_key(graph, e)
            channels = graph.vertices[e.target].parallelism
            subtask = self.task.subtask
            out.append(ResultHandle(producer, subtask, consumer, index, channels, w.handle))
        return tuple(out)


def build_batch_task(
    g: JobGraph,
    cfg: Config,
    v: Vertex,
    subtask: int,
    *,
    attempt: int,
    inputs: Sequence[InputResult],
    storage: Storage | None,
    failures: FailureInjector,
    on_done: Callable[[Task, BaseException | None], None],
    flush_interval: float,
) -> BatchTask:
    """Subtask ``subtask`` of ``v``: it reads ``inputs`` (the results of every
    producer it reads, each on its gate channel) and writes its results into
    ``storage`` (gate id: the output edge's index among ``v``'s outputs)."""
    net = cfg.network
    ins = sorted(g.inputs_of(v.id), key=lambda e: e.input_index)
    infos = [
        InputChannelInfo(e.input_index, e, u, e.dtype)
        for e in ins
        for u in range(g.vertices[e.source].parallelism)
    ]
    gate = (
        InputGate(
            len(infos),
            buffers_per_channel=net.buffers_per_channel,
            floating_buffers=net.floating_buffers_per_gate,
            name=f"{v.uid}#{subtask}",
        )
        if infos
        else None
    )
    partitions: list[ResultPartition] = []
    outboxes: list[Outbox] = []
    writers: list[PartitionWriter] = []
    files: list[tuple[JobEdge, ResultWriter]] = []
    for k, e in enumerate(g.outputs_of(v.id)):
        assert storage is not None, "a task with outputs needs somewhere to write them"
        down = g.vertices[e.target]
        pool = BufferPool(net.segment_size, net.buffers_per_partition, f"{v.uid}#{subtask}")
        part = ResultPartition(down.parallelism, pool, name=f"{v.uid}#{subtask}->{down.uid}")
        file = ResultWriter(storage, k, down.parallelism)
        for d in range(down.parallelism):
            part.connect(d, BlockingSubpartition(file, d))
        files.append((e, file))
        partitions.append(part)
        box = Outbox(part, pool)
        outboxes.append(box)
        writers.append(edge_writer(g, e, subtask, net.segment_size, box))
    task = Task(
        graph=g,
        vertex=v,
        subtask=subtask,
        attempt=attempt,
        gate=gate,
        channels=infos,
        partitions=list(partitions),
        outboxes=outboxes,
        writers=writers,
        restore=None,
        coordinator=NoCheckpoints(),
        checkpoint_dir=None,
        keyed_backend_factory=keyed_backend(g),
        failures=failures,
        on_done=on_done,
        flush_interval=flush_interval,
        checkpointing=False,
    )
    reader = None
    if gate is not None:
        reader = ResultReader(g, subtask, v.parallelism, gate, inputs, net.segment_size, task.name)
    return BatchTask(task, reader, files)
