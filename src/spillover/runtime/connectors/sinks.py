"""Built-in sinks: an in-memory collector for tests, a pacing sink that creates
backpressure on purpose, and a Parquet writer; the first and the last commit
their output exactly once through a two-phase commit.

Two-phase commit, as both transactional sinks do it:

1. Records go into the subtask's open *transaction* (staged, invisible).
2. ``snapshot(c)`` pre-commits it: the transaction becomes *pending for c*, and
   the operator state lists every pending transaction not yet committed (those
   of ``c`` and of earlier checkpoints whose completion was not notified, or
   that were aborted). A new transaction starts with the next record.
3. ``notify_checkpoint_complete(c)`` commits every pending transaction of a
   checkpoint ``<= c``, in checkpoint order; committing twice is a no-op.
4. ``restore(state)``: the restored checkpoint completed, so every transaction
   its state lists is committed (it may already be); staged data of this
   subtask that the state does not list was written after the checkpoint by the
   failed attempt, and is discarded.
5. ``finish()`` commits nothing: the data written after the last checkpoint is
   committed by the final checkpoint the runtime takes at end of input, once it
   completes. A job that ends without one leaves that data staged, never visible.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from spillover.errors import ConfigError, StateFileNotFoundError, StorageError
from spillover.runtime.api import Batch, Operator, OperatorContext, OperatorSnapshot
from spillover.runtime.connectors.sources import byte_matrix, filesystem_for

__all__ = [
    "CollectingSink",
    "ParquetSink",
    "ThrottledSink",
    "batch_to_arrow",
]


def _pending_state(pending: dict[int, list[str]]) -> dict[str, list[str]]:
    return {str(c): list(names) for c, names in sorted(pending.items())}


def _pending_from_state(state: Any) -> dict[int, list[str]]:
    return {int(c): [str(n) for n in names] for c, names in dict(state["pending"]).items()}


class _Collected:
    """The process-global store of :class:`CollectingSink`: committed batches per
    subtask, staged transactions, and the ids of committed transactions."""

    def __init__(self) -> None:
        self.committed: dict[int, list[Batch]] = {}
        self.staged: dict[str, tuple[int, list[Batch]]] = {}
        self.done: set[str] = set()


class CollectingSink(Operator):
    """Keeps every record in memory, visible through :meth:`results` once committed.

    Exactly-once by default: a subtask's records become visible when a completed
    checkpoint covers them (see the module docstring for the protocol); the
    staged transactions live in a process-global store next to the results and
    the operator state only names them, so it suits the in-process executor.
    ``immediate=True`` makes every batch visible at once (at-least-once after a
    failure: replayed records show up twice), for debugging.
    """

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _stores: ClassVar[dict[str, _Collected]] = {}
    _txn_ids: ClassVar[itertools.count[int]] = itertools.count()

    def __init__(self, name: str, *, immediate: bool = False) -> None:
        self.name = name
        self.immediate = immediate

    @classmethod
    def _store(cls, name: str) -> _Collected:
        store = cls._stores.get(name)
        if store is None:
            store = cls._stores[name] = _Collected()
        return store

    @classmethod
    def results(cls, name: str) -> dict[int, list[Batch]]:
        """Committed batches per subtask index, in commit order."""
        with cls._lock:
            store = cls._stores.get(name)
            return {} if store is None else {s: list(b) for s, b in store.committed.items()}

    @classmethod
    def records(cls, name: str, dtype: npt.DTypeLike | None = None) -> Batch:
        """Every committed record of every subtask as one array (subtask order).

        ``dtype`` gives the empty result its dtype when nothing was committed.
        """
        batches = [b for _, bs in sorted(cls.results(name).items()) for b in bs]
        if not batches:
            return np.empty(0, dtype=np.dtype([]) if dtype is None else np.dtype(dtype))
        return np.concatenate(batches)

    @classmethod
    def staged_records(cls, name: str) -> int:
        """How many records are staged and not (yet) committed."""
        with cls._lock:
            store = cls._stores.get(name)
            staged = [] if store is None else store.staged.values()
            return sum(len(b) for _, batches in staged for b in batches)

    @classmethod
    def clear(cls, name: str) -> None:
        """Forgets everything of ``name``: committed, staged and pending."""
        with cls._lock:
            cls._stores.pop(name, None)

    def open(self, ctx: OperatorContext) -> None:
        super().open(ctx)
        self._txn: str | None = None
        self._pending: dict[int, list[str]] = {}

    def process(self, batch: Batch, input_index: int = 0) -> None:
        if not len(batch):
            return
        kept = batch.copy()  # the caller may reuse its batch
        with self._lock:
            store = self._store(self.name)
            if self.immediate:
                store.committed.setdefault(self.ctx.subtask_index, []).append(kept)
                return
            if self._txn is None:
                self._txn = f"{self.ctx.subtask_index}-{self.ctx.attempt}-{next(self._txn_ids)}"
                store.staged[self._txn] = (self.ctx.subtask_index, [])
            store.staged[self._txn][1].append(kept)

    def snapshot(self, checkpoint_id: int) -> OperatorSnapshot:
        if self.immediate:
            return OperatorSnapshot()
        if self._txn is not None:
            self._pending.setdefault(checkpoint_id, []).append(self._txn)
            self._txn = None
        return OperatorSnapshot({"pending": _pending_state(self._pending)})

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        for c in sorted(c for c in self._pending if c <= checkpoint_id):
            self._commit(self._pending.pop(c))

    def restore(self, state: Any) -> None:
        if state is None or self.immediate:
            return
        for _, txns in sorted(_pending_from_state(state).items()):
            self._commit(txns)
        me = self.ctx.subtask_index
        with self._lock:
            store = self._store(self.name)
            for txn in [t for t, (s, _) in store.staged.items() if s == me]:
                del store.staged[txn]

    def restore_rescaled(self, states: list[Any]) -> None:
        """Every old subtask's pending output belongs to a completed checkpoint: commit it
        all (committing twice is a no-op)."""
        for st in states:
            if st is not None and not self.immediate:
                for _, txns in sorted(_pending_from_state(st).items()):
                    self._commit(txns)

    def _commit(self, txns: list[str]) -> None:
        with self._lock:
            store = self._store(self.name)
            for txn in txns:
                if txn in store.done:
                    continue
                if txn not in store.staged:
                    raise StorageError(
                        "staged output of a completed checkpoint is missing",
                        detail=f"sink {self.name!r} transaction {txn}",
                        hint="was CollectingSink.clear() called while the job ran?",
                    )
                subtask, batches = store.staged.pop(txn)
                store.committed.setdefault(subtask, []).extend(batches)
                store.done.add(txn)


class ThrottledSink(Operator):
    """Consumes at most ``rate_per_subtask`` records/s per subtask: after each batch it
    takes no more input until the batch's share of time has passed (``ready_at``;
    outside a pacing task it sleeps), never spinning.

    It backpressures its inputs on purpose. Pacing has no memory of idle time:
    a burst after a pause is paced like any other. ``inner`` (another sink, e.g.
    :class:`CollectingSink`) also receives every batch and every lifecycle call;
    the operator state is the inner sink's. ``clock`` and ``sleep`` are for tests.
    """

    def __init__(
        self,
        rate_per_subtask: float,
        inner: Operator | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not rate_per_subtask > 0:
            raise ConfigError(f"rate_per_subtask must be > 0, got {rate_per_subtask}")
        self.rate = float(rate_per_subtask)
        self.inner = inner
        self.clock = clock
        self.sleep = sleep

    def open(self, ctx: OperatorContext) -> None:
        super().open(ctx)
        self._due: float | None = None
        if self.inner is not None:
            self.inner.open(ctx)

    def process(self, batch: Batch, input_index: int = 0) -> None:
        if self.inner is not None:
            self.inner.process(batch, input_index)
        now = self.clock()
        start = now if self._due is None else max(self._due, now)
        self._due = start + len(batch) / self.rate
        # In a task that honours ready_at, the task waits (taking barriers meanwhile).
        if self._due > now and not self.ctx.pacing:
            self.sleep(self._due - now)

    def ready_at(self) -> float:
        return self._due or 0.0

    def restore(self, state: Any) -> None:
        if self.inner is not None:
            self.inner.restore(state)

    def restore_rescaled(self, states: list[Any]) -> None:
        if self.inner is not None:
            self.inner.restore_rescaled(states)

    def snapshot(self, checkpoint_id: int) -> OperatorSnapshot:
        return OperatorSnapshot() if self.inner is None else self.inner.snapshot(checkpoint_id)

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        if self.inner is not None:
            self.inner.notify_checkpoint_complete(checkpoint_id)

    def notify_checkpoint_aborted(self, checkpoint_id: int) -> None:
        if self.inner is not None:
            self.inner.notify_checkpoint_aborted(checkpoint_id)

    def end_input(self, input_index: int) -> None:
        if self.inner is not None:
            self.inner.end_input(input_index)

    def finish(self) -> None:
        if self.inner is not None:
            self.inner.finish()

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


# ---- Parquet ----


def batch_to_arrow(batch: Batch) -> Any:
    """A structured array as a pyarrow Table, column by column: numeric and bool
    fields keep their type, ``S<n>`` fields become ``fixed_size_binary(n)``."""
    import pyarrow as pa

    batch = np.ascontiguousarray(batch)
    arrays = []
    names = batch.dtype.names or ()
    for name in names:
        field = batch.dtype[name]
        if field.subdtype is not None or field.kind not in "biufSU":
            raise ConfigError(f"field {name!r} of type {field} cannot be written to Parquet")
        if field.kind == "S":
            data = np.ascontiguousarray(byte_matrix(batch, name))
            arrays.append(
                pa.FixedSizeBinaryArray.from_buffers(
                    pa.binary(field.itemsize), len(batch), [None, pa.py_buffer(data)]
                )
            )
        else:
            arrays.append(pa.array(np.ascontiguousarray(batch[name])))
    return pa.Table.from_arrays(arrays, names=list(names))


class ParquetSink(Operator):
    """Writes records to Parquet files under ``directory_uri``, exactly once.

    Each subtask writes an in-progress file in ``<dir>/_staging/`` (readers of
    the directory skip names starting with ``_``), buffering up to
    ``row_group_rows`` rows per row group. ``snapshot(c)`` closes the file (in
    ``finalize``, off the task thread) and makes it pending for ``c``;
    ``notify_checkpoint_complete(c)`` publishes every pending file of a
    checkpoint ``<= c`` by renaming it into ``<dir>/`` (atomic on local disks; a
    copy and delete on object stores), idempotently. ``restore`` publishes the
    restored checkpoint's pending files and deletes this subtask's other staged
    files (left by the failed attempt); so does the first write of an attempt
    > 0 that restored nothing (no checkpoint had completed). See the module
    docstring for the whole protocol. File names:
    ``part-<subtask>-a<attempt>-c<last checkpoint>-<counter>.parquet``.

    ``pyarrow.parquet.read_table(directory)`` reads the committed output.
    """

    def __init__(
        self,
        directory_uri: str,
        *,
        filesystem: Any = None,
        row_group_rows: int = 65536,
        compression: str | None = "snappy",
    ) -> None:
        if row_group_rows < 1:
            raise ConfigError(f"row_group_rows must be >= 1, got {row_group_rows}")
        self.directory_uri = directory_uri
        self.filesystem = filesystem
        self.row_group_rows = row_group_rows
        self.compression = compression

    def open(self, ctx: OperatorContext) -> None:
        super().open(ctx)
        self._fs, root = filesystem_for(self.directory_uri, self.filesystem)
        self._root = root.rstrip("/")
        self._staging = f"{self._root}/_staging"
        self._fs.create_dir(self._staging, recursive=True)
        self._prefix = f"part-{ctx.subtask_index:05d}-"
        self._pending: dict[int, list[str]] = {}
        self._counter = 0
        self._last_checkpoint = 0
        self._cleaned = ctx.attempt == 0
        self._name: str | None = None  # the open transaction's file
        self._writer: Any = None
        self._buffer: list[Batch] = []
        self._buffered = 0

    def process(self, batch: Batch, input_index: int = 0) -> None:
        if not len(batch):
            return
        if self._name is None:
            self._name = self._new_name()
        self._buffer.append(batch.copy())  # the caller may reuse its batch
        self._buffered += len(batch)
        if self._buffered >= self.row_group_rows:
            self._writer = self._write(self._name, self._writer, self._take_buffer())

    def _new_name(self) -> str:
        if not self._cleaned:
            self._delete_staged()
        name = (
            f"{self._prefix}a{self.ctx.attempt:04d}-c{self._last_checkpoint:06d}"
            f"-{self._counter:06d}.parquet"
        )
        self._counter += 1
        return name

    def _take_buffer(self) -> Batch | None:
        if not self._buffer:
            return None
        rows = np.concatenate(self._buffer) if len(self._buffer) > 1 else self._buffer[0]
        self._buffer, self._buffered = [], 0
        return rows

    def _write(self, name: str, writer: Any, rows: Batch | None) -> Any:
        import pyarrow.parquet as pq

        if rows is None:
            return writer
        table = batch_to_arrow(rows)
        if writer is None:
            writer = pq.ParquetWriter(
                f"{self._staging}/{name}",
                table.schema,
                filesystem=self._fs,
                compression=self.compression,
            )
        writer.write_table(table, row_group_size=self.row_group_rows)
        return writer

    def snapshot(self, checkpoint_id: int) -> OperatorSnapshot:
        finalize: Callable[[str], None] | None = None
        if self._name is not None:
            name, writer, rows = self._name, self._writer, self._take_buffer()
            self._pending.setdefault(checkpoint_id, []).append(name)
            self._name, self._writer = None, None

            def close_file(directory_uri: str) -> None:
                self._write(name, writer, rows).close()

            finalize = close_file
        self._last_checkpoint = checkpoint_id
        state = {
            "pending": _pending_state(self._pending),
            "counter": self._counter,
            "checkpoint": checkpoint_id,
        }
        return OperatorSnapshot(state, finalize)

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        for c in sorted(c for c in self._pending if c <= checkpoint_id):
            for name in self._pending[c]:
                self._publish(name)
            del self._pending[c]

    def restore(self, state: Any) -> None:
        if state is None:
            return
        for _, names in sorted(_pending_from_state(state).items()):
            for name in names:
                self._publish(name)
        self._counter = int(state["counter"])
        self._last_checkpoint = int(state["checkpoint"])
        self._delete_staged()

    def restore_rescaled(self, states: list[Any]) -> None:
        """Publishes the pending files of the old subtasks this subtask owns and
        continues the file counter past all of them.

        Old subtask ``j``'s files have exactly one owner, new subtask
        ``j % parallelism``: two new subtasks publishing the same file race on its
        rename (one of them finds the staged file gone). The owner also deletes the
        owned old subtasks' other staged files, as :meth:`restore` does for its own."""
        live = [st for st in states if st is not None]
        if not live:
            return
        me, p = self.ctx.subtask_index, self.ctx.parallelism
        owned = [j for j in range(len(states)) if j % p == me]
        for j in owned:
            if states[j] is None:
                continue
            for _, names in sorted(_pending_from_state(states[j]).items()):
                for name in names:
                    self._publish(name)
        self._counter = max(int(st["counter"]) for st in live)
        self._last_checkpoint = max(int(st["checkpoint"]) for st in live)
        self._delete_staged()
        for j in owned:
            if j != me:
                self._delete_staged(f"part-{j:05d}-")

    def _publish(self, name: str) -> None:
        import pyarrow.fs as pafs

        src, dst = f"{self._staging}/{name}", f"{self._root}/{name}"
        src_info, dst_info = self._fs.get_file_info([src, dst])
        if dst_info.type == pafs.FileType.File:
            if src_info.type == pafs.FileType.File:  # a copy-and-delete move cut short
                self._fs.delete_file(src)
            return
        if src_info.type != pafs.FileType.File:
            raise StateFileNotFoundError(
                "a pending output file of a completed checkpoint is missing",
                path=src,
                hint="the staging directory was changed while the job ran",
            )
        self._fs.move(src, dst)

    def _delete_staged(self, prefix: str | None = None) -> None:
        """Deletes every staged file of this subtask (called before it writes any), or
        of the old subtask whose files start with ``prefix`` (after a rescale)."""
        import pyarrow.fs as pafs

        prefix = prefix or self._prefix
        for info in self._fs.get_file_info(pafs.FileSelector(self._staging, allow_not_found=True)):
            if info.type == pafs.FileType.File and info.base_name.startswith(prefix):
                self._fs.delete_file(info.path)
        self._cleaned = True

    def close(self) -> None:
        # An unfinished file stays in staging; the next attempt's restore deletes it.
        if getattr(self, "_writer", None) is not None:
            self._writer.close()
            self._writer = None
