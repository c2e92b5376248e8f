"""Operators the whole-job tests share."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from spillover.runtime.api import Batch, Operator, OperatorSnapshot
from spillover.runtime.connectors.collecting import CollectingSink
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.failures import FailureInjector, FailureSpec


class SummaryOnFinish(Operator):
    """Forwards its input and, in ``finish()``, emits one summary record (partition
    ``-1 - subtask``, ``seq`` = the records it saw). ``opened`` counts its opens in
    this process, per job name, so a test sees whether a restore ran it again."""

    opened: dict[str, int] = {}  # noqa: RUF012 (a test's process-wide record)
    lock = threading.Lock()

    out_dtype = GeneratorSource.dtype(16)

    def __init__(self, job: str) -> None:
        self.job = job
        self.seen = 0

    def open(self, ctx: Any) -> None:
        super().open(ctx)
        with self.lock:
            self.opened[self.job] = self.opened.get(self.job, 0) + 1

    def restore(self, state: Any) -> None:
        self.seen = int(state["seen"])

    def snapshot(self, checkpoint_id: int) -> Any:
        return OperatorSnapshot({"seen": self.seen})

    def process(self, batch: Batch, input_index: int) -> None:
        self.seen += len(batch)
        self.ctx.output.emit(batch)

    def finish(self) -> None:
        summary = np.zeros(1, dtype=self.out_dtype)
        summary["partition"] = -1 - self.ctx.subtask_index
        summary["seq"] = self.seen
        self.ctx.output.emit(summary)


class Paced(Operator):
    """Forwards its input at most ``rate`` records/s per subtask (``ready_at``): it
    backpressures the edge in front of it, so checkpoints hold in-flight data."""

    def __init__(self, rate: float, dtype: Any) -> None:
        self.rate = rate
        self.out_dtype = dtype
        self._due = 0.0

    def process(self, batch: Batch, input_index: int) -> None:
        now = time.monotonic()
        self._due = max(self._due, now) + len(batch) / self.rate
        self.ctx.output.emit(batch)

    def ready_at(self) -> float:
        return self._due


class LingeringGenerator(GeneratorSource):
    """A generator whose subtasks without partitions stay up (and idle) until the job
    stops, as a source waiting for splits to be assigned would."""

    def on_timer(self) -> bool:
        if not len(self._parts):
            time.sleep(0.005)
            return True
        return super().on_timer()


class FinalCheckpointSink(CollectingSink):
    """A :class:`CollectingSink` that remembers, per sink name and subtask, the first
    checkpoint it snapshotted after ``finish()``: the final checkpoint whose
    completion alone commits the records it got since the checkpoint before."""

    final: dict[tuple[str, int], int] = {}  # noqa: RUF012 (a test's process-wide record)

    def open(self, ctx: Any) -> None:
        super().open(ctx)
        self._finished = False

    def finish(self) -> None:
        self._finished = True

    def snapshot(self, checkpoint_id: int) -> OperatorSnapshot:
        if self._finished:
            self.final.setdefault((self.name, self.ctx.subtask_index), checkpoint_id)
        return super().snapshot(checkpoint_id)


class FailAtFinalCommit(FailureInjector):
    """Fails subtask ``subtask`` of ``vertex_uid`` when it is told that the final
    checkpoint of its :class:`FinalCheckpointSink` ``sink`` completed, before the sink
    hears of it: the checkpoint completed, and nothing it pre-committed is committed."""

    def __init__(self, vertex_uid: str, subtask: int, sink: str) -> None:
        super().__init__([FailureSpec("commit", vertex_uid, subtask)])
        self.sink = sink

    def ready(
        self, point: str, attempt: int, vertex_uid: str, subtask: int, checkpoint: int | None
    ) -> bool:
        final = FinalCheckpointSink.final.get((self.sink, subtask))
        return point != "commit" or (final is not None and checkpoint == final)


class DecliningSnapshots(Operator):
    """Forwards its input; once armed (``arm(job, n)``) the next ``n`` checkpoints it
    takes fail in their asynchronous part on every subtask, so the coordinator
    aborts them (a savepoint attempt that fails on storage). ``declined[job]``: their
    ids, in order."""

    remaining: dict[str, int] = {}  # noqa: RUF012 (a test's process-wide record)
    declined: dict[str, list[int]] = {}  # noqa: RUF012
    lock = threading.Lock()

    def __init__(self, job: str, dtype: Any) -> None:
        self.job = job
        self.out_dtype = dtype

    @classmethod
    def arm(cls, job: str, n: int) -> None:
        with cls.lock:
            cls.remaining[job] = n
            cls.declined[job] = []

    def process(self, batch: Batch, input_index: int) -> None:
        self.ctx.output.emit(batch)

    def snapshot(self, checkpoint_id: int) -> Any:
        with self.lock:
            declined = self.declined.setdefault(self.job, [])
            fail = checkpoint_id in declined
            if not fail and self.remaining.get(self.job, 0) > 0:
                self.remaining[self.job] -= 1
                declined.append(checkpoint_id)
                fail = True

        def finalize(_directory: str) -> None:
            if fail:
                # Slow to fail, as storage that times out: the subtasks that took
                # the checkpoint meanwhile went on taking input.
                time.sleep(0.3)
                raise OSError(f"induced storage failure of checkpoint {checkpoint_id}")

        return OperatorSnapshot(None, finalize)
