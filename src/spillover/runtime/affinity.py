"""CPU pinning: the threads of one process on one CPU.

A process runs Python on one core at a time (the interpreter lock). Its task
threads hand the lock to each other many times a buffer; on two cores each hand-off
wakes a thread on the other core, which costs an inter-processor wake-up and a
cold cache, on one core it is a switch (docs/benchmarks.md, "One core per
process"). ``spillover.cpu-pinning.enabled`` turns it off.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable

_ERRORS = (OSError, AttributeError, ValueError, OverflowError)  # AttributeError: not Linux


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on, in order; empty where that is not known."""
    try:
        return sorted(os.sched_getaffinity(0))
    except _ERRORS:
        return []


def cpu_for(rank: int, cpus: list[int]) -> int | None:
    """The CPU for the ``rank``-th worker of a host (round-robin over ``cpus``), or
    None when there is no choice to make (fewer than two CPUs)."""
    return cpus[rank % len(cpus)] if len(cpus) >= 2 else None


def _threads() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def pin(cpu: int, threads: Iterable[int] | None = None) -> Callable[[], None]:
    """Pins ``threads`` (native thread ids; None: every thread of this process) to
    ``cpu``; threads they start later inherit it. Returns the undo,
    :func:`release` of ``cpu`` to the CPUs the caller had. Never raises: a thread
    that ended meanwhile, a CPU the process may not use or a platform without
    affinity leaves things as they were."""
    before = allowed_cpus()
    for tid in _threads() if threads is None else threads:
        with contextlib.suppress(*_ERRORS):
            os.sched_setaffinity(tid, {cpu})
    return lambda: release(cpu, before)


def release(cpu: int, cpus: list[int] | None = None) -> None:
    """Every live thread of this process on ``cpu`` alone, those started since a
    :func:`pin` included, gets ``cpus`` (None: the caller's). Live ones only: an
    ended thread's id may be reused. Never raises."""
    cpus = allowed_cpus() if cpus is None else cpus
    if not cpus:
        return
    for tid in _threads():
        with contextlib.suppress(*_ERRORS):
            if os.sched_getaffinity(tid) == {cpu}:
                os.sched_setaffinity(tid, cpus)
