"""The whole tree, :class:`Config`: built from code, dicts of dotted keys, YAML or
TOML files and ``SPILLOVER_*`` environment variables, with every value checked."""

from __future__ import annotations

import difflib
import importlib
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar, Final

from spillover.config.options import (
    _SPEC,
    _Spec,
)
from spillover.config.sections import (
    _ALIGNED_TIMEOUT,
    _CP,
    _UNALIGNED,
    CheckpointingConfig,
    DeploymentConfig,
    ExecutionConfig,
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
    _Bad,
    format_memory_size,
)
from spillover.errors import ConfigError
from spillover.storage import FORMAT_VERSION

# --- the whole tree -----------------------------------------------------------------------

_SECTIONS: Final[tuple[tuple[str, type[Any]], ...]] = (
    ("checkpointing", CheckpointingConfig),
    ("state", StateConfig),
    ("network", NetworkConfig),
    ("pipeline", PipelineConfig),
    ("restart", RestartConfig),
    ("recovery", RecoveryConfig),
    ("deployment", DeploymentConfig),
    ("execution", ExecutionConfig),
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
    "execution.checkpointing.savepoint-dir": "state.savepoints.dir",
}

# Flink's keys that have no work to do here: refused with why, not ignored.
_RETIRED: Final[dict[str, str]] = {
    "execution.checkpointing.unaligned.forced": (
        "is not needed: unaligned checkpoints work for every job here, loops included "
        "(forward edges that change parallelism: "
        "execution.checkpointing.unaligned.forward-rescale.forced)"
    ),
}

KEYS: Final[tuple[str, ...]] = tuple(_OPTIONS)
"""Every dotted key, in documentation order."""


def canonical_key(name: str) -> str:
    """The key ``name`` stands for: itself, or the key an older name of it (an alias
    Flink also accepts) sets."""
    return _ALIASES.get(name.strip(), name.strip())


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
        key = canonical_key(name)
        if key in _RETIRED:
            raise ConfigError(f"{key} {_RETIRED[key]}{where}", hint="remove it")
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
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)

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
                hint=f"set it to at least {format_memory_size(self.network.segment_size)} "
                "(one network buffer is persisted whole), lower taskmanager.memory.segment-size, "
                "or leave it unset",
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
        """The restart strategy in force: set, or fixed-delay when checkpointing is on
        or the job runs in batch mode (a failed task re-runs its region)."""
        if self.restart.strategy is not None:
            return self.restart.strategy
        batch = self.execution.runtime_mode is RuntimeMode.BATCH
        return (
            RestartStrategy.FIXED_DELAY
            if self.checkpointing.enabled or batch
            else RestartStrategy.NONE
        )

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
