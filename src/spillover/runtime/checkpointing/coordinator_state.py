"""What a checkpoint coordinator is waiting for, as a value: read from another
thread when a job does not end (``spillover chaos`` reports it with a hang), so
that a hang says which checkpoint waits for which subtask and where a stop is."""

from __future__ import annotations

from dataclasses import dataclass

_KINDS = {0: "aligned", 1: "unaligned", 2: "aligned-with-timeout"}


def _subtasks(keys: tuple[tuple[str, int], ...]) -> str:
    return ",".join(f"{uid}#{i}" for uid, i in keys) or "-"


@dataclass(frozen=True)
class PendingCheckpoint:
    """A checkpoint triggered and not yet completed or aborted."""

    checkpoint_id: int
    kind: int  # events.BarrierKind
    savepoint: bool  # a stop's savepoint
    final: bool  # FLIP-147's final checkpoint
    age_s: float
    waiting_for: tuple[tuple[str, int], ...]  # expected subtasks that did not acknowledge
    not_triggered: tuple[tuple[str, int], ...]  # current roots its trigger never reached

    def describe(self) -> str:
        what = "savepoint" if self.savepoint else "final" if self.final else "checkpoint"
        line = (
            f"{what} {self.checkpoint_id} ({_KINDS.get(self.kind, self.kind)}, "
            f"{self.age_s:.1f} s) waits for {_subtasks(self.waiting_for)}"
        )
        if self.not_triggered:
            line += f"; roots never triggered: {_subtasks(self.not_triggered)}"
        return line


@dataclass(frozen=True)
class CoordinatorState:
    """One attempt's coordinator: its pending checkpoints, its stop and final
    checkpoint, which subtasks ended their data and which exited."""

    alive: bool  # its thread runs
    next_id: int
    completed: tuple[int, ...]  # this attempt's, still retained
    last_ended: tuple[str, ...]  # the latest checkpoints that ended: "12 completed", ...
    pending: tuple[PendingCheckpoint, ...]
    stopping: bool  # a stop's savepoint is asked for
    stop_id: int | None  # its latest attempt
    stop_failures: int
    stop_savepoint_id: int | None  # once it completed
    final_id: int | None
    final_done: bool
    data_ended: tuple[tuple[str, int], ...]
    exited: tuple[tuple[str, int], ...]
    running: tuple[tuple[str, int], ...]

    def describe(self) -> str:
        """A few lines: the stop, the final checkpoint, what is pending and ended."""
        stop = (
            f"stop asked (attempt {self.stop_id}, {self.stop_failures} failed"
            + (f", savepoint {self.stop_savepoint_id} completed" if self.stop_savepoint_id else "")
            + ")"
            if self.stopping
            else "no stop"
            if self.stop_savepoint_id is None
            else f"stop's savepoint {self.stop_savepoint_id} completed"
        )
        final = (
            "final checkpoint done"
            if self.final_done
            else f"final checkpoint {self.final_id} asked"
            if self.final_id is not None
            else "no final checkpoint yet"
        )
        lines = [
            f"coordinator {'running' if self.alive else 'ended'}, next id {self.next_id}, "
            f"{stop}, {final}; completed {list(self.completed)}; "
            f"last ended: {', '.join(self.last_ended) or '-'}",
            *(f"  {p.describe()}" for p in self.pending),
            f"  data ended: {_subtasks(self.data_ended)}",
            f"  exited: {_subtasks(self.exited)}",
        ]
        return "\n".join(lines)
