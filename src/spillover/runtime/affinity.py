"""CPU pinning: the threads of one process on one CPU.

A process runs Python on one core at a time (the interpreter lock). Its task
threads hand the lock to each other many times a buffer; on two cores each hand-off
wakes a thread on the other core, which costs an inter-processor wake-up and a
cold cache, on one core it is a switch. Pinned, one process moves about a quarter
more records on this repository's bench (docs/benchmarks.md, "One core per
process"). ``spillover.cpu-pinning.enabled`` turns it off.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on, in order; empty where that is not known."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return []


def cpu_for(index: int, cpus: list[int]) -> int | None:
    """The CPU for worker ``index`` (round-robin over ``cpus``), or None when there
    is no choice to make (fewer than two CPUs)."""
    return cpus[index % len(cpus)] if len(cpus) >= 2 else None


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]  # the calling thread alone


def pin(cpu: int, threads: Iterable[int] | None = None) -> Callable[[], None]:
    """Pins ``threads`` (native thread ids; None: every thread of this process) to
    ``cpu``; threads they start later inherit it. Returns the undo, which gives the
    threads still alive the CPUs they had. Never raises: a thread that ended
    meanwhile, or a CPU the process may not use, leaves things as they were."""
    before: dict[int, set[int]] = {}
    for tid in _threads() if threads is None else threads:
        with contextlib.suppress(OSError):
            cpus = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, {cpu})
            before[tid] = cpus

    def undo() -> None:
        for tid, cpus in before.items():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, cpus)

    return undo
