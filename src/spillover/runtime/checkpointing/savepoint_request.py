"""A savepoint taken without stopping the job: a checkpoint triggered on request and
exported once it completes, while it cannot yet be subsumed (Flink's
``triggerSavepoint``). The request is a small future any thread can wait on."""

from __future__ import annotations

import threading
from collections.abc import Callable

from spillover.runtime.network.events import BarrierKind


class SavepointFailedError(RuntimeError):
    """The savepoint's checkpoint was aborted, or exporting it failed."""


class SavepointRequest:
    """Asks the coordinator for one checkpoint of barrier ``kind``. Once it completes
    the coordinator calls :meth:`completed` and keeps the checkpoint (and what it
    references) while the request is :attr:`exporting`; ``export(checkpoint_id)``
    then copies it on a thread of its own, not the coordinator's (a copy to an
    object store takes long), and returns the savepoint's path. Without ``export``
    the owner ends the request with :meth:`succeeded` or :meth:`failed` (a stop's
    savepoint, exported by the job master). :meth:`wait` gives the path or raises
    :class:`SavepointFailedError`."""

    def __init__(self, kind: BarrierKind, export: Callable[[int], str] | None = None) -> None:
        self.kind = kind
        self._export = export
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._checkpoint_id: int | None = None
        self.path: str | None = None
        self.error: str | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def exporting(self) -> int | None:
        """The completed checkpoint being exported, None before it completed or once
        the export ended: what must not be deleted meanwhile."""
        return None if self.done else self._checkpoint_id

    def completed(self, checkpoint_id: int) -> None:
        """The checkpoint completed (the coordinator's thread): starts its export."""
        self._checkpoint_id = checkpoint_id
        export = self._export
        if export is None:
            return

        def run() -> None:
            try:
                path = export(checkpoint_id)
            except Exception as e:  # the checkpoint stands; only its export failed
                self.failed(f"exporting checkpoint {checkpoint_id} failed: {type(e).__name__}: {e}")
            else:
                self.succeeded(path)

        threading.Thread(target=run, name=f"savepoint-export-{checkpoint_id}", daemon=True).start()

    def succeeded(self, path: str) -> None:
        with self._lock:
            if not self.done:
                self.path = path
                self._done.set()

    def failed(self, reason: str) -> None:
        with self._lock:
            if not self.done:
                self.error = reason
                self._done.set()

    def wait_done(self, timeout: float | None = None) -> bool:
        """Waits until it succeeded or failed; whether it did in time."""
        return self._done.wait(timeout)

    def wait(self, timeout: float | None = None) -> str:
        if not self._done.wait(timeout):
            raise TimeoutError("the savepoint did not complete in time")
        if self.path is None:
            raise SavepointFailedError(self.error or "the savepoint failed")
        return self.path
