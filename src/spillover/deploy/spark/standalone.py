"""A Spark standalone cluster on loopback, for tests and benchmarks: a master and
``workers`` workers started from the pyspark distribution (``spark-class ...Master``
and ``...Worker``, what ``sbin/start-master.sh`` and ``sbin/start-worker.sh`` start as
daemons) in the foreground of this process's children, so that they end with it
whatever happens."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from spillover.errors import SpilloverError

__all__ = ["StandaloneCluster", "free_port", "standalone_cluster"]

_SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


class ClusterStartError(SpilloverError, RuntimeError):
    """A standalone master or worker did not start."""


@dataclass(frozen=True)
class StandaloneCluster:
    """A running cluster: its master's URL, the environment its processes (and a
    driver meant for it) run with, and the file they log to."""

    url: str
    env: dict[str, str]
    log: str


def free_port() -> int:
    """A TCP port free on loopback just now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise ClusterStartError(f"the Spark {what} did not start") from None
            time.sleep(0.2)


@contextlib.contextmanager
def standalone_cluster(
    root: str,
    workers: int,
    cores: int,
    *,
    pythonpath: Sequence[str] = (),
    memory: str = "1g",
    timeout: float = 90,
) -> Iterator[StandaloneCluster]:
    """A master and ``workers`` workers of ``cores`` cores and ``memory`` each, on
    loopback, logging under ``root``; their Python workers import this package's
    source first, then ``pythonpath``. Stopped on exit."""
    import pyspark

    home = os.path.dirname(pyspark.__file__)
    paths = [_SRC, *pythonpath, os.environ.get("PYTHONPATH", "")]
    env = {
        **os.environ,
        "SPARK_HOME": home,
        "PYSPARK_PYTHON": sys.executable,
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "SPARK_LOG_DIR": os.path.join(root, "logs"),
        "SPARK_WORKER_DIR": os.path.join(root, "work"),
        "SPARK_LOCAL_IP": "127.0.0.1",
    }
    spark_class = os.path.join(home, "bin", "spark-class")
    port = free_port()
    log_path = os.path.join(root, "cluster.log")
    log = open(log_path, "wb")  # noqa: SIM115  (closed below)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        master_args = ["--host", "127.0.0.1", "--port", str(port), "--webui-port", str(free_port())]
        master = subprocess.Popen(
            [spark_class, "org.apache.spark.deploy.master.Master", *master_args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        procs.append(master)
        _wait_port(port, master, "master", timeout)
        url = f"spark://127.0.0.1:{port}"
        for _ in range(workers):
            args = ["--host", "127.0.0.1", "--cores", str(cores), "--memory", memory]
            args += ["--webui-port", str(free_port()), url]
            procs.append(
                subprocess.Popen(
                    [spark_class, "org.apache.spark.deploy.worker.Worker", *args],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        yield StandaloneCluster(url, env, log_path)
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()
