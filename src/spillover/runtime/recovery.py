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
from spillover.storage import DataType, GateStateHandle, Retriever, open_retriever

# Joined buffer size: replayed records go to the operator, not to the network.
JOIN_BYTES = 1 << 20
# Bytes read per step (the retriever's block): a barrier waits at most one step.
STEP_BYTES = 1 << 20


@dataclass
class Piece:
    """Frames of one channel in one state file, less the first ``skip`` bytes."""

    handle: GateStateHandle
    channel: int
    skip: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the channel in the file (the handle's count)."""
        return self.handle.channels.get(self.channel, (0, 0))[1]

    def to_dict(self) -> dict[str, Any]:
        return {"handle": self.handle.to_dict(), "channel": self.channel, "skip": self.skip}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Piece:
        try:
            return cls(GateStateHandle.from_dict(d["handle"]), int(d["channel"]), int(d["skip"]))
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError("malformed channel-state reference", detail=str(e)) from e


def references_of(channel_state: dict[str, Any] | None, gate: int) -> dict[int, list[Piece]]:
    """``{input channel: pieces}`` a checkpoint's channel state references for one gate."""
    out: dict[int, list[Piece]] = {}
    for ref in (channel_state or {}).get("references", []):
        if int(ref["gate"]) == gate:
            out.setdefault(int(ref["channel"]), []).extend(
                Piece.from_dict(p) for p in ref["pieces"]
            )
    return out


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
                by_file: dict[str, tuple[GateStateHandle, dict[int, int]]] = {}
                for ch, pieces in refs.items():
                    if k < len(pieces):
                        entry = by_file.setdefault(pieces[k].handle.uri, (pieces[k].handle, {}))
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

    @property
    def done(self) -> bool:
        return self._step >= len(self._plan) and self._retriever is None

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
                raise CorruptFrameError(
                    "a referenced state file holds fewer frames than its handle says",
                    path=handle.uri,
                    detail=f"{self._left} frames of channels {sorted(chans)} missing",
                )
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
