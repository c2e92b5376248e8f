"""The command line: inspect reports and exit codes, demo runs end to end."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import spillover
from spillover.cli import main
from spillover.errors import StorageError


def _store(tmp_path: Path) -> spillover.GateStateHandle:
    storage = spillover.open_storage(tmp_path, checkpoint_id=9, subtask_index=2, compression="lz4")
    with storage.create_storer(0) as st:
        st.append(0, b"a" * 5000)
        st.append(1, b"event", spillover.DataType.EVENT)
        st.append(0, bytes(range(256)))
    with storage.create_storer(1, kind="output") as st2:
        st2.append(4, b"x")
    return st.close()


def test_inspect_reports_every_gate_and_channel(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _store(tmp_path)
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    reports = json.loads(capsys.readouterr().out)
    by_name = {Path(r["uri"]).name: r for r in reports}
    assert set(by_name) == {"in-00000.spill", "out-00001.spill"}
    r = by_name["in-00000.spill"]
    assert (r["checkpoint_id"], r["subtask_index"], r["gate_kind"]) == (9, 2, "input")
    assert r["channels"]["0"]["frames"] == 2 and r["channels"]["0"]["raw_bytes"] == 5256
    assert r["channels"]["0"]["lz4_frames"] == 1  # the run of "a" compresses, 0..255 does not
    assert r["channels"]["1"]["events"] == 1
    assert main(["inspect", str(tmp_path)]) == 0
    assert "every checksum verified" in capsys.readouterr().out


def test_commands_leave_the_sigpipe_disposition_alone(tmp_path: Path) -> None:
    """A driver in the same process (a job on Spark) must see EPIPE from a dead worker's
    socket, not die of SIGPIPE, after any command ran."""
    import signal

    before = signal.getsignal(signal.SIGPIPE)
    _store(tmp_path)
    assert main(["inspect", str(tmp_path)]) == 0
    assert signal.getsignal(signal.SIGPIPE) == before


def test_inspect_names_the_damage_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    handle = _store(tmp_path)
    data = bytearray(Path(handle.uri).read_bytes())
    data[64 + 24 + 3] ^= 0xFF  # inside the first payload
    Path(handle.uri).write_bytes(bytes(data))
    assert main(["inspect", handle.uri]) == 1
    out = capsys.readouterr().out
    assert "CorruptFrameError" in out and "offset 64" in out


def test_inspect_missing_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tmp_path / "nothing.spill")]) == 1
    assert "StateFileNotFoundError" in capsys.readouterr().out


def test_demo_runs_and_reports_against_raw(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPILLOVER_DEMO_SIZE_MB", "8")
    assert main(["demo", "--dir", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert "raw sequential write" in out and "restore, streaming" in out
    assert not (tmp_path / "demo").exists()  # cleaned up unless --keep


def test_bad_flags_fail_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        main(["demo", "--size-mb", "0"])
    assert ei.value.code == 2


def test_verify_refuses_a_master_without_the_spark_executor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before any run: nothing is written to the work directory."""
    work = tmp_path / "work"
    assert main(["verify", "--master", "local[2]", "--workdir", str(work)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spillover verify: error: ") and "(--master) needs the spark" in err
    assert "'local[2]' with executor 'local'" in err and "--executor spark" in err
    assert not work.exists()


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--drain", "--stop-with-savepoint", "unaligned"], "--drain takes an aligned savepoint"),
        (["--drain", "--topology", "rebalance-chain"], "a drained stop is checked record by"),
        (["--kill-driver", "-1"], "--kill-driver must be at least 0"),
        (["--kill-driver", "2", "--failures", "3"], "kills the driver instead of inducing"),
        (["--kill-driver", "2", "--rescale-to", "3"], "kills the driver instead of inducing"),
    ],
)
def test_verify_refuses_stops_it_cannot_check(
    flags: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", *flags, "--workdir", str(tmp_path / "work")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and says in err, err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--parallelism", "0"], "parallelism (--parallelism) must be at least 1: got 0"),
        (["--parallelism", "-2"], "parallelism (--parallelism) must be at least 1: got -2"),
        (["--failures", "-1"], "failures (--failures) must be at least 0: got -1"),
        (["--rescale-to", "0"], "rescale_to (--rescale-to) must be at least 1: got 0"),
        (["--records", "0"], "records (--records) must be at least 1: got 0"),
        (["--records", "-5"], "records (--records) must be at least 1: got -5"),
        (["--interval-ms", "0"], "interval_ms (--interval-ms) must be at least 1: got 0"),
        (["--interval-ms", "-100"], "interval_ms (--interval-ms) must be at least 1"),
        (["--rate", "-1"], "rate_per_subtask (--rate) must be positive: got -1"),
    ],
)
def test_verify_refuses_counts_out_of_range(
    flags: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One line, exit code 2, before anything is written to the work directory."""
    work = tmp_path / "work"
    assert main(["verify", *flags, "--workdir", str(work)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and says in err, err
    assert err.startswith("spillover verify: error: ")
    assert not work.exists()


@pytest.mark.parametrize(
    ("body", "returned"),
    [("pass", "NoneType"), ("return {'env': out_dir}", "dict")],
)
def test_verify_names_a_job_that_returns_no_environment(
    body: str, returned: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    jobs = tmp_path / "not_an_env_jobs.py"
    jobs.write_text(f"def make_job(out_dir, name, parallelism):\n    {body}\n")
    ref = f"{jobs}:make_job"
    try:
        code = main(["verify", "--job", ref, "--workdir", str(tmp_path / "work")])
    finally:
        sys.modules.pop("not_an_env_jobs", None)
    assert code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert f"error: job {ref} returned {returned}, not a StreamEnvironment" in err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        main(["--version"])
    assert ei.value.code == 0
    assert capsys.readouterr().out == f"spillover {spillover.__version__}\n"


def _unwritable(tmp_path: Path) -> Path:
    """A directory no one can create, root included: its parent is a file."""
    (tmp_path / "a-file").write_text("")
    return tmp_path / "a-file" / "dir"


@pytest.mark.parametrize("where", ["proc", "under-a-file"])
def test_demo_refuses_a_directory_it_cannot_write(
    where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = "/proc/unwritable" if where == "proc" else str(_unwritable(tmp_path))
    assert main(["demo", "--size-mb", "1", "--dir", path]) == 2
    std = capsys.readouterr()
    assert len(std.err.strip().splitlines()) == 1, std.err
    assert std.err.startswith(
        f"spillover demo: error: cannot write to the demo directory [file {path}]"
    )
    assert std.out == ""


def test_demo_removes_only_its_own_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "mine.txt").write_text("keep me")
    assert main(["demo", "--size-mb", "1", "--dir", str(tmp_path)]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["mine.txt"]


@pytest.mark.parametrize("flag", ["--out", "--json", "--markdown"])
def test_bench_checks_its_outputs_before_running(
    flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from spillover.cli import bench

    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("ran before the check"))
    bad = _unwritable(tmp_path)
    path = str(bad) if flag == "--out" else str(bad / "report")
    argv = ["bench", "--executor", "local", "--out", str(tmp_path / "results"), flag, path]
    assert main(argv) == 2
    std = capsys.readouterr()
    assert len(std.err.strip().splitlines()) == 1, std.err
    env = "SPILLOVER_BENCH_CLI_" + flag[2:].upper()
    assert f"bench: error: cannot write the folder of {flag} (env {env})" in std.err
    assert std.out == ""


def test_bench_refuses_a_json_path_that_is_a_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "--executor", "local", "--out", str(tmp_path / "results")]
    assert main([*argv, "--json", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "is a directory" in err, err


def test_inspect_finds_state_files_in_subdirectories(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _store(tmp_path / "job" / "task-1")
    _store(tmp_path / "job" / "task-0")
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    found = [Path(r["uri"]).relative_to(tmp_path) for r in json.loads(capsys.readouterr().out)]
    assert [str(p) for p in found] == [
        "job/task-0/in-00000.spill",
        "job/task-0/out-00001.spill",
        "job/task-1/in-00000.spill",
        "job/task-1/out-00001.spill",
    ]
    assert main(["inspect", str(tmp_path)]) == 0
    assert capsys.readouterr().out.count("every checksum verified") == 4


def test_inspect_prints_a_job_event_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from spillover.runtime.jobevents import (
        CheckpointCompleted,
        GenerationStarted,
        JobEventLog,
        JobSubmitted,
        SplitsAssigned,
        TaskFinished,
    )

    events = tmp_path / "ckpts" / "job" / "_events"
    log = JobEventLog.open(events, clock=lambda: 1_700_000_000.0)
    log.append(JobSubmitted("job", "fp-1", 2, {"execution.checkpointing.interval": "1s"}))
    log.append(GenerationStarted(1, 2, "submitted"))
    log.append(SplitsAssigned("src", {0: ("a",), 1: ("b", "c")}))
    log.flush()
    log.append(TaskFinished("map", 1, 1))
    log.append(CheckpointCompleted(4, "ckpts/job/chk-4/_metadata"))
    log.flush()
    assert main(["inspect", str(events)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"job event log {events}") and "5 events" in out[0]
    assert out[1].split()[:3] == ["#0", "2023-11-14T22:13:20.000+00:00", "job-submitted"]
    assert 'graph_fingerprint="fp-1"' in out[1] and "parallelism=2" in out[1]
    assert [line.split()[2] for line in out[2:6]] == [
        "generation-started",
        "splits-assigned",
        "task-finished",
        "checkpoint-completed",
    ]
    summary = "\n".join(out[6:])
    assert "summary: running" in summary
    assert "last completed checkpoint 4: ckpts/job/chk-4/_metadata" in summary
    assert "1 finished task(s): map-1" in summary
    assert "splits of src: {0: ['a'], 1: ['b', 'c']}" in summary

    assert main(["inspect", str(events), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["events"]) == 5 and doc["events"][0]["kind"] == "job-submitted"
    assert doc["summary"]["checkpoint"] == {
        "checkpoint_id": 4,
        "metadata_path": "ckpts/job/chk-4/_metadata",
    }
    assert doc["summary"]["splits"] == {"src": {"0": ["a"], "1": ["b", "c"]}}

    segment = sorted(events.iterdir())[0]
    data = bytearray(segment.read_bytes())
    data[64 + 28 + 2] ^= 1  # the first event, with valid records after it
    segment.write_bytes(bytes(data))
    assert main(["inspect", str(events)]) == 1
    assert "CorruptFrameError" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "says"),
    [([], "writes synced to disk"), (["--no-sync"], "writes to the page cache (not synced)")],
)
def test_demo_syncs_both_timed_writes_or_neither_and_says_which(
    flags: list[str],
    says: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The raw baseline fsyncs inside its timing exactly when the engine's storers do."""
    import os

    from spillover.cli import demo

    synced: list[int] = []
    engine: list[bool] = []
    real_fsync, real_open = os.fsync, spillover.open_storage
    monkeypatch.setattr(demo.os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))

    def open_storage(*a: object, **kw: object) -> spillover.Storage:
        engine.append(bool(kw.get("fsync")))
        return real_open(*a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(demo.spillover, "open_storage", open_storage)
    assert main(["demo", "--size-mb", "1", "--dir", str(tmp_path / "d"), *flags]) == 0
    out = capsys.readouterr().out
    assert says in out
    sync = not flags
    assert bool(synced) is sync  # the raw write: file and directory
    assert engine and set(engine[:3]) == {sync}  # the three timed engine writes


def test_demo_sync_has_an_environment_twin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPILLOVER_DEMO_SYNC", "0")
    assert main(["demo", "--size-mb", "1", "--dir", str(tmp_path / "d")]) == 0
    assert "writes to the page cache (not synced)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "SPILLOVER_DEMO_SYNC" in capsys.readouterr().out


# --- one style of errors, one convention of exit codes ----------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--no-such-flag"],
        ["verify", "--policy", "sideways"],
        ["verify", "--parallelism", "two"],
        ["demo", "--size-mb", "0"],
        ["inspect"],
    ],
)
def test_bad_usage_is_one_line_and_exit_code_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as ei:
        main(argv)
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"spillover {argv[0]}: error: "), err


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--repeat", "0"],
        ["bench", "--duration", "soon"],
        ["bench", "--duration", "inf"],  # would run for ever
        ["bench", "--warmup", "Infinity"],
        ["bench", "--sink-rate", "inf"],
        ["verify", "--records", "0"],
        ["verify", "--master", "local[2]"],
    ],
)
def test_bad_configuration_is_one_line_and_exit_code_2(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    where = ["--out", str(tmp_path / "out")] if argv[0] == "bench" else []
    assert main([*argv, *where]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"spillover {argv[0]}: error: "), err


class _Verdict:
    """What ``verify`` returns, as a run with the given outcome would."""

    def __init__(self, exact: bool, errors: list[str]) -> None:
        self.exact, self.errors = exact, errors

    def text(self) -> str:
        return "EXACT" if self.exact else "NOT EXACT"

    def shortfalls(self) -> list[str]:
        return []


@pytest.mark.parametrize(
    ("outcome", "code"),
    [
        (_Verdict(True, []), 0),
        (_Verdict(False, []), 1),  # the runs ended; something was lost or duplicated
        (_Verdict(False, ["the run with failures failed: restarts exhausted"]), 3),
        (StorageError("cannot write the checkpoint", detail="ENOSPC"), 3),
        (RuntimeError("the Spark stage failed\nat a JVM frame"), 3),
    ],
)
def test_verify_exit_codes(
    outcome: object,
    code: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from spillover.cli import verify as verify_cli

    def verify(spec: object, workdir: str | None = None) -> object:
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(verify_cli, "verify", verify)
    assert main(["verify"]) == code
    err = capsys.readouterr().err
    if isinstance(outcome, Exception):
        assert len(err.strip().splitlines()) == 1, err
        assert err.startswith("spillover verify: error: ")


def test_bench_exit_code_3_when_a_run_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import spillover.benchmark.runner as bench_run
    from spillover.runtime.jobmaster import JobResult

    class _Failing:
        def prepare(self) -> None:
            pass

        def running_since(self) -> float | None:
            return None

        def run(self, timeout: float | None = None, **_: object) -> JobResult:
            return JobResult("bench", "failed", 1, 0.1, failures=["a subtask failed: boom"])

    monkeypatch.setattr(bench_run, "create_executor", lambda *a, **k: _Failing())
    argv = ["bench", "--executor", "local", "--policies", "none", "--repeat", "1"]
    assert main([*argv, "--duration", "0.2", "--warmup", "0", "--out", str(tmp_path)]) == 3
    std = capsys.readouterr()
    assert "FAILED: a subtask failed: boom" in std.out
    assert std.err.strip().splitlines()[-1].startswith("spillover bench: error: 1 of 1 runs")


def test_spark_logs_point_new_contexts_at_the_file_only_while_the_command_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import warnings

    from spillover.cli import sparklog

    monkeypatch.delenv(sparklog.LOG_FILE_ENV, raising=False)
    monkeypatch.setattr("spillover.deploy.spark.spark_log_file", lambda: (False, None))
    with sparklog.spark_logs("bench", None) as where:  # --verbose: the terminal
        assert where is None and sparklog.LOG_FILE_ENV not in os.environ
    log = tmp_path / "out" / "spark.log"
    with sparklog.spark_logs("bench", str(log)) as where:
        assert os.environ[sparklog.LOG_FILE_ENV] == str(log)
        warnings.warn_explicit("from pyspark", UserWarning, "/x/pyspark/context.py", 1)
    assert sparklog.LOG_FILE_ENV not in os.environ
    assert "from pyspark" in log.read_text()


def test_inspect_reads_a_shared_file_gate_by_gate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A channels directory of shared files (no checkpoint metadata in sight): every
    section is reported as its gate, and a damaged one is named by its offset."""
    from spillover.runtime.checkpointing.channel_state import (
        channel_state_groups,
        open_channel_state,
    )

    groups = channel_state_groups([("a", 0), ("a", 1)], 5, lambda cid: str(tmp_path / "chk-1"))
    sizes, offsets = [], []
    for i in range(2):
        w = open_channel_state(
            lambda cid, uid, i: str(tmp_path / "chk-1" / f"{uid}-{i}"),
            1,
            "a",
            i,
            None,
            groups[("a", i)],
        )
        w.add_input(0, 0, b"subtask-%d" % i * 10)
        gate = w.close()["input"][0]
        sizes.append(gate["size"])
        offsets.append(gate["offset"])
    channels = tmp_path / "chk-1" / "channels"
    assert main(["inspect", str(channels), "--json"]) == 0
    reports = json.loads(capsys.readouterr().out)
    # each section is followed by its index section (its channel maps), skipped
    assert offsets[1] > sizes[0]
    assert [(r["subtask_index"], r["offset"], r["size"]) for r in reports] == [
        (0, 0, sizes[0]),
        (1, offsets[1], sizes[1]),
    ]
    shared = channels / "a-0.spill"
    data = bytearray(shared.read_bytes())
    data[offsets[1] + 64 + 24 + 3] ^= 0xFF  # inside the second gate's payload
    shared.write_bytes(bytes(data))
    assert main(["inspect", str(shared)]) == 1
    out = capsys.readouterr().out
    assert "section at byte 0" in out and "every checksum verified" in out
    assert "CorruptFrameError" in out


@pytest.mark.parametrize(
    ("env", "value", "command"),
    [
        ("SPILLOVER_DEMO_SIZE_MB", "x", "demo"),  # the type refuses it
        ("SPILLOVER_DEMO_SYNC", "banana", "demo"),  # neither yes nor no
        ("SPILLOVER_BENCH_CLI_VERBOSE", "maybe", "bench"),
        ("SPILLOVER_VERIFY_POLICY", "sideways", "verify"),  # not one of the choices
        ("SPILLOVER_VERIFY_PARALLELISM", "two", "verify"),
    ],
)
def test_a_bad_environment_twin_is_bad_usage(
    env: str,
    value: str,
    command: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Checked as its flag is: one line naming the variable, exit code 2, not a
    traceback (nor a run that fails later, nor a yes/no silently read as no)."""
    monkeypatch.setenv(env, value)
    with pytest.raises(SystemExit) as ei:
        main([command])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"spillover {command}: error: bad {env}="), err


def test_the_command_line_wins_over_a_bad_environment_twin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SPILLOVER_DEMO_SIZE_MB", "x")
    monkeypatch.setenv("SPILLOVER_DEMO_SYNC", "banana")
    assert main(["demo", "--size-mb", "1", "--no-sync", "--dir", str(tmp_path / "d")]) == 0
    assert "not synced" in capsys.readouterr().out


def test_a_yes_no_flag_refuses_other_words(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        main(["demo", "--sync", "banana"])
    assert ei.value.code == 2
    assert "expected yes" in capsys.readouterr().err


def test_verify_refuses_a_workdir_it_cannot_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bad usage before any run (exit 2, as bench's --out), not a run that could not
    complete (3), and with Spark not a raw OSError from where its log would go."""
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    for executor in ("local", "spark"):
        argv = ["verify", "--executor", executor, "--workdir", str(not_a_folder / "w")]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert err.startswith("spillover verify: error: cannot write the folder of --workdir")


def test_verify_names_the_spark_log_when_the_run_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from spillover.cli import verify as verify_cli

    def verify(spec: object, workdir: str | None = None) -> object:
        raise RuntimeError("the Spark stage failed")

    monkeypatch.setattr(verify_cli, "verify", verify)
    monkeypatch.setattr("spillover.deploy.spark.spark_log_file", lambda: (False, None))
    assert main(["verify", "--executor", "spark", "--workdir", str(tmp_path)]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == f"Spark's log lines: {tmp_path / 'spark.log'} (--verbose: here)"
    assert err[1].startswith("spillover verify: error: the run could not complete")


@pytest.mark.parametrize("metadata", [b"garbage", b'{"format": "something else"}', b"\xff\xfe"])
def test_inspect_of_a_checkpoint_with_damaged_metadata_is_a_failed_check(
    metadata: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 1 with the damage named, as for a damaged state file (docs/getting-started.md),
    not 3 ("the run could not complete") nor a JSON parser's message; the other
    checkpoints are still reported."""
    from spillover.runtime.checkpointing.metadata import CheckpointStorage
    from support.checkpoint_golden import empty_metadata

    storage = CheckpointStorage(str(tmp_path), "j")
    for cid in (1, 2):
        meta = empty_metadata(cid)
        storage.write_metadata(cid, meta)
    (tmp_path / "j" / "chk-1" / "_metadata").write_bytes(metadata)
    assert main(["inspect", str(tmp_path / "j")]) == 1
    out = capsys.readouterr().out
    assert f"{tmp_path / 'j' / 'chk-1'}: FormatError: " in out
    assert "checkpoint 2 of job 'j'" in out
