"""Serving a job: uvicorn on a daemon thread of the driver process, at
``rest.bind-address``/``rest.port`` (port 0: a free one), with the job's registry
entry (its state, latest checkpoint and the operators' commands) and token under
``SPILLOVER_HOME`` kept up to date."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import uvicorn

from spillover.rest import registry
from spillover.rest.app import create_app
from spillover.rest.job import ServedJob
from spillover.runtime.jobmaster import Executor

logger = logging.getLogger(__name__)


class JobServer:
    """The REST API of one job, running until :meth:`close`. ``url`` is its base
    address; ``token`` the secret its mutating calls need."""

    def __init__(self, job: ServedJob, host: str, port: int, *, register: bool = True) -> None:
        self.job = job
        self._register = register
        ex = job.executor
        self.token_file = registry.new_token(job.job_id)
        self.token = self.token_file.read_text().strip()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        self._sock = sock
        bound = sock.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{bound}"
        app = create_app(job, self.token, self.update)
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="rest-server", daemon=True
        )
        self._entry = registry.JobEntry(
            id=job.job_id,
            name=job.name,
            state=ex.status.snapshot().state,
            rest_url=self.url,
            token_file=str(self.token_file),
            pid=os.getpid(),
            started=registry.now(),
        )
        self._lock = threading.Lock()
        ex.stats.on_ended(lambda record: self.update())
        job.on_end(lambda _job: self.update())

    def start(self) -> JobServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started and self._thread.is_alive():
            if time.monotonic() > deadline:
                raise TimeoutError("the REST server did not start")
            time.sleep(0.01)
        self.update()
        return self

    def update(self) -> None:
        """Writes the registry entry anew from the job's state."""
        if not self._register:
            return
        ex = self.job.executor
        st = ex.status.snapshot()
        last = ex.stats.snapshot().latest_completed
        result = self.job.result
        with self._lock:
            self._entry = self._entry.with_changes(
                state=st.state,
                last_checkpoint=last.checkpoint_id if last else self._entry.last_checkpoint,
                ended=None if st.end_ms is None else st.end_ms / 1000,
                savepoint=result.savepoint if result is not None else None,
                commands=self.job.commands,
            )
            try:
                registry.write(self._entry)
            except OSError as e:  # the registry is a convenience: the job goes on
                logger.warning("cannot write the job registry entry: %s", e)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


def serve(executor: Executor, *, register: bool = True) -> JobServer:
    """Serves ``executor``'s job at its configured REST address; run the job with
    ``server.job.run(...)``."""
    dep = executor.config.deployment
    return JobServer(
        ServedJob(executor), dep.rest_bind_address, dep.rest_port, register=register
    ).start()
