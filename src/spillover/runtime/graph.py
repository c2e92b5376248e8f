"""The job API and the job graph it builds.

``StreamEnvironment`` is the entry point; ``DataStream`` methods add operators
and edges. ``build()`` turns them into a ``JobGraph``: operators joined by
forward edges of equal parallelism are chained into one vertex (one task per
subtask runs the whole chain); every other edge becomes a network edge.

Loops (FLIP-15): ``stream.iterate()`` adds an iteration head and
``IterativeStream.close_with(feedback)`` a *feedback* edge from the loop body back
to it, the one kind of edge that points backwards. The head is never chained, the
vertices on a cycle through it form the loop (``Vertex.loop``), and loops may not
nest.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spillover.errors import ConfigError
from spillover.keygroups import compute_default_max_parallelism
from spillover.records import partitioner_name
from spillover.runtime.api import Batch, EdgeKind, Operator, Partitioner
from spillover.runtime.eventtime.strategy import WatermarkStrategy
from spillover.runtime.iteration.operator import IterationHead


@dataclass
class Node:
    """One operator of the logical graph."""

    id: int
    uid: str
    name: str
    prototype: Operator  # copied for every subtask
    parallelism: int
    out_dtype: Any
    inputs: list[InputEdge] = field(default_factory=list)
    keyed: bool = False
    key_field: str | None = None  # the key of the keyed input (keyed operators)
    watermarks: WatermarkStrategy | None = None  # sources: how they generate watermarks

    @property
    def is_iteration_head(self) -> bool:
        return isinstance(self.prototype, IterationHead)

    def instantiate(self) -> Operator:
        return copy.deepcopy(self.prototype)


@dataclass(frozen=True)
class InputEdge:
    """``source`` feeds logical input ``input_index`` of the node it belongs to."""

    source: int
    kind: EdgeKind
    input_index: int = 0
    key_field: str | None = None
    partitioner: Partitioner | None = None
    feedback: bool = False  # closes a loop: from the loop body back to its head


class StreamEnvironment:
    """Builds a job: ``env.from_source(...)`` then transformations, then ``execute``."""

    def __init__(
        self,
        name: str = "spillover-job",
        *,
        parallelism: int = 1,
        max_parallelism: int | None = None,
    ) -> None:
        self.name = name
        self.parallelism = parallelism
        self.max_parallelism = max_parallelism
        self.nodes: list[Node] = []
        self._uids: set[str] = set()

    def _add(
        self,
        op: Operator,
        *,
        name: str | None,
        uid: str | None,
        parallelism: int | None,
        out_dtype: Any,
        inputs: list[InputEdge],
        keyed: bool = False,
        key_field: str | None = None,
    ) -> Node:
        if not isinstance(op, Operator):
            raise TypeError(f"expected an Operator, got {type(op).__name__}")
        p = parallelism if parallelism is not None else self.parallelism
        if not isinstance(p, int) or p < 1:
            raise ConfigError(f"parallelism must be a positive int, got {p!r}")
        name = name or type(op).__name__
        if uid is None:
            # Derived uids are stable as long as the program builds the same graph.
            uid = f"{name.lower()}-{len(self.nodes)}"
        if uid in self._uids:
            raise ConfigError(f"operator uid {uid!r} is used twice", hint="give each a unique uid")
        self._uids.add(uid)
        node = Node(len(self.nodes), uid, name, op, p, out_dtype, inputs, keyed, key_field)
        self.nodes.append(node)
        return node

    def from_source(
        self,
        source: Operator,
        *,
        name: str | None = None,
        uid: str | None = None,
        parallelism: int | None = None,
        watermarks: WatermarkStrategy | None = None,
    ) -> DataStream:
        """A stream of ``source``'s records; ``watermarks`` makes it emit watermarks
        (event time, docs/runtime.md). Every source ends its input with the end of
        event time (``MAX_WATERMARK``) when it runs out or is drained."""
        if not source.is_source:
            raise ConfigError(f"{type(source).__name__} is not a source operator")
        if watermarks is not None:
            watermarks.check(source.out_dtype, source)
        node = self._add(
            source,
            name=name,
            uid=uid,
            parallelism=parallelism,
            out_dtype=source.out_dtype,
            inputs=[],
        )
        node.watermarks = watermarks
        return DataStream(self, node)

    def build(self) -> JobGraph:
        return JobGraph.build(self)


class DataStream:
    """A stream of batches of one dtype, produced by one operator."""

    def __init__(
        self,
        env: StreamEnvironment,
        node: Node,
        kind: EdgeKind | None = None,
        key_field: str | None = None,
        partitioner: Partitioner | None = None,
    ) -> None:
        self.env = env
        self.node = node
        self._kind = kind  # the partitioning of the next edge; None = forward or rebalance
        self._key_field = key_field
        self._partitioner = partitioner

    @property
    def dtype(self) -> Any:
        return self.node.out_dtype

    def _edge(self, downstream_parallelism: int, input_index: int = 0) -> InputEdge:
        kind = self._kind
        if kind is None:
            same = downstream_parallelism == self.node.parallelism
            kind = EdgeKind.FORWARD if same else EdgeKind.REBALANCE
        if kind is EdgeKind.FORWARD and downstream_parallelism != self.node.parallelism:
            raise ConfigError(
                "a forward edge needs equal parallelism on both sides",
                detail=f"{self.node.uid} has {self.node.parallelism}, "
                f"the downstream {downstream_parallelism}",
                hint="use rebalance() or key_by() before the operator",
            )
        return InputEdge(self.node.id, kind, input_index, self._key_field, self._partitioner)

    def _then(
        self,
        op: Operator,
        out_dtype: Any,
        name: str | None,
        uid: str | None,
        parallelism: int | None,
    ) -> DataStream:
        p = parallelism if parallelism is not None else self.node.parallelism
        keyed = self._kind is EdgeKind.KEY_BY
        node = self.env._add(
            op,
            name=name,
            uid=uid,
            parallelism=p,
            out_dtype=out_dtype,
            inputs=[self._edge(p)],
            keyed=keyed,
            key_field=self._key_field if keyed else None,
        )
        return DataStream(self.env, node)

    def process(
        self,
        op: Operator,
        *,
        name: str | None = None,
        uid: str | None = None,
        parallelism: int | None = None,
    ) -> DataStream:
        """Adds ``op`` downstream (keyed state is available after ``key_by``)."""
        return self._then(op, op.out_dtype, name, uid, parallelism)

    def map(self, fn: Callable[[Batch], Batch], out_dtype: Any = None, **kw: Any) -> DataStream:
        from spillover.runtime.operators import MapOperator

        return self.process(
            MapOperator(fn, out_dtype if out_dtype is not None else self.dtype), **kw
        )

    def filter(self, fn: Callable[[Batch], Any], **kw: Any) -> DataStream:
        from spillover.runtime.operators import FilterOperator

        op = FilterOperator(fn)
        op.out_dtype = self.dtype
        return self.process(op, **kw)

    def flat_map(
        self, fn: Callable[[Batch], Batch], out_dtype: Any = None, **kw: Any
    ) -> DataStream:
        from spillover.runtime.operators import FlatMapOperator

        return self.process(
            FlatMapOperator(fn, out_dtype if out_dtype is not None else self.dtype), **kw
        )

    def _check_key_field(self, key_field: str) -> None:
        names = np.dtype(self.dtype).names or ()
        if key_field not in names:
            raise ConfigError(f"no field {key_field!r} in {np.dtype(self.dtype)}")
        if np.dtype(self.dtype)[key_field] != np.dtype("<i8"):
            raise ConfigError(f"key field {key_field!r} must be int64 (little-endian)")

    def key_by(self, key_field: str) -> DataStream:
        """Partitions by the key group of an int64 field (Flink-compatible)."""
        self._check_key_field(key_field)
        return DataStream(self.env, self.node, EdgeKind.KEY_BY, key_field)

    def partition_custom(self, partitioner: Partitioner, key_field: str) -> DataStream:
        """Sends each record to the subtask ``partitioner(keys, n)`` picks for its int64 key.

        The next operator is not keyed (no keyed state). The partitioner is
        called per batch and again on a rescaled restore to route recovered
        records, so it must be vectorised, deterministic and picklable.
        """
        self._check_key_field(key_field)
        if not callable(partitioner):
            raise ConfigError(f"partitioner must be callable, got {type(partitioner).__name__}")
        return DataStream(self.env, self.node, EdgeKind.CUSTOM, key_field, partitioner)

    def window_count(
        self,
        size_ms: int,
        *,
        timestamp_field: str,
        name: str | None = None,
        uid: str | None = None,
        parallelism: int | None = None,
    ) -> DataStream:
        """Counts records per key in tumbling event-time windows of ``size_ms``
        (after ``key_by``): ``(key, window_end, count)`` records, emitted when the
        watermark passes each window (``TumblingWindowCount``)."""
        from spillover.runtime.eventtime.windows import TumblingWindowCount

        if self._kind is not EdgeKind.KEY_BY or self._key_field is None:
            raise ConfigError("window_count needs a keyed stream", hint="key_by(field) first")
        names = np.dtype(self.dtype).names or ()
        if timestamp_field not in names or np.dtype(self.dtype)[timestamp_field] != np.dtype("<i8"):
            raise ConfigError(f"no int64 timestamp field {timestamp_field!r} in {self.dtype}")
        op = TumblingWindowCount(self._key_field, timestamp_field, size_ms)
        return self.process(op, name=name, uid=uid, parallelism=parallelism)

    def iterate(
        self,
        *,
        name: str | None = None,
        uid: str | None = None,
        parallelism: int | None = None,
    ) -> IterativeStream:
        """Starts a loop (FLIP-15): the returned stream carries these records and
        the loop's feedback; operators applied to it form the loop body, and
        ``close_with(feedback)`` closes it. Checkpoints stay exactly-once (the head
        logs the feedback), a loop under backpressure spills its feedback instead of
        deadlocking, and a bounded job's loop ends once no record is left in it
        (docs/iterations.md)."""
        head = self._then(
            IterationHead(self.dtype), self.dtype, name or "iterate", uid, parallelism
        )
        return IterativeStream(self.env, head.node)

    def rebalance(self) -> DataStream:
        return DataStream(self.env, self.node, EdgeKind.REBALANCE)

    def broadcast(self) -> DataStream:
        return DataStream(self.env, self.node, EdgeKind.BROADCAST)

    def forward(self) -> DataStream:
        return DataStream(self.env, self.node, EdgeKind.FORWARD)

    def union(self, *others: DataStream) -> UnionStream:
        """The records of several streams of one dtype as one input."""
        for o in others:
            if np.dtype(o.dtype) != np.dtype(self.dtype):
                raise ConfigError("union needs streams of one dtype")
        return UnionStream([self, *others])

    def connect(self, other: DataStream) -> ConnectedStreams:
        """Two inputs for a two-input operator (input 0 and input 1)."""
        return ConnectedStreams(self, other)

    def sink(
        self,
        op: Operator,
        *,
        name: str | None = None,
        uid: str | None = None,
        parallelism: int | None = None,
    ) -> None:
        self._then(op, None, name, uid, parallelism)


class IterativeStream(DataStream):
    """The head of a loop: a stream of the loop's input and its feedback."""

    def close_with(self, feedback: DataStream) -> None:
        """Closes the loop with ``feedback``, a stream derived from this one: its
        records come back into the head (forward, or partitioned with ``key_by`` or
        ``rebalance``), and leave the loop only through other operators."""
        head = self.node
        if any(e.feedback for e in head.inputs):
            raise ConfigError(f"the loop of {head.uid!r} is closed already")
        if feedback.env is not self.env or not _reaches(self.env.nodes, head.id, feedback.node.id):
            raise ConfigError(
                "close_with needs a stream derived from the iterative stream",
                detail=f"{feedback.node.uid!r} is not downstream of {head.uid!r}",
            )
        if np.dtype(feedback.dtype) != np.dtype(self.dtype):
            raise ConfigError(
                "the feedback must have the loop's record type",
                detail=f"{np.dtype(feedback.dtype)} is not {np.dtype(self.dtype)}",
            )
        if feedback._kind is EdgeKind.BROADCAST:
            raise ConfigError(
                "a loop's feedback cannot be broadcast",
                hint="every round would multiply the records: use forward, key_by or rebalance",
            )
        edge = feedback._edge(head.parallelism, IterationHead.FEEDBACK)
        head.inputs.append(
            InputEdge(
                edge.source,
                edge.kind,
                edge.input_index,
                edge.key_field,
                edge.partitioner,
                feedback=True,
            )
        )


def _reaches(nodes: list[Node], start: int, target: int) -> bool:
    """Whether ``target`` is ``start`` or downstream of it (not over feedback edges)."""
    consumers: dict[int, list[int]] = {}
    for n in nodes:
        for e in n.inputs:
            if not e.feedback:
                consumers.setdefault(e.source, []).append(n.id)
    seen, todo = {start}, [start]
    while todo:
        for c in consumers.get(todo.pop(), []):
            if c not in seen:
                seen.add(c)
                todo.append(c)
    return target in seen


class UnionStream:
    """Several streams feeding one logical input of the next operator."""

    def __init__(self, streams: list[DataStream]) -> None:
        self.streams = streams
        self.env = streams[0].env

    def _multi(
        self,
        op: Operator,
        out_dtype: Any,
        name: str | None,
        uid: str | None,
        parallelism: int | None,
    ) -> DataStream:
        p = parallelism if parallelism is not None else self.streams[0].node.parallelism
        edges = [s._edge(p, 0) for s in self.streams]
        keyed = all(e.kind is EdgeKind.KEY_BY for e in edges)
        key = edges[0].key_field if keyed else None
        node = self.env._add(
            op,
            name=name,
            uid=uid,
            parallelism=p,
            out_dtype=out_dtype,
            inputs=edges,
            keyed=keyed,
            key_field=key,
        )
        return DataStream(self.env, node)

    def process(
        self,
        op: Operator,
        *,
        name: str | None = None,
        uid: str | None = None,
        parallelism: int | None = None,
    ) -> DataStream:
        return self._multi(op, op.out_dtype, name, uid, parallelism)

    def sink(
        self,
        op: Operator,
        *,
        name: str | None = None,
        uid: str | None = None,
        parallelism: int | None = None,
    ) -> None:
        self._multi(op, None, name, uid, parallelism)

    def map(self, fn: Callable[[Batch], Batch], out_dtype: Any = None, **kw: Any) -> DataStream:
        from spillover.runtime.operators import MapOperator

        dtype = out_dtype if out_dtype is not None else self.streams[0].dtype
        return self.process(MapOperator(fn, dtype), **kw)


class ConnectedStreams:
    """Input 0 and input 1 of a two-input operator."""

    def __init__(self, first: DataStream, second: DataStream) -> None:
        self.first, self.second = first, second

    def process(
        self,
        op: Operator,
        *,
        name: str | None = None,
        uid: str | None = None,
        parallelism: int | None = None,
    ) -> DataStream:
        p = parallelism if parallelism is not None else self.first.node.parallelism
        edges = [self.first._edge(p, 0), self.second._edge(p, 1)]
        keyed = all(e.kind is EdgeKind.KEY_BY for e in edges)
        node = self.first.env._add(
            op,
            name=name,
            uid=uid,
            parallelism=p,
            out_dtype=op.out_dtype,
            inputs=edges,
            keyed=keyed,
            key_field=edges[0].key_field if keyed else None,
        )
        return DataStream(self.first.env, node)


@dataclass
class Vertex:
    """A chain of operators run by one task per subtask: ``nodes[0]`` is the head."""

    id: int
    nodes: list[Node]
    parallelism: int
    loop: str | None = None  # the uid of the loop's head, for a vertex in a loop

    @property
    def is_iteration_head(self) -> bool:
        return self.nodes[0].is_iteration_head

    @property
    def uid(self) -> str:
        return self.nodes[0].uid

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def tail(self) -> Node:
        return self.nodes[-1]

    @property
    def is_source(self) -> bool:
        return self.head.prototype.is_source


@dataclass(frozen=True)
class JobEdge:
    """A network edge between two vertices."""

    source: int  # vertex id
    target: int  # vertex id
    kind: EdgeKind
    input_index: int
    key_field: str | None
    dtype: Any
    partitioner: Partitioner | None = None
    feedback: bool = False  # a loop's feedback edge, into its iteration head


@dataclass
class JobGraph:
    name: str
    vertices: list[Vertex]
    edges: list[JobEdge]
    max_parallelism: int

    def inputs_of(self, vertex_id: int) -> list[JobEdge]:
        return [e for e in self.edges if e.target == vertex_id]

    def outputs_of(self, vertex_id: int) -> list[JobEdge]:
        return [e for e in self.edges if e.source == vertex_id]

    def loop_outputs(self, vertex: Vertex) -> list[int]:
        """``vertex``'s outputs (partition indexes) that lead into its loop."""
        return [
            i
            for i, e in enumerate(self.outputs_of(vertex.id))
            if self.vertices[e.target].loop == vertex.loop
        ]

    def loop_channels(self, vertex: Vertex, edges: list[JobEdge]) -> frozenset[int]:
        """The input channels (one edge each, in order) that come from inside the loop."""
        return frozenset(
            ch for ch, e in enumerate(edges) if self.vertices[e.source].loop == vertex.loop
        )

    def fingerprint(self) -> str:
        """Changes when the topology, uids, parallelism or record types change."""
        desc = {
            "vertices": [[n.uid for n in v.nodes] + [v.parallelism] for v in self.vertices],
            "edges": [
                [e.source, e.target, e.kind.value, e.input_index, e.key_field, str(e.dtype)]
                + ([partitioner_name(e.partitioner)] if e.partitioner is not None else [])
                + (["feedback"] if e.feedback else [])
                for e in self.edges
            ],
            "max_parallelism": self.max_parallelism,
        }
        return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]

    @classmethod
    def build(cls, env: StreamEnvironment) -> JobGraph:
        nodes = env.nodes
        if not nodes:
            raise ConfigError("the job has no operators")
        consumers: dict[int, list[tuple[Node, InputEdge]]] = {n.id: [] for n in nodes}
        for n in nodes:
            for e in n.inputs:
                consumers[e.source].append((n, e))

        def chainable(n: Node) -> bool:
            if len(n.inputs) != 1:
                return False
            e = n.inputs[0]
            up = nodes[e.source]
            return (
                e.kind is EdgeKind.FORWARD
                and up.parallelism == n.parallelism
                and len(consumers[up.id]) == 1
                and not up.is_iteration_head  # a head's task is a task of its own
            )

        vertex_of: dict[int, int] = {}
        vertices: list[Vertex] = []
        for n in nodes:  # nodes are in creation order, so upstreams come first
            if chainable(n):
                v = vertices[vertex_of[n.inputs[0].source]]
                v.nodes.append(n)
                vertex_of[n.id] = v.id
            else:
                v = Vertex(len(vertices), [n], n.parallelism)
                vertices.append(v)
                vertex_of[n.id] = v.id
        edges = []
        for n in nodes:
            for e in n.inputs:
                if vertex_of[e.source] != vertex_of[n.id]:
                    edges.append(
                        JobEdge(
                            vertex_of[e.source],
                            vertex_of[n.id],
                            e.kind,
                            e.input_index,
                            e.key_field,
                            nodes[e.source].out_dtype,
                            e.partitioner,
                            e.feedback,
                        )
                    )
        _find_loops(nodes, vertices, edges)
        max_p = env.max_parallelism or compute_default_max_parallelism(
            max(n.parallelism for n in nodes)
        )
        for n in nodes:
            if n.parallelism > max_p:
                raise ConfigError(
                    f"parallelism {n.parallelism} of {n.uid} exceeds max parallelism {max_p}"
                )
        return cls(env.name, vertices, edges, max_p)


def _find_loops(nodes: list[Node], vertices: list[Vertex], edges: list[JobEdge]) -> None:
    """Marks the vertices of each loop (on a cycle through its head) with the head's
    uid; refuses unclosed and nested loops."""
    for n in nodes:
        if n.is_iteration_head and not any(e.feedback for e in n.inputs):
            raise ConfigError(
                f"the loop of {n.uid!r} is never closed", hint="call close_with(feedback) on it"
            )
    forward_edges = [e for e in edges if not e.feedback]

    def reach(start: int, step: Callable[[JobEdge], tuple[int, int]]) -> set[int]:
        seen, todo = {start}, [start]
        while todo:
            at = todo.pop()
            for e in forward_edges:
                a, b = step(e)
                if a == at and b not in seen:
                    seen.add(b)
                    todo.append(b)
        return seen

    for fb in (e for e in edges if e.feedback):
        head = vertices[fb.target]
        body = reach(head.id, lambda e: (e.source, e.target)) & reach(
            fb.source, lambda e: (e.target, e.source)
        )
        for vid in sorted(body):
            v = vertices[vid]
            if (v.loop is not None and v.loop != head.uid) or (
                v.is_iteration_head and v is not head
            ):
                raise ConfigError(
                    f"loops cannot nest: {v.uid!r} is in the loops of {v.loop or v.uid!r} "
                    f"and {head.uid!r}",
                    hint="close the inner loop's records out and iterate again after it",
                )
            v.loop = head.uid
