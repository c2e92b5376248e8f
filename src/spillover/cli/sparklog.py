"""Where Spark's log lines go while a command runs on Spark: a file, so that they
never print into the progress bar or the report, or (``--verbose``) the terminal."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

LOG_FILE_ENV = "SPILLOVER_SPARK_LOG_FILE"  # read by spillover.deploy.spark.spark_context
_SPARK_MODULES = ("pyspark", "py4j")


@contextmanager
def spark_logs(command: str, path: str | None) -> Iterator[str | None]:
    """While the block runs, a SparkContext created in this process (or in the
    driver processes it starts) logs to ``path``: its JVM's log4j lines and output,
    and the Python side's warnings and log records from pyspark and py4j. None:
    the terminal, as Spark does. Yields the file the lines go to (None: the
    terminal). A SparkContext already running keeps its logging: the command says
    once where that goes."""
    if path is None:
        yield None
        return
    from spillover.deploy.spark import spark_log_file

    running, current = spark_log_file()
    if running and current != os.path.abspath(path):
        where = current or "the terminal"
        print(
            f"spillover {command}: Spark already runs in this process; its log lines go to {where}",
            file=sys.stderr,
        )
        yield current
        return
    previous = os.environ.get(LOG_FILE_ENV)
    os.environ[LOG_FILE_ENV] = os.path.abspath(path)
    try:
        with _python_side_to(path):
            yield path
    finally:
        if previous is None:
            os.environ.pop(LOG_FILE_ENV, None)
        else:
            os.environ[LOG_FILE_ENV] = previous


@contextmanager
def _python_side_to(path: str) -> Iterator[None]:
    """pyspark's and py4j's warnings and log records go to ``path`` too."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    handler = logging.FileHandler(path, delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    loggers = [logging.getLogger(name) for name in _SPARK_MODULES]
    kept = [(lg.propagate, lg.level) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False
        if lg.level == logging.NOTSET:
            lg.setLevel(logging.WARNING)
    show = warnings.showwarning

    def showwarning(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if any(f"{os.sep}{m}{os.sep}" in filename for m in _SPARK_MODULES):
            with open(path, "a") as f:
                f.write(warnings.formatwarning(message, category, filename, lineno, line))
        else:
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    try:
        yield
    finally:
        warnings.showwarning = show
        for lg, (propagate, level) in zip(loggers, kept, strict=True):
            lg.removeHandler(handler)
            lg.propagate = propagate
            lg.setLevel(level)
        handler.close()
