"""The ``spillover`` command line.

Every option has an environment-variable twin (shown in ``--help``); the command
line wins over the environment.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from spillover import __version__
from spillover.cli import bench, demo, inspect, verify
from spillover.errors import SpilloverError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spillover",
        description="Persist, restore and rescale the in-flight data of streaming dataflows.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (inspect, demo, verify, bench):
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "size_mb", 1) <= 0 or getattr(args, "buffer_size", 1) <= 0:
        parser.error("--size-mb and --buffer-size must be positive")
    try:
        return int(args.func(args))
    except SpilloverError as e:
        print(f"spillover: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
