"""Where a restart's time goes: the recovery round of
``spillover.benchmark.recovery`` with the phases of each Spark attempt timed.

Run: ``PYTHONPATH=src .venv/bin/python bench/restart_timeline.py [ROUNDS] [EXECUTOR]``
(default 3 rounds on ``spark``; ``local`` times the job master's part only).

The attempt's methods are wrapped, not changed: every phase is a ``time.monotonic()``
instant on the driver, printed in ms after the failure (the instant the operator
raised, in the subtask), with the sink's own stamps:

- ``detected``: the attempt learnt of the failure (``failed_at``);
- ``cancel sent`` / ``stage ended``: ``_end`` began (CancelAll to the workers) and
  returned (the barrier stage's thread joined, its control connections closed);
- ``reset sent`` / ``reset confirmed``: a restart in place (docs/spark.md): ``ResetTo``
  sent to every worker / every worker confirmed its subtasks ended (the stage kept);
- ``rebuild sent``: the next attempt took the stage over and sent ``Rebuild``;
- ``attempt returned``: ``run`` returned (the driver's control endpoint closed);
- ``next attempt``: the job master built the next attempt (the restore planned);
- ``stage submitted``: the new barrier stage's thread began submitting it;
- ``hello`` / ``wired``: every worker connected / wired its data channels;
- ``running``: ``Go`` sent to every worker (``running_at``);
- ``sink opened`` / ``first record``: a sink of the new attempt opened (its state
  restored) / took its first record (:class:`~spillover.benchmark.recovery.SinkStamps`).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from spillover.benchmark import BenchSpec
from spillover.benchmark.recovery import recover_once

PHASES = (
    "detected",
    "cancel sent",
    "stage ended",
    "reset sent",
    "reset confirmed",
    "attempt returned",
    "next attempt",
    "stage submitted",
    "rebuild sent",
    "hello",
    "wired",
    "running",
)

marks: list[tuple[str, float]] = []


def _wrap(cls: Any, name: str, before: str | None, after: str | None) -> None:
    inner: Callable[..., Any] = getattr(cls, name)

    def wrapped(self: Any, *a: Any, **kw: Any) -> Any:
        if before:
            marks.append((before, time.monotonic()))
        out = inner(self, *a, **kw)
        if after:
            label = after.format(*a) if "{" in after else after
            marks.append((label, time.monotonic()))
        return out

    setattr(cls, name, wrapped)


def instrument_spark() -> None:
    from spillover.deploy.spark import runner

    attempt = runner._SparkAttempt
    _wrap(attempt, "_end", "cancel sent", "stage ended")
    _wrap(attempt, "_submit", "stage submitted", None)
    _wrap(attempt, "_reset", "reset sent", "reset confirmed")
    _wrap(attempt, "_rebuild", "rebuild sent", None)
    _wrap(attempt, "_wait", None, "{0}")
    _wrap(runner.SparkExecutor, "_attempt", None, "next attempt")
    run = attempt.run

    def timed_run(self: Any, *a: Any, **kw: Any) -> Any:
        out = run(self, *a, **kw)
        if self.running_at is not None:
            marks.append(("running", self.running_at))
        if self.failed_at is not None:
            marks.append(("detected", self.failed_at))
        marks.append(("attempt returned", time.monotonic()))
        return out

    attempt.run = timed_run


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    executor = sys.argv[2] if len(sys.argv) > 2 else "spark"
    if executor == "spark":
        from spillover.deploy.spark import spark_context

        instrument_spark()
        spark_context()
    spec = BenchSpec(policies=["unaligned"], warmup_s=5, executor="local")
    table: dict[str, list[float]] = {}
    for _ in range(rounds):
        marks.clear()
        offset = time.time() - time.monotonic()
        r = recover_once(spec, executor, after_s=2.0)
        print(r.line(), flush=True)
        if r.status != "ok" or r.first_record_ms is None:
            continue
        # The failure instant (wall ms), from the detection's mark and its distance.
        failed_wall_ms = None
        for name, t in marks:
            if name == "detected" and r.detected_ms is not None:
                failed_wall_ms = (t + offset) * 1000 - r.detected_ms
        if failed_wall_ms is None:
            continue
        seen: dict[str, float] = {}
        for name, t in marks:
            ms = (t + offset) * 1000 - failed_wall_ms
            if ms >= -1 and name not in seen:  # the restart's, not the first attempt's
                seen[name] = ms
        seen["sink opened"] = r.sink_opened_ms or float("nan")
        seen["first record"] = r.first_record_ms
        for name in (*PHASES, "sink opened", "first record"):
            if name in seen:
                table.setdefault(name, []).append(seen[name])
        print("  " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(seen.items(), key=lambda x: x[1])))
    print("\nmedian ms after the failure:")
    for name, xs in table.items():
        print(f"  {name:<18} {statistics.median(xs):8.1f}   ({', '.join(f'{x:.0f}' for x in xs)})")


if __name__ == "__main__":
    main()
