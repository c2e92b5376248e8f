"""The lifecycle CLI against a real detached job: run, list, savepoint, stop, cancel,
dispose; and each bad input as one line, exit code 2, with the job untouched."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from spillover.cli import main
from spillover.cli.jobs import _run_with_progress
from spillover.deploy.local import LocalExecutor
from spillover.errors import SpilloverError
from spillover.rest import ServedJob, registry
from support.rest_jobs import PATH, backpressured, config

JOB = f"{PATH}:backpressured"


def _options(tmp: Path) -> list[str]:
    return [
        "-D", "execution.checkpointing.interval=100 ms",
        "-D", "execution.checkpointing.unaligned.enabled=true",
        "-D", f"state.checkpoints.dir={tmp / 'ckpt'}",
    ]  # fmt: skip


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("SPILLOVER_HOME", str(tmp_path / "home"))
    yield tmp_path / "home"
    for entry in registry.entries():  # a job a failed test left running
        if entry.effective_state in ("RUNNING", "RESTARTING", "INITIALIZING"):
            os.kill(entry.pid, signal.SIGTERM)


def _detach(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "spillover.cli", "run", JOB, "--detached", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ,
    )
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.splitlines()[0]
    assert len(job_id) == 32 and int(job_id, 16) >= 0
    return job_id


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _wait_for_checkpoint(capsys: pytest.CaptureFixture[str], job_id: str) -> None:
    import time

    deadline = time.monotonic() + 60
    while registry.read(job_id).last_checkpoint is None:
        assert time.monotonic() < deadline, "no checkpoint in 60 s"
        time.sleep(0.05)


def test_run_detached_savepoint_stop_and_resume(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job_id = _detach(*_options(tmp_path))
    code, out, _ = _cli(capsys, "list", "--json")
    (listed,) = json.loads(out)
    assert code == 0 and listed["id"] == job_id and listed["state"] == "RUNNING"
    assert listed["rest_url"].startswith("http://127.0.0.1:")
    _wait_for_checkpoint(capsys, job_id)

    code, out, _ = _cli(capsys, "savepoint", job_id[:8], "--savepoint-dir", str(tmp_path / "sp"))
    savepoint = out.strip()
    assert code == 0 and Path(savepoint, "_metadata").exists(), out
    assert savepoint.startswith(str(tmp_path / "sp"))
    assert registry.read(job_id).effective_state == "RUNNING"

    code, out, err = _cli(capsys, "rescale", job_id[:8], "--parallelism", "3")
    assert code == 0, err
    assert re.fullmatch(
        f"job {job_id} rescaled from 2 to 3: the first record at the new parallelism came "
        r"\d+ ms after the request\n",
        out,
    ), out
    entry = registry.read(job_id)
    assert entry.effective_state == "RUNNING" and entry.rest_url == listed["rest_url"]
    assert [c.command for c in entry.commands] == ["savepoint", "rescale"]

    code, out, _ = _cli(capsys, "stop", job_id, "--drain")
    final = out.strip()
    assert code == 0 and Path(final, "_metadata").exists(), out
    assert registry.read(job_id).state == "FINISHED"
    # The job's event log has every command its master accepted, in order.
    from spillover.runtime.jobevents import EVENTS_DIR, JobEventLog

    (events,) = (tmp_path / "ckpt").glob(f"*/{EVENTS_DIR}")
    logged = JobEventLog.open(events).replay()
    assert [c.command for c in logged.commands] == ["savepoint", "rescale", "stop"]
    assert logged.stop is None and logged.status == "finished"

    code, _, err = _cli(capsys, "stop", job_id)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"spillover stop: error: job {job_id} has ended (FINISHED)")

    resumed = _detach(
        *_options(tmp_path), "--from-savepoint", savepoint, "--claim-mode", "no-claim"
    )
    assert resumed != job_id
    code, out, err = _cli(capsys, "cancel", resumed)
    assert code == 0 and out.strip() == f"job {resumed} CANCELED", err

    code, out, _ = _cli(capsys, "savepoint", "--dispose", savepoint)
    assert code == 0 and not Path(savepoint).exists()


def test_bad_inputs_are_one_line_and_leave_the_job_alone(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job_id = _detach(*_options(tmp_path))
    _wait_for_checkpoint(capsys, job_id)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cases = {
        ("savepoint", "0000ffff"): "spillover savepoint: error: no job '0000ffff'",
        ("stop", "0000ffff", "--drain"): "spillover stop: error: no job '0000ffff'",
        ("cancel", "0000ffff"): "spillover cancel: error: no job '0000ffff'",
        (
            "savepoint",
            job_id,
            "--savepoint-dir",
            str(blocker / "sp"),
        ): "spillover savepoint: error: cannot write the folder of --savepoint-dir",
        (
            "stop",
            job_id,
            "--savepoint-dir",
            str(blocker / "sp"),
        ): "spillover stop: error: cannot write the folder of --savepoint-dir",
        ("savepoint", "--dispose", str(tmp_path)): "spillover savepoint: error: not a savepoint",
        ("rescale", job_id, "--parallelism", "2"): "spillover rescale: error: job "
        "'backpressured' runs at that parallelism already",
        ("rescale", job_id, "--parallelism", "0"): "spillover rescale: error: --parallelism "
        "must be at least 1",
        ("rescale", job_id, "--parallelism", "129"): "spillover rescale: error: parallelism "
        "129 of source exceeds the job's max parallelism 128",
    }
    for argv, expected in cases.items():
        code, out, err = _cli(capsys, *argv)
        assert code == 2 and out == "" and err.count("\n") == 1, (argv, err)
        assert err.startswith(expected), (argv, err)
        assert registry.read(job_id).effective_state == "RUNNING", argv
    code, out, _ = _cli(capsys, "cancel", job_id)
    assert code == 0 and out.strip() == f"job {job_id} CANCELED"
    code, _, err = _cli(capsys, "savepoint", job_id)
    assert code == 2 and f"job {job_id} has ended (CANCELED)" in err


def test_a_run_with_progress_raises_the_jobs_own_error(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-savepoint")
    job = ServedJob(LocalExecutor(backpressured(), config(tmp_path), restore_checkpoint=missing))
    with pytest.raises(SpilloverError) as raised:
        _run_with_progress(job)
    assert raised.value is job.error and missing in str(raised.value)
