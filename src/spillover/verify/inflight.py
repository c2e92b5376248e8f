"""Failures that restore in-flight data (``VerifySpec.failures_after_inflight``).

How much data is in flight at a barrier depends on backpressure, and a sink throttled
below the sources' configured rate backpressures only while the sources really reach
that rate: on a starved CPU they do not, the channels are empty at every barrier, and
the checkpoints the failures restore hold no in-flight data. With this option each
induced failure waits until the latest completed checkpoint holds some, and while one
waits the run's throttled sinks take no input between a checkpoint's end and their
next snapshot, so the next barriers find full channels whatever the machine's speed.
The sinks and the script share memory: the local executor only.
"""

from __future__ import annotations

import threading
from typing import Any

from spillover.runtime.checkpointing.stats import CheckpointRecord
from spillover.runtime.connectors.throttled import ThrottledSink
from spillover.runtime.failures import FailureInjector, FailureSpec

HOLD_POLL_S = 0.002
"""How far ahead a held sink says it will be ready: how often its task looks again
(taking unaligned barriers and mail meanwhile)."""


class InflightWait:
    """What a run's failure script and its held sinks share: the in-flight bytes of
    the latest completed checkpoint of any attempt (the one a restart restores), fed
    by the job's checkpoint statistics. Every subtask's copy of a sink shares it."""

    def __init__(self) -> None:
        self.latest_inflight = 0
        self.pending = 0  # failures of the script not fired yet
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: dict[int, Any]) -> InflightWait:
        return self  # one per run: a sink's per-subtask copies must see the script's

    def checkpoint_ended(self, record: CheckpointRecord) -> None:
        if record.status == "COMPLETED":
            with self._lock:
                self.latest_inflight = record.total("inflight_bytes")

    @property
    def holding(self) -> bool:
        """Whether a failure waits for a completed checkpoint with in-flight data."""
        return self.pending > 0 and self.latest_inflight == 0


class AfterInflight(FailureInjector):
    """A failure script whose failures each fire only while the latest completed
    checkpoint holds in-flight data, so that the restore each one causes replays
    some."""

    def __init__(self, specs: list[FailureSpec], wait: InflightWait) -> None:
        super().__init__(specs)
        self.wait = wait
        wait.pending = self.pending

    def ready(
        self, point: str, attempt: int, vertex_uid: str, subtask: int, checkpoint: int | None
    ) -> bool:
        return self.wait.latest_inflight > 0

    def firing(self, spec: FailureSpec, attempt: int) -> None:
        self.wait.pending = self.pending

    def hold_sinks(self, graph: Any) -> None:
        """Holds ``graph``'s throttled sinks while a failure waits (before the graph
        runs)."""
        for v in graph.vertices:
            for node in v.nodes:
                p = node.prototype
                if type(p) is ThrottledSink:
                    node.prototype = HeldSink(p.rate, p.inner, self.wait)

    def follow(self, executor: Any) -> None:
        """Follows the checkpoints ``executor`` (a local executor) completes."""
        executor.stats.on_ended(self.wait.checkpoint_ended)


class HeldSink(ThrottledSink):
    """A :class:`ThrottledSink` that, while ``wait.holding``, takes no input from the
    start of its subtask or the end of a checkpoint until its next snapshot: the data
    upstream sent meanwhile is in flight when the barrier comes (it overtakes it), and
    after the snapshot the sink goes on at its pace, so alignment never waits on it."""

    def __init__(self, rate_per_subtask: float, inner: Any, wait: InflightWait) -> None:
        super().__init__(rate_per_subtask, inner)
        self.wait = wait

    def open(self, ctx: Any) -> None:
        super().open(ctx)
        self._snapshotted = False

    def ready_at(self) -> float:
        if not self._snapshotted and self.wait.holding:
            return self.clock() + HOLD_POLL_S
        return super().ready_at()

    def snapshot(self, checkpoint_id: int) -> Any:
        self._snapshotted = True
        return super().snapshot(checkpoint_id)

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        self._snapshotted = False
        super().notify_checkpoint_complete(checkpoint_id)

    def notify_checkpoint_aborted(self, checkpoint_id: int) -> None:
        self._snapshotted = False
        super().notify_checkpoint_aborted(checkpoint_id)
