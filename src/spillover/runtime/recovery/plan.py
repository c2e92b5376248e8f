"""Restoring a job from a checkpoint, at the same or another parallelism per operator.

``plan_restore`` checks that the checkpoint fits the job and works out, for every
new subtask, what it restores:

- keyed state: the handles of every old subtask; the backend keeps the key groups
  of its own range (redistribution by key group);
- operator state: its own when the operator's parallelism is unchanged, else the
  states of every old subtask (``Operator.restore_rescaled``, union redistribution);
- in-flight data, per edge: when neither side changed parallelism, the upstream
  replays its own output state and the downstream its own input state; otherwise
  the new downstream reads every old channel that maps to it, the old downstream's
  input part then the old upstream's output part, filtered by key group where the
  edge is keyed (``spillover.rescale``), and the upstream replays nothing for it;
- finished operators (FLIP-147): a subtask the checkpoint records as finished is
  restored finished (nothing of its operators runs again) when the operator keeps
  its parallelism, and every new subtask of a fully finished operator is, at any
  parallelism. A partially finished operator restored at another parallelism
  runs again from the union of its subtasks' operator state (finished ones
  included, so nothing they did is redone) and the running subtasks' keyed state.

Every file the plan reads is opened and checked before any task starts, so a
checkpoint with a missing or damaged file is refused whole, naming the file.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from spillover.errors import ConfigError, RescaleError, SpilloverError, StorageError
from spillover.rescale import (
    EdgeType,
    PartitionerFilter,
    Reference,
    Side,
    check_partitioner,
    map_edge,
)
from spillover.runtime.api import EdgeKind
from spillover.runtime.checkpointing.checkpoint_meta import (
    CheckpointMetadata,
    InputInfo,
    SubtaskMeta,
    VertexInfo,
)
from spillover.runtime.graph import JobEdge, JobGraph
from spillover.runtime.recovery.replay_plan import ReplayPlan, RescaledInput, unfiltered
from spillover.runtime.recovery.restore import TaskRestore
from spillover.storage import GateStateHandle, open_retriever
from spillover.storage.channel_index import check_index

_EDGE_TYPES = {
    EdgeKind.KEY_BY.value: EdgeType.KEY_BY,
    EdgeKind.REBALANCE.value: EdgeType.REBALANCE,
    EdgeKind.BROADCAST.value: EdgeType.BROADCAST,
    EdgeKind.FORWARD.value: EdgeType.FORWARD,
    EdgeKind.CUSTOM.value: EdgeType.CUSTOM,
}


def _edge_type(kind: str, force_forward: bool) -> EdgeType:
    """The rescale mapping of a runtime edge. A forward edge forced to rescale is
    redistributed as a rebalance edge: the runtime wires every upstream subtask to
    every downstream one and a forward edge's upstream ``u`` sends on subpartition
    ``u``, so its old channels are those of a rebalance edge that used one of them
    (the engine's forward mapping assumes one subpartition per upstream)."""
    edge_type = _EDGE_TYPES[kind]
    if edge_type is EdgeType.FORWARD and force_forward:
        return EdgeType.REBALANCE
    return edge_type


def vertex_infos(g: JobGraph) -> dict[str, VertexInfo]:
    """What a checkpoint must remember of the graph to be restored into another one."""
    vertices: dict[str, VertexInfo] = {}
    for v in g.vertices:
        outs = [e for e in g.edges if e.source == v.id]
        ins = sorted(g.inputs_of(v.id), key=lambda e: e.input_index)
        vertices[v.uid] = VertexInfo(
            parallelism=v.parallelism,
            nodes=tuple(n.uid for n in v.nodes),
            inputs=tuple(
                InputInfo(
                    source=g.vertices[e.source].uid,
                    kind=e.kind.value,
                    input_index=e.input_index,
                    key_field=e.key_field,
                    key_offset=(
                        int(np.dtype(e.dtype).fields[e.key_field][1]) if e.key_field else None
                    ),
                    # the edge's result partition among the source's partitions
                    partition=[x for x in g.edges if x.source == e.source].index(e),
                    # a loop's feedback edge: not a predecessor for checkpoint roots
                    feedback=e.feedback,
                )
                for e in ins
            ),
            outputs=tuple(g.vertices[e.target].uid for e in outs),
            loop=v.loop,
            iteration_head=v.is_iteration_head,
        )
    return vertices


def graph_info(g: JobGraph) -> dict[str, Any]:
    """:func:`vertex_infos` as the checkpoint metadata holds it (the coordinator's)."""
    return {"vertices": {uid: v.to_json() for uid, v in vertex_infos(g).items()}}


def plan_restore(
    meta: CheckpointMetadata,
    g: JobGraph,
    *,
    allow_non_restored_state: bool = False,
    ignore_inflight: bool = False,
    force_forward: bool = False,
    validate: bool = True,
) -> dict[tuple[str, int], TaskRestore]:
    """Per new subtask ``(vertex uid, index)``, what it restores; raises when the
    checkpoint does not fit the job (and nothing is started)."""
    cid = meta.checkpoint_id
    if meta.max_parallelism != g.max_parallelism:
        raise ConfigError(
            "max parallelism changed",
            detail=f"checkpoint {cid} was taken with {meta.max_parallelism}, "
            f"the job has {g.max_parallelism}",
            hint="keep pipeline.max-parallelism unchanged across restores: it fixes key groups",
        )
    old = meta.graph
    if old is None:
        raise ConfigError(f"checkpoint {cid} does not describe its job graph")
    new = vertex_infos(g)
    gone = sorted(set(old) - set(new))
    if gone and not allow_non_restored_state:
        raise ConfigError(
            "the checkpoint holds state of operators the job no longer has",
            detail=f"uids {gone}",
            hint="give operators their old uids, or allow non-restored state "
            "(execution.state-recovery.ignore-unclaimed-state) to drop that state",
        )
    for uid, nv in new.items():
        ov = old.get(uid)
        if ov is None:
            continue
        if ov.nodes != nv.nodes:
            raise ConfigError(
                f"the chain of {uid!r} changed",
                detail=f"checkpoint {list(ov.nodes)}, job {list(nv.nodes)}",
                hint="keep the operators between network edges as they were",
            )
        if [i.signature for i in nv.inputs] != [i.signature for i in ov.inputs]:
            if meta.operator(uid).finished == "fully":
                raise ConfigError(
                    f"operator {uid!r} finished in checkpoint {cid}, and the job gives it "
                    "other inputs",
                    detail="a finished operator never runs again: records of a new "
                    "predecessor would never be processed",
                    hint="restore into the topology of the checkpoint, or give the "
                    "operator a new uid so that it starts anew",
                )
            raise ConfigError(
                f"the inputs of {uid!r} changed since the checkpoint",
                hint="restore into the same topology (parallelism may change)",
            )
    edges = {v.uid: sorted(g.inputs_of(v.id), key=lambda e: e.input_index) for v in g.vertices}

    def entry(uid: str, j: int) -> SubtaskMeta:
        return meta.operator(uid).subtask(j)

    def references(uid: str, j: int) -> tuple[Reference, ...]:
        return entry(uid, j).references

    def handle(uid: str, j: int, side: str, gate: int) -> GateStateHandle | None:
        cs = entry(uid, j).channel_state
        return cs.gate(side, gate) if cs is not None else None

    plans: dict[tuple[str, int], TaskRestore] = {}
    to_check: list[GateStateHandle] = []
    rescaled_edges: dict[tuple[str, int], RescaledInput] = {}
    for uid, nv in new.items():
        ov = old.get(uid)
        p_new = nv.parallelism
        if ov is None:
            continue  # a new operator starts empty
        p_old = ov.parallelism
        olds = [entry(uid, j) for j in range(p_old)]
        was_finished = [e.finished for e in olds]
        fully = p_old > 0 and all(was_finished)
        # Per node, every old subtask's operator state and keyed handles: the same
        # for every new subtask (each gets its own list of them).
        all_states = {node: [e.operators.get(node) for e in olds] for node in nv.nodes}
        all_keyed = {
            node: [k for e in olds if (k := e.keyed.get(node)) is not None] for node in nv.nodes
        }
        for i in range(p_new):
            own: dict[str, Any] = {}
            rescaled_state: dict[str, list[Any]] = {}
            keyed_handles: dict[str, list[dict[str, Any]]] = {}
            for node in nv.nodes:
                states = all_states[node]
                if p_old == p_new:
                    if states[i] is not None:
                        own[node] = states[i]
                else:
                    rescaled_state[node] = list(states)
                if all_keyed[node]:
                    keyed_handles[node] = list(all_keyed[node])
            outputs: list[GateStateHandle] = []
            inputs: list[GateStateHandle] = []
            refs: list[Reference] = []
            rescaled: list[RescaledInput] = []
            if not ignore_inflight:
                for part, target in enumerate(nv.outputs):
                    tv, to = new[target], old.get(target)
                    if to is not None and p_old == p_new and to.parallelism == tv.parallelism:
                        h = handle(uid, i, "output", part)
                        if h is not None:
                            outputs.append(h)
                for k, spec in enumerate(nv.inputs):
                    src = spec.source
                    so, sn = old.get(src), new[src]
                    if so is None:
                        continue
                    if p_old == p_new and so.parallelism == sn.parallelism:
                        h = handle(uid, i, "input", k)
                        if h is not None:
                            inputs.append(h)
                        mine = [r for r in references(uid, i) if r.gate == k]
                        refs += mine
                        _check_partitioner(cid, uid, k, edges[uid][k], mine)
                        continue
                    # One mapping and one set of old handles per edge, shared by its
                    # new subtasks (the mapping is O(old + new subtasks) blocks, each
                    # subtask expands only its own; the handles are O(old subtasks)).
                    edge = rescaled_edges.get((uid, k))
                    if edge is None:
                        edge = rescaled_edges[(uid, k)] = RescaledInput(
                            gate=k,
                            mapping=map_edge(
                                _edge_type(spec.kind, force_forward),
                                old_upstream=so.parallelism,
                                old_downstream=p_old,
                                new_upstream=sn.parallelism,
                                new_downstream=p_new,
                                max_parallelism=g.max_parallelism,
                                force=force_forward,
                            ),
                            input_handles={d: handle(uid, d, "input", k) for d in range(p_old)},
                            output_handles={
                                u: handle(src, u, "output", spec.partition)
                                for u in range(so.parallelism)
                            },
                            key_offset=spec.key_offset,
                            input_references={
                                d: unfiltered(references(uid, d), k) for d in range(p_old)
                            },
                        )
                        to_check += edge.handles()  # no subtask's filtered references yet
                    # Streams the old subtasks referenced with a filter, replayed first: an
                    # old subtask's go where its input state goes (the mapping), then
                    # the new subtask's own filter applies on top.
                    in_filtered = tuple(
                        r
                        for d in edge.mapping.side(Side.INPUT).old_subtasks(i)
                        for r in references(uid, d)
                        if r.gate == k and r.filter is not None
                    )
                    _check_partitioner(cid, uid, k, edges[uid][k], in_filtered)
                    rescaled.append(replace(edge, filtered_references=in_filtered))
            replay = ReplayPlan(tuple(outputs), tuple(inputs), tuple(refs), tuple(rescaled))
            # its own files (the rescaled edges' shared ones were added once per edge)
            to_check += [*outputs, *inputs]
            to_check += [p.handle for r in refs for p in r.pieces]
            to_check += [
                p.handle for e in rescaled for r in e.filtered_references for p in r.pieces
            ]
            plans[(uid, i)] = TaskRestore(
                cid,
                operator_state=own,
                keyed_handles=keyed_handles,
                channel_state=replay,
                rescaled_state=rescaled_state,
                finished=fully or (p_old == p_new and was_finished[i]),
            )
    if validate:
        _validate(
            cid, to_check, [h for r in plans.values() for v in r.keyed_handles.values() for h in v]
        )
    return plans


def _check_partitioner(
    cid: int, uid: str, gate: int, edge: JobEdge, refs: Sequence[Reference]
) -> None:
    """Refuses, before anything starts, references filtered by a custom partitioner
    other than the one the edge has now (``check_partitioner``)."""
    for r in refs:
        if isinstance(r.filter, PartitionerFilter):
            try:
                check_partitioner(r.filter.names, edge.partitioner)
            except RescaleError as e:  # refused as the restore's configuration
                raise ConfigError(
                    f"checkpoint {cid} cannot be restored: input {gate} of {uid!r} "
                    "references in-flight data filtered by another partitioner",
                    detail=e.detail,
                    hint=e.hint,
                ) from e


def _validate(
    cid: int, channel_handles: list[GateStateHandle], keyed: list[dict[str, Any]]
) -> None:
    """Opens every file the restore will read; refuses the checkpoint on the first bad one.
    A channel index is checked to be there and long enough for every entry the
    handles name; its entries are read (and their checksums checked) only by the
    subtasks that replay their gates."""
    seen: set[tuple[str, int]] = set()
    try:
        check_index(channel_handles)
        for h in channel_handles:
            # Gates of several subtasks may share a file: each section is checked once.
            if h.key in seen:
                continue
            seen.add(h.key)
            open_retriever(h).close()
    except SpilloverError as e:
        kept = {"errno": e.errno} if isinstance(e, StorageError) else {}
        raise type(e)(
            f"checkpoint {cid} cannot be restored: {e.message}",
            path=e.path,
            offset=e.offset,
            detail=e.detail,
            hint="restore an older checkpoint, or restore without in-flight data",
            **kept,
        ) from e
    for k in keyed:
        for st in k.get("states", []):
            uri = st["uri"]
            if "://" not in uri and not os.path.exists(uri):
                raise StorageError(
                    f"checkpoint {cid} cannot be restored: a keyed-state file is missing",
                    path=uri,
                    errno=2,
                )
