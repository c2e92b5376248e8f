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

The own state is handed on record-agnostic: at unchanged parallelism a channel's
input file may end inside a record whose tail the upstream's output state brings
over the network, so only the task's own record reader can join it. Old
channels' streams (a rescaled edge, or what a checkpoint referenced with a
filter) end on record boundaries and are read by the engine's one piece reader,
the :class:`~spillover.rescale.FilteringRetriever`.

docs/runtime.md ("Checkpoints during recovery") and docs/format.md describe the
metadata; ``checkpoints.referenced_checkpoints`` keeps referenced checkpoints
from being deleted while a retained one needs them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from spillover.errors import CorruptFrameError
from spillover.records import FieldKey, FrameJoiner
from spillover.rescale import Filter, FilteringRetriever, Piece, Reference, SharedReplayPart
from spillover.rescale.pieces import missing_frames
from spillover.storage import DataType, GateStateHandle, Retriever, open_retriever

if TYPE_CHECKING:
    from spillover.runtime.recovery.replay_plan import RescaledInput

# Joined buffer size: replayed records go to the operator, not to the network.
JOIN_BYTES = 1 << 20
# Bytes read per step (the retrievers' block): a barrier waits at most one step.
STEP_BYTES = 1 << 20


def rescaled_read(item: RescaledInput) -> dict[str, Any]:
    """How a rescaled edge's old channels are read, by one subtask alone or shared by
    the subtasks of a process: key_by edges filter by the key group of the edge's
    int64 key field; replayed records are processed here, not sent, so buffers are
    large (the per-batch cost dominates small ones) and a buffer is what a step hands
    on at least; reads go a step at a time, with read-ahead."""
    return {
        "input_handles": item.input_handles,
        "output_handles": item.output_handles,
        "key": FieldKey(item.key_offset or 0, "int64"),
        "buffer_size": JOIN_BYTES,
        "input_references": item.input_references,
        "read_block_bytes": STEP_BYTES,
        "read_ahead_bytes": 4 * STEP_BYTES,
    }


# Longest wait of a step for a block: a part of a shared read may wait for its
# sharers, and the task loop takes mail and barriers in between.
STEP_WAIT_S = 0.05

Part = tuple[int, FilteringRetriever | SharedReplayPart, Filter]
"""``(gate, retriever, filter)``: old channels' streams replayed on one input gate
(alone, or a part of a read shared with other subtasks of this process), and the
filter a reference to their rest records."""


class StreamRecovery:
    """Replays old channels' streams through filtering retrievers, at most one read
    block (or :data:`STEP_BYTES` handed on) per step.

    ``parts`` are replayed one after the other; ``process(gate, buffer)`` takes the
    retrievers' buffers, each of whole records, on the buffer's ``channel_id``. At a
    checkpoint, :meth:`references` hands out what is kept so far and lists each
    unfinished stream's rest, with the part's filter.
    """

    def __init__(self, parts: Sequence[Part], process: Callable[[int, Any], None]) -> None:
        self._parts = list(parts)
        self._process = process
        self._next = 0
        self.replayed_bytes = 0

    def step(self) -> bool:
        """Replays one step; False once everything was replayed."""
        n = read = 0
        while self._next < len(self._parts):
            gate, r, _ = self._parts[self._next]
            if read and not r.ready:
                return True  # one block consumed, everything it gave handed on
            before = r.blocks_read
            buf = r.poll_next()  # reads at most one block
            read += r.blocks_read - before
            if buf is None:
                if r.finished:
                    r.close()
                    self._next += 1
                    continue
                if not (read or n):
                    # One bounded wait a step, whatever ends it: a step that waited
                    # again could spin for as long as a part sharing its read is held
                    # up, taking no mail, barrier or cancel meanwhile.
                    r.wait(STEP_WAIT_S)
                return True
            self.replayed_bytes += len(buf)
            n += len(buf)
            self._process(gate, buf)
            if n >= STEP_BYTES:
                return True
        return False

    def references(self) -> list[Reference]:
        """Processes every record kept so far, then returns each unfinished stream's
        rest as a reference with its part's filter. What the cut hands on is replayed
        like what a step hands on, and counted once: reading goes on after it."""
        out = []
        for gate, r, flt in self._parts[self._next :]:
            for buf in r.cut():
                self.replayed_bytes += len(buf)
                self._process(gate, buf)
            for stream, pieces in r.remainder():
                out.append(Reference(gate, stream.channel or 0, pieces, flt))
        return out

    def close(self) -> None:
        for _, r, _ in self._parts[self._next :]:
            r.close()
        self._next = len(self._parts)


@dataclass
class _Channel:
    """One input channel's recovered pieces and how far the replay got in them."""

    pieces: list[Piece]
    fed: list[int] = field(default_factory=list)  # bytes fed per piece (after its skip)

    def remainder(self, pending: int) -> tuple[Piece, ...]:
        """The pieces from where the record in progress (``pending`` bytes fed but not
        yet a whole record) begins. Pieces are fed one after the other, each whole."""
        pos = sum(self.fed) - pending  # bytes up to the last whole record
        for k, p in enumerate(self.pieces):
            avail = p.nbytes - p.skip
            if pos < avail:
                return (Piece(p.handle, p.channel, p.skip + pos), *self.pieces[k + 1 :])
            pos -= avail
        return ()


class InputRecovery:
    """Replays a task's own recovered input state, one read-ahead block per ``step``.

    ``gates`` maps an input gate to ``(own handle or None, {channel: referenced
    pieces})``: per channel, the referenced pieces come first, then the channel's
    frames in the own file. Bytes are handed on as stored, record-agnostic: a
    channel's state may end inside a record whose tail arrives over the network, so
    the task's reader joins records. ``process(gate, channel, buffer)`` takes the
    joined buffers (up to :data:`JOIN_BYTES`) in each channel's order; a block costs
    one native :class:`~spillover.records.FrameJoiner` call.
    """

    def __init__(
        self,
        gates: Mapping[int, tuple[GateStateHandle | None, Mapping[int, Sequence[Piece]]]],
        process: Callable[[int, int, Any], None],
    ) -> None:
        self._process = process
        self.channels: dict[tuple[int, int], _Channel] = {}
        # The reading plan: (gate, handle, {channel: piece index}), referenced pieces
        # first (the k-th of every channel at once), then the own file.
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
            for k in range(depth):
                # By section, not file: old subtasks' gates may share one file.
                by_file: dict[tuple[str, int], tuple[GateStateHandle, dict[int, int]]] = {}
                for ch, ps in refs.items():
                    if k < len(ps):
                        by_file.setdefault(ps[k].handle.key, (ps[k].handle, {}))[1][ch] = k
                self._plan += [(gate, h, chans) for h, chans in by_file.values()]
            if own is not None:
                self._plan.append((gate, own, {ch: len(refs.get(ch, [])) for ch in own.channels}))
        self._joiners: dict[int, FrameJoiner] = {}
        self._step = 0
        self._retriever: Retriever | None = None
        self._lut = np.zeros(0, np.int32)  # channel id -> output (-1: not read here)
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
            self._lut = np.full(max(chans) + 1, -1, np.int32)
            self._lut[list(chans)] = list(chans)
            self._skip = {c: self.channels[(gate, c)].pieces[k].skip for c, k in chans.items()}
        gate, handle, chans = self._plan[self._step]
        r = self._retriever
        frames = r.poll_frames() if r.wait() else None
        if frames is None:
            if r.finished:
                if self._left:
                    raise missing_frames(handle.uri, self._left, chans)
                self._end_file()
            return True
        ids = frames.channel_ids
        lut = self._lut
        outputs = np.where(ids < len(lut), lut[np.minimum(ids, len(lut) - 1)], -1)
        outputs = outputs.astype(np.int32, copy=False)
        wanted = outputs >= 0
        self._left -= int(np.count_nonzero(wanted))
        if (frames.data_types[wanted] != DataType.DATA).any():
            i = int(np.flatnonzero(wanted & (frames.data_types != DataType.DATA))[0])
            raise CorruptFrameError(
                "recovered input state holds an event buffer",
                path=handle.uri,
                offset=int(frames.file_offsets[i]),
                detail=f"channel {int(ids[i])}: only data buffers are persisted",
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
        fed = np.bincount(outputs[wanted], weights=lengths[wanted], minlength=len(lut))
        for c in np.flatnonzero(fed).tolist():
            st = self.channels[(gate, c)]
            k = chans[c]
            st.fed += [0] * (k + 1 - len(st.fed))
            st.fed[k] += int(fed[c])
            self.replayed_bytes += int(fed[c])
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

    def references(self, pending: Callable[[int, int], int]) -> list[Reference]:
        """What is left to replay, per input channel, as referenced pieces (call after
        :meth:`flush`); ``pending(gate, channel)`` is the bytes of the record the task's
        reader has begun and not finished."""
        out = []
        for (gate, ch), st in sorted(self.channels.items()):
            rest = st.remainder(pending(gate, ch))
            if rest:
                out.append(Reference(gate, ch, rest))
        return out

    def close(self) -> None:
        if self._retriever is not None:
            self._retriever.close()
            self._retriever = None
