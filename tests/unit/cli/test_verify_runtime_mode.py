"""``spillover verify --runtime-mode``: the flag and its twin reach the check, and what
means nothing in a batch run is refused in one line (exit 2) before any run."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from spillover.cli import main
from spillover.cli import verify as verify_cli


class _Exact:
    exact, errors = True, []

    def text(self) -> str:
        return "EXACT"

    def shortfalls(self) -> list[str]:
        return []


@pytest.fixture
def specs(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The specs ``verify`` was called with (no run)."""
    seen: list[Any] = []

    def verify(spec: Any, workdir: str | None = None) -> _Exact:
        seen.append(spec)
        return _Exact()

    monkeypatch.setattr(verify_cli, "verify", verify)
    return seen


@pytest.mark.parametrize(
    ("argv", "mode", "failures", "kill", "executor"),
    [
        ([], "streaming", 5, 0, "local"),
        (["--runtime-mode", "batch"], "batch", 5, 0, "local"),
        (["--runtime-mode", "batch", "--kill-driver", "2"], "batch", 0, 2, "local"),
        (["--runtime-mode", "batch", "--failures", "3"], "batch", 3, 0, "local"),
        (["--runtime-mode", "batch", "--executor", "spark"], "batch", 5, 0, "spark"),
    ],
)
def test_the_runtime_mode_reaches_the_check(
    argv: list[str], mode: str, failures: int, kill: int, executor: str, specs: list[Any]
) -> None:
    assert main(["verify", *argv]) == 0
    (spec,) = specs
    assert (spec.runtime_mode, spec.failures, spec.kill_driver) == (mode, failures, kill)
    assert spec.executor == executor


def test_the_runtime_mode_has_an_environment_twin(
    specs: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPILLOVER_VERIFY_RUNTIME_MODE", "batch")
    assert main(["verify"]) == 0
    assert main(["verify", "--runtime-mode", "streaming"]) == 0  # the command line wins
    assert [s.runtime_mode for s in specs] == ["batch", "streaming"]


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--stop-with-savepoint"], "a batch run cannot be stopped with a savepoint"),
        (["--drain"], "a batch run cannot be stopped with a savepoint"),
        (["--rescale-to", "3"], "a batch run cannot be stopped with a savepoint or rescaled"),
        (["--policy", "unaligned"], "so policy (--policy) means nothing in it"),
        (["--interval-ms", "50"], "so interval_ms (--interval-ms) means nothing in it"),
        (["--aligned-timeout-ms", "9"], "aligned_timeout_ms (--aligned-timeout-ms) means"),
        (["--max-inflight-bytes", "1024"], "max_inflight_bytes (--max-inflight-bytes) means"),
        (["--topology", "iteration"], "topology iteration cannot run in batch mode: a batch"),
    ],
)
def test_batch_refuses_what_means_nothing_in_it(
    flags: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One line, exit code 2, before anything is written to the work directory."""
    work = tmp_path / "work"
    assert main(["verify", "--runtime-mode", "batch", *flags, "--workdir", str(work)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and says in err, err
    assert err.startswith("spillover verify: error: ")
    assert not work.exists()


def test_batch_refuses_a_job_with_an_unbounded_source(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    jobs = tmp_path / "unbounded_jobs.py"
    jobs.write_text(
        "from spillover.streaming import GeneratorSource, ParquetSink, StreamEnvironment\n"
        "def make_job(out_dir, name, parallelism):\n"
        "    env = StreamEnvironment(name, parallelism=parallelism)\n"
        "    gen = GeneratorSource(partitions=2, rate_per_subtask=100.0)\n"
        "    env.from_source(gen, uid='src').sink(ParquetSink(out_dir), uid='sink')\n"
        "    return env\n"
    )
    work = tmp_path / "work"
    ref = f"{jobs}:make_job"
    try:
        code = main(["verify", "--runtime-mode", "batch", "--job", ref, "--workdir", str(work)])
    finally:
        sys.modules.pop("unbounded_jobs", None)
    assert code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert f"job {ref} cannot run in batch mode: a batch job needs bounded sources" in err
    assert "unbounded: src" in err
    assert not work.exists()


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["verify", "--runtime-mode", "bulk"], {}),
        (["verify"], {"SPILLOVER_VERIFY_RUNTIME_MODE": "bulk"}),
    ],
)
def test_an_unknown_runtime_mode_is_bad_usage(
    argv: list[str],
    env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as ei:
        main(argv)
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "bulk" in err, err
    assert err.startswith("spillover verify: error: ")
