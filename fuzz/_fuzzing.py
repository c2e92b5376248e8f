"""Running a fuzz target under atheris (standard library only, atheris imported lazily).

Each ``fuzz_<target>.py`` imports the code it fuzzes inside :func:`instrumented`, so
that atheris adds coverage feedback to spillover's Python modules when the file runs
as a fuzzer, and nothing happens when a test imports it to replay inputs (without
atheris installed, too). :func:`main` adds the target's default libFuzzer flags
(those given on the command line win) and hands over to ``atheris.Fuzz()``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

FUZZ_DIR = Path(__file__).resolve().parent


@contextlib.contextmanager
def instrumented(module_name: str) -> Iterator[None]:
    """Imports inside the block get atheris's coverage instrumentation (spillover's
    modules only) when ``module_name`` is ``__main__``, i.e. the file runs as a fuzzer."""
    if module_name != "__main__":
        yield
        return
    import atheris  # type: ignore[import-untyped]

    with atheris.instrument_imports(include=["spillover"]):
        yield


def with_defaults(argv: list[str], defaults: dict[str, str]) -> list[str]:
    """``argv`` with ``-flag=value`` for every default flag it does not set itself."""
    given = {a.partition("=")[0] for a in argv[1:] if a.startswith("-")}
    return argv[:1] + [f"{k}={v}" for k, v in defaults.items() if k not in given] + argv[1:]


def main(test_one_input: Callable[[bytes], None], defaults: dict[str, str]) -> None:
    """Runs ``test_one_input`` under libFuzzer with ``sys.argv`` (libFuzzer's flags and
    corpus directories) plus ``defaults``."""
    import atheris

    atheris.Setup(with_defaults(sys.argv, defaults), test_one_input)
    atheris.Fuzz()
