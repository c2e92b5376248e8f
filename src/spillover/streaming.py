"""The public job API in one import.

    from spillover.streaming import (
        CollectingSink, Config, GeneratorSource, KeyedCount, StreamEnvironment, create_executor,
    )

    env = StreamEnvironment("counts", parallelism=2)
    (env.from_source(GeneratorSource(partitions=2, records_per_partition=10_000), uid="src")
        .key_by("key")
        .process(KeyedCount("key"), uid="count")
        .sink(CollectingSink("counts"), uid="sink"))
    result = create_executor("local", env, Config()).run()

Everything here is also importable from the module that defines it; this module
only gathers what a job author needs: environment and streams, operator base
classes and built-in operators, sources and sinks, configuration, executors, and
induced failures for tests.
"""

from __future__ import annotations

from spillover.config import Config
from spillover.deploy import EXECUTORS, create_executor
from spillover.deploy.local import LocalExecutor
from spillover.runtime.api import (
    Batch,
    KeyedState,
    Operator,
    OperatorContext,
    OperatorSnapshot,
    StateDescriptor,
)
from spillover.runtime.connectors.collecting import CollectingSink
from spillover.runtime.connectors.generator import GeneratedEventTime, GeneratorSource
from spillover.runtime.connectors.parquet import ParquetSink, ParquetSource
from spillover.runtime.connectors.throttled import ThrottledSink
from spillover.runtime.eventtime import TumblingWindowCount, WatermarkStrategy
from spillover.runtime.failures import FailureInjector, FailureSpec, InducedFailure
from spillover.runtime.graph import (
    ConnectedStreams,
    DataStream,
    IterativeStream,
    StreamEnvironment,
    UnionStream,
)
from spillover.runtime.jobmaster import Executor, JobResult
from spillover.runtime.operators import (
    CoMap,
    FilterOperator,
    FlatMapOperator,
    KeyedCount,
    KeyedProcess,
    KeyedSum,
    MapOperator,
    TwoInputOperator,
)

__all__ = [
    "EXECUTORS",
    "Batch",
    "CoMap",
    "CollectingSink",
    "Config",
    "ConnectedStreams",
    "DataStream",
    "Executor",
    "FailureInjector",
    "FailureSpec",
    "FilterOperator",
    "FlatMapOperator",
    "GeneratedEventTime",
    "GeneratorSource",
    "InducedFailure",
    "IterativeStream",
    "JobResult",
    "KeyedCount",
    "KeyedProcess",
    "KeyedState",
    "KeyedSum",
    "LocalExecutor",
    "MapOperator",
    "Operator",
    "OperatorContext",
    "OperatorSnapshot",
    "ParquetSink",
    "ParquetSource",
    "StateDescriptor",
    "StreamEnvironment",
    "ThrottledSink",
    "TumblingWindowCount",
    "TwoInputOperator",
    "UnionStream",
    "WatermarkStrategy",
    "create_executor",
]
