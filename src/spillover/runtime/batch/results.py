"""Blocking result partitions, written and read through the engine.

A producer subtask of a batch job writes each of its outputs (one per output edge)
to one format-v1 gate file through a :class:`~spillover.storage.Storer`: one
channel per consumer subtask, the records' network buffers as they were, checksums
and the optional LZ4 of the storage options (docs/format.md, "Result partitions").
Only data goes in: a blocking result ends where its file ends, so the reader adds
the end of data and of the partition itself, and watermarks (which a batch job
does not need: every timer fires at the end of its input) are left out.

A consumer subtask reads its channel of every producer's file with a
:class:`~spillover.rescale.FilteringRetriever` on a reader thread that feeds its
input gate under the gate's credit: buffers pass through unparsed when the file
was written for the consumer's parallelism; otherwise a key_by input keeps the
consumer's key groups (the same key-group filter as a rescaled restore), a
rebalance input takes old channels ``c`` with ``c % parallelism == subtask`` and a
broadcast input channel 0. A result no reader can use (a forward or custom
partitioned edge at another parallelism) makes its producer run again.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from spillover.errors import ClosedError, FormatError, SpilloverError, StorageError
from spillover.keygroups import key_group_range_for_operator
from spillover.records import FieldKey
from spillover.rescale import FilteringRetriever, RecordStream
from spillover.runtime.api import EdgeKind
from spillover.runtime.graph import JobEdge, JobGraph
from spillover.runtime.network import events as ev
from spillover.runtime.network.buffers import NetworkBuffer, append_zero_copy
from spillover.runtime.network.errors import ChannelCancelledError, ChannelFailedError
from spillover.runtime.network.gate import InputGate
from spillover.runtime.network.partition import Subpartition
from spillover.storage import GateKind, GateStateHandle, Storage, Storer

_HANDLE_SCHEMA = 1


@dataclass(frozen=True)
class ResultHandle:
    """One producer subtask's finished blocking result for one output edge.

    ``consumer``/``input_index`` name the edge (with ``producer``); ``channels`` is
    the consumer parallelism the file was written for; ``gate`` the file's state
    handle. ``to_dict`` is what the job event log records (``TaskFinished.results``).
    """

    producer: str
    subtask: int
    consumer: str
    input_index: int
    channels: int
    gate: GateStateHandle

    @property
    def edge(self) -> tuple[str, str, int]:
        return (self.producer, self.consumer, self.input_index)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": _HANDLE_SCHEMA,
            "producer": self.producer,
            "subtask": self.subtask,
            "consumer": self.consumer,
            "input_index": self.input_index,
            "channels": self.channels,
            "gate": self.gate.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ResultHandle:
        """Raises :class:`~spillover.errors.FormatError` (via the gate handle) or
        ValueError/KeyError/TypeError for a record that is not a result handle."""
        if d.get("schema") != _HANDLE_SCHEMA:
            raise ValueError(f"result handle schema {d.get('schema')!r}")
        return cls(
            str(d["producer"]),
            int(d["subtask"]),
            str(d["consumer"]),
            int(d["input_index"]),
            int(d["channels"]),
            GateStateHandle.from_dict(dict(d["gate"])),
        )


def edge_key(graph: JobGraph, edge: JobEdge) -> tuple[str, str, int]:
    return (graph.vertices[edge.source].uid, graph.vertices[edge.target].uid, edge.input_index)


# ---- the producer's side ------------------------------------------------------------


class ResultWriter:
    """One blocking result partition's file: a storer whose channels are the consumer
    subtasks; closed (its handle set) once every channel finished, deleted on
    failure. The producer's thread appends; ``fail`` may come from any thread."""

    def __init__(self, storage: Storage, gate_id: int, channels: int) -> None:
        self._storer: Storer = storage.create_storer(gate_id, kind=GateKind.OUTPUT)
        self._open = set(range(channels))
        self._lock = threading.Lock()
        self._cause: BaseException | None = None
        self.handle: GateStateHandle | None = None

    def append(self, channel: int, buffer: NetworkBuffer) -> None:
        """Takes over the caller's reference: the buffer goes back to its pool once
        written (zero-copy, as channel state is written)."""
        with self._lock:
            if self._cause is not None:
                buffer.release()
                raise ChannelCancelledError(f"result partition file failed: {self._cause}")
            self._storer.reap()
            append_zero_copy(self._storer, channel, buffer)
            # A held buffer holds a pool permit: write it now, not when a batch fills.
            self._storer.submit()

    def end(self, channel: int) -> None:
        with self._lock:
            self._open.discard(channel)
            if not self._open and self._cause is None and self.handle is None:
                self.handle = self._storer.close()

    def fail(self, cause: BaseException) -> None:
        with self._lock:
            if self._cause is None and self.handle is None:
                self._cause = cause
                self._storer.discard()


class BlockingSubpartition(Subpartition):
    """A subpartition whose consumer reads later: data goes to the result's file at
    once (never waiting for credit), events are dropped (see the module docstring)."""

    def __init__(self, writer: ResultWriter, channel: int) -> None:
        self.writer = writer
        self.channel = channel

    def add_data(self, buffer: NetworkBuffer, deadline: float | None) -> float:
        self.writer.append(self.channel, buffer)
        return 0.0

    def add_event(self, buffer: NetworkBuffer, priority: bool) -> list[NetworkBuffer]:
        buffer.release()
        return []

    def finish(self, buffer: NetworkBuffer) -> None:
        buffer.release()
        self.writer.end(self.channel)

    def fail(self, cause: BaseException) -> None:
        self.writer.fail(cause)

    @property
    def credit(self) -> int:
        return 1 << 30

    @property
    def backlog(self) -> tuple[int, int]:
        return (0, 0)


# ---- the consumer's side --------------------------------------------------------------


def readable(edge: JobEdge, written_for: int, consumers: int) -> bool:
    """Whether a result written for ``written_for`` consumer subtasks can be read by
    ``consumers`` of them (else its producer runs again)."""
    if written_for == consumers:
        return True
    return edge.kind in (EdgeKind.KEY_BY, EdgeKind.REBALANCE, EdgeKind.BROADCAST)


@dataclass(frozen=True)
class InputResult:
    """A result one consumer subtask reads, on its gate channel ``channel``."""

    result: ResultHandle
    edge: JobEdge
    channel: int


class ResultUnreadableError(SpilloverError):
    """A consumer could not read a producer's result (missing, truncated, corrupt):
    its producer runs again. ``result`` is the result it could not read."""

    def __init__(self, result: ResultHandle, cause: BaseException) -> None:
        super().__init__(
            f"the result of {result.producer}#{result.subtask} cannot be read",
            detail=str(cause),
        )
        self.result = result
        self.producer = (result.producer, result.subtask)


class ResultReader:
    """Feeds one consumer subtask's input gate from its producers' results, one
    producer after the other, then ends every channel (EndOfData, EndOfPartition).

    On a thread of its own; a failure fails the gate (the task then fails) and is
    kept in ``error`` as a :class:`ResultUnreadableError` naming the producer."""

    def __init__(
        self,
        graph: JobGraph,
        subtask: int,
        parallelism: int,
        gate: InputGate,
        inputs: Sequence[InputResult],
        buffer_size: int,
        name: str,
    ) -> None:
        self.graph = graph
        self.subtask = subtask
        self.parallelism = parallelism
        self.gate = gate
        self.inputs = list(inputs)
        self.buffer_size = buffer_size
        self.error: BaseException | None = None  # what ended it, if it failed
        self.bytes_read = 0
        self.thread = threading.Thread(target=self._run, name=f"results {name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _retriever(self, item: InputResult) -> FilteringRetriever:
        h, e, me, p = item.result, item.edge, self.subtask, self.parallelism
        if h.channels == p:
            olds = [me]
        elif e.kind is EdgeKind.REBALANCE:
            olds = [c for c in range(h.channels) if c % p == me]
        elif e.kind is EdgeKind.BROADCAST:
            olds = [0]
        else:  # key_by: every old channel may hold some of this subtask's key groups
            olds = list(range(h.channels))
        streams = [RecordStream(((h.gate, c),), h.subtask, c, channel=item.channel) for c in olds]
        if h.channels == p or e.kind is not EdgeKind.KEY_BY:
            return FilteringRetriever(streams, pass_through=True, n_outputs=item.channel + 1)
        assert e.key_field is not None
        offset = np.dtype(e.dtype).fields[e.key_field][1]
        return FilteringRetriever(
            streams,
            max_parallelism=self.graph.max_parallelism,
            key_group_table=key_group_range_for_operator(self.graph.max_parallelism, p, me),
            key=FieldKey(int(offset), "int64"),
            n_outputs=item.channel + 1,
            buffer_size=self.buffer_size,
        )

    def _run(self) -> None:
        try:
            for item in self.inputs:
                self._feed(item)
            for ch in range(self.gate.num_channels):
                self.gate.channel(ch).push_event(ev.to_buffer(ev.EndOfData(True)))
                self.gate.channel(ch).push_end(ev.to_buffer(ev.EndOfPartition()))
        except (ChannelFailedError, ClosedError):
            return  # the task failed or was cancelled: it reads no more
        except BaseException as e:
            self.error = e
            self.gate.fail(e)

    def _feed(self, item: InputResult) -> None:
        r = item.result
        channel = self.gate.channel(item.channel)
        retriever = self._retriever(item)
        buffers = iter(retriever)
        with retriever:
            while True:
                try:
                    buf = next(buffers, None)
                except (FormatError, StorageError, OSError) as e:
                    raise ResultUnreadableError(r, e) from e
                if buf is None:
                    return
                self.bytes_read += len(buf)
                channel.push_data(NetworkBuffer.unpooled(buf), None)
