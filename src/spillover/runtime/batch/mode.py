"""Whether a job runs in batch mode (``execution.runtime-mode``), decided once per
job graph: batch needs bounded sources, as in Flink."""

from __future__ import annotations

from spillover.config import Config, RuntimeMode
from spillover.errors import ConfigError
from spillover.runtime.graph import JobGraph


def runs_as_batch(graph: JobGraph, config: Config) -> bool:
    """True when ``graph`` runs in batch mode under ``config``: ``batch``, or
    ``automatic`` with every source bounded. A batch job with an unbounded source,
    or with a loop, is refused with :class:`ConfigError`."""
    mode = config.execution.runtime_mode
    if mode is RuntimeMode.STREAMING:
        return False
    unbounded = [v.uid for v in graph.vertices if v.is_source and not v.head.prototype.bounded]
    if mode is RuntimeMode.AUTOMATIC and (unbounded or _loops(graph)):
        return False
    if unbounded:
        raise ConfigError(
            "a batch job needs bounded sources",
            detail=f"unbounded: {', '.join(unbounded)}",
            hint="give the sources an end (e.g. GeneratorSource(records_per_partition=...)), "
            "or set execution.runtime-mode: streaming",
        )
    loops = _loops(graph)
    if loops:
        raise ConfigError(
            "a batch job cannot hold a loop",
            detail=f"the loop of {loops[0]!r}",
            hint="set execution.runtime-mode: streaming",
        )
    return True


def _loops(graph: JobGraph) -> list[str]:
    return sorted({v.loop for v in graph.vertices if v.loop is not None})
