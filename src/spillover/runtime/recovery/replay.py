"""Replaying recovered input state step by step, and checkpoints taken meanwhile.

A restored task replays its own input state (edges whose parallelism did not
change) before any new input. :class:`InputRecovery` does it one read-ahead
block per step, so the task loop takes unaligned barriers between steps: a
checkpoint triggered during the replay completes instead of waiting for it.

Such a checkpoint does not write the recovered bytes again. For every input
channel still being replayed, its input state starts with a **reference**: the
pieces of old state files that remain, each ``(handle, channel, skip)`` (skip
the first ``skip`` bytes of that channel's frames in that file), cut where the
task's last processed record ended; the buffers that arrive from the network
until the channel's barrier follow in the checkpoint's own file, as usual.
Restoring replays a channel's referenced pieces, then its own file, through the
same record reader, so a record cut anywhere (between pieces too) joins again.
A checkpoint taken while replaying a checkpoint that references older files
references those older files directly: references never point at references.

docs/runtime.md ("Checkpoints during recovery") and docs/format.md describe the
metadata; ``checkpoints.referenced_checkpoints`` keeps referenced checkpoints
from being deleted while a retained one needs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spillover.errors import CorruptFrameError, FormatError
from spillover.records import FrameJoiner
from spillover.rescale.pieces import Piece, missing_frames
from spillover.storage import DataType, GateStateHandle, Retriever, open_retriever

# Joined buffer size: replayed records go to the operator, not to the network.
JOIN_BYTES = 1 << 20
# Bytes read per step (the retriever's block): a barrier waits at most one step.
STEP_BYTES = 1 << 20


def references_of(channel_state: dict[str, Any] | None, gate: int) -> dict[int, list[Piece]]:
    """``{input channel: pieces}`` a checkpoint's channel state references for one gate."""
    out: dict[int, list[Piece]] = {}
    for ref in (channel_state or {}).get("references", []):
        if int(ref["gate"]) == gate and "filter" not in ref:
            out.setdefault(int(ref["channel"]), []).extend(
                Piece.from_dict(p) for p in ref["pieces"]
            )
    return out


def filtered_references_of(
    channel_state: dict[str, Any] | None, gate: int
) -> list[tuple[list[Piece], dict[str, Any]]]:
    """``[(pieces, filter)]``: the old channels' streams a checkpoint references for one
    gate with the filter to apply (taken while replaying a rescaled edge), in order."""
    return [
        ([Piece.from_dict(p) for p in ref["pieces"]], dict(ref["filter"]))
        for ref in (channel_state or {}).get("references", [])
        if int(ref["gate"]) == gate and "filter" in ref
    ]


def compose_filters(old: dict[str, Any], new: dict[str, Any] | None) -> dict[str, Any] | None:
    """The filter keeping what both keep (``new`` None: keep what ``old`` keeps); None
    when nothing can pass. Filters of one edge are of one kind (its kind never changes)."""
    if new is None or new["kind"] == "none":
        return old
    if old["kind"] == "none":
        return new
    if old["kind"] == "key_groups" and new["kind"] == "key_groups":
        start, end = max(old["start"], new["start"]), min(old["end"], new["end"])
        return None if end < start else {**old, "start": start, "end": end}
    if old["kind"] == "partitioner" and new["kind"] == "partitioner":
        parts = [*old.get("all", [old]), *new.get("all", [new])]
        return {"kind": "partitioner", "all": [{k: p[k] for k in _PART} for p in parts]}
    raise FormatError("a reference's filter does not fit the edge", detail=f"{old} and {new}")


_PART = ("name", "index", "parallelism", "key_offset")


def filter_partitioners(flt: dict[str, Any]) -> set[str]:
    """The names of the custom partitioners a reference's filter (or a composition of
    them) applies; empty for other kinds."""
    if flt.get("kind") != "partitioner":
        return set()
    return {p["name"] for p in flt.get("all", [flt])}


def filtered_retriever(
    streams: list[tuple[list[Piece], int]],
    flt: dict[str, Any],
    *,
    partitioner: Callable[..., Any] | None,
    buffer_size: int,
) -> Any:
    """A filtering retriever replaying ``(pieces, new channel)`` streams, keeping what
    ``flt`` keeps (a reference's filter, or a composition of them)."""
    from spillover.keygroups import KeyGroupRange
    from spillover.records import FieldKey, partitioner_name
    from spillover.rescale import FilteringRetriever, RecordStream

    rs = [
        RecordStream(
            tuple((p.handle, p.channel) for p in ps), i, 0, ch, skips=tuple(p.skip for p in ps)
        )
        for i, (ps, ch) in enumerate(streams)
    ]
    common: dict[str, Any] = {
        "buffer_size": buffer_size,
        "n_outputs": 1 + max(ch for _, ch in streams),
    }
    kind = flt["kind"]
    if kind == "none":
        return FilteringRetriever(rs, pass_through=True, coalesce=True, **common)
    if kind == "key_groups":
        return FilteringRetriever(
            rs,
            max_parallelism=int(flt["max_parallelism"]),
            key_group_table=KeyGroupRange(int(flt["start"]), int(flt["end"])),
            key=FieldKey(int(flt["key_offset"]), "int64"),
            **common,
        )
    parts = flt.get("all", [flt])
    if partitioner is None or filter_partitioners(flt) != {partitioner_name(partitioner)}:
        raise FormatError(
            "a reference's partitioner is not the edge's",
            detail=f"reference: {sorted({p['name'] for p in parts})}, edge: "
            f"{partitioner_name(partitioner) if partitioner else None}",
            hint="restore with the partitioner the checkpoint was taken with",
        )
    if len(parts) == 1:
        p, fn = parts[0], partitioner
        index, n = int(p["index"]), int(p["parallelism"])
    else:
        index, n = 0, 2
        fn = _all_of(partitioner, [(int(p["index"]), int(p["parallelism"])) for p in parts])
    return FilteringRetriever(
        rs,
        key=FieldKey(int(parts[0]["key_offset"]), "int64"),
        partitioner=fn,
        partition=index,
        n_partitions=n,
        **common,
    )


def _all_of(partitioner: Callable[..., Any], keep: list[tuple[int, int]]) -> Callable[..., Any]:
    """A partitioner sending a record to 0 when ``partitioner`` picks ``index`` of
    ``parallelism`` for every pair of ``keep``, else to 1 (one numpy call per pair)."""
    from spillover.records import partitions_of

    def both(keys: Any, _n: int) -> Any:
        ok = np.ones(len(keys), bool)
        for index, n in keep:
            ok &= partitions_of(partitioner, keys, n) == index
        return np.where(ok, 0, 1)

    both.__qualname__ = f"all_of({getattr(partitioner, '__qualname__', '?')})"
    return both


@dataclass
class _Channel:
    """One input channel's recovered pieces and how far the replay got in them."""

    pieces: list[Piece]
    fed: list[int] = field(default_factory=list)  # bytes fed per piece (after its skip)

    def remainder(self, pending: int) -> list[Piece]:
        """The pieces from where the record in progress (``pending`` bytes fed but not
        yet a whole record) begins. Pieces are fed one after the other, each whole."""
        pos = sum(self.fed) - pending  # bytes up to the last whole record
        for k, p in enumerate(self.pieces):
            avail = p.nbytes - p.skip
            if pos < avail:
                rest = [Piece(p.handle, p.channel, p.skip + pos)]
                return rest + [Piece(q.handle, q.channel, q.skip) for q in self.pieces[k + 1 :]]
            pos -= avail
        return []


class InputRecovery:
    """Replays a task's own recovered input state, one read-ahead block per ``step``.

    ``gates`` maps an input gate to ``(own handle or None, {channel: referenced
    pieces})``: per channel, the referenced pieces come first, then the channel's
    frames in the own file. ``process(gate, channel, buffer)`` takes the joined
    buffers (up to :data:`JOIN_BYTES`) in each channel's order.
    """

    def __init__(
        self,
        gates: dict[int, tuple[GateStateHandle | None, dict[int, list[Piece]]]],
        process: Callable[[int, int, Any], None],
    ) -> None:
        self._process = process
        self.channels: dict[tuple[int, int], _Channel] = {}
        # The reading plan: (gate, handle, {channel: piece index} or None for own files).
        self._plan: list[tuple[int, GateStateHandle, dict[int, int]]] = []
        for gate, (own, refs) in sorted(gates.items()):
            width = max([*refs, *(own.channels if own else [])], default=-1) + 1
            for ch in range(width):
                pieces = list(refs.get(ch, []))
                if own is not None and own.channels.get(ch, (0, 0))[0]:
                    pieces.append(Piece(own, ch))
                if pieces:
                    self.channels[(gate, ch)] = _Channel(pieces)
            depth = max((len(refs.get(ch, [])) for ch in range(width)), default=0)
            for k in range(depth):  # referenced pieces, k-th of every channel at once
                # By section, not file: old subtasks' gates may share one file.
                by_file: dict[tuple[str, int], tuple[GateStateHandle, dict[int, int]]] = {}
                for ch, pieces in refs.items():
                    if k < len(pieces):
                        entry = by_file.setdefault(pieces[k].handle.key, (pieces[k].handle, {}))
                        entry[1][ch] = k
                self._plan += [(gate, h, chans) for h, chans in by_file.values()]
            if own is not None:
                self._plan.append((gate, own, {ch: len(refs.get(ch, [])) for ch in own.channels}))
        self._joiners: dict[int, FrameJoiner] = {}
        self._step = 0
        self._retriever: Retriever | None = None
        self._skip: dict[int, int] = {}
        self._left = 0
        self.replayed_bytes = 0

    def step(self) -> bool:
        """Replays one block; False once everything was replayed (and handed on)."""
        while self._retriever is None:
            if self._step >= len(self._plan):
                self.flush()
                return False
            gate, handle, chans = self._plan[self._step]
            self._left = sum(handle.channels.get(c, (0, 0))[0] for c in chans)
            if self._left == 0:
                self._step += 1
                continue
            self._retriever = open_retriever(
                handle,
                channels=list(chans),
                read_block_bytes=STEP_BYTES,
                read_ahead_bytes=4 * STEP_BYTES,
            )
            self._skip = {c: self.channels[(gate, c)].pieces[k].skip for c, k in chans.items()}
        gate, handle, chans = self._plan[self._step]
        r = self._retriever
        frames = r.poll_frames() if r.wait() else None
        if frames is None and r.finished:
            if self._left:
                raise missing_frames(handle.uri, self._left, chans)
            self._end_file()
            return True
        if frames is None:
            return True
        ids = frames.channel_ids
        outputs = np.full(len(ids), -1, np.int32)
        for c in chans:
            outputs[ids == c] = c
        wanted = outputs >= 0
        self._left -= int(np.count_nonzero(wanted))
        if (frames.data_types[wanted] != DataType.DATA).any():
            raise CorruptFrameError(
                "recovered input state holds an event buffer",
                path=handle.uri,
                offset=int(frames.file_offsets[0]),
            )
        offsets, lengths = frames.offsets, frames.lengths
        for c, skip in self._skip.items():
            if skip <= 0:
                continue
            for i in np.flatnonzero(ids == c).tolist():
                cut = min(skip, int(lengths[i]))
                offsets[i] += cut
                lengths[i] -= cut
                skip -= cut
                if skip == 0:
                    break
            self._skip[c] = skip
        for c in chans:
            fed = int(lengths[ids == c].sum())
            if fed:
                st = self.channels[(gate, c)]
                k = chans[c]
                st.fed += [0] * (k + 1 - len(st.fed))
                st.fed[k] += fed
                self.replayed_bytes += fed
        joiner = self._joiners.get(gate)
        if joiner is None:
            width = 1 + max(c for g, c in self.channels if g == gate)
            joiner = self._joiners[gate] = FrameJoiner(width, JOIN_BYTES)
        for ch, buf in joiner.put_frames(frames.data, offsets, lengths, outputs):
            self._process(gate, ch, buf)
        if self._left <= 0:
            self._end_file()
        return True

    def _end_file(self) -> None:
        if self._retriever is not None:
            self._retriever.close()
            self._retriever = None
        self._step += 1

    def flush(self) -> None:
        """Hands on every joined byte, so everything fed has been processed."""
        for gate, joiner in self._joiners.items():
            for ch, buf in joiner.flush():
                self._process(gate, ch, buf)

    def references(self, pending: Callable[[int, int], int]) -> list[dict[str, Any]]:
        """What is left to replay, per input channel, as referenced pieces (call after
        :meth:`flush`); ``pending(gate, channel)`` is the bytes of the record the task's
        reader has begun and not finished."""
        out = []
        for (gate, ch), st in sorted(self.channels.items()):
            rest = st.remainder(pending(gate, ch))
            if rest:
                out.append({"gate": gate, "channel": ch, "pieces": [p.to_dict() for p in rest]})
        return out

    def close(self) -> None:
        if self._retriever is not None:
            self._retriever.close()
            self._retriever = None


class StreamRecovery:
    """Replays old channels' streams through filtering retrievers (a rescaled edge, or
    a checkpoint's filtered references), a step of about :data:`STEP_BYTES` at a time.

    ``parts`` are ``(gate, retriever, filter)`` replayed one after the other (the
    filter as a reference records it: the retriever's, or a composition);
    ``process(gate, buffer)`` takes the retrievers' buffers, each of whole records.
    At a checkpoint, :meth:`references` hands out what is kept so far and lists each
    unfinished stream's rest with the retriever's filter.
    """

    def __init__(
        self, parts: list[tuple[int, Any, dict[str, Any]]], process: Callable[[int, Any], None]
    ) -> None:
        self._parts = parts
        self._process = process
        self._next = 0
        self.replayed_bytes = 0

    def step(self) -> bool:
        """Replays about one step; False once everything was replayed."""
        n = 0
        while self._next < len(self._parts):
            gate, r, _ = self._parts[self._next]
            buf = r.poll_next()
            if buf is None:
                if r.finished:
                    r.close()
                    self._next += 1
                    continue
                if n:
                    return True
                r.wait()
                continue
            self.replayed_bytes += len(buf)
            n += len(buf)
            self._process(gate, buf)
            if n >= STEP_BYTES:
                return True
        return False

    def references(self) -> list[dict[str, Any]]:
        """Processes every record kept so far, then returns each unfinished stream's
        rest as a filtered reference (``{"gate", "channel", "pieces", "filter"}``)."""
        out = []
        for gate, r, flt in self._parts[self._next :]:
            for buf in r.cut():
                self._process(gate, buf)
            for stream, pieces in r.remainder():
                out.append(
                    {
                        "gate": gate,
                        "channel": stream.channel or 0,
                        "pieces": [Piece(h, c, k).to_dict() for h, c, k in pieces],
                        "filter": flt,
                    }
                )
        return out

    def close(self) -> None:
        for _, r, _ in self._parts[self._next :]:
            r.close()
        self._next = len(self._parts)
