"""The runtime's configuration: Flink-named dotted keys over a frozen dataclass tree.

Every option has one dotted key (``execution.checkpointing.interval``, ...) and
one typed field (``Config.checkpointing.interval``, a ``timedelta``). A
:class:`Config` is built from code, a dict of dotted keys, a YAML or TOML file
or ``SPILLOVER_*`` environment variables; :meth:`Config.load` merges them with
precedence overrides > environment > file > defaults. Every value and every
combination is checked when a config is built: a bad one raises
:class:`~spillover.errors.ConfigError` naming the key and the fix.

Extension point: a later feature adds its ``spillover.*`` key as a field of
:class:`DeploymentConfig` (or of a new section listed in ``load._SECTIONS``), declared
as ``field(default=..., metadata=_key(key, kind))``. That alone makes the key
parse from every source, appear in :data:`KEYS` and get its environment
variable; the key also needs a row in ``docs/configuration.md`` (a test checks).
"""

from __future__ import annotations

from spillover.config.load import (
    KEYS,
    Config,
    canonical_key,
    env_var,
)
from spillover.config.sections import (
    Alignment,
    CheckpointingConfig,
    CheckpointingMode,
    ClaimMode,
    DeploymentConfig,
    ExecutionConfig,
    Executor,
    NetworkConfig,
    PipelineConfig,
    RecoveryConfig,
    RestartConfig,
    RestartStrategy,
    RuntimeMode,
    StateConfig,
)
from spillover.config.units import (
    ENV_PREFIX,
    format_duration,
    format_memory_size,
    parse_duration,
    parse_memory_size,
)

__all__ = [
    "ENV_PREFIX",
    "KEYS",
    "Alignment",
    "CheckpointingConfig",
    "CheckpointingMode",
    "ClaimMode",
    "Config",
    "DeploymentConfig",
    "ExecutionConfig",
    "Executor",
    "NetworkConfig",
    "PipelineConfig",
    "RecoveryConfig",
    "RestartConfig",
    "RestartStrategy",
    "RuntimeMode",
    "StateConfig",
    "canonical_key",
    "env_var",
    "format_duration",
    "format_memory_size",
    "parse_duration",
    "parse_memory_size",
]
