"""A task: one subtask of one vertex (a chain of operators) on its own thread.

The task thread owns the chain (``chain.py``) and its output (``taskoutput.py``):
it processes input buffers and runs mailbox messages (checkpoint triggers for
sources, completion notifications, termination) between buffers. Barriers go to
its barrier handling (``checkpointing/barriers/``), which acts on the task through
:class:`~spillover.runtime.taskcheckpoints.TaskCheckpoints`, the task's side of
its checkpoints. A restored task replays its channel state first
(``recovery/channels.py``).

Tasks finish (FLIP-147, ``checkpointing/finishing.py``): once its input ended (or
its source is exhausted) a task runs ``end_input``/``finish``, sends EndOfData and
stays only until a checkpoint it took after finishing completed, so two-phase-commit
sinks commit its last data; then it closes its operators, sends EndOfPartition,
tells the coordinator it exited and ends. Its state along the way is one value,
``lifecycle.TaskLifecycle``. An iteration head composes a ``LoopHead``
(``iteration/head.py``); a loop body task relays the loop's probes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from spillover.rescale import SharedReplayPart
from spillover.runtime.affinity import pin
from spillover.runtime.chain import OperatorChain
from spillover.runtime.checkpointing.barriers.states import CollectingAligned, CollectingUnaligned
from spillover.runtime.checkpointing.channel_state import CheckpointDir
from spillover.runtime.checkpointing.finishing import (
    FINAL_WITHOUT_CHECKPOINTS,
    await_final,
    end_of_data,
)
from spillover.runtime.checkpointing.messages import (
    Cancel,
    CoordinatorGateway,
    MailboxMessage,
    SwitchToUnaligned,
)
from spillover.runtime.eventtime.clock import TaskClock
from spillover.runtime.failures import FailureInjector
from spillover.runtime.graph import JobGraph, Vertex
from spillover.runtime.iteration.feedback import FeedbackPartition
from spillover.runtime.iteration.head import LoopHead
from spillover.runtime.lifecycle import TaskLifecycle
from spillover.runtime.mailbox import TaskMailbox
from spillover.runtime.network import events as ev
from spillover.runtime.network.buffers import NetworkBuffer, OutputWaker, SignalWaker
from spillover.runtime.network.gate import InputGate
from spillover.runtime.network.partition import ResultPartition
from spillover.runtime.network.writers import Outbox, PartitionWriter
from spillover.runtime.recovery.channels import ChannelStateReplay
from spillover.runtime.recovery.restore import TaskRestore
from spillover.runtime.taskcheckpoints import TaskCheckpoints
from spillover.runtime.taskinput import (
    OUTPUT_WAIT,
    InputChannelInfo,
    SourceInput,
    TaskCancelled,
    TaskInput,
)
from spillover.runtime.taskoutput import TaskOutput
from spillover.storage.channel_index import ReadEntries

__all__ = ["FINAL_WITHOUT_CHECKPOINTS", "InputChannelInfo", "Task", "TaskCancelled", "TaskRestore"]


def _no_input(ch: int, buf: Any) -> None:
    raise AssertionError("a source task has no input to replay")


class Task:
    """Runs one subtask of a vertex. Built by ``wiring.build_tasks``, which wires its
    network; ``coordinator`` is set before ``start``."""

    def __init__(
        self,
        *,
        graph: JobGraph,
        vertex: Vertex,
        subtask: int,
        attempt: int,
        gate: InputGate | None,
        channels: list[InputChannelInfo],
        partitions: list[ResultPartition | FeedbackPartition],
        outboxes: list[Outbox],
        writers: list[PartitionWriter],
        restore: TaskRestore | None,
        coordinator: CoordinatorGateway | None,
        checkpoint_dir: CheckpointDir | None,
        keyed_backend_factory: Callable[[Vertex, int], Any] | None,
        failures: FailureInjector,
        on_done: Callable[[Task, BaseException | None], None],
        flush_interval: float = 0.01,
        channel_compression: str | None = None,
        max_inflight_bytes: int | None = None,
        checkpointing: bool = True,
    ) -> None:
        self.graph, self.vertex, self.subtask, self.attempt = graph, vertex, subtask, attempt
        self._gate = gate
        self.channels = channels
        self.restore_state = restore
        self._coordinator = coordinator
        self.failures = failures
        self.on_done = on_done
        # Whether the job takes checkpoints (else sinks commit on their own at the end).
        self.checkpointing = checkpointing and checkpoint_dir is not None
        self.name = f"{vertex.uid}#{subtask}"
        self.mailbox = TaskMailbox(self)
        self.cancelled = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"task {self.name}", daemon=True)
        # Set before start: the CPU the task thread pins itself to first, and the
        # snapshot threads it starts inherit (runtime/affinity.py).
        self.cpu: int | None = None
        keyed = (
            keyed_backend_factory(vertex, subtask)
            if keyed_backend_factory is not None and vertex.head.keyed
            else None
        )
        self.chain = OperatorChain(graph, vertex, subtask, attempt, keyed)
        # A source waits in its mailbox, and its output's waker is the mailbox's signal
        # (a TCP channel's credit reader wakes it natively); a task with inputs waits
        # on its gate.
        waker = (
            OutputWaker(self._output_can_move)
            if gate is not None
            else SignalWaker(self.mailbox.signal)
        )
        self.output = TaskOutput(partitions, outboxes, writers, flush_interval, waker)
        # FLIP-147: restored finished, the operators run nothing (two-phase-commit ones
        # are opened only to commit what the restored checkpoint left pending).
        self.life = TaskLifecycle.restored(restore is not None and restore.finished)
        self.clock = TaskClock(
            len(channels),
            self.output.net,
            lambda ts: self.chain.head.process_watermark(ts),
            self.life.restored_finished,
        )
        self.output_wait_seconds = 0.0  # waiting for the output to drain: backpressure
        self.started_at = self.finished_at = 0.0
        self.replay: ChannelStateReplay | None = None  # recovered channel state
        # Per rescaled input gate, its part of a read shared with subtasks here (wiring).
        self.shared_reads: dict[int, SharedReplayPart] = {}
        # The channel index entries this attempt's restore read here (wiring), held
        # until this subtask's replay has resolved its plan.
        self.read_entries: ReadEntries | None = None
        self.head: LoopHead | None = None
        if vertex.is_iteration_head:
            feedback = frozenset(ch for ch, c in enumerate(channels) if c.edge.feedback)
            self.head = LoopHead(self, feedback, frozenset(range(len(channels))) - feedback)
            if self.clock.valve is not None:
                for ch in feedback:  # its own output coming back holds no watermark back
                    self.clock.valve.on_end(ch)
        self.input = (
            TaskInput(self, gate, channels, graph, vertex, flush_interval)
            if gate is not None
            else None
        )
        self.source = SourceInput(self) if gate is None else None
        self.readers = self.input.readers if self.input is not None else []
        self._loop_outputs = graph.loop_outputs(vertex) if vertex.loop is not None else []
        # A batch job's source subtask: the splits the log assigned it (None: its own).
        self.splits: tuple[str, ...] | None = None
        self.cp = TaskCheckpoints(
            self,
            checkpoint_dir,
            channel_compression,
            max_inflight_bytes,
            feedback=self.head.log if self.head is not None else None,
        )

    # -- what other modules read ---------------------------------------------------

    @property
    def records_in(self) -> int:
        return self.input.records_in if self.input is not None else 0

    @property
    def has_input(self) -> bool:
        """Whether the task reads an input gate (sources do not)."""
        return self._gate is not None

    @property
    def gate(self) -> InputGate:
        """The input gate (a source task has none: only input paths ask for it)."""
        assert self._gate is not None, f"{self.name} has no input gate"
        return self._gate

    @property
    def coordinator(self) -> CoordinatorGateway:
        assert self._coordinator is not None, f"{self.name} has no coordinator yet"
        return self._coordinator

    @coordinator.setter
    def coordinator(self, value: CoordinatorGateway) -> None:
        self._coordinator = value

    # -- control, from other threads -------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def post(self, message: MailboxMessage) -> None:
        """Queues a mailbox message and wakes the task."""
        self.mailbox.put(message)
        if self._gate is not None:
            self._gate.wake()

    def _output_can_move(self) -> None:
        """From the thread that returned credit or a permit: ends the wait of a task
        with inputs (a source's waker wakes its mailbox itself)."""
        if self._gate is not None:
            self._gate.wake()

    def request_unaligned(self, cid: int) -> None:
        """From the coordinator: checkpoint ``cid``'s alignment timed out. Seen at once
        by a task draining its output for that barrier, and queued for the rest."""
        self.cp.barriers.request_unaligned(cid)
        self.post(SwitchToUnaligned(cid))

    def overtaken(self, ch: int, event: ev.Event, buffers: list[NetworkBuffer]) -> None:
        """From a TCP receiving thread: what a priority event of channel ``ch``
        overtook in the receive queue (``BarrierHandler.overtaken``)."""
        self.cp.barriers.overtaken(ch, event, buffers)

    def cancel(self) -> None:
        """Stops the task: wakes it wherever it blocks (emit, poll) with an error."""
        self.cancelled.set()
        self.mailbox.put(Cancel())
        self.output.cancel()
        if self._gate is not None:
            self._gate.cancel()

    # -- the task thread -------------------------------------------------------------

    def _run(self) -> None:
        if self.cpu is not None:  # (never raises)
            pin(self.cpu, [threading.get_native_id()])
        error: BaseException | None = None
        self.started_at = time.monotonic()
        try:
            self._open()
            if self.source is not None:
                self.source.run(self.life.restored_finished)
            else:
                assert self.input is not None
                self.input.run()
                await_final(self)
            error = self.chain.close()  # before EndOfPartition, as Flink closes
            if error is None and not self.life.suspended:
                self.output.finish()
            # Suspended (an unaligned stop's savepoint completed): what is queued and
            # what would follow is in the savepoint; the tasks around end alike.
        except BaseException as e:  # reported to the executor, which fails over
            error = e if not self.cancelled.is_set() else TaskCancelled(self.name)
        finally:
            for part in self.shared_reads.values():
                part.close()  # a part nobody drains would hold its sharers back
            self.cp.release()
            self.output.close()
            error = self.chain.close() or error  # (a no-op when closed already)
            self.cp.snapshots.shutdown(wait=error is None)
            self.finished_at = time.monotonic()
        if error is None and self._coordinator is not None:
            # After its acknowledgements (the snapshot thread is done) and its
            # EndOfPartition: the tasks behind it may become checkpoint roots.
            self.coordinator.task_exited(self.vertex.uid, self.subtask)
        self.on_done(self, error)

    def _open(self) -> None:
        r, chain = self.restore_state, self.chain
        entries, self.read_entries = self.read_entries, None  # not kept past the resolve
        # Restored finished, nothing of the operators runs again (FLIP-147); its keyed
        # state is kept for the next checkpoints, and recovered output state (what the
        # last snapshot's barrier overtook) still goes downstream first.
        if not self.life.restored_finished:
            chain.open(self.output.net, self._source_output)
            if self.splits is not None and self.vertex.is_source:
                chain.head.assign_splits(self.splits)
        if r is None:
            return
        if not self.life.restored_finished:
            self.failures.check("restore", self.attempt, self.vertex.uid, self.subtask)
        chain.restore_keyed(r)
        if self.life.restored_finished:  # after the keyed state its operators may read
            chain.commit_restored(r, self.output.net, self._source_output)
        chain.restore(r)
        self.replay = ChannelStateReplay(
            r.channel_state,
            subtask=self.subtask,
            input_edges=self.cp.input_edges,
            offsets=self.cp.offsets,
            outboxes=self.output.outboxes,
            process=self.input.process if self.input is not None else _no_input,
            shared=self.shared_reads,
            entries=entries,
        )

    def _source_output(self, i: int, out: Any) -> Any:
        return self.clock.source_output(out, self.vertex.nodes[i].watermarks, self.chain.ops[i])

    def mail(self, block: bool = False, timeout: float | None = None) -> float:
        """Runs queued mailbox messages; returns the seconds spent waiting for one."""
        return self.mailbox.run(block, timeout)

    def has_mail(self) -> bool:
        """Whether a mailbox message waits (cheap: asked between two input buffers)."""
        return bool(self.mailbox.messages)

    # -- what the chain's ending and the loop head ask of the task ---------------------

    def end_of_time(self) -> None:
        self.clock.end_of_time()

    def finish_chain(self) -> None:
        self.chain.finish()

    def commit_without_checkpoints(self) -> None:
        self.chain.commit_without_checkpoints(FINAL_WITHOUT_CHECKPOINTS)

    def flush_output(self) -> None:
        self.output.flush()
        self.drain_responsive()

    def send_end_of_data(self, drain: bool) -> None:
        self.output.end_of_data(drain)
        # The final checkpoint waits until every task processed all its input.
        self.coordinator.end_of_data(self.vertex.uid, self.subtask)

    def take_deferred_trigger(self) -> bool:
        return self.mailbox.take_deferred_trigger()

    def idle(self) -> None:
        self.cp.reap()
        self.mail(block=True, timeout=0.05)

    def send_probe(self, round: int) -> None:
        self.output.send_event(self._loop_outputs, ev.LoopProbe(round))

    def loop_quiet(self, round: int) -> None:
        self.coordinator.loop_quiet(self.vertex.uid, self.subtask, round)

    def end_feedback(self) -> None:
        assert self.input is not None
        self.input.end_feedback()

    def end_of_data(self, drain: bool) -> None:
        end_of_data(self, drain)

    def check_operator(self, records: int) -> None:
        uid = self.vertex.uid
        self.failures.check("operator", self.attempt, uid, self.subtask, records=records)

    # -- output ------------------------------------------------------------------------

    def drain(self) -> bool:
        """Moves output on as credit allows; True when every outbox is empty."""
        return self.output.drain()

    def drain_responsive(self) -> None:
        """Hands on all output before an in-line event, taking priority barriers and
        mailbox messages while it waits for credit (a downstream checkpoint may need
        this task's barrier before it gives credit back)."""
        while not self.output.drain():
            self.cp.reap()
            if self.input is not None:
                self.output_wait_seconds += self.input.take_priority(OUTPUT_WAIT)
                self.mail()
            else:
                self.output_wait_seconds += self.mail(block=True, timeout=OUTPUT_WAIT)

    def drain_unless_switched(self, cid: int) -> bool:
        """Drains the output; True when checkpoint ``cid``'s alignment timed out first."""
        barriers = self.cp.barriers
        while not self.output.drain():
            if barriers.switch_requested(cid):
                return True
            if self.input is not None:
                self.output_wait_seconds += self.input.take_priority(0.0002)
            else:
                time.sleep(0.0002)
                self.output_wait_seconds += 0.0002
        return False

    def maybe_flush(self) -> None:
        self.output.maybe_flush()
        if self.head is not None:
            self.head.tick()

    def flush_deadline(self) -> float:
        """When the output's partly filled buffers are due (the input loop ends a run
        of buffers then)."""
        return self.output.flush_deadline()

    # -- metrics -----------------------------------------------------------------------

    def describe(self) -> str:
        """Where the task is, read from any thread (for a job that does not end): its
        lifecycle, its barrier state, the channels that ended and mail not yet run."""
        alive = "alive" if self.thread.is_alive() else "exited"
        line = f"{self.name} {alive}: {self.life.describe()}"
        barriers = self.cp.barriers
        state = barriers.state
        line += f"; barriers {type(state).__name__}"
        if isinstance(state, CollectingAligned):
            line += f"({state.checkpoint_id}, came on {sorted(state.seen)})"
        elif isinstance(state, CollectingUnaligned):
            line += f"({state.checkpoint_id})"
        line += f", latest {barriers.latest}"
        if self.input is not None:
            line += f", channels ended {len(barriers.ended)}/{len(self.channels)}"
            line += f", held {self.input.held}" if self.input.held else ""
        mail = self.mailbox.pending()
        deferred = len(self.mailbox.deferred)
        if mail or deferred:
            line += f"; mail {mail}, deferred triggers {deferred}"
        return line

    @property
    def replayed_bytes(self) -> int:
        return self.replay.replayed_bytes if self.replay is not None else 0

    def metrics(self) -> dict[str, float]:
        wall = (self.finished_at or time.monotonic()) - self.started_at
        # Blocked on credit (the consumer is slow) or on the partition's buffer budget
        # (its buffers are all in flight): both are backpressure.
        inp = self.input or self.source
        waited = self.output_wait_seconds + (inp.output_wait_seconds if inp is not None else 0.0)
        bp = waited + self.output.backpressured_seconds()
        return {
            **self.chain.counted(),
            **(self.head.metrics() if self.head is not None else {}),
            "records_in": float(self.records_in),
            "records_out": float(self.output.net.records),
            "busy_seconds": inp.busy_seconds if inp is not None else 0.0,
            "backpressured_seconds": bp,
            "backpressured_share": bp / wall if wall > 0 else 0.0,
            "replayed_bytes": float(self.replayed_bytes),
            "output_buffer_bytes": self.output.buffer_bytes(),
            "feedback_spilled_bytes": self.output.spilled_bytes(),
            "wall_seconds": wall,
        }
