"""Command-line options with environment-variable twins, the exit codes, and shared
formatting."""

from __future__ import annotations

import argparse
import os
from typing import Any

# The exit codes of every command (docs/getting-started.md).
EXIT_OK = 0  # done, and every check passed (verify: exact)
EXIT_CHECK_FAILED = 1  # the command ran to its end, and what it checked is wrong
EXIT_USAGE = 2  # bad usage or configuration: nothing ran
EXIT_RUN_FAILED = 3  # the run could not complete: storage, Spark, a job that failed


class _EnvDefault(argparse.Action):
    """An option whose default comes from an environment variable."""

    def __init__(self, env: str, default: Any = None, **kw: Any) -> None:
        if env in os.environ:
            default = kw.get("type", str)(os.environ[env])
            kw["required"] = False
        kw["help"] = f"{kw.get('help', '')} [env {env}; default {default}]"
        super().__init__(default=default, **kw)

    def __call__(self, parser: Any, ns: Any, values: Any, option: Any = None) -> None:
        setattr(ns, self.dest, values)


def env_option(p: argparse.ArgumentParser, *names: str, env: str, **kw: Any) -> None:
    p.add_argument(*names, action=_EnvDefault, env=env, **kw)


def env_flag(p: argparse.ArgumentParser, name: str, *, env: str, help: str) -> None:
    """A yes/no flag: ``--name`` alone is yes; ``--name no`` or the variable ``env``
    (1/true/yes/on, anything else no) set it too."""
    env_option(
        p,
        name,
        env=env,
        type=lambda v: str(v).strip().lower() in ("1", "true", "yes", "on"),
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
