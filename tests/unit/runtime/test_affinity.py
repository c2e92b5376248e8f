"""CPU pinning: a job's task threads on one core, and the pinning undone."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any, ClassVar

import pytest

from spillover.config import Config
from spillover.deploy import local
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
    """The undo gives the process's CPUs back to every thread left on the one CPU,
    those started after the pin included (a pool a task started outlives it)."""
    go, done, started = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, set[int]] = {}
    kids: list[threading.Thread] = []

    def child() -> None:
        seen["child"] = os.sched_getaffinity(0)
        started.set()
        done.wait(10)

    def body() -> None:
        go.wait(10)
        seen["self"] = os.sched_getaffinity(0)
        kids.append(threading.Thread(target=child))
        kids[0].start()
        done.wait(10)

    t = threading.Thread(target=body)
    t.start()
    assert t.native_id is not None
    undo = pin(CPUS[-1], [t.native_id])
    go.set()
    assert started.wait(10)
    assert seen == {"self": {CPUS[-1]}, "child": {CPUS[-1]}}
    assert os.sched_getaffinity(0) == set(CPUS)  # the caller is not pinned
    undo()
    assert os.sched_getaffinity(t.native_id) == set(CPUS)
    assert kids[0].native_id is not None
    assert os.sched_getaffinity(kids[0].native_id) == set(CPUS)
    done.set()
    t.join()
    kids[0].join()
    undo()  # the threads are gone: nothing to give back, no error


def test_pinning_never_raises() -> None:
    """A CPU the process may not use, a thread that is gone: nothing changes, and
    the task thread that pins itself first goes on to run its task."""
    undo = pin(10**6, [0])
    undo()
    pin(0, [2**40])()
    assert os.sched_getaffinity(0) == set(CPUS) or not CPUS


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
    assert local._pinned_runs == {}  # no other local job runs in this process
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
    # Nothing stays pinned once the job ended: not the driver, nor a thread its
    # tasks started that outlives them.
    assert {CPUS[0]} not in _masks()


def _masks() -> list[set[int]]:
    """The CPUs of every live thread of this process."""
    out = []
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            out.append(os.sched_getaffinity(int(tid)))
    return out


class _Blocking(Operator):
    """Holds its task until ``go`` is set, then records its thread's CPUs."""

    started: ClassVar[threading.Event] = threading.Event()
    go: ClassVar[threading.Event] = threading.Event()
    seen: ClassVar[list[frozenset[int]]] = []

    def process(self, batch: Any, input_index: int = 0) -> None:
        if len(batch) and not self.seen:
            self.started.set()
            self.go.wait(60)
            self.seen.append(frozenset(os.sched_getaffinity(0)))


@needs_two
def test_a_local_job_that_ends_leaves_another_running_jobs_threads_pinned(
    tmp_path: Path,
) -> None:
    """Two local jobs in one process share the CPU; the first to end does not free
    the threads of the other, the last one frees them all."""
    assert local._pinned_runs == {}  # no other local job runs in this process
    _Blocking.started.clear()
    _Blocking.go.clear()
    _Blocking.seen = []
    _Affinity.seen = {}
    config = Config.from_dict({"state.checkpoints.dir": str(tmp_path / "a")})
    long_env = StreamEnvironment("long", parallelism=1)
    long_env.from_source(GeneratorSource(1, 10, payload_bytes=8), uid="src").process(
        _Blocking(), uid="held"
    )
    results: list[Any] = []
    runner = threading.Thread(
        target=lambda: results.append(LocalExecutor(long_env, config).run(timeout=60)),
        daemon=True,
    )
    runner.start()
    try:
        assert _Blocking.started.wait(30)
        short_env = StreamEnvironment("short", parallelism=1)
        short_env.from_source(GeneratorSource(1, 100, payload_bytes=8), uid="src").process(
            _Affinity(), uid="seen"
        )
        short = Config.from_dict({"state.checkpoints.dir": str(tmp_path / "b")})
        assert LocalExecutor(short_env, short).run(timeout=60).status == "finished"
        assert set(_Affinity.seen.values()) == {frozenset({CPUS[0]})}  # it shared the CPU
    finally:
        _Blocking.go.set()
        runner.join(60)
    assert results and results[0].status == "finished", results
    assert _Blocking.seen == [frozenset({CPUS[0]})]  # still pinned after the other ended
    assert {CPUS[0]} not in _masks()
