"""Unaligned checkpoints of one task: persisting in-flight buffers through the engine.

When the first barrier of checkpoint n reaches a task (on the priority path, or
when an aligned-with-timeout checkpoint switches), the task snapshots its
operators at once and forwards the barrier at the head of every output queue.
The checkpoint then also holds:

- output state: the data buffers the forwarded barrier overtook in each output
  queue (``broadcast_event(priority=True)`` hands them back);
- input state: per input channel, the bytes of a record the task had begun
  reading, then every buffer the task processes from that channel until the
  channel's own barrier n arrives (a channel whose barrier already came adds
  nothing more).

Each record stream thus replays as "this task's input state for the channel,
then the upstream's output state for it", which is also how rescaling reads it.
Buffers go to the storer without a copy (``OnRelease`` returns them to their
pool once written); the writer thread does the I/O.

A bound on in-flight data (``max_inflight_bytes``): once a task has persisted
that many bytes of input state for checkpoint n, it blocks the channels whose
barrier has not come, as an aligned checkpoint would, so it persists no more.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spillover.storage import OnRelease, Storage, Storer, open_storage


class ChannelStateWriter:
    """The in-flight buffers of one subtask for one checkpoint.

    Appends come from the task thread; ``close`` (from the task's snapshot thread,
    once the task stopped appending) finishes the files and returns JSON-able
    handles. Input gate ``k`` holds the channels of the task's ``k``-th input edge,
    one per upstream subtask; output gate ``p`` holds the subpartitions of the
    task's ``p``-th result partition (one per downstream subtask). That is the
    layout rescaling reads (docs/rescaling.md).
    """

    def __init__(self, uri: str, checkpoint_id: int, subtask: int, compression: str | None) -> None:
        self.uri = uri
        self._storage: Storage = open_storage(
            uri, checkpoint_id=checkpoint_id, subtask_index=subtask, compression=compression
        )
        self._inputs: dict[int, Storer] = {}
        self._outputs: dict[int, Storer] = {}
        self.input_bytes = 0
        self.output_bytes = 0
        self.closed = False

    def _append(self, storer: Storer, channel: int, buffer: Any, submit: bool = True) -> None:
        """Zero-copy for network buffers: retained now, released once written."""
        release = getattr(buffer, "release", None)
        if release is None:
            storer.append(channel, buffer)
            return
        buffer.retain()
        try:
            storer.append(channel, OnRelease(buffer, release))
        except BaseException:
            release()
            raise
        # A held network buffer holds its channel's credit: write it now, not when a
        # batch fills, and give it back as soon as it is written (see reap). Many
        # buffers appended at once (a snapshot's output state) go as one batch.
        if submit:
            storer.submit()

    def submit(self) -> None:
        """Starts writing everything appended so far (after appends with submit=False)."""
        for s in [*self._inputs.values(), *self._outputs.values()]:
            s.submit()

    def reap(self) -> None:
        """Gives back the network buffers already written (the task calls it often)."""
        for s in [*self._inputs.values(), *self._outputs.values()]:
            s.reap()

    def add_input(self, gate: int, channel: int, buffer: Any, submit: bool = True) -> None:
        storer = self._inputs.get(gate)
        if storer is None:
            storer = self._inputs[gate] = self._storage.create_storer(gate, kind="input")
        self._append(storer, channel, buffer, submit)
        self.input_bytes += len(buffer)

    def add_output(
        self, partition: int, subpartition: int, buffer: Any, submit: bool = True
    ) -> None:
        storer = self._outputs.get(partition)
        if storer is None:
            storer = self._outputs[partition] = self._storage.create_storer(
                partition, kind="output"
            )
        self._append(storer, subpartition, buffer, submit)
        self.output_bytes += len(buffer)

    @property
    def bytes(self) -> int:
        return self.input_bytes + self.output_bytes

    def close(self) -> dict[str, Any]:
        """Finishes every file; ``{"input": [...], "output": [...], "bytes": n}``."""
        self.closed = True
        inputs = [s.close().to_dict() for _, s in sorted(self._inputs.items())]
        outputs = [s.close().to_dict() for _, s in sorted(self._outputs.items())]
        return {"input": inputs, "output": outputs, "bytes": self.bytes}

    def discard(self) -> None:
        """Drops everything (the checkpoint was aborted); buffers go back to their pools."""
        self.closed = True
        for s in [*self._inputs.values(), *self._outputs.values()]:
            s.discard()


@dataclass
class InFlightCheckpoint:
    """A task's unaligned checkpoint while its input state is still being persisted."""

    checkpoint_id: int
    writer: ChannelStateWriter
    pending: set[int]  # input channels whose barrier has not come yet
    trigger_ms: int
    started: float
    max_inflight_bytes: int | None = None
    limited: bool = False  # the bound was reached: pending channels are blocked
    metrics: dict[str, float] = field(default_factory=dict)
    # Recovered input state not yet replayed, referenced in old files (recovery.py).
    references: list[dict[str, Any]] = field(default_factory=list)
    recovering: bool = False  # taken while recovered input state was being replayed

    @property
    def done(self) -> bool:
        return not self.pending

    def over_limit(self) -> bool:
        return (
            self.max_inflight_bytes is not None
            and not self.limited
            and self.writer.input_bytes >= self.max_inflight_bytes
        )
