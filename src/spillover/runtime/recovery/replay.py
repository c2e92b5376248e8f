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

Both the own state and old channels' streams (a rescaled edge, or what a
checkpoint referenced with a filter) are read by the engine's one piece reader, the
:class:`~spillover.rescale.FilteringRetriever` (keeping every record of the own
state), which joins records cut between pieces and says where each stream stands.

docs/runtime.md ("Checkpoints during recovery") and docs/format.md describe the
metadata; ``checkpoints.referenced_checkpoints`` keeps referenced checkpoints
from being deleted while a retained one needs them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from spillover.rescale import Filter, FilteringRetriever, Piece, RecordStream, Reference
from spillover.storage import GateStateHandle

# Joined buffer size: replayed records go to the operator, not to the network.
JOIN_BYTES = 1 << 20
# Bytes read per step (the retriever's block): a barrier waits at most one step.
STEP_BYTES = 1 << 20

Part = tuple[int, FilteringRetriever, Filter | None]
"""``(gate, retriever, filter)``: streams replayed on one input gate; the filter a
reference to their rest records (None: the gate's own state, unfiltered)."""


class StreamRecovery:
    """Replays streams through filtering retrievers, a step of about
    :data:`STEP_BYTES` at a time.

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

    def flush(self) -> None:
        """Processes every record kept so far (the retrievers' partly filled buffers)."""
        for gate, r, _ in self._parts[self._next :]:
            for buf in r.cut():
                self._process(gate, buf)

    def references(self, held: Callable[[int, RecordStream], int] | None = None) -> list[Reference]:
        """Processes every record kept so far, then returns each unfinished stream's
        rest as a reference; ``held(gate, stream)`` is the bytes of it a consumer
        holds in a record it has begun."""
        self.flush()
        out = []
        for gate, r, flt in self._parts[self._next :]:
            by = (lambda s, g=gate: held(g, s)) if held is not None else None
            for stream, pieces in r.remainder(by):
                out.append(Reference(gate, stream.channel or 0, pieces, flt))
        return out

    def close(self) -> None:
        for _, r, _ in self._parts[self._next :]:
            r.close()
        self._next = len(self._parts)


class InputRecovery:
    """Replays a task's own recovered input state, a step at a time.

    ``gates`` maps an input gate to ``(own handle or None, {channel: referenced
    pieces})``: per channel, the referenced pieces come first, then the channel's
    frames in the own file, one stream read by the engine's filtering retriever
    keeping every record. ``process(gate, channel, buffer)`` takes buffers of whole
    records (up to :data:`JOIN_BYTES`) in each channel's order.
    """

    def __init__(
        self,
        gates: Mapping[int, tuple[GateStateHandle | None, Mapping[int, Sequence[Piece]]]],
        process: Callable[[int, int, Any], None],
    ) -> None:
        self.channels: set[tuple[int, int]] = set()
        parts: list[Part] = []
        for gate, (own, refs) in sorted(gates.items()):
            own_channels = [c for c, (n, _) in own.channels.items() if n] if own else []
            streams = []
            for ch in sorted({*refs, *own_channels}):
                pieces = list(refs.get(ch, ()))
                if ch in own_channels:
                    assert own is not None
                    pieces.append(Piece(own, ch))
                if pieces:
                    self.channels.add((gate, ch))
                    streams.append(RecordStream.of(pieces, ch, 0, ch))
            if streams:
                r = FilteringRetriever(
                    streams,
                    pass_through=True,
                    coalesce=True,
                    n_outputs=1 + max(s.channel or 0 for s in streams),
                    buffer_size=JOIN_BYTES,
                    # a step reads about one block
                    read_block_bytes=STEP_BYTES,
                    read_ahead_bytes=4 * STEP_BYTES,
                )
                parts.append((gate, r, None))
        self._streams = StreamRecovery(parts, lambda g, b: process(g, b.channel_id, b))

    @property
    def replayed_bytes(self) -> int:
        return self._streams.replayed_bytes

    def step(self) -> bool:
        """Replays about one step; False once everything was replayed."""
        return self._streams.step()

    def flush(self) -> None:
        """Hands on every joined byte, so everything read has been processed."""
        self._streams.flush()

    def references(self, pending: Callable[[int, int], int]) -> list[Reference]:
        """What is left to replay, per input channel, as referenced pieces;
        ``pending(gate, channel)`` is the bytes of the record the task's reader has
        begun and not finished."""
        return self._streams.references(lambda g, s: pending(g, s.channel or 0))

    def close(self) -> None:
        self._streams.close()
