"""The operators of one subtask's chain: opened, restored, snapshot, finished and
closed in the chain's order, as its task says."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spillover.runtime.api import Operator, OperatorContext, OperatorSnapshot, Output
from spillover.runtime.checkpointing.snapshot import Captured
from spillover.runtime.eventtime.timers import KeyedTimerService
from spillover.runtime.graph import JobGraph, Vertex
from spillover.runtime.outputs import ChainOutput
from spillover.runtime.recovery.restore import TaskRestore

# What an operator's output is, given its index and the network output.
OutputFor = Callable[[int, Output], Output]


class OperatorChain:
    """The chain of ``vertex`` on subtask ``subtask``: its operators and keyed state."""

    def __init__(
        self, graph: JobGraph, vertex: Vertex, subtask: int, attempt: int, keyed: Any
    ) -> None:
        self.graph = graph
        self.vertex = vertex
        self.subtask = subtask
        self.attempt = attempt
        self.keyed = keyed
        self.ops: list[Operator] = [n.instantiate() for n in vertex.nodes]
        self._opened = 0
        self._closed = False
        self.batch_run: str | None = None  # a batch job's run id (OperatorContext)
        self.job_run: str | None = None  # the job's run id (OperatorContext)

    @property
    def head(self) -> Operator:
        return self.ops[0]

    @property
    def opened(self) -> list[Operator]:
        """The operators that were opened (none when restored finished)."""
        return self.ops[: self._opened]

    def open(self, net: Output, source_output: OutputFor) -> None:
        """Opens every operator, the last one writing to ``net`` (a source's output
        is watched by its watermark strategy: ``source_output``)."""
        for i, op in enumerate(self.ops):
            op.open(self.context(i, net, source_output))
            self._opened = i + 1

    def context(self, i: int, net: Output, source_output: OutputFor) -> OperatorContext:
        """The context of the chain's ``i``-th operator."""
        node = self.vertex.nodes[i]
        out: Output = net if i + 1 == len(self.ops) else ChainOutput(self.ops[i + 1])
        if i == 0 and self.vertex.is_source:
            out = source_output(i, out)
        keyed = self.keyed if node.keyed else None
        return OperatorContext(
            uid=node.uid,
            name=node.name,
            subtask_index=self.subtask,
            parallelism=self.vertex.parallelism,
            max_parallelism=self.graph.max_parallelism,
            attempt=self.attempt,
            output=out,
            keyed=keyed,
            timers=KeyedTimerService(keyed, f"{node.uid}.timers") if keyed is not None else None,
            pacing=True,
            batch_run=self.batch_run,
            job_run=self.job_run,
        )

    def restore(self, r: TaskRestore) -> None:
        """The opened operators take their restored state."""
        for node, op in zip(self.vertex.nodes, self.opened, strict=False):
            if node.uid in r.rescaled_state:
                op.restore_rescaled(r.rescaled_state[node.uid])
            elif node.uid in r.operator_state:
                op.restore(r.operator_state[node.uid])

    def restore_keyed(self, r: TaskRestore) -> None:
        if self.keyed is not None:
            self.keyed.restore([h for uid in r.keyed_handles for h in r.keyed_handles[uid]])

    def commit_restored(self, r: TaskRestore, net: Output, source_output: OutputFor) -> None:
        """Restored finished: the restored checkpoint completed, but the notification
        that would have committed what its snapshot pre-committed may never have come
        (the attempt ended between the two). Two-phase-commit operators are opened and
        restored, which commits it, and closed; nothing else of them runs."""
        for i, (node, op) in enumerate(zip(self.vertex.nodes, self.ops, strict=True)):
            rescaled = r.rescaled_state.get(node.uid)
            state = r.operator_state.get(node.uid)
            if not op.commits_on_restore:
                continue
            if state is None and all(st is None for st in rescaled or ()):
                continue  # nothing restored: nothing pending
            op.open(self.context(i, net, source_output))
            try:
                if rescaled is not None:
                    op.restore_rescaled(rescaled)
                else:
                    op.restore(state)
            finally:
                op.close()

    def finish(self) -> None:
        """Every input ended (a source: it ran out): ``finish()`` down the chain, each
        operator after its input's ``end_input``."""
        for i, op in enumerate(self.ops):
            if i > 0:
                op.end_input(0)
            op.finish()

    def capture(self, cid: int, finished: bool, restored: TaskRestore | None) -> Captured:
        """The synchronous part of a snapshot. Restored finished (``restored``), the
        operators never opened: the state they were restored with is their state (the
        keyed state was restored and is written again, FLIP-147 keeps it)."""
        snaps: dict[str, OperatorSnapshot]
        if restored is not None:
            snaps = {uid: OperatorSnapshot(st) for uid, st in restored.operator_state.items()}
        else:
            pairs = zip(self.vertex.nodes, self.ops, strict=True)
            snaps = {n.uid: op.snapshot(cid) for n, op in pairs}
        keyed = self.keyed
        return Captured(
            snaps,
            keyed.snapshot() if keyed is not None else None,
            next((n.uid for n in self.vertex.nodes if n.keyed), None),
            float(keyed.state_bytes()) if keyed is not None else 0.0,
            finished,
        )

    def commit_without_checkpoints(self, cid: int) -> None:
        """A job without checkpointing ends: the operators commit on their own."""
        snaps = [op.snapshot(cid) for op in self.ops]
        for snap in snaps:
            if snap.finalize is not None:
                snap.finalize("")
        for op in self.ops:
            op.notify_checkpoint_complete(cid)

    def close(self) -> Exception | None:
        """Closes the opened operators, once; the first error, if any."""
        if self._closed:
            return None
        self._closed = True
        error: Exception | None = None
        for op in self.opened:
            try:
                op.close()
            except Exception as e:
                error = error or e
        return error

    def counted(self) -> dict[str, float]:
        """What operators count themselves (e.g. late_records_dropped), summed."""
        out: dict[str, float] = {}
        for op in self.opened:
            for k, v in op.ctx.metrics.items():
                if isinstance(v, int | float):
                    out[k] = out.get(k, 0.0) + float(v)
        return out
