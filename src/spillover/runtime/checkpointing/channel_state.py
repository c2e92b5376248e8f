"""Channel state: the in-flight buffers a subtask persists for one checkpoint,
written through the engine's ``Storer`` (the one place a task's input or output
buffer becomes channel state), and its no-op twin for jobs that take no
checkpoints."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

from spillover.errors import SpilloverError
from spillover.storage import OnRelease, Storage, Storer, open_storage
from spillover.storage.location import Location


class ChannelState(Protocol):
    """What a task appends to while an unaligned checkpoint collects in-flight data."""

    input_bytes: int
    output_bytes: int

    def add_input(self, gate: int, channel: int, buffer: Any, submit: bool = True) -> None: ...

    def add_output(
        self, partition: int, subpartition: int, buffer: Any, submit: bool = True
    ) -> None: ...

    def submit(self) -> None: ...

    def reap(self) -> None: ...

    @property
    def bytes(self) -> int: ...

    def close(self) -> dict[str, Any]: ...

    def discard(self) -> None: ...


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
        self._args = (checkpoint_id, subtask, compression)
        self._storage: Storage | None = None
        self._inputs: dict[int, Storer] = {}
        self._outputs: dict[int, Storer] = {}
        self.input_bytes = 0
        self.output_bytes = 0
        self.closed = False
        # Storage failed this checkpoint (a file it could not create or write): later
        # appends are dropped, and close() raises it, so the task declines the
        # checkpoint instead of failing (failing storage costs a checkpoint).
        self.failed: BaseException | None = None

    def _fail(self, e: BaseException) -> None:
        self.failed = e
        with contextlib.suppress(Exception):
            self.discard()
        self.closed = False  # close() still comes, and reports the failure

    def _storer(self, storers: dict[int, Storer], index: int, kind: str) -> Storer | None:
        if self.failed is not None:
            return None
        storer = storers.get(index)
        if storer is None:
            try:
                if self._storage is None:
                    cid, subtask, compression = self._args
                    self._storage = open_storage(
                        self.uri, checkpoint_id=cid, subtask_index=subtask, compression=compression
                    )
                storer = storers[index] = self._storage.create_storer(index, kind=kind)
            except (OSError, SpilloverError) as e:
                self._fail(e)
                return None
        return storer

    def _append(self, storer: Storer, channel: int, buffer: Any, submit: bool = True) -> None:
        """Zero-copy for network buffers: retained now, released once written."""
        try:
            self._append_now(storer, channel, buffer, submit)
        except (OSError, SpilloverError) as e:
            self._fail(e)

    def _append_now(self, storer: Storer, channel: int, buffer: Any, submit: bool) -> None:
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
        self._each(Storer.submit)

    def reap(self) -> None:
        """Gives back the network buffers already written (the task calls it often)."""
        self._each(Storer.reap)

    def _each(self, op: Callable[[Storer], None]) -> None:
        if self.failed is not None:
            return
        try:
            for s in [*self._inputs.values(), *self._outputs.values()]:
                op(s)
        except (OSError, SpilloverError) as e:
            self._fail(e)

    def add_input(self, gate: int, channel: int, buffer: Any, submit: bool = True) -> None:
        storer = self._storer(self._inputs, gate, "input")
        if storer is not None:
            self._append(storer, channel, buffer, submit)
        self.input_bytes += len(buffer)

    def add_output(
        self, partition: int, subpartition: int, buffer: Any, submit: bool = True
    ) -> None:
        storer = self._storer(self._outputs, partition, "output")
        if storer is not None:
            self._append(storer, subpartition, buffer, submit)
        self.output_bytes += len(buffer)

    @property
    def bytes(self) -> int:
        return self.input_bytes + self.output_bytes

    def close(self) -> dict[str, Any]:
        """Finishes every file; ``{"input": [...], "output": [...], "bytes": n}``; raises
        what failed the checkpoint's storage before, if anything did."""
        self.closed = True
        if self.failed is not None:
            raise self.failed
        inputs = [s.close().to_dict() for _, s in sorted(self._inputs.items())]
        outputs = [s.close().to_dict() for _, s in sorted(self._outputs.items())]
        return {"input": inputs, "output": outputs, "bytes": self.bytes}

    def discard(self) -> None:
        """Drops everything (the checkpoint was aborted); buffers go back to their pools."""
        self.closed = True
        for s in [*self._inputs.values(), *self._outputs.values()]:
            s.discard()


class NoChannelState:
    """The twin for a job without checkpoint storage: takes every buffer and keeps
    nothing (no unaligned checkpoint can complete without storage to hold it)."""

    def __init__(self) -> None:
        self.input_bytes = 0
        self.output_bytes = 0

    def add_input(self, gate: int, channel: int, buffer: Any, submit: bool = True) -> None:
        self.input_bytes += len(buffer)

    def add_output(
        self, partition: int, subpartition: int, buffer: Any, submit: bool = True
    ) -> None:
        self.output_bytes += len(buffer)

    def submit(self) -> None:
        pass

    def reap(self) -> None:
        pass

    @property
    def bytes(self) -> int:
        return self.input_bytes + self.output_bytes

    def close(self) -> dict[str, Any]:
        return {"input": [], "output": [], "bytes": 0}

    def discard(self) -> None:
        pass


CheckpointDir = Callable[[int, str, int], str]
"""``(checkpoint id, operator uid, subtask)`` -> the subtask's checkpoint directory URI."""


def open_channel_state(
    checkpoint_dir: CheckpointDir | None,
    checkpoint_id: int,
    uid: str,
    subtask: int,
    compression: str | None,
) -> ChannelState:
    """The channel state of one subtask for one checkpoint: files under
    ``<subtask dir>/channels`` (the directory's query string, e.g. an S3 endpoint,
    kept), or :class:`NoChannelState` when the job has no checkpoint storage."""
    if checkpoint_dir is None:
        return NoChannelState()
    where = Location.parse(checkpoint_dir(checkpoint_id, uid, subtask)).child("channels")
    return ChannelStateWriter(where.uri, checkpoint_id, subtask, compression)
