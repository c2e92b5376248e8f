"""A child driver for the tests of a driver that dies during a stop-with-savepoint:
it runs a verify job, may ask the stop once a checkpoint completed, and may SIGKILL
its own process at a point of the stop; its :class:`JobResult` is pickled."""

from __future__ import annotations

import os
import pickle
import signal
import threading
from typing import Any

from spillover.deploy import create_executor
from spillover.runtime.jobrecovery import JobRecovery
from spillover.verify.spec import VerifySpec, config_for

# "requested": once the stop is in the job event log, before any savepoint of it;
# "savepoint": once the stop's savepoint is logged complete, before a task hears of it.
POINTS = ("requested", "savepoint")


def drive(
    spec: VerifySpec,
    out_dir: str,
    name: str,
    ckpt: str,
    result_path: str,
    stop: str | None,
    kill_at: str | None,
    restore: str | None = None,
) -> None:
    """``stop``: ``savepoint``, ``unaligned-savepoint`` or ``drain``, asked once a
    checkpoint completed; ``kill_at``: one of :data:`POINTS`; ``restore``: a
    savepoint the run starts from."""
    graph = spec.factory()(out_dir, name, spec.parallelism).build()
    cfg = config_for(spec, ckpt)
    ex: Any = create_executor("local", graph, cfg, restore_checkpoint=restore)
    if kill_at == "requested":
        asked = JobRecovery.stop_requested

        def requested(self: JobRecovery, *args: Any) -> None:
            asked(self, *args)
            os.kill(os.getpid(), signal.SIGKILL)

        JobRecovery.stop_requested = requested  # type: ignore[method-assign]
    elif kill_at == "savepoint":
        record = ex.checkpoint_completed

        def completed(cid: int, metadata: Any) -> None:
            record(cid, metadata)
            if cid == ex._current.coordinator.stop_id:
                os.kill(os.getpid(), signal.SIGKILL)

        ex.checkpoint_completed = completed
    if stop is not None:

        def ask() -> None:
            while not ex.completed_ids():
                threading.Event().wait(0.01)
            ex.stop_with_savepoint(drain=stop == "drain", unaligned=stop == "unaligned-savepoint")

        threading.Thread(target=ask, daemon=True).start()
    result = ex.run(timeout=600)
    with open(result_path + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(result_path + ".tmp", result_path)
