"""Command-line options with environment-variable twins, the exit codes, and shared
formatting."""

from __future__ import annotations

import argparse
import os
from typing import Any

from spillover.errors import ConfigError
from spillover.storage.folders import check_folder as check_folder  # the commands' import

# The exit codes of every command (docs/getting-started.md).
EXIT_OK = 0  # done, and every check passed (verify: exact)
EXIT_CHECK_FAILED = 1  # the command ran to its end, and what it checked is wrong
EXIT_USAGE = 2  # bad usage or configuration: nothing ran
EXIT_RUN_FAILED = 3  # the run could not complete: storage, Spark, a job that failed


class BadEnvValue:
    """The value of an environment twin that its option's type or choices refuse. It
    stands as the option's default, so the command line still wins over it; the
    command reports it as bad usage only when it would be used."""

    def __init__(self, env: str, value: str, problem: str) -> None:
        self.env, self.value, self.problem = env, value, problem

    def __str__(self) -> str:
        return f"bad {self.env}={self.value!r}: {self.problem}"


def _from_env(env: str, value: str, convert: Any, choices: Any) -> Any:
    """An environment variable's value, checked as argparse checks a flag's."""
    try:
        got = convert(value)
    except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
        return BadEnvValue(env, value, str(e) or "not a valid value")
    if choices is not None and got not in choices:
        return BadEnvValue(env, value, "choose from " + ", ".join(map(str, choices)))
    return got


def yes_no(text: str) -> bool:
    """A yes/no value: 1/true/yes/on or 0/false/no/off (empty: no); anything else is
    refused rather than read as no."""
    v = str(text).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("", "0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(
        f"expected yes (1/true/yes/on) or no (0/false/no/off), not {text!r}"
    )


class _EnvDefault(argparse.Action):
    """An option whose default comes from an environment variable."""

    def __init__(self, env: str, default: Any = None, **kw: Any) -> None:
        if env in os.environ:
            default = _from_env(env, os.environ[env], kw.get("type", str), kw.get("choices"))
            kw["required"] = False
        kw["help"] = f"{kw.get('help', '')} [env {env}; default {default}]"
        super().__init__(default=default, **kw)

    def __call__(self, parser: Any, ns: Any, values: Any, option: Any = None) -> None:
        setattr(ns, self.dest, values)


def env_option(p: argparse.ArgumentParser, *names: str, env: str, **kw: Any) -> None:
    p.add_argument(*names, action=_EnvDefault, env=env, **kw)


def define_option(p: argparse.ArgumentParser, help: str) -> None:
    """``-D KEY=VALUE``, repeatable, into ``args.define`` (read with :func:`defines`)."""
    p.add_argument("-D", dest="define", action="append", default=[], metavar="KEY=VALUE", help=help)


def defines(pairs: list[str]) -> dict[str, str]:
    """The ``-D`` options as key -> value; a pair without ``=`` or a key raises ConfigError."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"-D takes key=value, not {pair!r}")
        out[key.strip()] = value.strip()
    return out


def env_flag(p: argparse.ArgumentParser, name: str, *, env: str, help: str) -> None:
    """A yes/no flag: ``--name`` alone is yes; ``--name no`` or the variable ``env``
    (:func:`yes_no`) set it too."""
    env_option(
        p,
        name,
        env=env,
        type=yes_no,
        nargs="?",
        const=True,
        default=False,
        help=help,
    )


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
