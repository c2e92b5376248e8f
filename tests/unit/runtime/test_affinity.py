"""CPU pinning: a job's task threads on one core, and the pinning undone."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, ClassVar

import pytest

from spillover.config import Config
from spillover.deploy.local import LocalExecutor
from spillover.runtime.affinity import allowed_cpus, cpu_for, pin
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.graph import StreamEnvironment
from spillover.runtime.operators import Operator

CPUS = allowed_cpus()
needs_two = pytest.mark.skipif(len(CPUS) < 2, reason="pinning needs two CPUs to choose from")


def test_workers_take_the_cpus_round_robin_and_one_cpu_is_no_choice() -> None:
    assert [cpu_for(i, [2, 5, 7]) for i in range(5)] == [2, 5, 7, 2, 5]
    assert cpu_for(3, [4]) is None
    assert cpu_for(0, []) is None


@needs_two
def test_a_pinned_thread_and_the_threads_it_starts_run_on_one_cpu_until_undone() -> None:
    go, done = threading.Event(), threading.Event()
    seen: dict[str, set[int]] = {}

    def child() -> None:
        seen["child"] = os.sched_getaffinity(0)

    def body() -> None:
        go.wait(10)
        seen["self"] = os.sched_getaffinity(0)
        t = threading.Thread(target=child)
        t.start()
        t.join()
        done.wait(10)

    t = threading.Thread(target=body)
    t.start()
    assert t.native_id is not None
    undo = pin(CPUS[-1], [t.native_id])
    go.set()
    while "child" not in seen and t.is_alive():
        threading.Event().wait(0.01)
    assert seen == {"self": {CPUS[-1]}, "child": {CPUS[-1]}}
    undo()
    assert os.sched_getaffinity(t.native_id) == set(CPUS)
    done.set()
    t.join()
    undo()  # the thread is gone: nothing to give back, no error


class _Affinity(Operator):
    """Records the CPUs each subtask's thread may run on, once it sees records."""

    seen: ClassVar[dict[tuple[str, int], frozenset[int]]] = {}

    def process(self, batch: Any, input_index: int = 0) -> None:
        if len(batch):
            key = (self.ctx.uid, self.ctx.subtask_index)
            self.seen[key] = frozenset(os.sched_getaffinity(0))


@needs_two
@pytest.mark.parametrize("enabled", [True, False])
def test_a_local_jobs_task_threads_share_one_cpu_unless_turned_off(
    tmp_path: Path, enabled: bool
) -> None:
    """On: every subtask's thread runs on the same one CPU of the process's (the
    interpreter lock handed on one core); off: each keeps all of them. The driver's
    own thread is never pinned."""
    _Affinity.seen = {}
    env = StreamEnvironment("affinity", parallelism=2)
    env.from_source(GeneratorSource(2, 2_000, payload_bytes=8), uid="src").key_by("key").process(
        _Affinity(), uid="seen"
    )
    config = Config.from_dict(
        {"spillover.cpu-pinning.enabled": enabled, "state.checkpoints.dir": str(tmp_path)}
    )
    result = LocalExecutor(env, config).run(timeout=60)
    assert result.status == "finished", result
    cpus = set(_Affinity.seen.values())
    assert len(_Affinity.seen) == 2
    assert cpus == ({frozenset({CPUS[0]})} if enabled else {frozenset(CPUS)})
    assert os.sched_getaffinity(0) == set(CPUS)
