"""An in-memory sink for tests, exactly once through a two-phase commit.

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
   completes. A job that ends without one leaves that data staged, never visible."""

from __future__ import annotations

import itertools
import threading
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from spillover.errors import StorageError
from spillover.runtime.api import Batch, Operator, OperatorContext, OperatorSnapshot


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

    commits_on_restore = True
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
