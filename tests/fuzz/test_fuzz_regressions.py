"""Every input that ever found a bug with the fuzzers (``fuzz/regressions/<target>/``),
and the seed corpora (``fuzz/corpus/<target>/``), replayed through the fuzz targets'
own ``TestOneInput``: the same oracle, without atheris (docs/fuzzing.md)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

FUZZ_DIR = Path(__file__).resolve().parents[2] / "fuzz"
TARGETS = ["native_reader", "reference_reader", "handle", "metadata", "event_log", "lease"]


def target(name: str) -> ModuleType:
    """``fuzz/fuzz_<name>.py``, imported as a module (not instrumented: atheris unused)."""
    if str(FUZZ_DIR) not in sys.path:
        sys.path.insert(0, str(FUZZ_DIR))
    return importlib.import_module(f"fuzz_{name}")


def inputs(kind: str) -> Iterator[object]:
    for name in TARGETS:
        directory = FUZZ_DIR / kind / name
        for path in sorted(directory.iterdir()) if directory.is_dir() else []:
            if not path.name.startswith(".") and path.suffix != ".md":
                yield pytest.param(name, path, id=f"{name}/{path.name}")


@pytest.fixture(scope="module", autouse=True)
def _scratch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The targets' scratch files go to a temporary directory of this test run."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPILLOVER_FUZZ_SCRATCH", str(tmp_path_factory.mktemp("fuzz")))
        harness = target("native_reader").h
        mp.setattr(harness, "_scratch", None)
        yield


def test_every_target_has_a_regressions_directory() -> None:
    for name in TARGETS:
        assert (FUZZ_DIR / "regressions" / name).is_dir(), name
        assert (FUZZ_DIR / "corpus" / name).is_dir(), name
        assert (FUZZ_DIR / f"fuzz_{name}.py").is_file(), name


@pytest.mark.parametrize(("name", "path"), list(inputs("regressions")))
def test_regression_input_passes(name: str, path: Path) -> None:
    target(name).TestOneInput(path.read_bytes())


@pytest.mark.parametrize(("name", "path"), list(inputs("corpus")))
def test_seed_input_passes(name: str, path: Path) -> None:
    target(name).TestOneInput(path.read_bytes())
