"""Channel state: the in-flight buffers a subtask persists for one checkpoint,
written through the engine's ``Storer`` (the one place a task's input or output
buffer becomes channel state), and its no-op twin for jobs that take no
checkpoints.

**Few files per checkpoint** (issue 15). One file per gate of every subtask makes
thousands of small files per checkpoint at a thousand subtasks, which object
stores and metadata servers charge for. As Flink's
``execution.checkpointing.unaligned.max-subtasks-per-channel-state-file`` does,
the subtasks of one process form groups of at most N (a
:class:`ChannelStateGroup`, made by :func:`channel_state_groups`), and the gates
of a group's subtasks share one file per checkpoint,
``chk-<id>/channels/<first member>.spill``. N = 1 keeps one file per gate under
each subtask's directory, as before.

Each gate is a whole format-v1 section of the shared file, so every reader of
format v1 reads it given the section's offset and size (the handle carries both).
Subtasks close their gates at their own times, and a section's offset is known only
when it closes, so a gate is staged while it grows, by the storer's writer thread
(network buffers go back as soon as written): in memory (a ``memfd``) or, without
memory staging, in an unlinked temporary file under ``io.tmp.dirs``. ``close``
finishes a subtask's gates and writes them with their index entries into the
group's file in one native call, outside the file's lock once their places are
taken (:meth:`~spillover.storage.shared.SharedFile.append_all`): the bytes reach the
shared file once, and subtasks closing together copy side by side. Staging rather
than a writer thread per group that interleaves buffers (Flink's choice) keeps each
gate's frames contiguous, so the channel index and ranged reads work unchanged
and a failed gate never leaves half a section a handle names. A failure of one
subtask's part still declines only that checkpoint.

On an object store (``s3://``, ``gs://``: no appends) the group's gates are staged
the same way, and the group publishes one object per checkpoint once its parts
are settled; a part's ``close`` (and so its acknowledgement) waits for that
publish, and a part that fails or is discarded declines the checkpoint for the
whole group (:class:`~spillover.storage.shared_objects.SharedObjects`).

**Each task writes its gates' channel index entries** (metadata version 3,
docs/format.md "Channel index"): a gate's per-channel maps, encoded as one entry,
follow its section in the group's shared file or object (its index section), and
the entries of gates in files of their own go into one small object per subtask,
``<subtask dir>/channels/_index``. The acknowledgement names each entry by URI,
offset and length and never carries its bytes, so the coordinator's work per
checkpoint grows with the gates, not with their channels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Sequence
from operator import methodcaller
from typing import Any, Protocol

from spillover.errors import SpilloverError
from spillover.runtime.network.buffers import NetworkBuffer, append_zero_copy
from spillover.storage import Storage, StorageOptions, Storer
from spillover.storage.backends import backend_for
from spillover.storage.channel_index import INDEX_OBJECT, encode_entry
from spillover.storage.handle import GateStateHandle, IndexRef, state_file_name
from spillover.storage.location import Location
from spillover.storage.shared import SharedFile, StagingBackend, on_local_disk
from spillover.storage.shared_objects import PUBLISH_WAIT, SharedObjects

Closed = tuple[GateStateHandle, bytes]
"""A closed gate's handle and its encoded channel index entry."""


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

    def close(self, quick: bool = False) -> dict[str, Any] | None: ...

    def discard(self) -> None: ...


QUICK_CLOSE_BYTES = 1 << 20
"""Channel state of at most this many bytes, staged for a shared file on a local
disk, may be finished on the task thread when its inputs' barriers are in (a few
writes and one copy into the shared file, well under a millisecond) instead of
being handed to the channel-state thread: waking that thread cost 1-2 ms of the
acknowledgement on a busy worker. Only if nothing could make it wait long: the
group's file is not on a network filesystem (parts copy into it side by side and
take its lock only to count their places, :meth:`SharedFile.append_all`)
(``close(quick=True)``). Everything else still goes to the thread, so the task
never waits for storage."""


class ChannelStateWriter:
    """The in-flight buffers of one subtask for one checkpoint.

    Appends come from the task thread; ``close`` (from the task's channel-state thread,
    once the task stopped appending) finishes the files and returns JSON-able
    handles. Input gate ``k`` holds the channels of the task's ``k``-th input edge,
    one per upstream subtask; output gate ``p`` holds the subpartitions of the
    task's ``p``-th result partition (one per downstream subtask). That is the
    layout rescaling reads (docs/rescaling.md).
    """

    def __init__(
        self,
        uri: str | Location,
        checkpoint_id: int,
        subtask: int,
        compression: str | None,
        shared: tuple[SharedFile | SharedObjects, str | None] | None = None,
        member: tuple[str, int] | None = None,
    ) -> None:
        # A Location is used as it is: parsing a remote URI again may ask the network.
        self._where = uri if isinstance(uri, Location) else None
        self.uri = uri.uri if isinstance(uri, Location) else uri
        self._args = (checkpoint_id, subtask, compression)
        self._storage: Storage | None = None
        # (the group's file, the staging directory): gates are staged there and
        # appended to the shared file as they close (see the module docstring).
        self._shared = shared
        self._staging: StagingBackend | None = None
        self._inputs: dict[int, Storer] = {}
        self._outputs: dict[int, Storer] = {}
        self._part_closed = False  # handed to the group's object (SharedObjects)
        self._member = member  # (uid, subtask): who this part is, in its group
        self.input_bytes = 0
        self.output_bytes = 0
        self.closed = False
        # Gates opened ahead (prepare): those still without a frame are dropped at close.
        self._ahead: list[tuple[str, int]] = []
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
                    if self._shared is not None:
                        self._staging = StagingBackend(self._shared[1])
                        opts = StorageOptions(compression=compression)
                        self._storage = Storage(self._staging, opts, cid, subtask)
                    else:
                        # Remote files are created by the writer's I/O thread: the
                        # task thread never waits on remote storage at a barrier.
                        where = self._where or Location.parse(self.uri)
                        opts = StorageOptions(compression=compression, defer_create=not where.local)
                        backend = backend_for(where, defer_create=opts.defer_create)
                        self._storage = Storage(backend, opts, cid, subtask)
                storer = storers[index] = self._storage.create_storer(index, kind=kind)
            except (OSError, SpilloverError) as e:
                self._fail(e)
                return None
        return storer

    @property
    def preparable(self) -> bool:
        """Whether its gates may be opened ahead (:meth:`prepare`): they are staged for a
        group's shared file on a local disk, so opening one writes nothing the
        checkpoint's directory holds until it closes. Not gates in files of their own
        (opened, each is a file there), nor a part of an object store's group object
        (one dropped unused would decline the group's checkpoint)."""
        return self._shared is not None and isinstance(self._shared[0], SharedFile)

    def gates(self) -> list[tuple[str, int]]:
        """The gates opened so far, ``("input" or "output", index)`` each (those it
        wrote, once closed)."""
        return [("input", i) for i in sorted(self._inputs)] + [
            ("output", i) for i in sorted(self._outputs)
        ]

    def prepare(self, gates: Sequence[tuple[str, int]]) -> bool:
        """Opens the storers of ``gates`` (``("input" or "output", index)`` each) now,
        before the checkpoint reaches the task, so that its barrier finds them open; a
        gate opened so that gets nothing is dropped at close, as if never opened.
        False if storage failed (the writer is then failed: discard it)."""
        for kind, index in gates:
            storers = self._of_kind(kind)
            if index not in storers:
                if self._storer(storers, index, kind) is None:
                    return False
                self._ahead.append((kind, index))
        return True

    def _of_kind(self, kind: str) -> dict[int, Storer]:
        return self._inputs if kind == "input" else self._outputs

    def _drop_unused_ahead(self) -> None:
        """Discards the gates opened ahead that got no frame (their staged files too):
        counted by the storers, so appends pay nothing for it."""
        for kind, index in self._ahead:
            storers = self._of_kind(kind)
            if storers[index].frames == 0:
                storers.pop(index).discard()
        self._ahead.clear()

    def _append(self, storer: Storer, channel: int, buffer: Any, submit: bool = True) -> None:
        """Zero-copy for network buffers: retained now, released once written."""
        try:
            self._append_now(storer, channel, buffer, submit)
        except (OSError, SpilloverError) as e:
            self._fail(e)

    def _append_now(self, storer: Storer, channel: int, buffer: Any, submit: bool) -> None:
        if not isinstance(buffer, NetworkBuffer):
            storer.append(channel, buffer)
            return
        append_zero_copy(storer, channel, buffer.retain())
        # A held network buffer holds its channel's credit: write it now, not when a
        # batch fills, and give it back as soon as it is written (see reap). Many
        # buffers appended at once (a snapshot's output state) go as one batch.
        if submit:
            storer.submit()

    def submit(self) -> None:
        """Starts writing everything appended so far (after appends with submit=False)."""
        self._each(methodcaller("submit"))

    def reap(self) -> None:
        """Gives back the network buffers already written (the task calls it often)."""
        self._each(methodcaller("reap"))

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

    def close(self, quick: bool = False) -> dict[str, Any] | None:
        """Finishes every file; ``{"input": [...], "output": [...], "bytes": n}``; raises
        what failed the checkpoint's storage before, if anything did. With ``quick``
        only if that cannot wait on storage (see :data:`QUICK_CLOSE_BYTES`); None,
        having done nothing, if it could."""
        if not quick or self.failed is not None:
            return self._close()
        shared = self._shared[0] if self._shared is not None else None
        if not isinstance(shared, SharedFile) or self.bytes > QUICK_CLOSE_BYTES or not shared.local:
            return None  # an object store's part waits for the group's publish
        return self._close()

    def _close(self) -> dict[str, Any]:
        self.closed = True
        if self.failed is not None:
            raise self.failed
        try:
            if self._ahead:
                self._drop_unused_ahead()
            if self._shared is not None and isinstance(self._shared[0], SharedObjects):
                inputs, outputs = self._publish(self._shared[0])
            else:
                storers = [s for _, s in sorted(self._inputs.items())]
                storers += [s for _, s in sorted(self._outputs.items())]
                closed = self._index_object(self._finish(storers))
                handles = [gate_entry(h) for h, _ in closed]
                inputs, outputs = handles[: len(self._inputs)], handles[len(self._inputs) :]
        except BaseException:
            # The gates after the one that failed were never closed: their writers
            # still hold descriptors, staged files and network buffers (credit).
            # Nobody discards a writer whose close raised, so let go of them now.
            with contextlib.suppress(Exception):
                self.discard()
            raise
        return {"input": inputs, "output": outputs, "bytes": self.bytes}

    def _publish(self, objects: SharedObjects) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Closes every gate, hands the staged sections to the group's object and waits
        until it is published (an object store: docs/scaling.md)."""
        gates = [*sorted(self._inputs.items()), *sorted(self._outputs.items())]
        sections = []
        entries = []
        try:
            for _, storer in gates:
                handle = storer.close()
                assert self._staging is not None
                name = state_file_name(handle.gate_id, handle.gate_kind)
                sections.append((self._staging.take(name), handle))
                entries.append(encode_entry(handle))
        except BaseException as e:
            for staged, _ in sections:
                staged.close()
            self._part_closed = True
            objects.fail(e)  # the group publishes nothing of this checkpoint
            raise
        self._part_closed = True  # the object owns the staged files now
        handles = [gate_entry(h) for h in objects.close(sections, self._member, entries)]
        return handles[: len(self._inputs)], handles[len(self._inputs) :]

    def _finish(self, storers: list[Storer]) -> list[Closed]:
        """Closes the gates and encodes their channel index entries; staged gates join
        the group's shared file together, each entry right after its section (the
        handle names it), in one append (one release of the GIL)."""
        closed = []
        for storer in storers:
            handle = storer.close()
            closed.append((handle, encode_entry(handle)))
        if self._shared is None or self._staging is None or not closed:
            return closed
        shared = self._shared[0]
        assert isinstance(shared, SharedFile)
        staging = self._staging
        staged = [staging.take(state_file_name(h.gate_id, h.gate_kind)) for h, _ in closed]
        try:
            sections = shared.append_all(
                [(f, h, e) for f, (h, e) in zip(staged, closed, strict=True)], empty=True
            )
        except BaseException:
            for f in staged:
                f.close()
            raise
        for f in staged:
            staging.recycle(f)  # emptied: it stages another gate next time
        return [(section, e) for section, (_, e) in zip(sections, closed, strict=True)]

    def _index_object(self, closed: list[Closed]) -> list[Closed]:
        """Gates in files of their own (no index section) get their entries written
        into the subtask's index object, ``channels/_index``, one after another."""
        alone = [i for i, (h, _) in enumerate(closed) if h.index is None]
        if not alone:
            return closed
        target = (self._where or Location.parse(self.uri)).child(INDEX_OBJECT)
        out = list(closed)
        at = 0
        for i in alone:
            handle, entry = closed[i]
            ref = IndexRef(target.uri, at, len(entry))
            out[i] = (dataclasses.replace(handle, index=ref), entry)
            at += len(entry)
        target.publish(b"".join(closed[i][1] for i in alone), what="channel index")
        return out

    def discard(self) -> None:
        """Drops everything (the checkpoint was aborted); buffers go back to their pools.
        A part of an object store's group object that had not closed declines the
        checkpoint for the whole group (:meth:`SharedObjects.fail`)."""
        self.closed = True
        objects = self._shared[0] if self._shared is not None else None
        if isinstance(objects, SharedObjects) and not self._part_closed:
            self._part_closed = True
            objects.fail(self.failed)
        for s in [*self._inputs.values(), *self._outputs.values()]:
            s.discard()
        if self._staging is not None:  # gates closed but not yet appended
            for name in self._staging.list():
                self._staging.delete(name)


def gate_entry(handle: GateStateHandle) -> dict[str, Any]:
    """What a subtask's acknowledgement carries for one closed gate (the one place
    a handle becomes part of an ``Ack``): the handle without its per-channel maps,
    naming the channel index entry the task wrote for them (``handle.index``; see
    the module docstring). The metadata grows with gates, not channels, and the
    task, not the driver, pays for encoding and writing the maps."""
    if handle.index is None:
        raise ValueError(f"gate {handle.uri} has no channel index entry written")
    return dataclasses.replace(handle, channels={}, channel_ranges={}).to_dict()


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

    def close(self, quick: bool = False) -> dict[str, Any] | None:
        return {"input": [], "output": [], "bytes": 0}

    def discard(self) -> None:
        pass


CheckpointDir = Callable[[int, str, int], str]
"""``(checkpoint id, operator uid, subtask)`` -> the subtask's checkpoint directory URI."""


class ChannelStateGroup:
    """Subtasks of one process whose channel state shares one file per checkpoint
    (at most ``execution.checkpointing.unaligned.max-subtasks-per-channel-state-file``).

    ``directory(checkpoint id)`` is the checkpoint's directory; the group's file is
    ``<it>/channels/<name>.spill``, ``name`` its first member's ``<uid>-<subtask>``,
    unique within the checkpoint. ``staging`` is where gates wait until they close.
    """

    KEPT = 16  # checkpoints whose files a group remembers (a late gate of an older
    # one meets its existing file and fails: that checkpoint is long declined)

    def __init__(
        self,
        name: str,
        members: Sequence[tuple[str, int]],
        directory: Callable[[int], str],
        staging: str | None = None,
        publish_wait: float = PUBLISH_WAIT,
    ) -> None:
        self.name = name
        self.members = tuple(members)
        self.directory = directory
        self.staging = staging
        self.publish_wait = publish_wait
        self._files: dict[int, SharedFile | SharedObjects] = {}
        self._left: set[tuple[str, int]] = set()  # members whose task ended
        self._lock = threading.Lock()
        # Whether the checkpoints' directories are on a local disk: asked once, as
        # every checkpoint's directory lies under the same root.
        self._local: bool | None = None

    @property
    def shared(self) -> bool:
        return len(self.members) > 1

    def file(self, checkpoint_id: int) -> SharedFile | SharedObjects | None:
        """The group's file of one checkpoint: a :class:`SharedFile` on a local
        filesystem, :class:`SharedObjects` on any other (an object store, published
        once its parts are settled); None for a group of one."""
        if not self.shared:
            return None
        with self._lock:
            f = self._files.get(checkpoint_id)
            if f is None:
                where = Location.parse(self.directory(checkpoint_id)).child("channels")
                if not where.local:
                    f = SharedObjects(where, self.name, len(self.members), self.publish_wait)
                    for member in self._left:
                        f.leave(member)
                else:
                    if self._local is None:
                        self._local = on_local_disk(where.path)
                    f = SharedFile(where, f"{self.name}.spill", local=self._local)
                self._files[checkpoint_id] = f
                for old in sorted(self._files)[: -self.KEPT]:
                    del self._files[old]
            return f

    def leave(self, member: tuple[str, int]) -> None:
        """``member``'s task ended: on an object store the group's objects, of this
        checkpoint and later ones, stop waiting for its parts."""
        with self._lock:
            self._left.add(member)
            objects = [f for f in self._files.values() if isinstance(f, SharedObjects)]
        for f in objects:
            f.leave(member)


def channel_state_groups(
    tasks: Sequence[tuple[str, int]],
    per_file: int,
    directory: Callable[[int], str],
    staging: str | None = None,
    publish_wait: float = PUBLISH_WAIT,
) -> dict[tuple[str, int], ChannelStateGroup]:
    """Groups the subtasks one process hosts, in the order given, ``per_file`` at a
    time: ``{(uid, subtask): its group}``. ``per_file`` 1 shares nothing.
    ``publish_wait``: on an object store, how long a group's object waits for late
    members (:data:`~spillover.storage.shared_objects.PUBLISH_WAIT`)."""
    if per_file < 1:
        raise ValueError(f"per_file must be at least 1, not {per_file}")
    groups: dict[tuple[str, int], ChannelStateGroup] = {}
    for start in range(0, len(tasks), per_file):
        members = tasks[start : start + per_file]
        uid, subtask = members[0]
        group = ChannelStateGroup(f"{uid}-{subtask}", members, directory, staging, publish_wait)
        for m in members:
            groups[m] = group
    return groups


def open_channel_state(
    checkpoint_dir: CheckpointDir | None,
    checkpoint_id: int,
    uid: str,
    subtask: int,
    compression: str | None,
    group: ChannelStateGroup | None = None,
) -> ChannelState:
    """The channel state of one subtask for one checkpoint: its gates are sections of
    its ``group``'s shared file, or files under ``<subtask dir>/channels`` (the
    directory's query string, e.g. an S3 endpoint, kept) when the group shares
    nothing; :class:`NoChannelState` when the job has no checkpoint storage."""
    if checkpoint_dir is None:
        return NoChannelState()
    where = Location.parse(checkpoint_dir(checkpoint_id, uid, subtask)).child("channels")
    shared = group.file(checkpoint_id) if group is not None else None
    if shared is not None and group is not None:
        return ChannelStateWriter(
            where.uri, checkpoint_id, subtask, compression, (shared, group.staging), (uid, subtask)
        )
    return ChannelStateWriter(where, checkpoint_id, subtask, compression)
