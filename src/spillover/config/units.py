"""Value formats of options: durations (``100ms``, ``1 min``) and memory sizes
(``32kb``, ``1 gb``), parsed and printed the way Flink's users write them."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Final

from spillover.errors import ConfigError

ENV_PREFIX: Final = "SPILLOVER_"
KiB: Final = 1024
MiB: Final = 1024 * KiB
_INT_MAX: Final = 2**31 - 1  # Flink's options are Java ints
_MICROSECOND: Final = timedelta(microseconds=1)


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
