"""Option kinds and keys: how a raw value is parsed, a typed one checked and
dumped as plain data, and how a dataclass field declares its dotted key."""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, Final

from spillover.config.units import (
    _DURATION_FORM,
    _INT_MAX,
    _MEMORY_FORM,
    _Bad,
    _to_duration,
    _to_memory_size,
    format_duration,
    format_memory_size,
)
from spillover.errors import ConfigError

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
