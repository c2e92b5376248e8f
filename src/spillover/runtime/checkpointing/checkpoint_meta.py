"""A checkpoint's metadata as one typed value, and its one JSON boundary.

``CheckpointStorage`` (``metadata.py``) reads and writes the metadata file as JSON;
everything that reads what a checkpoint holds (``plan_restore``, the job master's
recovery, ``spillover inspect``, verify) goes through :meth:`CheckpointMetadata.from_json`
instead of indexing dicts. The parts read by a restore are typed (subtasks' operator
state, keyed and channel-state handles, references, finished flags, the graph, the
restore-critical settings); keys this version does not model are kept as written
(``extra``), so :meth:`CheckpointMetadata.to_json` gives back the same JSON.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from spillover.errors import FormatError
from spillover.rescale import Reference
from spillover.storage import GateStateHandle

__all__ = [
    "METADATA_FORMAT",
    "METADATA_VERSION",
    "ChannelIndexMeta",
    "ChannelStateMeta",
    "CheckpointMetadata",
    "InputInfo",
    "OperatorMeta",
    "SubtaskMeta",
    "VertexInfo",
    "check_metadata",
]

METADATA_FORMAT = "spillover-checkpoint"
# 2: per-channel maps in the checkpoint's channel index; 3: in entries the tasks
# wrote beside their state, which the gates name (docs/format.md, "Channel index").
METADATA_VERSION = 3

Place = Callable[[bytes], int]
"""Where the metadata's write puts an acknowledged gate's encoded channel index entry:
its offset in the checkpoint's channel index (``metadata.py``)."""


def check_metadata(meta: Any, path: str) -> None:
    """:class:`FormatError` naming ``path`` unless ``meta`` is spillover checkpoint
    metadata of a version this one reads."""
    if not isinstance(meta, dict) or meta.get("format") != METADATA_FORMAT:
        raise FormatError("not spillover checkpoint metadata", path=path)
    version = meta.get("version")
    # Version 1 (every gate's channel maps inline) is read as ever.
    if not isinstance(version, int) or version > METADATA_VERSION or version < 1:
        raise FormatError(
            "unsupported checkpoint metadata version",
            path=path,
            detail=f"found {version!r}, this version reads up to {METADATA_VERSION}",
            hint="restore with the spillover version that wrote it, or newer",
        )


def _extra(d: Mapping[str, Any], known: frozenset[str]) -> dict[str, Any]:
    if d.keys() <= known:  # the common case, at every subtask of every checkpoint
        return {}
    return {k: v for k, v in d.items() if k not in known}


def _json(value: Mapping[str, Any]) -> dict[str, Any]:
    """``value`` as a JSON object: itself when it is a dict already (the encoder only
    reads it; a copy per subtask and field cost the coordinator at 1,000 subtasks)."""
    return value if type(value) is dict else dict(value)


@dataclass(frozen=True, slots=True)
class ChannelStateMeta:
    """A subtask's in-flight data: its gates' files, what it referenced in older
    checkpoints' files instead of writing it again, and the bytes it wrote."""

    input: tuple[GateStateHandle, ...] = ()
    output: tuple[GateStateHandle, ...] = ()
    references: tuple[Reference, ...] = ()
    bytes: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)

    _KEYS = frozenset(("input", "output", "references", "bytes"))

    def gate(self, side: str, gate: int) -> GateStateHandle | None:
        """The handle of input or output gate ``gate`` (None: nothing stored there)."""
        handles = self.input if side == "input" else self.output
        return next((h for h in handles if h.gate_id == gate), None)

    def to_json(self, index_uri: str | None = None, place: Place | None = None) -> dict[str, Any]:
        """``index_uri``: the checkpoint's channel index; ``place``: see :data:`Place`
        (without it, an acknowledged gate's maps are written inline)."""
        d: dict[str, Any] = {
            **self.extra,
            "input": [h.to_dict(index_uri, place) for h in self.input],
            "output": [h.to_dict(index_uri, place) for h in self.output],
            "bytes": self.bytes,
        }
        if self.references:
            d["references"] = [r.to_dict() for r in self.references]
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any], index_uri: str | None = None) -> ChannelStateMeta:
        """``index_uri``: the checkpoint's channel index, which its gates name."""
        # Once per subtask in every checkpoint's completion: no generators.
        refs = d.get("references")
        parse = partial(GateStateHandle.from_dict, index_uri=index_uri)
        return cls(
            tuple(map(parse, d.get("input", ()))),
            tuple(map(parse, d.get("output", ()))),
            tuple([Reference.from_dict(r, index_uri) for r in refs]) if refs else (),
            int(d.get("bytes", 0)),
            _extra(d, cls._KEYS),
        )


@dataclass(frozen=True, slots=True)
class SubtaskMeta:
    """What one subtask acknowledged. ``operators``: per operator uid its snapshot
    (the operator's own, opaque here); ``keyed``: per operator uid its keyed-state
    handle (the keyed backend's own record, checked by it); ``handles``: other state
    handles; ``channel_state`` None when it wrote none (it had exited)."""

    operators: Mapping[str, Any] = field(default_factory=dict)
    keyed: Mapping[str, Any] = field(default_factory=dict)
    handles: Mapping[str, Any] = field(default_factory=dict)
    channel_state: ChannelStateMeta | None = None
    metrics: Mapping[str, Any] = field(default_factory=dict)
    finished: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)

    _KEYS = frozenset(("operators", "keyed", "handles", "channel_state", "metrics", "finished"))

    @property
    def references(self) -> tuple[Reference, ...]:
        return self.channel_state.references if self.channel_state is not None else ()

    def to_json(self, index_uri: str | None = None, place: Place | None = None) -> dict[str, Any]:
        cs = self.channel_state
        return {
            **self.extra,
            "operators": _json(self.operators),
            "handles": _json(self.handles),
            "keyed": _json(self.keyed),
            # none written (an exited subtask, an aligned checkpoint): an empty dict
            "channel_state": cs.to_json(index_uri, place) if cs else {},
            "metrics": _json(self.metrics),
            "finished": self.finished,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any], index_uri: str | None = None) -> SubtaskMeta:
        cs = d.get("channel_state")
        return cls(
            dict(d.get("operators") or {}),
            dict(d.get("keyed") or {}),
            dict(d.get("handles") or {}),
            # None or {}: none written
            ChannelStateMeta.from_json(cs, index_uri) if cs else None,
            dict(d.get("metrics") or {}),
            bool(d.get("finished")),
            _extra(d, cls._KEYS),
        )


@dataclass(frozen=True, slots=True)
class OperatorMeta:
    """One vertex's subtasks in the checkpoint, and whether it had finished
    (``"fully"``, ``"partially"`` or ``"running"``, FLIP-147)."""

    subtasks: Mapping[int, SubtaskMeta] = field(default_factory=dict)
    parallelism: int | None = None
    finished: str = "running"
    extra: Mapping[str, Any] = field(default_factory=dict)

    _KEYS = frozenset(("subtasks", "parallelism", "finished"))

    def subtask(self, index: int) -> SubtaskMeta:
        """Subtask ``index``'s entry; an empty one when it stored nothing."""
        return self.subtasks.get(index) or SubtaskMeta()

    def to_json(self, index_uri: str | None = None, place: Place | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {
            **self.extra,
            "subtasks": {str(i): s.to_json(index_uri, place) for i, s in self.subtasks.items()},
            "finished": self.finished,
        }
        if self.parallelism is not None:
            d["parallelism"] = self.parallelism
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any], index_uri: str | None = None) -> OperatorMeta:
        subs = d.get("subtasks") or {}
        p = d.get("parallelism")
        return cls(
            {int(i): SubtaskMeta.from_json(s, index_uri) for i, s in subs.items()},
            int(p) if p is not None else None,
            str(d.get("finished", "running")),
            _extra(d, cls._KEYS),
        )


@dataclass(frozen=True, slots=True)
class InputInfo:
    """One input edge of a vertex as the checkpoint's graph records it."""

    source: str
    kind: str
    input_index: int
    key_field: str | None
    key_offset: int | None
    partition: int
    feedback: bool = False

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "source": self.source,
            "kind": self.kind,
            "input_index": self.input_index,
            "key_field": self.key_field,
            "key_offset": self.key_offset,
            "partition": self.partition,
        }
        if self.feedback:
            d["feedback"] = True
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> InputInfo:
        off = d.get("key_offset")
        return cls(
            str(d["source"]),
            str(d["kind"]),
            int(d["input_index"]),
            d.get("key_field"),
            int(off) if off is not None else None,
            int(d.get("partition", 0)),
            bool(d.get("feedback", False)),
        )

    @property
    def signature(self) -> tuple[str, str, int, str | None]:
        """What must not change across a restore."""
        return (self.source, self.kind, self.input_index, self.key_field)


@dataclass(frozen=True, slots=True)
class VertexInfo:
    """What a checkpoint remembers of one vertex, to be restored into another graph."""

    parallelism: int
    nodes: tuple[str, ...]
    inputs: tuple[InputInfo, ...]
    outputs: tuple[str, ...]
    loop: Any = None
    iteration_head: bool = False

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "parallelism": self.parallelism,
            "nodes": list(self.nodes),
            "inputs": [i.to_json() for i in self.inputs],
            "outputs": list(self.outputs),
        }
        if self.loop is not None:
            d["loop"] = self.loop
        if self.iteration_head:
            d["iteration_head"] = True
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> VertexInfo:
        return cls(
            int(d["parallelism"]),
            tuple(d["nodes"]),
            tuple(InputInfo.from_json(i) for i in d["inputs"]),
            tuple(d["outputs"]),
            d.get("loop"),
            bool(d.get("iteration_head", False)),
        )


def graph_from_json(d: Mapping[str, Any] | None) -> dict[str, VertexInfo] | None:
    """Per vertex uid its :class:`VertexInfo` (None: the metadata has no graph)."""
    vertices = (d or {}).get("vertices")
    if vertices is None:
        return None
    return {uid: VertexInfo.from_json(v) for uid, v in vertices.items()}


@dataclass(frozen=True, slots=True)
class ChannelIndexMeta:
    """Metadata version 2: the object beside ``_metadata`` that holds every gate's
    per-channel maps (``chk-<id>/_channel_index``, docs/format.md "Channel index")."""

    uri: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"uri": self.uri, "size": self.size}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ChannelIndexMeta:
        return cls(str(d["uri"]), int(d["size"]))


@dataclass(frozen=True, slots=True)
class CheckpointMetadata:
    """One completed checkpoint's metadata (docs/runtime.md, docs/format.md)."""

    version: int
    job: str
    checkpoint_id: int
    trigger_ms: int
    completed_ms: int
    graph_fingerprint: str
    settings: Mapping[str, Any]
    final: bool
    tasks: Mapping[str, OperatorMeta]
    graph: Mapping[str, VertexInfo] | None = None
    references: tuple[int, ...] = ()
    savepoint_from: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    # Version 2: the channel index object its gates' per-channel maps are in.
    channel_index: ChannelIndexMeta | None = None

    _KEYS = frozenset(
        (
            "channel_index",
            "format",
            "version",
            "job",
            "checkpoint_id",
            "trigger_ms",
            "completed_ms",
            "graph_fingerprint",
            "settings",
            "final",
            "tasks",
            "graph",
            "references",
            "savepoint",
        )
    )

    @property
    def max_parallelism(self) -> int | None:
        """The max parallelism the checkpoint was taken with (it fixes key groups)."""
        mp = self.settings.get("max-parallelism")
        return int(mp) if mp is not None else None

    @property
    def is_savepoint(self) -> bool:
        return self.savepoint_from is not None

    def operator(self, uid: str) -> OperatorMeta:
        """Vertex ``uid``'s entry; an empty one when the checkpoint holds none."""
        return self.tasks.get(uid) or OperatorMeta()

    def to_json(self, index_uri: str | None = None, place: Place | None = None) -> dict[str, Any]:
        """The metadata's JSON. Only ``CheckpointStorage.write_metadata`` writes it to a
        file: with ``place`` its acknowledged gates' entries go into a new channel
        index at ``index_uri``, which it names then (``channel_index``). Without, an
        acknowledged gate's maps are written inline."""
        if self.channel_index is not None:
            index_uri = self.channel_index.uri
        d: dict[str, Any] = {
            **self.extra,
            "format": METADATA_FORMAT,
            "version": self.version,
            "job": self.job,
            "checkpoint_id": self.checkpoint_id,
            "trigger_ms": self.trigger_ms,
            "completed_ms": self.completed_ms,
            "graph_fingerprint": self.graph_fingerprint,
            "settings": dict(self.settings),
            "final": self.final,
            "tasks": {uid: t.to_json(index_uri, place) for uid, t in self.tasks.items()},
            "references": list(self.references),
        }
        if self.channel_index is not None:
            d["channel_index"] = self.channel_index.to_json()
        if self.graph is not None:
            d["graph"] = {"vertices": {uid: v.to_json() for uid, v in self.graph.items()}}
        if self.savepoint_from is not None:
            d["savepoint"] = {"from": self.savepoint_from}
        return d

    @classmethod
    def from_json(cls, d: Any, path: str = "<metadata>") -> CheckpointMetadata:
        """The metadata a checkpoint's file holds; :class:`FormatError` naming ``path``
        when it is not spillover metadata, of a newer version, or malformed."""
        check_metadata(d, path)
        try:
            sp = d.get("savepoint")
            graph = graph_from_json(d.get("graph"))
            extra = _extra(d, cls._KEYS)
            if graph is None and "graph" in d:
                extra["graph"] = d["graph"]  # no vertices: kept as written
            ci = d.get("channel_index")
            index = ChannelIndexMeta.from_json(ci) if ci is not None else None
            index_uri = index.uri if index is not None else None
            return cls(
                int(d["version"]),
                str(d.get("job", "")),
                int(d["checkpoint_id"]),
                int(d.get("trigger_ms", 0)),
                int(d.get("completed_ms", 0)),
                str(d.get("graph_fingerprint", "")),
                dict(d.get("settings") or {}),
                bool(d.get("final", False)),
                {
                    uid: OperatorMeta.from_json(t, index_uri)
                    for uid, t in (d.get("tasks") or {}).items()
                },
                graph,
                tuple(int(c) for c in d.get("references", [])),
                str(sp["from"]) if sp else None,
                extra,
                index,
            )
        except FormatError as e:
            raise FormatError(e.message, path=path, detail=e.detail, hint=e.hint) from e
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            raise FormatError(
                "malformed checkpoint metadata", path=path, detail=f"{type(e).__name__}: {e}"
            ) from e
