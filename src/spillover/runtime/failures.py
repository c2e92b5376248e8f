"""Failures induced on purpose, for exactly-once tests and ``spillover verify``.

A ``FailureSpec`` names a point in the runtime; the runtime calls
``FailureInjector.check`` at each point. Specs fire one after the other, each
in a later attempt than the one before (a failure ends its attempt), so a list
of specs is a script of failures: ``operator`` (while processing, once the
subtask handled ``after_records`` records in this attempt), ``snapshot``
(taking a checkpoint), ``restore`` (restoring operator state; only happens
after a checkpoint completed, so put it after a ``commit``), ``commit``
(before the operators hear that a checkpoint completed: a two-phase-commit
sink fails before it publishes).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass


class InducedFailure(RuntimeError):
    """A failure injected on purpose."""


POINTS = ("operator", "snapshot", "restore", "commit")


@dataclass
class FailureSpec:
    point: str
    vertex_uid: str | None = None  # None: any vertex
    subtask: int | None = None  # None: any subtask
    after_records: int = 0  # operator point: records handled by the subtask in this attempt
    after_checkpoint: int = 0  # commit point: the completed checkpoint's id is at least this
    fired_in: int | None = None  # the attempt it fired in

    def __post_init__(self) -> None:
        if self.point not in POINTS:
            raise ValueError(f"failure point must be one of {POINTS}, not {self.point!r}")

    def describe(self) -> str:
        where = f"{self.vertex_uid or '*'}#{'*' if self.subtask is None else self.subtask}"
        extra = f" after {self.after_records} records" if self.point == "operator" else ""
        if self.point == "commit" and self.after_checkpoint:
            extra = f" of checkpoint {self.after_checkpoint} or later"
        return f"{self.point} at {where}{extra}"


class FailureInjector:
    """A script of failures; thread-safe. ``fired`` lists those that happened.

    A copy in another process (a Spark worker) sets ``on_fire(index, attempt)`` to
    report a failure before it is raised; the original records it with
    :meth:`mark_fired`, so the script plays once across every copy.
    """

    def __init__(self, specs: list[FailureSpec] | None = None) -> None:
        self.specs = list(specs or [])
        self.fired: list[FailureSpec] = []
        self.on_fire: Callable[[int, int], None] | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        del state["_lock"]
        state["on_fire"] = None  # a copy reports to whoever set its own
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def pending(self) -> int:
        return len(self.specs) - len(self.fired)

    def ready(
        self, point: str, attempt: int, vertex_uid: str, subtask: int, checkpoint: int | None
    ) -> bool:
        """Whether the next spec may fire at this point, beyond what the spec itself
        asks: a script that waits for something outside the job (a file, what a
        checkpoint holds) says no until it is there."""
        return True

    def firing(self, spec: FailureSpec, attempt: int) -> None:
        """Called as ``spec`` fires in ``attempt``, before its failure is raised: a
        script that tells the outside world when it fired does so here."""

    def check(
        self,
        point: str,
        attempt: int,
        vertex_uid: str,
        subtask: int,
        *,
        records: int = 0,
        checkpoint: int | None = None,
    ) -> None:
        if len(self.fired) == len(self.specs):
            return
        if not self.ready(point, attempt, vertex_uid, subtask, checkpoint):
            return
        with self._lock:
            if len(self.fired) == len(self.specs):
                return
            s = self.specs[len(self.fired)]
            last = self.fired[-1].fired_in if self.fired else -1
            assert last is not None
            if s.point != point or attempt <= last:
                return
            if s.vertex_uid is not None and s.vertex_uid != vertex_uid:
                return
            if s.subtask is not None and s.subtask != subtask:
                return
            if point == "operator" and records < s.after_records:
                return
            if point == "commit" and (checkpoint or 0) < s.after_checkpoint:
                return
            s.fired_in = attempt
            self.fired.append(s)
            index = len(self.fired) - 1
        if self.on_fire is not None:
            self.on_fire(index, attempt)
        self.firing(s, attempt)
        raise InducedFailure(f"induced failure: {s.describe()} (attempt {attempt})")

    def mark_fired(self, index: int, attempt: int) -> None:
        """Spec ``index`` fired in ``attempt`` in a copy (see ``on_fire``); the first
        report of it counts."""
        with self._lock:
            if len(self.fired) == index < len(self.specs):
                self.specs[index].fired_in = attempt
                self.fired.append(self.specs[index])

    @classmethod
    def random(
        cls,
        count: int,
        vertices: list[tuple[str, int]],
        *,
        seed: int,
        records_per_subtask: int,
        kinds: tuple[str, ...] = ("operator", "commit", "restore", "snapshot"),
    ) -> FailureInjector:
        """``count`` failures at random points and places; every point kind of
        ``kinds`` appears once ``count`` allows, and each ``restore`` follows a
        ``commit`` (a batch job, without checkpoints, has only ``operator``)."""
        rng = random.Random(seed)
        script: list[str] = []
        while len(script) < count:
            script.extend(list(kinds))
        script = script[:count]
        specs = []
        for point in script:
            uid, parallelism = rng.choice(vertices)
            anywhere = point in ("restore", "commit")
            specs.append(
                FailureSpec(
                    point,
                    None if anywhere else uid,
                    None if anywhere else rng.randrange(parallelism),
                    after_records=rng.randrange(1, max(2, records_per_subtask // (count + 2))),
                )
            )
        return cls(specs)
