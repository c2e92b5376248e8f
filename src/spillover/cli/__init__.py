"""The ``spillover`` command line.

Every option has an environment-variable twin (shown in ``--help``); the command
line wins over the environment. Every error is one line, ``spillover <command>:
error: ...``, and the exit code says what kind (:mod:`spillover.cli.options`:
0 done, 1 a check failed, 2 bad usage or configuration, 3 the run could not
complete); ``SPILLOVER_TRACEBACK=1`` adds the traceback of an unexpected error.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from spillover import __version__
from spillover.cli import bench, chaos, demo, inspect, jobs, verify
from spillover.cli.options import EXIT_RUN_FAILED, EXIT_USAGE, BadEnvValue
from spillover.errors import ConfigError, SpilloverError


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line in the style of every other
    error, exit code 2 (the subcommands' parsers are of this class too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="spillover",
        description="Persist, restore and rescale the in-flight data of streaming dataflows.",
        epilog="Exit codes: 0 done (verify: exact), 1 the run ended and a check failed, "
        "2 bad usage or configuration, 3 the run could not complete (storage, Spark, "
        "a job that failed). See docs/getting-started.md.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (inspect, demo, verify, chaos, bench):
        command.add_parser(sub)
    jobs.add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    prog = f"spillover {args.command}"
    if extra:  # named by the command they were given to, not by spillover
        _Parser(prog=prog).error(f"unrecognized arguments: {' '.join(extra)}")
    bad = [v for v in vars(args).values() if isinstance(v, BadEnvValue)]
    if bad:  # an environment twin that the command line did not override
        _Parser(prog=prog).error(str(bad[0]))
    if getattr(args, "size_mb", 1) <= 0 or getattr(args, "buffer_size", 1) <= 0:
        _Parser(prog=prog).error("--size-mb and --buffer-size must be positive")
    try:
        return int(args.func(args))
    except ConfigError as e:  # nothing ran, or nothing that counts
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except SpilloverError as e:  # storage, a damaged file: the run could not go on
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_RUN_FAILED
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a job or Spark failed in a way no check foresaw
        if os.environ.get("SPILLOVER_TRACEBACK", "") not in ("", "0"):
            traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0]
        print(
            f"{prog}: error: the run could not complete: {type(e).__name__}: {first} "
            "(SPILLOVER_TRACEBACK=1 shows where)",
            file=sys.stderr,
        )
        return EXIT_RUN_FAILED
