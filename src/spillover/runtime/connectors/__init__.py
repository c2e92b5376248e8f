"""Built-in sources and sinks."""

from __future__ import annotations

from spillover.runtime.connectors.collecting import (
    CollectingSink,
)
from spillover.runtime.connectors.generator import (
    GeneratedEventTime,
    GeneratorSource,
)
from spillover.runtime.connectors.parquet import (
    ParquetSink,
    ParquetSource,
    arrow_to_batch,
    batch_to_arrow,
    byte_matrix,
    filesystem_for,
)
from spillover.runtime.connectors.throttled import (
    ThrottledSink,
)

__all__ = [
    "CollectingSink",
    "GeneratedEventTime",
    "GeneratorSource",
    "ParquetSink",
    "ParquetSource",
    "ThrottledSink",
    "arrow_to_batch",
    "batch_to_arrow",
    "byte_matrix",
    "filesystem_for",
]
