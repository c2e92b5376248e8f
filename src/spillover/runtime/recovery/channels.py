"""A restored task's channel state, replayed before anything new.

Recovered output state goes into the task's outboxes ahead of any new output (the
task loop drains them as credit allows and takes barriers meanwhile; a checkpoint
persists what is still there, like any output). Recovered input state is processed
before any new input, one block per step, so the task loop takes unaligned
barriers between steps: old channels' streams (rescaled edges, and streams a
checkpoint referenced with a filter) first, then the task's own input files and
what they reference (``replay.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from spillover.records import RecordReader
from spillover.rescale import (
    Piece,
    RecordStream,
    Reference,
    SharedReplayPart,
    compose,
    filter_retriever,
)
from spillover.rescale import rescaled_retriever as rescaled
from spillover.runtime.graph import JobEdge
from spillover.runtime.recovery import replay
from spillover.runtime.recovery.replay import InputRecovery, Part, StreamRecovery
from spillover.runtime.recovery.replay_plan import ReplayPlan
from spillover.storage import GateStateHandle, open_retriever
from spillover.storage.channel_index import ReadEntries

Process = Callable[[int, Any], None]
"""``(task input channel, buffer)``: processes a replayed buffer as input."""


class ChannelStateReplay:
    """One restored subtask's recovered channel state (a :class:`ReplayPlan`), replayed
    step by step: its own output files go into the outboxes at once, its input state
    (old channels' streams first, then its own files and what they reference) one
    step at a time. ``shared`` gives, per rescaled input gate, this subtask's part of
    a read shared with other subtasks of its process (``shared_reads.py``); other
    rescaled gates are read by a retriever of its own. ``entries`` holds the channel
    index entries the attempt's restore has read in this process."""

    def __init__(
        self,
        plan: ReplayPlan,
        *,
        subtask: int,
        input_edges: Sequence[JobEdge],
        offsets: Sequence[int],
        outboxes: Sequence[Any],
        process: Process,
        shared: Mapping[int, SharedReplayPart] | None = None,
        entries: ReadEntries | None = None,
    ) -> None:
        self.offsets = offsets
        self._output_bytes = 0  # recovered output state, sent at once
        # only the channel maps of the gates it reads, each entry read once per
        # attempt in this process (``entries``, shared with the subtasks here)
        plan = plan.resolved(subtask, entries)
        for handle in plan.outputs:
            box = outboxes[handle.gate_id]
            with open_retriever(handle) as r:
                for buf in r:
                    self._output_bytes += len(buf)
                    box.send(buf.channel_id, np.frombuffer(memoryview(buf), np.uint8).copy())

        gates: dict[int, tuple[GateStateHandle | None, Mapping[int, Sequence[Piece]]]] = {
            h.gate_id: (h, {}) for h in plan.inputs
        }
        # Unfiltered references join their gate; filtered ones are old channels'
        # streams, replayed below.
        for gate in sorted({r.gate for r in plan.references}):
            refs = plan.unfiltered(gate)
            if refs:
                gates[gate] = (gates.get(gate, (None, {}))[0], refs)
        self.inputs: InputRecovery | None = (
            InputRecovery(gates, lambda gate, ch, buf: process(offsets[gate] + ch, buf))
            if gates
            else None
        )
        parts: list[Part] = []

        def filtered(gate: int, refs: Sequence[Reference], new: Any) -> None:
            """Streams a checkpoint referenced with a filter, grouped by the filter that
            keeps what both theirs and ``new`` (this subtask's, or None) keep."""
            groups: dict[Any, list[RecordStream]] = {}
            for ref in refs:
                assert ref.filter is not None
                both = compose(ref.filter, new)
                if both is not None:
                    streams = groups.setdefault(both, [])
                    streams.append(RecordStream.of(ref.pieces, len(streams), 0, 0))
            for both, streams in groups.items():
                r = filter_retriever(
                    streams,
                    both,
                    partitioner=input_edges[gate].partitioner,
                    buffer_size=replay.JOIN_BYTES,
                    # a step reads one block
                    read_block_bytes=replay.STEP_BYTES,
                    read_ahead_bytes=4 * replay.STEP_BYTES,
                )
                parts.append((gate, r, both))

        for gate in sorted({r.gate for r in plan.references}):
            filtered(gate, plan.filtered(gate), None)
        for item in plan.rescaled:
            k = item.gate
            part = (shared or {}).get(k)
            if part is not None:  # read once for the subtasks here that share it
                filtered(k, item.filtered_references, part.filter)
                parts.append((k, part, part.filter))
                continue
            retriever = rescaled(
                item.mapping,
                "input",
                subtask,
                coalesce=True,
                # custom edges route recovered records with the job's partitioner
                partitioner=input_edges[k].partitioner,
                **replay.rescaled_read(item),
            )
            # What the old subtasks referenced with a filter comes first, kept by
            # both their filter and this subtask's.
            filtered(k, item.filtered_references, retriever.filter)
            parts.append((k, retriever, retriever.filter))
        # Each part's streams end on record boundaries, and parts replay one after the
        # other before any new input: the channels' own readers serve.
        self.streams: StreamRecovery | None = (
            StreamRecovery(parts, lambda gate, b: process(offsets[gate] + b.channel_id, b))
            if parts
            else None
        )
        # Both recoveries count what they hand on (steps and checkpoints' cuts alike),
        # and keep their counts once they end.
        self._recoveries = [r for r in (self.streams, self.inputs) if r is not None]

    @property
    def replayed_bytes(self) -> int:
        """Recovered bytes handed on so far, output and input state, each byte once."""
        return self._output_bytes + sum(r.replayed_bytes for r in self._recoveries)

    @property
    def active(self) -> bool:
        """Whether recovered input state is left to replay."""
        return self.streams is not None or self.inputs is not None

    def step(self) -> None:
        """Replays one block of recovered input state."""
        rec: InputRecovery | StreamRecovery | None = (
            self.streams if self.streams is not None else self.inputs
        )
        if rec is None:
            return
        if not rec.step():
            rec.close()
            if rec is self.streams:
                self.streams = None
            else:
                self.inputs = None

    def references(self, readers: Sequence[RecordReader]) -> list[Reference]:
        """For a checkpoint taken now: what is left to replay, as references into the
        old files (the kept records of old streams are processed first; each own
        channel's rest is cut at the start of the record its reader has begun)."""
        out: list[Reference] = []
        if self.streams is not None:
            out += self.streams.references()
        rec = self.inputs
        if rec is not None:
            rec.flush()
            out += rec.references(lambda g, c: readers[self.offsets[g] + c].pending_bytes)
        return out

    def recovering_channels(self) -> set[int]:
        """Task input channels whose own recovered input state is still replaying
        (their readers' begun records are in the references, not new state)."""
        if self.inputs is None:
            return set()
        return {self.offsets[g] + c for g, c in self.inputs.channels}

    def close(self) -> None:
        for rec in (self.streams, self.inputs):
            if rec is not None:
                rec.close()
