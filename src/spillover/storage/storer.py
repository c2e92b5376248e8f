"""Storage and Storer: persist a gate's in-flight buffers into one state file.

These are FLIP-76's PersistentInFlightDataStorage and Storer. One :class:`Storage`
belongs to one subtask for one checkpoint; it makes one :class:`Storer` and one
:class:`~spillover.storage.retriever.Retriever` per gate. docs/embedding.md shows
how to use them and docs/format.md specifies the bytes.
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Callable
from types import TracebackType
from typing import Any, Self

from spillover._native import _storage as native
from spillover.errors import ClosedError, ConfigError
from spillover.storage.backends import Backend, backend_for
from spillover.storage.handle import Codec, DataType, GateKind, GateStateHandle, state_file_name
from spillover.storage.options import StorageOptions, check_u32, pure_selected
from spillover.storage.retriever import Retriever
from spillover.storage.shared import StagingBackend

__all__ = ["Storage", "Storer", "open_storage"]


def open_storage(
    uri: str | os.PathLike[str],
    *,
    compression: str | None = None,
    blocking: bool = True,
    checkpoint_id: int = 0,
    subtask_index: int = 0,
    filesystem: Any = None,
    **options: Any,
) -> Storage:
    """Opens the storage directory of one subtask for one checkpoint.

    ``uri`` is a local path, a ``file://`` URI or any URI ``pyarrow.fs`` understands
    (``s3://bucket/ckpt/17/task-3``, ``gs://...``, ``hdfs://...``); ``filesystem`` passes a
    ready pyarrow filesystem instead. Further keywords are :class:`StorageOptions` fields.
    """
    try:
        opts = StorageOptions(compression=compression, blocking=blocking, **options)
    except TypeError as e:
        raise ConfigError(
            "unknown storage option", detail=str(e), hint="see StorageOptions for the options"
        ) from e
    if not 0 <= checkpoint_id < 2**64:
        raise ConfigError(f"checkpoint_id must fit in 64 bits, not {checkpoint_id}")
    if not 0 <= subtask_index < 2**32:
        raise ConfigError(f"subtask_index must fit in 32 bits, not {subtask_index}")
    backend = backend_for(uri, filesystem, opts.defer_create)
    return Storage(backend, opts, checkpoint_id, subtask_index)


class Storage:
    """The in-flight data of one subtask for one checkpoint: one state file per gate."""

    def __init__(
        self, backend: Backend, options: StorageOptions, checkpoint_id: int, subtask_index: int
    ) -> None:
        self.backend = backend
        self.options = options
        self.checkpoint_id = checkpoint_id
        self.subtask_index = subtask_index

    @property
    def uri(self) -> str:
        return self.backend.root

    def create_storer(self, gate_id: int, *, kind: GateKind | str = GateKind.INPUT) -> Storer:
        """A storer for one gate; fails if that gate's file exists already (the pure
        twin's with ``SPILLOVER_PURE=1``, see ``pure.py``)."""
        gk = GateKind.parse(kind)
        check_u32("gate_id", gate_id)
        if pure_selected():
            from spillover.storage import pure  # the twin loads only when asked for

            return pure.PureStorer(  # type: ignore[return-value]
                self.backend,
                state_file_name(gate_id, gk),
                self.options,
                self.checkpoint_id,
                self.subtask_index,
                gate_id,
                gk,
                uuid.uuid4().bytes,
            )
        return Storer(self, gate_id, gk)

    def create_retriever(self, gate_id: int, *, kind: GateKind | str = GateKind.INPUT) -> Retriever:
        """A retriever streaming back one gate's buffers in the order they were stored."""
        gk = GateKind.parse(kind)
        check_u32("gate_id", gate_id)
        name = state_file_name(gate_id, gk)
        if pure_selected():
            from spillover.storage import pure  # the twin loads only when asked for

            return pure.PureRetriever(self.backend, name, self.options)  # type: ignore[return-value]
        return Retriever(self.backend, name, self.options)

    def gates(self) -> list[tuple[GateKind, int]]:
        """The gates that have a state file here, as ``(kind, gate_id)``."""
        found = []
        for name in self.backend.list():
            prefix, _, rest = name.partition("-")
            if rest.endswith(".spill") and prefix in ("in", "out") and rest[:-6].isdigit():
                kind = GateKind.INPUT if prefix == "in" else GateKind.OUTPUT
                found.append((kind, int(rest[:-6])))
        return sorted(found)


class GateFile:
    """The end of a storer's life, shared by the native :class:`Storer` and its
    pure-Python twin: ``discard()`` drops what is queued (``_abandon``) and deletes
    the file unless it was closed; a ``with`` block closes on success and discards
    on an exception. Subclasses set ``_handle``, ``_done``, ``_close_file``,
    ``_backend`` and ``_name``, and give ``close()`` and ``_abandon()``."""

    _handle: GateStateHandle | None
    _done: bool
    _backend: Backend
    _name: str
    _close_file: Callable[[bool], None]

    def close(self) -> GateStateHandle:
        raise NotImplementedError

    def _abandon(self) -> None:
        raise NotImplementedError

    def discard(self) -> None:
        """Drops what is queued and deletes the file (an aborted checkpoint)."""
        if self._handle is not None or self._done:
            return
        self._done = True
        self._abandon()
        try:
            self._close_file(False)
        finally:
            self._backend.delete(self._name)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.discard()


class Storer(GateFile):
    """Persists the buffers of one gate, in append order, into one state file.

    Lifecycle: ``append`` any number of times, then ``close()`` (which returns the
    :class:`GateStateHandle`) or ``discard()``. Used from one thread at a time.

    Buffer ownership: in blocking mode ``append`` keeps a reference to the caller's
    buffer, without copying it, until the batch holding it is written (after at most
    ``batch_bytes`` more, or at ``flush()`` / ``close()``); do not modify it until then
    (if you do, the checksum written with it no longer matches and reading it back
    fails). In non-blocking mode ``append`` copies the buffer and returns; the caller
    may reuse it at once. I/O errors are sticky: they are raised by the next
    ``append``, ``flush`` or ``close``, and what was appended before stays intact
    up to the failure.
    """

    def __init__(self, storage: Storage, gate_id: int, kind: GateKind) -> None:
        opts = storage.options
        self._backend = storage.backend
        self._name = state_file_name(gate_id, kind)
        self.gate_id = gate_id
        self.kind = kind
        self.checkpoint_id = storage.checkpoint_id
        self.subtask_index = storage.subtask_index
        self.uri = self._backend.uri_of(self._name)
        self._fsync = opts.fsync
        self._codec = opts.codec
        self._file_id = uuid.uuid4().bytes
        fd, write, self._close_file = self._backend.create(self._name)
        header = native.encode_state_header(
            self.checkpoint_id,
            self.subtask_index,
            gate_id,
            int(kind),
            int(self._codec),
            self._file_id,
        )
        compress = None
        if self._codec is Codec.LZ4:
            import lz4.block

            compress = lz4.block.compress
        try:
            self._native = native.NativeStorer(
                fd,
                write,
                header,
                self._file_id,
                compress,
                opts.batch_bytes,
                0 if opts.blocking else opts.pool_bytes,
                self.uri,
            )
        except BaseException:
            self._close_file(False)
            self._backend.delete(self._name)
            raise
        self._handle: GateStateHandle | None = None
        self._done = False
        if isinstance(self._backend, StagingBackend):
            self._native.staged = True
            bound = self._backend.memory_limit(self._name)
            if bound:  # staged in memory: moved to a file, once, before it passes its bound
                self._native.set_bound(bound, functools.partial(self._backend.spill, self._name))
        # Binding the native method skips one Python frame per buffer.
        self.append = self._native.append  # type: ignore[method-assign]

    def append(self, channel_id: int, buffer: Any, data_type: int = DataType.DATA) -> None:
        """Stores one buffer of ``channel_id`` (data or event); see the class for ownership."""
        self._native.append(channel_id, buffer, data_type)

    def flush(self) -> None:
        """Writes everything appended so far and releases the held buffers."""
        self._native.flush()

    def submit(self) -> None:
        """Blocking mode: starts writing what was appended so far without waiting for
        it; pair with ``reap()`` to give buffers back as soon as they are written."""
        self._native.submit()

    def reap(self) -> None:
        """Blocking mode: releases the held buffers of everything already written."""
        self._native.reap()

    @property
    def frames(self) -> int:
        return int(self._native.frames)

    @property
    def raw_bytes(self) -> int:
        return int(self._native.raw_bytes)

    def close(self) -> GateStateHandle:
        """Writes the trailer, waits until every byte is stored (fsynced if asked) and
        returns the handle. Closing again returns the same handle."""
        if self._handle is not None:
            return self._handle
        if self._done:
            raise ClosedError("storer was discarded", path=self.uri)
        self._done = True
        try:
            size = self._native.finish(self._fsync)
        except BaseException:
            self._close_file(False)
            raise
        self._close_file(self._fsync)
        n = self._native
        self._handle = GateStateHandle(
            uri=self.uri,
            gate_id=self.gate_id,
            gate_kind=self.kind,
            checkpoint_id=self.checkpoint_id,
            subtask_index=self.subtask_index,
            file_id=self._file_id.hex(),
            size=int(size),
            frame_count=int(n.frames),
            raw_bytes=int(n.raw_bytes),
            stored_bytes=int(n.stored_bytes),
            codec=self._codec,
            format_version=native.FORMAT_VERSION,
            channels={int(k): (int(v[0]), int(v[1])) for k, v in n.channels.items()},
            channel_ranges={int(k): (int(v[0]), int(v[1])) for k, v in n.channel_ranges.items()},
        )
        return self._handle

    def _abandon(self) -> None:
        self._native.discard()
