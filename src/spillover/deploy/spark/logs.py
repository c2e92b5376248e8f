"""Where a SparkContext's JVM logs: the terminal, or a file (what ``spillover bench``
and ``spillover verify`` ask for, so that Spark's and the JVM's lines stay out of
the progress display). docs/spark.md."""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

__all__ = ["new_context", "spark_log_file"]


def new_context(conf: Any, log_file: str | None) -> Any:
    """A new SparkContext on ``conf``, its JVM logging to ``log_file`` (default
    ``$SPILLOVER_SPARK_LOG_FILE``; unset: the terminal) at
    ``$SPILLOVER_SPARK_LOG_LEVEL`` (default WARN in a file, ERROR on the terminal)."""
    from pyspark import SparkContext

    log_file = log_file or os.environ.get("SPILLOVER_SPARK_LOG_FILE") or None
    sc = SparkContext(conf=conf) if log_file is None else _logging_to(log_file, conf, SparkContext)
    level = "WARN" if log_file else "ERROR"
    sc.setLogLevel(os.environ.get("SPILLOVER_SPARK_LOG_LEVEL", level))
    _LOG_FILES[id(sc)] = log_file
    return sc


# id(SparkContext) -> the file its JVM logs to (None: the terminal), for those made here.
_LOG_FILES: dict[int, str | None] = {}

_LOG4J2 = """\
status = error
appender.file.type = File
appender.file.name = file
appender.file.fileName = {path}
appender.file.append = true
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = %d{{yy/MM/dd HH:mm:ss}} %p %c{{1}}: %m%n%ex
rootLogger.level = warn
rootLogger.appenderRef.file.ref = file
"""


def _logging_to(log_file: str, conf: Any, context: Any) -> Any:
    """A SparkContext whose JVM logs to ``log_file``: a log4j2 configuration with a
    file appender, given to the JVM at its launch (pyspark hands the conf's
    ``spark.driver.extraJavaOptions`` to spark-submit), and the JVM's stdout and
    stderr (its own warnings, its Python workers' output) opened on the same file."""
    from pyspark.java_gateway import launch_gateway

    path = os.path.abspath(log_file)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, props = tempfile.mkstemp(prefix="spillover-log4j2-", suffix=".properties")
    with os.fdopen(fd, "w") as f:
        f.write(_LOG4J2.format(path=path.replace("\\", "\\\\")))
    options = conf.get("spark.driver.extraJavaOptions", "")
    conf.set("spark.driver.extraJavaOptions", f"{options} -Dlog4j2.configurationFile=file:{props}")
    try:
        with open(path, "ab") as out:  # the JVM keeps its own copy of the descriptor
            gateway = launch_gateway(  # type: ignore[no-untyped-call]
                conf, popen_kwargs={"stdout": out, "stderr": out}
            )
        return context(conf=conf, gateway=gateway)
    finally:
        os.remove(props)  # read once, when the JVM's logging starts


def spark_log_file() -> tuple[bool, str | None]:
    """Whether a SparkContext runs in this process, and the file its JVM logs to
    (None: the terminal, or a context this module did not create)."""
    pyspark = sys.modules.get("pyspark")
    active = None if pyspark is None else pyspark.SparkContext._active_spark_context
    return active is not None, None if active is None else _LOG_FILES.get(id(active))
