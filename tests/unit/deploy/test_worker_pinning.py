"""A Spark or process worker's CPU: its rank among the job's workers on its host
picks it, every thread of the process runs there until the worker returns, and
then every one gets the process's CPUs back (Spark reuses its Python workers)."""

from __future__ import annotations

import contextlib
import os
import threading

import pytest

from spillover.deploy.spark.worker import _pin_worker
from spillover.runtime.affinity import allowed_cpus, cpu_for

CPUS = allowed_cpus()


def _masks() -> dict[int, set[int]]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            out[int(tid)] = os.sched_getaffinity(int(tid))
    return out


@pytest.mark.skipif(len(CPUS) < 2, reason="pinning needs two CPUs to choose from")
@pytest.mark.parametrize(("index", "rank"), [(0, 0), (1, 0), (2, 1), (3, 2)])
def test_a_worker_pins_the_whole_process_to_its_rank_on_its_host_and_gives_it_back(
    index: int, rank: int
) -> None:
    # Workers 0, 2 and 3 share a host; 1 is alone on another: ranks 0, 0, 1, 2.
    table = {0: ("10.0.0.1", 7001), 1: ("10.0.0.2", 7001), 2: ("10.0.0.1", 7002),
             3: ("10.0.0.1", 7003)}  # fmt: skip
    before = _masks()
    stop = threading.Event()
    bystander = threading.Thread(target=stop.wait, args=(10,))
    bystander.start()  # a thread the worker did not start is pinned too
    undo = _pin_worker(index, table)
    try:
        cpu = cpu_for(rank, CPUS)
        assert undo is not None and cpu is not None
        assert all(mask == {cpu} for mask in _masks().values())
        later = threading.Thread(target=stop.wait, args=(10,))
        later.start()  # one the worker starts once pinned: inherits the CPU
        assert later.native_id is not None
        assert os.sched_getaffinity(later.native_id) == {cpu}
    finally:
        if undo is not None:
            undo()
        stop.set()
    assert later.native_id is not None
    assert os.sched_getaffinity(later.native_id) == set(CPUS)
    assert all(_masks().get(tid, mask) == mask for tid, mask in before.items())
    bystander.join()
    later.join()
