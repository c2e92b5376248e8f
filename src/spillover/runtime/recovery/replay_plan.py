"""What one restored subtask replays of its channel state: the typed replay plan.

``plan_restore`` (``plan.py``) builds a :class:`ReplayPlan` per new subtask from the
checkpoint's metadata; ``ChannelStateReplay`` (``channels.py``) replays it. The plan
holds state handles, :class:`~spillover.rescale.pieces.Reference`\\ s and edge
mappings, never JSON: the metadata file is the only place they are dicts.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace

from spillover.rescale import EdgeMapping, Piece, Reference
from spillover.storage import GateStateHandle
from spillover.storage.channel_index import ReadEntries, resolve_all

__all__ = ["ReplayPlan", "RescaledInput", "unfiltered"]


Subtasks = int | Collection[int] | None
"""One new subtask, several (what they read between them), or None (everything)."""


def unfiltered(refs: Iterable[Reference], gate: int) -> dict[int, tuple[Piece, ...]]:
    """``{input channel: pieces}`` of the unfiltered references of ``gate``, in order:
    a channel's own recovered state, read ahead of its file."""
    out: dict[int, tuple[Piece, ...]] = {}
    for ref in refs:
        if ref.gate == gate and ref.filter is None:
            out[ref.channel] = out.get(ref.channel, ()) + ref.pieces
    return out


@dataclass(frozen=True, slots=True)
class RescaledInput:
    """One input edge whose parallelism changed on either side: what the filtering
    retriever of this subtask reads from the old subtasks (docs/rescaling.md).

    ``input_handles``/``output_handles``: per old downstream/upstream subtask its
    gate's handle for this edge (None: it stored nothing). ``input_references``: per
    old downstream, ``{channel: pieces}`` it had referenced instead of storing, read
    ahead of that channel's input piece. ``filtered_references``: old channels'
    streams the old subtasks referenced with a filter, replayed first, kept by both
    their filter and this subtask's."""

    gate: int
    mapping: EdgeMapping
    input_handles: Mapping[int, GateStateHandle | None]
    output_handles: Mapping[int, GateStateHandle | None]
    key_offset: int | None
    input_references: Mapping[int, Mapping[int, tuple[Piece, ...]]] = field(default_factory=dict)
    filtered_references: tuple[Reference, ...] = ()

    def handles(self, subtasks: Subtasks = None) -> list[GateStateHandle]:
        """The state file sections new subtask(s) ``subtasks`` read of this edge (their
        mapping's old downstreams' input gates and what they referenced, and the old
        upstreams' output gates that end their channels), each once; every one the
        edge names when None. The handles are shared by the edge's new subtasks."""
        downs: Iterable[int] = self.input_handles
        ups: Iterable[int] = self.output_handles
        if subtasks is not None:
            rm = self.mapping.input
            wanted = (subtasks,) if isinstance(subtasks, int) else subtasks
            downs = sorted({d for i in wanted for d in rm.old_subtasks(i)})
            if rm.pointwise:  # old channel d ends in upstream d's piece
                ups = downs
            elif not downs:
                ups = ()
        out = [h for d in downs if (h := self.input_handles.get(d)) is not None]
        out += [h for u in ups if (h := self.output_handles.get(u)) is not None]
        out += [
            p.handle for d in downs for ps in self.input_references.get(d, {}).values() for p in ps
        ]
        return out + [p.handle for r in self.filtered_references for p in r.pieces]

    def shared_by(self, subtasks: Iterable[int]) -> tuple[int, ...]:
        """Those of ``subtasks`` that read an old subtask another of them reads too
        (each old channel's stream is then read once for them), ascending; worked out
        from the mapping's blocks, nothing read."""
        readers: dict[int, list[int]] = {}
        for i in set(subtasks):
            for d in self.mapping.input.old_subtasks(i):
                readers.setdefault(d, []).append(i)
        return tuple(sorted({i for rs in readers.values() if len(rs) > 1 for i in rs}))


@dataclass(frozen=True, slots=True)
class ReplayPlan:
    """One restored subtask's recovered channel state.

    ``outputs``/``inputs``: its own gates' files, of edges whose parallelism did not
    change. ``references``: what its own checkpoint referenced (unfiltered ones go
    ahead of their channel's own file; filtered ones are old channels' streams).
    ``rescaled``: per rescaled input edge, what it reads of the old subtasks (the
    upstreams of a rescaled edge replay nothing: the new downstream reads both parts
    of each old channel)."""

    outputs: tuple[GateStateHandle, ...] = ()
    inputs: tuple[GateStateHandle, ...] = ()
    references: tuple[Reference, ...] = ()
    rescaled: tuple[RescaledInput, ...] = ()

    def unfiltered(self, gate: int) -> dict[int, tuple[Piece, ...]]:
        """``{input channel: pieces}`` the subtask's own references hold for ``gate``."""
        return unfiltered(self.references, gate)

    def filtered(self, gate: int) -> tuple[Reference, ...]:
        """The old channels' streams the subtask's references hold for ``gate``, in order."""
        return tuple(r for r in self.references if r.gate == gate and r.filter is not None)

    @property
    def handles(self) -> list[GateStateHandle]:
        """Every state file section the plan reads (to check them before any task starts)."""
        return self.reads()

    def reads(self, subtasks: Subtasks = None) -> list[GateStateHandle]:
        """The state file sections new subtask(s) ``subtasks`` replay
        (:meth:`RescaledInput.handles`); every one the plan names when None."""
        out = [*self.outputs, *self.inputs, *(p.handle for r in self.references for p in r.pieces)]
        for e in self.rescaled:
            out += e.handles(subtasks)
        return out

    def resolved(self, subtasks: Subtasks = None, entries: ReadEntries | None = None) -> ReplayPlan:
        """The plan with the per-channel maps of the handles new subtask(s) ``subtasks``
        read (several: a read they share; None: every handle's) read from their
        checkpoint's channel index (metadata version 2 and 3 keep them there), each
        index object opened once and each entry read once, and once per restore
        attempt in this process with the attempt's ``entries`` (``resolve_all``); the
        plan itself when every handle holds its maps (version 1). Handles they do not
        read are left as they are."""
        pending = [h for h in self.reads(subtasks) if h.index is not None]
        if not pending:
            return self
        by_key = dict(zip([id(h) for h in pending], resolve_all(pending, entries), strict=True))

        def one(h: GateStateHandle) -> GateStateHandle:
            return by_key.get(id(h), h)

        def maybe(h: GateStateHandle | None) -> GateStateHandle | None:
            return one(h) if h is not None else None

        def piece(p: Piece) -> Piece:
            return replace(p, handle=one(p.handle))

        def ref(r: Reference) -> Reference:
            return replace(r, pieces=tuple(piece(p) for p in r.pieces))

        return ReplayPlan(
            tuple(one(h) for h in self.outputs),
            tuple(one(h) for h in self.inputs),
            tuple(ref(r) for r in self.references),
            tuple(
                replace(
                    e,
                    input_handles={d: maybe(h) for d, h in e.input_handles.items()},
                    output_handles={u: maybe(h) for u, h in e.output_handles.items()},
                    input_references={
                        d: {c: tuple(piece(p) for p in ps) for c, ps in refs.items()}
                        for d, refs in e.input_references.items()
                    },
                    filtered_references=tuple(ref(r) for r in e.filtered_references),
                )
                for e in self.rescaled
            ),
        )
