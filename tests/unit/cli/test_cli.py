"""The command line: inspect reports and exit codes, demo runs end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import spillover
from spillover.cli import main


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
    assert main(["verify", "--master", "local[2]", "--workdir", str(work)]) == 1
    err = capsys.readouterr().err
    assert "ConfigError" in err and "(--master) needs the spark executor" in err
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
    assert main(["verify", *flags, "--workdir", str(tmp_path / "work")]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and says in err, err


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
