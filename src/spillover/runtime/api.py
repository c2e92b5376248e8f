"""The contracts between the runtime's parts: records, operators, state, contexts.

Records of a stream are rows of one numpy structured dtype (fixed width); a
**batch** is a 1-D numpy structured array of that dtype. Operators receive and
emit batches, never single records, so no operator loops over records in
Python. On the wire, records are framed as in ``spillover.records`` (4-byte
length prefix + the row's bytes) inside fixed-size network buffers.

Lifecycle of an operator instance (one per subtask), always on the task's thread:

1. ``open(ctx)``; then, when the job restores, ``restore(state)`` with what
   ``snapshot`` returned at the restored checkpoint (before any input). A subtask
   restored finished (FLIP-147) runs none of this, except for operators with
   ``commits_on_restore``: ``open``, ``restore`` and ``close``, nothing else.
2. ``process(batch, input_index)`` for every batch; ``on_timer()`` when the task
   is idle or at ``ctx.timer_interval`` (sources use ``emit`` from here);
   ``process_watermark(ts)`` in order with the batches whenever the task's
   watermark advances (keyed operators: ``on_event_time(keys, times)`` first, for
   the event-time timers it passed; then the watermark goes on downstream).
3. ``snapshot(checkpoint_id)`` when a checkpoint's barrier has been aligned (or
   a source is triggered): returns an ``OperatorSnapshot``. Its synchronous part
   runs on the task thread; anything slow (writing files) goes in
   ``OperatorSnapshot.finalize``, which the task runs off its thread.
4. ``notify_checkpoint_complete(checkpoint_id)`` once the coordinator has
   completed that checkpoint (two-phase-commit sinks commit here), and
   ``notify_checkpoint_aborted(checkpoint_id)``.
5. ``end_input(input_index)`` when an input has delivered its last record
   (EndOfData on every channel), then ``finish()`` once every input ended
   (sources: when exhausted), then ``close()``; ``close()`` also runs when the
   task fails or is cancelled.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

Batch = npt.NDArray[Any]  # a 1-D structured array of the stream's dtype


class EdgeKind(enum.Enum):
    """How records of an edge are distributed over the downstream subtasks."""

    FORWARD = "forward"  # subtask i -> subtask i; chained when parallelism is equal
    KEY_BY = "key_by"  # by key group of an int64 key field (Flink-compatible)
    REBALANCE = "rebalance"  # round robin of whole buffers
    BROADCAST = "broadcast"  # every buffer to every subtask
    CUSTOM = "custom"  # a user partitioner picks each record's subtask from its key


Partitioner = Callable[[npt.NDArray[np.int64], int], npt.ArrayLike]
"""``partitioner(keys, n)``: the downstream subtask (``0 .. n - 1``) of each key.

Called once per batch with the int64 key field of every record, so it must be
vectorised (numpy), deterministic, and depend on nothing but the keys and ``n``:
a rescaled restore calls it again to route recovered records.
"""


@dataclass(frozen=True)
class StateDescriptor:
    """Names a piece of keyed state. ``kind``: ``"value"`` (last value per key),
    ``"sum"`` (reducing state adding values), ``"list"`` (values appended per key).
    ``dtype`` is the value's numpy dtype."""

    name: str
    kind: str
    dtype: Any = np.int64


class KeyedState(Protocol):
    """One keyed state of a subtask: vectorised, keys are int64.

    Every method takes arrays (one entry per record) and never loops in Python.
    """

    def get(self, keys: npt.NDArray[np.int64]) -> tuple[npt.NDArray[Any], npt.NDArray[np.bool_]]:
        """Values (value/sum state) for ``keys`` and a mask of keys that have one."""
        ...

    def put(self, keys: npt.NDArray[np.int64], values: npt.NDArray[Any]) -> None:
        """value: last write per key wins (in array order); sum: adds; list: appends."""
        ...

    def items(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[Any]]:
        """All (keys, values) pairs; for list state one row per appended value."""
        ...

    def clear(self, keys: npt.NDArray[np.int64]) -> None: ...


class KeyedStateBackend(Protocol):
    """Keyed state of one subtask, owning a key-group range (for rescaling)."""

    def state(self, descriptor: StateDescriptor) -> KeyedState: ...

    def snapshot(self) -> Callable[[str], dict[str, Any]]:
        """Copies the state now (cheap, on the task thread) and returns a function that
        writes it under a directory URI, grouped by key group, and returns a JSON-able
        handle. The copy must not change when the state changes later."""
        ...

    def restore(self, handles: list[dict[str, Any]]) -> None:
        """Loads every handle's entries whose key group is in this backend's range."""
        ...

    def state_names(self) -> list[str]:
        """Names of the states declared or restored so far."""
        ...


class TimerService(Protocol):
    """Event-time timers of a keyed operator, per key (``ctx.timers``).

    A timer ``(key, t)`` fires once the watermark reaches ``t``: the operator's
    ``on_event_time(keys, times)`` gets every due timer in timestamp order. A pair
    registered twice fires once. Timers are keyed state: checkpointed with the
    keyed backend and redistributed by key group on a rescaled restore.
    """

    @property
    def current_watermark(self) -> int:
        """The last watermark the operator processed (``MIN_WATERMARK`` at first)."""
        ...

    def register(self, keys: npt.NDArray[np.int64], times: npt.NDArray[np.int64]) -> None:
        """Registers the timers ``(keys[i], times[i])``."""
        ...

    def delete(self, keys: npt.NDArray[np.int64], times: npt.NDArray[np.int64]) -> None:
        """Drops the timers ``(keys[i], times[i])`` that are registered."""
        ...

    def advance(
        self,
        watermark: int,
        fire: Callable[[npt.NDArray[np.int64], npt.NDArray[np.int64]], None],
    ) -> None:
        """The runtime's: moves to ``watermark`` and hands every due timer to ``fire``."""
        ...


@dataclass
class OperatorSnapshot:
    """What one operator contributes to a checkpoint.

    ``operator_state``: JSON-able, small (offsets, pending file names).
    ``finalize(directory_uri)``: runs off the task thread and returns the JSON-able
    handles of large state it wrote (keyed state); None when nothing to write.
    """

    operator_state: Any = None
    finalize: Callable[[str], Any] | None = None


class Output(Protocol):
    """Where an operator's batches go (the next chained operator or the network)."""

    def emit(self, batch: Batch) -> None: ...

    def emit_watermark(self, timestamp_ms: int) -> None:
        """Sends a watermark on, behind every batch emitted before it."""
        ...


@dataclass
class OperatorContext:
    """What an operator may use; given to ``open``."""

    uid: str
    name: str
    subtask_index: int
    parallelism: int
    max_parallelism: int
    attempt: int
    output: Output
    keyed: KeyedStateBackend | None = None
    # Keyed operators: their event-time timers.
    timers: TimerService | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    # Sources: how often on_timer is called while the task has no input.
    timer_interval: float = 0.001
    # True when the task honours ``Operator.ready_at``: an operator that paces itself
    # then says when it can take more input instead of sleeping in ``process``.
    pacing: bool = False
    # A batch job's run (docs/recovery.md): the same for every run of a task and every
    # master that resumes the run; None for a streaming job.
    batch_run: str | None = None
    # The job's run: the same for every subtask and attempt of one run of the job (and
    # for a master that resumes it from the job's event log); None outside a job.
    job_run: str | None = None


class Operator:
    """Base class of every operator; see the module docstring for the lifecycle.

    ``out_dtype`` is the dtype of the batches it emits (None for sinks).
    """

    out_dtype: Any = None
    is_source: bool = False
    # Sources that read splits (partitions): the int64-castable field naming each
    # record's split, so watermarks are generated per split (``active_splits``).
    split_field: str | None = None

    def open(self, ctx: OperatorContext) -> None:
        self.ctx = ctx

    @property
    def commits_on_restore(self) -> bool:
        """Two-phase commit: ``restore``/``restore_rescaled`` commit what the restored
        checkpoint lists pending (it completed, though its notification may never have
        come). A subtask restored finished (FLIP-147) opens, restores and closes such
        operators only, so the transaction its final checkpoint pre-committed is not
        lost. By default: every operator that acts on ``notify_checkpoint_complete``."""
        return type(self).notify_checkpoint_complete is not Operator.notify_checkpoint_complete

    @property
    def bounded(self) -> bool:
        """Whether the operator's output ends by itself: a source that runs out (a
        batch job needs every source bounded). Sources say so; others are."""
        return not self.is_source

    def splits_of(self, subtask: int, parallelism: int) -> tuple[str, ...] | None:
        """Sources with splits: the splits subtask ``subtask`` of ``parallelism`` reads
        (the enumerator's assignment, which a batch job's log records); None: the
        source has no splits to assign. Saying them is what lets a restarted batch
        master reuse the finished subtasks of a source stage left part way (Flink's
        ``SupportsBatchSnapshot``); without them that stage runs again whole."""
        return None

    def assign_splits(self, splits: tuple[str, ...]) -> None:
        """Sources with splits, after ``open``: read exactly ``splits`` (a re-run
        subtask of a batch job gets back the assignment the log recorded)."""

    def restore(self, state: Any) -> None:
        """``state`` is the ``operator_state`` this subtask snapshotted (same parallelism)."""

    def restore_rescaled(self, states: list[Any]) -> None:
        """The job is restored at another parallelism: ``states`` holds the operator
        state of every old subtask (union redistribution); keep what this subtask owns.
        Operators without operator state need nothing; the others must say how."""
        if any(s is not None for s in states):
            from spillover.errors import RescaleError

            raise RescaleError(
                f"{type(self).__name__} keeps operator state but cannot be restored at "
                "another parallelism",
                hint="implement restore_rescaled, or restore at the checkpoint's parallelism",
            )

    def process(self, batch: Batch, input_index: int = 0) -> None:
        raise NotImplementedError

    def process_watermark(self, timestamp_ms: int) -> None:
        """The task's watermark advanced to ``timestamp_ms`` (in order with the data):
        fires the event-time timers it passed, then forwards it. Override to hold
        watermarks back or to act on them; call ``super()`` to keep both."""
        timers = self.ctx.timers
        if timers is not None:
            timers.advance(timestamp_ms, self.on_event_time)
        self.ctx.output.emit_watermark(timestamp_ms)

    def on_event_time(self, keys: npt.NDArray[np.int64], times: npt.NDArray[np.int64]) -> None:
        """Keyed operators: the timers ``(keys[i], times[i])`` the watermark passed, in
        timestamp order."""

    def active_splits(self) -> npt.NDArray[np.int64] | None:
        """Sources with a ``split_field``: the splits this subtask still reads (an
        empty array: none, the subtask is idle); None when it does not know."""
        return None

    def ready_at(self) -> float:
        """``time.monotonic()`` before which the operator takes no more input (0: now).

        The task waits until then without holding up its mailbox or its unaligned
        barriers, so a deliberately slow operator does not delay checkpoints."""
        return 0.0

    def on_timer(self) -> bool:
        """Sources emit here. Returns False once the source is exhausted."""
        return True

    def snapshot(self, checkpoint_id: int) -> OperatorSnapshot:
        return OperatorSnapshot()

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        pass

    def notify_checkpoint_aborted(self, checkpoint_id: int) -> None:
        pass

    def end_input(self, input_index: int) -> None:
        pass

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass
