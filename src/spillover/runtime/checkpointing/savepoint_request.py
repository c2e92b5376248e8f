"""A savepoint taken without stopping the job: a checkpoint triggered on request and
exported once it completes, while it cannot yet be subsumed (Flink's
``triggerSavepoint``). The request is a small future any thread can wait on."""

from __future__ import annotations

import threading
from collections.abc import Callable


class SavepointFailedError(RuntimeError):
    """The savepoint's checkpoint was aborted, or exporting it failed."""


class SavepointRequest:
    """Asks the coordinator for one checkpoint of barrier ``kind`` (events.BarrierKind)
    and calls ``export(checkpoint_id)`` on the coordinator's thread once its metadata
    is written, before retention may delete it; ``export`` returns the savepoint's
    path. :meth:`wait` gives that path or raises :class:`SavepointFailedError`."""

    def __init__(self, kind: int, export: Callable[[int], str]) -> None:
        self.kind = kind
        self._export = export
        self._done = threading.Event()
        self.checkpoint_id: int | None = None
        self.path: str | None = None
        self.error: str | None = None

    def triggered(self, checkpoint_id: int) -> None:
        self.checkpoint_id = checkpoint_id

    def completed(self, checkpoint_id: int) -> None:
        try:
            self.path = self._export(checkpoint_id)
        except Exception as e:  # the checkpoint stands; only its export failed
            self.error = f"exporting checkpoint {checkpoint_id} failed: {type(e).__name__}: {e}"
        self._done.set()

    def failed(self, reason: str) -> None:
        if not self._done.is_set():
            self.error = reason
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> str:
        if not self._done.wait(timeout):
            raise TimeoutError("the savepoint did not complete in time")
        if self.path is None:
            raise SavepointFailedError(self.error or "the savepoint failed")
        return self.path
