"""Worker processes on this machine: the Spark deployment's wiring, without Spark.

:class:`ProcessExecutor` runs each generation as ``n`` worker processes (``n`` the
job's largest parallelism over ``taskmanager.numberOfTaskSlots``), each hosting its
slots' subtasks of every operator, exactly as the Spark executor's barrier tasks
do: the same job master, control endpoint, worker code
(:func:`~spillover.deploy.spark.worker.run_worker`) and TCP channels between
workers. Threads of one process share one interpreter lock, so
the local executor's job gets about one core; worker processes use them all.

Workers are forked from a server process that imported the worker code once
(``multiprocessing``'s forkserver), so a generation starts in well under a second
and a fork never copies the master's threads. The job travels to them pickled with
cloudpickle, as to Spark workers (operators defined in a test or a notebook too).
"""

from __future__ import annotations

import multiprocessing
import threading
from typing import Any

from spillover.config import Config
from spillover.deploy.spark.messages import StageEnded
from spillover.deploy.spark.runner import SparkExecutor as _WorkerMaster
from spillover.deploy.spark.runner import WorkerLostError, _SparkAttempt
from spillover.deploy.spark.worker import WorkerSpec
from spillover.runtime.graph import JobGraph, StreamEnvironment
from spillover.runtime.recovery.restore import TaskRestore

__all__ = ["ProcessExecutor"]

_WORKER_MODULE = "spillover.deploy.spark.worker"
_CONTEXT_LOCK = threading.Lock()
_context: Any = None


def _forkserver() -> Any:
    """The multiprocessing context whose server preloads the worker code (once per
    process: the server outlives executors)."""
    global _context
    with _CONTEXT_LOCK:
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload([_WORKER_MODULE, "numpy"])
            _context = ctx
        return _context


def _worker_main(spec: bytes, index: int) -> None:
    """A worker process: runs worker ``index`` of the pickled generation."""
    from pyspark import cloudpickle

    from spillover.deploy.spark.worker import run_worker

    run_worker(cloudpickle.loads(spec), index)


class _ProcessAttempt(_SparkAttempt):
    """One generation as worker processes instead of a barrier stage."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.processes: list[Any] = []

    def _submit(self, sc: Any, spec: WorkerSpec) -> None:
        from pyspark import cloudpickle

        error: BaseException | None = None
        try:
            ctx = _forkserver()
            payload = cloudpickle.dumps(spec)  # type: ignore[no-untyped-call]
            self.processes = [
                ctx.Process(
                    target=_worker_main,
                    args=(payload, i),
                    name=f"spillover-worker-{self.generation}-{i}",
                    daemon=True,
                )
                for i in range(self.n)
            ]
            for p in self.processes:
                p.start()
            for p in self.processes:
                p.join()
            failed = [(i, p.exitcode) for i, p in enumerate(self.processes) if p.exitcode]
            if failed:
                # A negative exit code is the signal that ended the process.
                codes = ", ".join(f"worker {i}: exit code {c}" for i, c in failed)
                error = WorkerLostError(
                    f"worker processes of generation {self.generation} died ({codes})"
                )
        except BaseException as e:
            error = e
        self.stage_error = error
        self._route(StageEnded(error))

    def _force_end(self, sc: Any) -> None:
        for p in self.processes:
            if p.is_alive():
                p.kill()


class ProcessExecutor(_WorkerMaster):
    """Runs a job in worker processes on this machine (``spillover.executor:
    processes``): the Spark executor's job master and workers, one process per
    worker instead of one Spark task. Options are those of
    :class:`~spillover.deploy.local.LocalExecutor`. Batch jobs are not supported."""

    supports_batch = False

    def __init__(
        self,
        job: JobGraph | StreamEnvironment,
        config: Config | None = None,
        **options: Any,
    ) -> None:
        super().__init__(job, config, master=None, **options)

    def available_slots(self) -> int:
        """As many workers as a generation asks for: they are processes here."""
        return self.slots

    def context(self) -> Any:
        """No SparkContext: the forkserver that starts the workers."""
        return _forkserver()

    def prepare(self) -> None:
        """Starts the forkserver (it imports the worker code once)."""
        ctx = _forkserver()
        # The server starts with the first process: a no-op one now, not at the job.
        p = ctx.Process(target=int, daemon=True)
        p.start()
        p.join()

    def start_cluster(self) -> None:
        self.prepare()

    def cluster_started(self) -> None:
        pass

    def driver_host(self, sc: Any) -> str:
        return "127.0.0.1"

    def _attempt(
        self,
        attempt: int,
        restore: dict[tuple[str, int], TaskRestore] | None,
        restored_id: int | None,
    ) -> _SparkAttempt:
        return _ProcessAttempt(self, attempt, restore, restored_id)
