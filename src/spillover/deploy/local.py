"""The local deployment: every subtask of a job on a thread of this process."""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
import traceback

from spillover.runtime.affinity import allowed_cpus, cpu_for, release
from spillover.runtime.checkpointing.messages import StopSource, Terminate
from spillover.runtime.jobmaster import Executor, StopWhen, next_event
from spillover.runtime.recovery.restore import TaskRestore
from spillover.runtime.task import Task, TaskCancelled
from spillover.runtime.wiring import build_tasks, make_coordinator, settle

logger = logging.getLogger(__name__)

# Local jobs of this process whose task threads are pinned, by CPU: the last of
# them to end gives the CPU's threads back, so one job's end never frees another's
# threads (runtime/affinity.py).
_pinned_lock = threading.Lock()
_pinned_runs: dict[int, int] = {}


def _hold_cpu(cpu: int) -> None:
    with _pinned_lock:
        _pinned_runs[cpu] = _pinned_runs.get(cpu, 0) + 1


def _let_go_cpu(cpu: int) -> None:
    with _pinned_lock:  # held while releasing: a run starting now pins after it
        left = _pinned_runs[cpu] - 1
        if left:
            _pinned_runs[cpu] = left
            return
        del _pinned_runs[cpu]
        release(cpu)  # threads the tasks started that outlive them


class _Attempt:
    """One execution attempt: the tasks, their network and the coordinator."""

    def __init__(
        self,
        ex: Executor,
        attempt: int,
        restore: dict[tuple[str, int], TaskRestore] | None,
        restored_id: int | None,
    ) -> None:
        self.ex = ex
        self.attempt = attempt
        self.done: queue.SimpleQueue[tuple[Task, BaseException | None]] = queue.SimpleQueue()
        self.coordinator_error: BaseException | None = None
        self.running_at: float | None = None
        self.failed_at: float | None = None
        g, cfg = ex.graph, ex.config
        self.tasks = build_tasks(
            g,
            cfg,
            attempt=attempt,
            restore=restore,
            storage=ex.storage,
            failures=ex.failures,
            on_done=lambda t, err: self.done.put((t, err)),
            flush_interval=ex.flush_interval,
            run_id=ex.run_id,
        )
        self.coordinator = make_coordinator(
            ex, self.tasks, restored_id, self._terminate_sources, self._coordinator_failed
        )
        for t in self.tasks.values():
            t.coordinator = self.coordinator

    def stop_sources(self, drain: bool) -> None:
        for t in self.tasks.values():
            if t.vertex.is_source:
                t.post(StopSource(drain))

    def _terminate_sources(self) -> None:
        for (_uid, _i), t in self.tasks.items():
            if t.vertex.is_source:
                t.post(Terminate())

    def _coordinator_failed(self, e: BaseException) -> None:
        self.coordinator_error = e
        # Wake the executor's wait with a synthetic failure.
        any_task = next(iter(self.tasks.values()))
        self.done.put((any_task, e))

    def run(
        self,
        deadline: float | None,
        stop_at: float | None = None,
        stop_when: StopWhen | None = None,
    ) -> BaseException | None:
        """Runs until every task finished (None) or one failed (its error); at
        ``stop_at`` the job is stopped (cancelled, not failed: returns None)."""
        self.coordinator.start()
        # The task threads on one core (runtime/affinity.py); the driver's float.
        cpu = cpu_for(0, allowed_cpus()) if self.ex.config.deployment.cpu_pinning else None
        held = False
        try:
            if cpu is not None:
                _hold_cpu(cpu)
                held = True
            for t in self.tasks.values():
                t.cpu = cpu
                t.start()
            return self._wait(deadline, stop_at, stop_when)
        finally:
            if held:
                assert cpu is not None
                _let_go_cpu(cpu)

    def _wait(
        self,
        deadline: float | None,
        stop_at: float | None,
        stop_when: StopWhen | None,
    ) -> BaseException | None:
        self.running_at = time.monotonic()
        remaining = set(self.tasks)
        error: BaseException | None = None
        self.stopped = False
        while remaining:
            what, item = next_event(self.done, self.coordinator, deadline, stop_at, stop_when)
            if what == "stop":
                self.stopped = True
                self._cancel_all()
                break
            if what == "timeout":
                unfinished = sorted(remaining)
                names = ", ".join(f"{uid}#{i}" for uid, i in unfinished[:8])
                more = f" and {len(unfinished) - 8} more" if len(unfinished) > 8 else ""
                error = TimeoutError(f"the job did not finish in time (running: {names}{more})")
                self._log_stacks(unfinished)
                break
            task, err = item
            if err is not None and not isinstance(err, TaskCancelled):
                error = err
                self.failed_at = time.monotonic()
                break
            remaining.discard((task.vertex.uid, task.subtask))
        if error is not None:
            self._cancel_all()
        self.coordinator.stop()
        return error

    def _log_stacks(self, keys: list[tuple[str, int]]) -> None:
        """Where each unfinished task's thread is, for whoever reads why a job hung."""
        frames = sys._current_frames()
        for key in keys:
            thread = self.tasks[key].thread
            frame = frames.get(thread.ident) if thread.ident is not None else None
            if frame is not None:
                stack = "".join(traceback.format_stack(frame)[-8:])
                logger.warning("%s#%d did not finish; its thread is at:\n%s", *key, stack)

    def _cancel_all(self) -> None:
        for t in self.tasks.values():
            t.cancel()
        settle(self.tasks.values())

    def task_metrics(self) -> dict[str, dict[str, float]]:
        """Each subtask's metrics (``uid#i``), live while the attempt runs."""
        return {f"{uid}#{i}": t.metrics() for (uid, i), t in self.tasks.items()}


class LocalExecutor(Executor):
    """Runs a job graph with one thread per subtask, restarting it on failures (a
    batch job: region by region, each region's subtasks on threads)."""

    supports_batch = True

    def _attempt(
        self,
        attempt: int,
        restore: dict[tuple[str, int], TaskRestore] | None,
        restored_id: int | None,
    ) -> _Attempt:
        return _Attempt(self, attempt, restore, restored_id)
