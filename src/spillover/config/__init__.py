"""The runtime's configuration: Flink-named dotted keys over a frozen dataclass tree.

Every option has one dotted key (``execution.checkpointing.interval``, ...) and
one typed field (``Config.checkpointing.interval``, a ``timedelta``). A
:class:`Config` is built from code, a dict of dotted keys, a YAML or TOML file
or ``SPILLOVER_*`` environment variables; :meth:`Config.load` merges them with
precedence overrides > environment > file > defaults. Every value and every
combination is checked when a config is built: a bad one raises
:class:`~spillover.errors.ConfigError` naming the key and the fix.

Extension point: a later feature adds its ``spillover.*`` key as a field of
:class:`DeploymentConfig` (or of a new section listed in ``_SECTIONS``), declared
as ``field(default=..., metadata=_key(key, kind))``. That alone makes the key
parse from every source, appear in :data:`KEYS` and get its environment
variable; the key also needs a row in ``docs/configuration.md`` (a test checks).
"""

from __future__ import annotations

import difflib
import enum
import importlib
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar, Final

from spillover.errors import ConfigError
from spillover.keygroups import UPPER_BOUND_MAX_PARALLELISM, compute_default_max_parallelism
from spillover.storage import FORMAT_VERSION
from spillover.storage.handle import Codec

__all__ = [
    "ENV_PREFIX",
    "KEYS",
    "Alignment",
    "CheckpointingConfig",
    "CheckpointingMode",
    "Config",
    "DeploymentConfig",
    "Executor",
    "NetworkConfig",
    "PipelineConfig",
    "RecoveryConfig",
    "RestartConfig",
    "RestartStrategy",
    "StateConfig",
    "env_var",
    "format_duration",
    "format_memory_size",
    "parse_duration",
    "parse_memory_size",
]

ENV_PREFIX: Final = "SPILLOVER_"
KiB: Final = 1024
MiB: Final = 1024 * KiB
_INT_MAX: Final = 2**31 - 1  # Flink's options are Java ints
_MICROSECOND: Final = timedelta(microseconds=1)


class CheckpointingMode(enum.Enum):
    """``execution.checkpointing.mode``."""

    EXACTLY_ONCE = "EXACTLY_ONCE"
    AT_LEAST_ONCE = "AT_LEAST_ONCE"


class Alignment(enum.Enum):
    """How a subtask handles barriers, derived from the unaligned options."""

    ALIGNED = "aligned"
    UNALIGNED = "unaligned"
    ALIGNED_WITH_TIMEOUT = "aligned-with-timeout"  # starts aligned, switches to unaligned


class RestartStrategy(enum.Enum):
    """``restart-strategy.type``."""

    NONE = "none"
    FIXED_DELAY = "fixed-delay"
    FAILURE_RATE = "failure-rate"


class Executor(enum.Enum):
    """``spillover.executor``: where subtasks run."""

    LOCAL = "local"
    SPARK = "spark"


# --- value formats ------------------------------------------------------------------------


class _Bad(Exception):
    """A value refused by a kind; the caller turns it into a ConfigError naming the key."""


_DAY_US = 86_400_000_000
_DURATION_UNITS: Final = (
    ("d", _DAY_US),
    ("h", 3_600_000_000),
    ("min", 60_000_000),
    ("s", 1_000_000),
    ("ms", 1_000),
    ("µs", 1),
)
_DURATION_ALIASES: Final[dict[str, int]] = {
    # Flink's TimeUtils labels, plus "us", "μs" (Greek mu) and "mins"
    **dict.fromkeys(("d", "day", "days"), _DAY_US),
    **dict.fromkeys(("h", "hour", "hours"), 3_600_000_000),
    **dict.fromkeys(("min", "m", "mins", "minute", "minutes"), 60_000_000),
    **dict.fromkeys(("s", "sec", "secs", "second", "seconds"), 1_000_000),
    **dict.fromkeys(("", "ms", "milli", "millis", "millisecond", "milliseconds"), 1_000),
    **dict.fromkeys(("µs", "μs", "us", "micro", "micros", "microsecond", "microseconds"), 1),
}
_NANO_ALIASES: Final = frozenset(("ns", "nano", "nanos", "nanosecond", "nanoseconds"))
_MEMORY_UNITS: Final = (("tb", 1 << 40), ("gb", 1 << 30), ("mb", 1 << 20), ("kb", 1 << 10))
_MEMORY_ALIASES: Final[dict[str, int]] = {
    # Flink's MemorySize labels (all binary), plus the IEC "kib", "mib", ...
    **dict.fromkeys(("", "b", "bytes"), 1),
    **dict.fromkeys(("k", "kb", "kib", "kibibytes"), 1 << 10),
    **dict.fromkeys(("m", "mb", "mib", "mebibytes"), 1 << 20),
    **dict.fromkeys(("g", "gb", "gib", "gibibytes"), 1 << 30),
    **dict.fromkeys(("t", "tb", "tib", "tebibytes"), 1 << 40),
}
_AMOUNT = re.compile(r"\s*([0-9]+)\s*([^\s0-9]*)\s*")
_DURATION_FORM: Final = "such as '500 ms', '10 s', '1 min' or '2 h'; a bare integer is milliseconds"
_MEMORY_FORM: Final = (
    "such as '32 kb', '32 KiB', '1 mb' or '4m'; a bare integer is bytes, "
    "k, m, g and t are powers of 1024"
)


def _split_amount(text: str, what: str) -> tuple[int, str]:
    match = _AMOUNT.fullmatch(text)
    if match is None:
        raise _Bad(f"{text!r} is not {what}: expected a whole number and an optional unit")
    return int(match.group(1)), match.group(2).lower()


def _to_duration(raw: object) -> timedelta:
    if isinstance(raw, timedelta):
        return raw
    if isinstance(raw, int) and not isinstance(raw, bool):
        micros = raw * 1_000
    elif isinstance(raw, str):
        amount, unit = _split_amount(raw, "a duration")
        if unit in _NANO_ALIASES:
            if amount % 1_000:
                raise _Bad(f"{raw!r} is finer than the microsecond resolution of a duration")
            micros = amount // 1_000
        elif unit in _DURATION_ALIASES:
            micros = amount * _DURATION_ALIASES[unit]
        else:
            raise _Bad(f"{raw!r} has an unknown time unit {unit!r}")
    else:
        raise _Bad(f"{raw!r} is not a duration")
    try:
        return timedelta(microseconds=micros)
    except OverflowError:
        raise _Bad(f"{raw!r} is too long a duration") from None


def _to_memory_size(raw: object) -> int:
    if isinstance(raw, int) and not isinstance(raw, bool):
        size = raw
    elif isinstance(raw, str):
        amount, unit = _split_amount(raw, "a memory size")
        if unit not in _MEMORY_ALIASES:
            raise _Bad(f"{raw!r} has an unknown memory unit {unit!r}")
        size = amount * _MEMORY_ALIASES[unit]
    else:
        raise _Bad(f"{raw!r} is not a memory size")
    if not 0 <= size < 2**63:
        raise _Bad(f"{raw!r} is out of range: a memory size is 0 to 2^63 - 1 bytes")
    return size


def parse_duration(value: str | int | timedelta) -> timedelta:
    """Parses a Flink-style duration: ``'500 ms'``, ``'10 s'``, ``'1 min'``, ``'2h'``, ``'3 d'``;
    an int or a bare number is milliseconds. Units are case-insensitive."""
    try:
        return _to_duration(value)
    except _Bad as bad:
        raise ConfigError(
            "bad duration", detail=str(bad), hint=f"use a duration {_DURATION_FORM}"
        ) from None


def format_duration(value: timedelta) -> str:
    """The exact duration in its largest whole unit (``'10 min'``, ``'1500 ms'``);
    :func:`parse_duration` reads it back."""
    if value < timedelta(0):
        raise ConfigError("bad duration", detail=f"{value} is negative")
    micros = value // _MICROSECOND
    if micros == 0:
        return "0 ms"
    label, size = next((lb, n) for lb, n in _DURATION_UNITS if micros % n == 0)
    return f"{micros // size} {label}"


def parse_memory_size(value: str | int) -> int:
    """Parses a Flink-style memory size into bytes: ``'32kb'``, ``'32 KiB'``, ``'1 mb'``,
    ``'4m'``; an int or a bare number is bytes. Units are binary and case-insensitive."""
    try:
        return _to_memory_size(value)
    except _Bad as bad:
        raise ConfigError(
            "bad memory size", detail=str(bad), hint=f"use a memory size {_MEMORY_FORM}"
        ) from None


def format_memory_size(value: int) -> str:
    """The exact size in its largest whole unit (``'32 kb'``, ``'100 b'``);
    :func:`parse_memory_size` reads it back."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError("bad memory size", detail=f"{value!r} is not a byte count")
    for label, size in _MEMORY_UNITS:
        if value and value % size == 0:
            return f"{value // size} {label}"
    return f"{value} b"


# --- option kinds: parse a raw value, check a typed one, dump it as plain data -------------


class _Kind:
    expected: str = ""

    def parse(self, raw: object) -> object:
        return raw

    def check(self, value: object) -> None:
        raise NotImplementedError

    def dump(self, value: Any) -> object:
        return value


class _Duration(_Kind):
    def __init__(self, low: timedelta = timedelta(0)) -> None:
        self.low = low
        bound = f" of at least {format_duration(low)}" if low else ""
        self.expected = f"a duration{bound}, {_DURATION_FORM}"

    def parse(self, raw: object) -> object:
        return _to_duration(raw)

    def check(self, value: object) -> None:
        if not isinstance(value, timedelta):
            raise _Bad(f"{value!r} is not a datetime.timedelta")
        if value < self.low:
            shown = format_duration(abs(value))
            shown = shown if value >= timedelta(0) else f"-{shown}"
            raise _Bad(f"{shown} is below the minimum of {format_duration(self.low)}")

    def dump(self, value: Any) -> object:
        return format_duration(value)


class _MemorySize(_Kind):
    def __init__(self, low: int = 0, high: int | None = None, power_of_two: bool = False) -> None:
        self.low, self.high, self.power_of_two = low, high, power_of_two
        self.bounds = f"at least {format_memory_size(low)}"
        if high is not None:
            self.bounds = f"between {format_memory_size(low)} and {format_memory_size(high)}"
        what = "a power of two" if power_of_two else "a memory size"
        self.expected = f"{what} {self.bounds}, {_MEMORY_FORM}"

    def parse(self, raw: object) -> object:
        return _to_memory_size(raw)

    def check(self, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Bad(f"{value!r} is not a byte count (an int)")
        if value < self.low or (self.high is not None and value > self.high):
            raise _Bad(f"{format_memory_size(value)} is not {self.bounds}")
        if self.power_of_two and value & (value - 1):
            raise _Bad(f"{format_memory_size(value)} is not a power of two")

    def dump(self, value: Any) -> object:
        return format_memory_size(value)


class _Int(_Kind):
    def __init__(self, low: int, high: int = _INT_MAX) -> None:
        self.low, self.high = low, high
        self.expected = f"an integer from {low} to {high}"

    def parse(self, raw: object) -> object:
        if isinstance(raw, str) and re.fullmatch(r"\s*[+-]?[0-9]+\s*", raw):
            return int(raw)
        return raw

    def check(self, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Bad(f"{value!r} is not an integer")
        if not self.low <= value <= self.high:
            raise _Bad(f"{value} is outside {self.low}..{self.high}")


class _Bool(_Kind):
    expected = "true or false"

    def parse(self, raw: object) -> object:
        if isinstance(raw, str) and raw.strip().lower() in ("true", "false"):
            return raw.strip().lower() == "true"
        return raw

    def check(self, value: object) -> None:
        if not isinstance(value, bool):
            raise _Bad(f"{value!r} is not a boolean")


class _Choice(_Kind):
    """One of a few names (case-insensitive, ``-`` and ``_`` alike) mapped to typed values."""

    def __init__(
        self, names: Mapping[str, object], refused: Mapping[str, str] | None = None
    ) -> None:
        self.names = {self._norm(k): v for k, v in names.items()}
        self.values = tuple(dict.fromkeys(self.names.values()))
        self.refused = {self._norm(k): v for k, v in (refused or {}).items()}
        self.expected = "one of " + ", ".join(str(self.dump(v)) for v in self.values)

    @staticmethod
    def _norm(name: str) -> str:
        return name.strip().lower().replace("_", "-")

    def parse(self, raw: object) -> object:
        if isinstance(raw, str):
            name = self._norm(raw)
            if name in self.refused:
                raise _Bad(f"{raw!r} {self.refused[name]}")
            return self.names.get(name, raw)
        return raw

    def check(self, value: object) -> None:
        if not any(type(value) is type(v) and value == v for v in self.values):
            raise _Bad(f"{value!r} is not {self.expected}")

    def dump(self, value: Any) -> object:
        return value.value if isinstance(value, enum.Enum) else value


class _Text(_Kind):
    def __init__(self, what: str = "a string", path: bool = False) -> None:
        self.expected, self.path = what, path

    def parse(self, raw: object) -> object:
        return os.fspath(raw) if self.path and isinstance(raw, os.PathLike) else raw

    def check(self, value: object) -> None:
        if not isinstance(value, str) or (self.path and not value.strip()):
            raise _Bad(f"{value!r} is not {self.expected}")


_SPARK_MASTER = re.compile(
    r"local(\[(\d+|\*)(,\d+)?\])?|local-cluster\[\d+,\d+,\d+\]"
    r"|spark://[^\s/]+(,[^\s/]+)*|yarn|k8s://\S+|mesos://\S+"
)


class _SparkMaster(_Kind):
    expected = "a Spark master URL: local[N], spark://host:port, yarn, k8s://..."

    def check(self, value: object) -> None:
        if not isinstance(value, str) or not _SPARK_MASTER.fullmatch(value):
            raise _Bad(f"{value!r} is not {self.expected}")


def _enum_choice(kind: type[enum.Enum], **aliases: enum.Enum) -> _Choice:
    return _Choice({**{m.value: m for m in kind}, **aliases})


@dataclass(frozen=True)
class _Spec:
    key: str
    kind: _Kind

    def error(self, bad: _Bad, where: str = "") -> ConfigError:
        return ConfigError(
            f"bad value for {self.key}{where}",
            detail=str(bad),
            hint=f"expected {self.kind.expected}",
        )

    def check(self, value: object, where: str = "") -> None:
        try:
            self.kind.check(value)
        except _Bad as bad:
            raise self.error(bad, where) from None


_SPEC: Final = "spillover.config"


def _key(key: str, kind: _Kind) -> dict[str, _Spec]:
    """A field's metadata: its dotted key and value kind. A field whose default is None
    is optional: None means unset."""
    return {_SPEC: _Spec(key, kind)}


def _check_fields(section: Any) -> None:
    for f in fields(section):
        value = getattr(section, f.name)
        if value is not None or f.default is not None:
            f.metadata[_SPEC].check(value)


def _seconds(value: timedelta) -> float:
    return value.total_seconds()


# --- the sections -------------------------------------------------------------------------

_CP = "execution.checkpointing."
_UNALIGNED = _CP + "unaligned.enabled"
_ALIGNED_TIMEOUT = _CP + "aligned-checkpoint-timeout"


@dataclass(frozen=True)
class CheckpointingConfig:
    """``execution.checkpointing.*``: when and how checkpoints are taken.

    ``interval`` None turns periodic checkpoints off. The unaligned options only
    act when ``unaligned`` is True.
    """

    interval: timedelta | None = field(
        default=None, metadata=_key(_CP + "interval", _Duration(timedelta(milliseconds=10)))
    )
    timeout: timedelta = field(
        default=timedelta(minutes=10),
        metadata=_key(_CP + "timeout", _Duration(timedelta(milliseconds=10))),
    )
    min_pause: timedelta = field(
        default=timedelta(0), metadata=_key(_CP + "min-pause", _Duration())
    )
    max_concurrent_checkpoints: int = field(
        default=1, metadata=_key(_CP + "max-concurrent-checkpoints", _Int(1))
    )
    mode: CheckpointingMode = field(
        default=CheckpointingMode.EXACTLY_ONCE,
        metadata=_key(_CP + "mode", _enum_choice(CheckpointingMode)),
    )
    tolerable_failed_checkpoints: int = field(
        default=0, metadata=_key(_CP + "tolerable-failed-checkpoints", _Int(0))
    )
    unaligned: bool = field(default=False, metadata=_key(_UNALIGNED, _Bool()))
    aligned_checkpoint_timeout: timedelta = field(
        default=timedelta(0), metadata=_key(_ALIGNED_TIMEOUT, _Duration())
    )
    unaligned_forced: bool = field(default=False, metadata=_key(_CP + "unaligned.forced", _Bool()))
    max_inflight_bytes: int | None = field(
        default=None, metadata=_key(_CP + "unaligned.max-inflight-bytes", _MemorySize())
    )
    compression: str = field(
        default="none",
        metadata=_key(_CP + "unaligned.compression", _Choice({"none": "none", "lz4": "lz4"})),
    )

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.unaligned and self.mode is not CheckpointingMode.EXACTLY_ONCE:
            raise ConfigError(
                f"{_UNALIGNED} requires {_CP}mode EXACTLY_ONCE",
                detail=f"the mode is {self.mode.value}",
                hint=f"set {_CP}mode to EXACTLY_ONCE or turn unaligned checkpoints off",
            )
        if self.unaligned and self.max_concurrent_checkpoints != 1:
            raise ConfigError(
                f"{_UNALIGNED} requires {_CP}max-concurrent-checkpoints 1",
                detail=f"it is {self.max_concurrent_checkpoints}",
                hint=f"set {_CP}max-concurrent-checkpoints to 1 or turn unaligned checkpoints off",
            )
        if self.aligned_checkpoint_timeout and not self.unaligned:
            raise ConfigError(
                f"{_ALIGNED_TIMEOUT} requires {_UNALIGNED} true",
                detail=f"the timeout is {format_duration(self.aligned_checkpoint_timeout)} "
                "with unaligned checkpoints off",
                hint=f"set {_UNALIGNED} to true to switch to unaligned checkpoints after the "
                "timeout, or leave the timeout at 0",
            )

    @property
    def enabled(self) -> bool:
        """Whether periodic checkpoints are taken (an interval is set)."""
        return self.interval is not None

    @property
    def alignment(self) -> Alignment:
        """How barriers are handled, from ``unaligned`` and ``aligned_checkpoint_timeout``."""
        if not self.unaligned:
            return Alignment.ALIGNED
        if self.aligned_checkpoint_timeout:
            return Alignment.ALIGNED_WITH_TIMEOUT
        return Alignment.UNALIGNED

    @property
    def interval_s(self) -> float | None:
        return None if self.interval is None else _seconds(self.interval)

    @property
    def timeout_s(self) -> float:
        return _seconds(self.timeout)

    @property
    def min_pause_s(self) -> float:
        return _seconds(self.min_pause)

    @property
    def aligned_checkpoint_timeout_s(self) -> float:
        return _seconds(self.aligned_checkpoint_timeout)

    @property
    def codec(self) -> Codec:
        """The codec for persisted in-flight buffers."""
        return Codec.parse(self.compression)


@dataclass(frozen=True)
class StateConfig:
    """``state.checkpoints.*``: where checkpoints go and how many are kept."""

    checkpoints_dir: str | None = field(
        default=None,
        metadata=_key("state.checkpoints.dir", _Text("a non-empty path or URI", path=True)),
    )
    num_retained: int = field(default=1, metadata=_key("state.checkpoints.num-retained", _Int(1)))

    def __post_init__(self) -> None:
        _check_fields(self)


_TM = "taskmanager.network.memory."


@dataclass(frozen=True)
class NetworkConfig:
    """Network buffers and credits: ``taskmanager.memory.segment-size`` and
    ``taskmanager.network.memory.*``."""

    segment_size: int = field(
        default=32 * KiB,
        metadata=_key("taskmanager.memory.segment-size", _MemorySize(4 * KiB, 16 * MiB, True)),
    )
    buffers_per_channel: int = field(default=2, metadata=_key(_TM + "buffers-per-channel", _Int(1)))
    floating_buffers_per_gate: int = field(
        default=8, metadata=_key(_TM + "floating-buffers-per-gate", _Int(0))
    )
    buffers_per_partition: int = field(
        default=16, metadata=_key(_TM + "buffers-per-partition", _Int(1))
    )

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True)
class PipelineConfig:
    """``parallelism.default`` and ``pipeline.*``.

    ``max_parallelism`` None derives it from the parallelism by Flink's rule;
    :attr:`effective_max_parallelism` is the value in force.
    """

    parallelism: int = field(
        default=1, metadata=_key("parallelism.default", _Int(1, UPPER_BOUND_MAX_PARALLELISM))
    )
    max_parallelism: int | None = field(
        default=None,
        metadata=_key("pipeline.max-parallelism", _Int(1, UPPER_BOUND_MAX_PARALLELISM)),
    )
    name: str | None = field(default=None, metadata=_key("pipeline.name", _Text()))

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.max_parallelism is not None and self.parallelism > self.max_parallelism:
            raise ConfigError(
                "parallelism.default exceeds pipeline.max-parallelism",
                detail=f"{self.parallelism} > {self.max_parallelism}",
                hint="raise pipeline.max-parallelism, or leave it unset to derive it",
            )

    @property
    def effective_max_parallelism(self) -> int:
        if self.max_parallelism is not None:
            return self.max_parallelism
        return compute_default_max_parallelism(self.parallelism)


_RS = "restart-strategy."


@dataclass(frozen=True)
class RestartConfig:
    """``restart-strategy.*``. ``strategy`` None means: fixed-delay when checkpointing
    is on, none otherwise (:attr:`Config.restart_strategy` is the one in force)."""

    strategy: RestartStrategy | None = field(
        default=None,
        metadata=_key(
            _RS + "type",
            _Choice(
                {
                    **{m.value: m for m in RestartStrategy},
                    "off": RestartStrategy.NONE,
                    "disable": RestartStrategy.NONE,
                    "fixeddelay": RestartStrategy.FIXED_DELAY,
                    "failurerate": RestartStrategy.FAILURE_RATE,
                },
                refused=dict.fromkeys(
                    ("exponential-delay", "exponentialdelay"), "is not supported by spillover"
                ),
            ),
        ),
    )
    fixed_delay_attempts: int = field(
        default=1, metadata=_key(_RS + "fixed-delay.attempts", _Int(0))
    )
    fixed_delay_delay: timedelta = field(
        default=timedelta(seconds=1), metadata=_key(_RS + "fixed-delay.delay", _Duration())
    )
    failure_rate_max_failures_per_interval: int = field(
        default=1, metadata=_key(_RS + "failure-rate.max-failures-per-interval", _Int(1))
    )
    failure_rate_interval: timedelta = field(
        default=timedelta(minutes=1),
        metadata=_key(
            _RS + "failure-rate.failure-rate-interval", _Duration(timedelta(milliseconds=1))
        ),
    )
    failure_rate_delay: timedelta = field(
        default=timedelta(seconds=1), metadata=_key(_RS + "failure-rate.delay", _Duration())
    )

    def __post_init__(self) -> None:
        _check_fields(self)

    @property
    def fixed_delay_delay_s(self) -> float:
        return _seconds(self.fixed_delay_delay)

    @property
    def failure_rate_interval_s(self) -> float:
        return _seconds(self.failure_rate_interval)

    @property
    def failure_rate_delay_s(self) -> float:
        return _seconds(self.failure_rate_delay)


@dataclass(frozen=True)
class DeploymentConfig:
    """``spillover.*``: spillover's own keys, where subtasks run and how."""

    executor: Executor = field(
        default=Executor.LOCAL, metadata=_key("spillover.executor", _enum_choice(Executor))
    )
    spark_master: str | None = field(
        default=None, metadata=_key("spillover.spark.master", _SparkMaster())
    )

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True)
class RecoveryConfig:
    """How a job restores: from which checkpoint, and what it may leave behind."""

    path: str | None = field(default=None, metadata=_key("execution.state-recovery.path", _Text()))
    ignore_unclaimed_state: bool = field(
        default=False, metadata=_key("execution.state-recovery.ignore-unclaimed-state", _Bool())
    )
    without_channel_state_checkpoint: int = field(
        default=-1,
        metadata=_key(_CP + "recover-without-channel-state.checkpoint-id", _Int(-1, 2**62)),
    )
    force_forward_rescale: bool = field(
        default=False, metadata=_key(_CP + "unaligned.forward-rescale.forced", _Bool())
    )

    def __post_init__(self) -> None:
        _check_fields(self)


# --- the whole tree -----------------------------------------------------------------------

_SECTIONS: Final[tuple[tuple[str, type[Any]], ...]] = (
    ("checkpointing", CheckpointingConfig),
    ("state", StateConfig),
    ("network", NetworkConfig),
    ("pipeline", PipelineConfig),
    ("restart", RestartConfig),
    ("recovery", RecoveryConfig),
    ("deployment", DeploymentConfig),
)
# key -> (section attribute, field name, spec)
_OPTIONS: Final[dict[str, tuple[str, str, _Spec]]] = {
    f.metadata[_SPEC].key: (attr, f.name, f.metadata[_SPEC])
    for attr, cls in _SECTIONS
    for f in fields(cls)
}
# Names the same option has in other Flink versions.
_ALIASES: Final[dict[str, str]] = {
    "execution.checkpointing.unaligned": _UNALIGNED,
    "execution.checkpointing.alignment-timeout": _ALIGNED_TIMEOUT,
    "execution.checkpointing.dir": "state.checkpoints.dir",
    "execution.checkpointing.num-retained": "state.checkpoints.num-retained",
}

KEYS: Final[tuple[str, ...]] = tuple(_OPTIONS)
"""Every dotted key, in documentation order."""


def env_var(key: str) -> str:
    """The environment variable of a key: ``SPILLOVER_`` + the key upper-cased with ``.`` and
    ``-`` as ``_``; a ``spillover.*`` key drops its own prefix (``SPILLOVER_EXECUTOR``)."""
    name = key.removeprefix("spillover.")
    return ENV_PREFIX + re.sub(r"[.-]", "_", name).upper()


_ENV_KEYS: Final[dict[str, str]] = {env_var(k): k for k in (*KEYS, *_ALIASES)}
# Variables under these prefixes must be keys; other SPILLOVER_* variables belong to
# the build and tools (docs/configuration.md) and are left alone.
_ENV_NAMESPACES: Final = tuple(
    sorted({env_var(k.split(".")[0]) + "_" for k in KEYS if not k.startswith("spillover.")})
)


def _suggest(name: str, known: list[str]) -> str | None:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"did you mean {close[0]}?" if close else None


def _flatten(options: object, where: str) -> dict[str, object]:
    """Nested mappings (YAML/TOML sections) to dotted keys."""
    if not isinstance(options, Mapping):
        raise ConfigError(
            f"configuration{where} must be a mapping of keys to values",
            detail=f"got {type(options).__name__}",
        )
    flat: dict[str, object] = {}
    for name, value in options.items():
        if not isinstance(name, str):
            raise ConfigError(f"configuration key {name!r}{where} is not a string")
        inner = _flatten(value, where) if isinstance(value, Mapping) else {"": value}
        for rest, leaf in inner.items():
            key = f"{name}.{rest}" if rest else name
            if key in flat:
                raise ConfigError(f"{key} is given twice{where}")
            flat[key] = leaf
    return flat


def _parse_options(options: object, where: str = "") -> dict[str, object]:
    """Canonical key -> typed value (None: back to the default), every value checked."""
    parsed: dict[str, object] = {}
    for name, raw in _flatten(options, where).items():
        key = _ALIASES.get(name.strip(), name.strip())
        if key not in _OPTIONS:
            raise ConfigError(
                f"unknown configuration key {name!r}{where}",
                hint=_suggest(name, [*KEYS, *_ALIASES]) or "docs/configuration.md lists every key",
            )
        if key in parsed:
            raise ConfigError(f"{key} is given twice{where}", detail=f"also as {name}")
        spec = _OPTIONS[key][2]
        if raw is None:
            parsed[key] = None
            continue
        try:
            value = spec.kind.parse(raw)
        except _Bad as bad:
            raise spec.error(bad, where) from None
        spec.check(value, where)
        parsed[key] = value
    return parsed


def _build(values: Mapping[str, object]) -> Config:
    sections: dict[str, dict[str, Any]] = {attr: {} for attr, _ in _SECTIONS}
    for key, value in values.items():
        if value is not None:
            attr, name, _ = _OPTIONS[key]
            sections[attr][name] = value
    return Config(**{attr: cls(**sections[attr]) for attr, cls in _SECTIONS})


@dataclass(frozen=True)
class Config:
    """The runtime's whole configuration: frozen, hashable, picklable.

    Build one with the constructor (typed sections), :meth:`from_dict`,
    :meth:`from_file`, :meth:`from_env` or :meth:`load`; derive another with
    :meth:`with_options`. Sections: ``checkpointing``, ``state``, ``network``,
    ``pipeline``, ``restart`` and ``deployment``.
    """

    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    state: StateConfig = field(default_factory=StateConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    restart: RestartConfig = field(default_factory=RestartConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    deployment: DeploymentConfig = field(default_factory=DeploymentConfig)

    FILE_SUFFIXES: ClassVar[tuple[str, ...]] = (".yaml", ".yml", ".toml")

    def __post_init__(self) -> None:
        for attr, cls in _SECTIONS:
            if not isinstance(getattr(self, attr), cls):
                raise ConfigError(f"Config.{attr} must be a {cls.__name__}")
        cp = self.checkpointing
        if cp.enabled and self.state.checkpoints_dir is None:
            raise ConfigError(
                f"{_CP}interval is set but state.checkpoints.dir is not",
                detail="checkpointing is on and needs somewhere to write checkpoints",
                hint="set state.checkpoints.dir to a path or URI such as /data/checkpoints or "
                f"s3://bucket/checkpoints, or unset {_CP}interval",
            )
        if cp.max_inflight_bytes is not None and cp.max_inflight_bytes < self.network.segment_size:
            raise ConfigError(
                f"{_CP}unaligned.max-inflight-bytes is below taskmanager.memory.segment-size",
                detail=f"{format_memory_size(cp.max_inflight_bytes)} < "
                f"{format_memory_size(self.network.segment_size)}",
                hint="allow at least one network buffer of in-flight data, or leave it unset",
            )

    # --- sources ---

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> Config:
        """From dotted keys (``{"execution.checkpointing.interval": "10 s"}``); nested
        mappings are joined with dots. Values are typed or strings; None means the default."""
        return _build(_parse_options(options))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Config:
        """From a YAML (``.yaml``, ``.yml``) or TOML (``.toml``) file of nested sections,
        flat dotted keys, or both."""
        return _build(_read_file(Path(path)))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Config:
        """From ``SPILLOVER_*`` variables (:func:`env_var`); ``environ`` defaults to
        ``os.environ``. An empty variable is ignored."""
        return _build(_read_env(os.environ if environ is None else environ))

    @classmethod
    def load(
        cls,
        file: str | os.PathLike[str] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> Config:
        """Merges, by precedence, ``overrides`` > environment > ``file`` > defaults, then
        checks the result as a whole. ``env`` defaults to ``os.environ``; pass ``{}`` to
        ignore the environment."""
        values = _read_file(Path(file)) if file is not None else {}
        values.update(_read_env(os.environ if env is None else env))
        values.update(_parse_options(overrides or {}, " in overrides"))
        return _build(values)

    def with_options(self, options: Mapping[str, Any]) -> Config:
        """A copy with some keys changed (None: back to the default), checked as a whole."""
        return _build({**self._values(), **_parse_options(options)})

    # --- views ---

    def _values(self) -> dict[str, object]:
        return {
            key: getattr(getattr(self, attr), name) for key, (attr, name, _) in _OPTIONS.items()
        }

    def to_dict(self) -> dict[str, object]:
        """Every key that has a value, as plain JSON/TOML data (durations and sizes as
        strings); unset optional keys are left out. ``Config.from_dict`` reads it back."""
        return {
            key: _OPTIONS[key][2].kind.dump(value)
            for key, value in self._values().items()
            if value is not None
        }

    @property
    def max_parallelism(self) -> int:
        """The max parallelism in force: set, or derived from the parallelism."""
        return self.pipeline.effective_max_parallelism

    @property
    def restart_strategy(self) -> RestartStrategy:
        """The restart strategy in force: set, or fixed-delay when checkpointing is on."""
        if self.restart.strategy is not None:
            return self.restart.strategy
        return RestartStrategy.FIXED_DELAY if self.checkpointing.enabled else RestartStrategy.NONE

    def restore_critical(self) -> dict[str, object]:
        """What a checkpoint's metadata must record to be restored: the max parallelism
        (it fixes the key groups), the state-file format version and the codec."""
        return {
            "max-parallelism": self.max_parallelism,
            "format-version": FORMAT_VERSION,
            "codec": self.checkpointing.compression,
        }

    def with_restored(self, saved: Mapping[str, object]) -> Config:
        """The config to restore a checkpoint whose metadata holds ``saved`` (from
        :meth:`restore_critical`): its max parallelism when none is set here."""
        version = saved.get("format-version")
        if version != FORMAT_VERSION:
            raise ConfigError(
                "the checkpoint was written in an unknown state-file format version",
                detail=f"format-version {version!r}; this spillover writes {FORMAT_VERSION}",
                hint="restore it with the spillover version that wrote it",
            )
        saved_max = saved.get("max-parallelism")
        if isinstance(saved_max, bool) or not isinstance(saved_max, int):
            raise ConfigError(
                "the checkpoint metadata has no valid max-parallelism",
                detail=f"got {saved_max!r}",
            )
        mine = self.pipeline.max_parallelism
        if mine is not None and mine != saved_max:
            raise ConfigError(
                "pipeline.max-parallelism differs from the checkpoint's",
                detail=f"set to {mine}, the checkpoint has {saved_max}",
                hint="keyed state cannot change its max parallelism; unset "
                "pipeline.max-parallelism or set it to the checkpoint's value",
            )
        if saved_max < self.pipeline.parallelism:
            raise ConfigError(
                "parallelism.default exceeds the checkpoint's max parallelism",
                detail=f"{self.pipeline.parallelism} > {saved_max}",
                hint=f"restore at a parallelism of at most {saved_max}",
            )
        return replace(self, pipeline=replace(self.pipeline, max_parallelism=saved_max))


def _read_file(path: Path) -> dict[str, object]:
    where = f" in {path}"
    suffix = path.suffix.lower()
    if suffix not in Config.FILE_SUFFIXES:
        raise ConfigError(
            f"unknown configuration file type {path.suffix!r}",
            path=str(path),
            hint="use a .yaml, .yml or .toml file",
        )
    text = path.read_text(encoding="utf-8")
    if suffix == ".toml":
        try:
            data: object = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("bad TOML", path=str(path), detail=str(exc)) from None
    else:
        try:
            yaml = importlib.import_module("yaml")
        except ImportError:
            raise ConfigError(
                "reading a YAML file needs PyYAML", path=str(path), hint="pip install pyyaml"
            ) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError("bad YAML", path=str(path), detail=str(exc)) from None
    return _parse_options({} if data is None else data, where)


def _read_env(environ: Mapping[str, str]) -> dict[str, object]:
    parsed: dict[str, object] = {}
    for var, raw in environ.items():
        if not var.startswith(ENV_PREFIX):
            continue
        key = _ENV_KEYS.get(var)
        if key is None:
            if var.startswith(_ENV_NAMESPACES):
                raise ConfigError(
                    f"unknown environment variable {var}",
                    hint=_suggest(var, list(_ENV_KEYS)) or "docs/configuration.md lists them",
                )
            continue
        if not raw.strip():
            continue
        for canonical, value in _parse_options({key: raw}, f" from {var}").items():
            if canonical in parsed:
                raise ConfigError(f"{canonical} is set twice in the environment, under two names")
            parsed[canonical] = value
    return parsed
