"""The job event log: round trips, torn tails, corruption in the middle, foreign files,
compaction, and the layout of docs/format.md."""

from __future__ import annotations

import itertools
import logging
import os
import struct
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from spillover.errors import (
    ConfigError,
    CorruptFrameError,
    ForeignFileError,
    StateFileExistsError,
    UnsupportedVersionError,
)
from spillover.runtime.jobevents import (
    CheckpointCompleted,
    CommandReceived,
    Event,
    GenerationEnded,
    GenerationStarted,
    JobCancelled,
    JobEventLog,
    JobFailed,
    JobFinished,
    JobLogState,
    JobSubmitted,
    RescaleDecided,
    SavepointCompleted,
    SplitsAssigned,
    StopAbandoned,
    StopRequested,
    TaskFinished,
    is_event_log,
)
from spillover.storage.location import Location
from support.s3 import s3_uri

SEGMENT_HEADER, RECORD_HEADER = 64, 28  # docs/format.md, "Job event log (format v2)"

# ------------------------------------------------------------------- strategies

names = st.text(min_size=1, max_size=8)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
json_dicts = st.dictionaries(st.text(max_size=6), json_values, max_size=3)
small = st.integers(0, 1000)
events: st.SearchStrategy[Event] = st.one_of(
    st.builds(JobSubmitted, names, names, small, json_dicts, names),
    st.builds(GenerationStarted, small, small, names, st.none() | names),
    st.builds(GenerationEnded, small, names),
    st.builds(TaskFinished, names, small, small, st.lists(json_dicts, max_size=2).map(tuple)),
    st.builds(CheckpointCompleted, small, names),
    st.builds(SavepointCompleted, small, names),
    st.builds(RescaleDecided, small, small, names),
    st.builds(
        SplitsAssigned,
        names,
        st.dictionaries(small, st.lists(names, max_size=3).map(tuple), max_size=3),
    ),
    st.builds(CommandReceived, names, names),
    st.builds(StopRequested, st.booleans(), st.booleans(), names),
    st.builds(StopAbandoned, names),
    st.builds(JobFinished, names),
    st.builds(JobFailed, names),
    st.builds(JobCancelled, names),
)
batches = st.lists(st.lists(events, min_size=1, max_size=4), min_size=1, max_size=4)


def clock() -> Callable[[], float]:
    ticks = itertools.count(1_700_000_000)
    return lambda: float(next(ticks))


# Native local I/O, or pyarrow's local filesystem (the object-store code path: one
# output stream to the final name, no rename).
backends = pytest.mark.parametrize("arrow", [False, True], ids=["local", "arrow-local"])


def at(path: str | Path, arrow: bool) -> Location:
    return Location.parse(str(path), pafs.LocalFileSystem() if arrow else None)


def temp_dir() -> Iterator[str]:
    with tempfile.TemporaryDirectory() as d:
        yield os.path.join(d, "_events")


def write(loc: Location, groups: list[list[Event]], **kw: Any) -> JobEventLog:
    log = JobEventLog.open(loc, clock=clock(), compact_after=None, **kw)
    for group in groups:
        for e in group:
            log.append(e)
        log.flush()
    return log


def segments(path: str) -> list[Path]:
    return sorted(p for p in Path(path).iterdir() if p.name.startswith("events-"))


def record_ends(data: bytes) -> list[int]:
    """Where each record ends, walked by the documented framing (the end marker last)."""
    ends, off = [], SEGMENT_HEADER
    while off < len(data):
        (length,) = struct.unpack_from("<I", data, off + 16)
        off += RECORD_HEADER + length
        ends.append(off)
    return ends


# ---------------------------------------------------------------- round trips


@backends
@settings(max_examples=30)
@given(groups=batches)
def test_round_trip_of_any_events(groups: list[list[Event]], arrow: bool) -> None:
    for path in temp_dir():
        write(at(path, arrow), groups)
        flat = [e for g in groups for e in g]
        log = JobEventLog.open(at(path, arrow))
        entries = list(log.entries())
        assert [e.event for e in entries] == flat
        assert [e.index for e in entries] == list(range(len(flat)))
        assert [e.at for e in entries] == [1_700_000_000.0 + i for i in range(len(flat))]
        assert not log.warnings
        assert len(segments(path)) == len(groups)
        assert log.replay() == JobLogState.replay(flat)


def test_appends_stay_pending_until_flushed(tmp_path: Path) -> None:
    log = JobEventLog.open(tmp_path / "ev", clock=clock())
    log.append(JobSubmitted("job", "fp", 2))
    assert log.pending == 1 and [e.index for e in log.entries()] == [0]
    assert list(JobEventLog.open(tmp_path / "ev").events()) == []
    log.flush()
    log.flush()  # nothing pending: no empty segment
    assert log.pending == 0 and len(segments(str(tmp_path / "ev"))) == 1
    assert list(JobEventLog.open(tmp_path / "ev").events()) == [JobSubmitted("job", "fp", 2)]


def test_a_reopened_log_goes_on_where_it_stopped(tmp_path: Path) -> None:
    a = [JobSubmitted("job", "fp", 2)], [CheckpointCompleted(1, "m1")]
    write(Location.parse(tmp_path), list(a))
    log = write(Location.parse(tmp_path), [[CheckpointCompleted(2, "m2")]])
    assert [e.index for e in log.entries()] == [0, 1, 2]
    reread = JobEventLog.open(tmp_path)
    assert reread.log_id == log.log_id
    assert reread.replay().checkpoint == CheckpointCompleted(2, "m2")


def test_values_json_cannot_carry_are_refused_at_append(tmp_path: Path) -> None:
    log = JobEventLog.open(tmp_path)
    with pytest.raises(ConfigError):
        log.append(JobSubmitted("job", "fp", 1, {"x": object()}))
    with pytest.raises(ConfigError):
        log.append(JobSubmitted("job", "fp", 1, {"x": float("nan")}))
    assert log.pending == 0


@backends
def test_a_second_writer_of_the_same_segment_fails(tmp_path: Path, arrow: bool) -> None:
    loc = at(tmp_path, arrow)
    first, second = JobEventLog.open(loc), JobEventLog.open(loc)
    first.append(JobSubmitted("job", "fp", 1))
    first.flush()
    second.append(JobSubmitted("job", "other", 1))
    with pytest.raises(StateFileExistsError, match="another job master"):
        second.flush()
    assert second.pending == 1  # kept: nothing is lost by a failed flush
    assert list(JobEventLog.open(loc).events()) == [JobSubmitted("job", "fp", 1)]


# ------------------------------------------------------------------ torn tails


def torn_log(path: str) -> tuple[list[Event], list[Event]]:
    """A log of three segments; returns the events of the first two and of the last."""
    head = [JobSubmitted("job", "fp", 4, {"k": [1, 2]}), GenerationStarted(1, 4, "submitted")]
    middle = [SplitsAssigned("src", {0: ("s0",), 1: ("s1", "s2")})]
    last = [
        TaskFinished("map", 0, 1, ({"uri": "x"},)),
        CheckpointCompleted(7, "chk-7/_metadata"),
        SavepointCompleted(8, "sp-8"),
    ]
    write(Location.parse(path), [head, middle, last])
    return head + middle, last


def test_truncation_at_every_byte_keeps_the_valid_prefix(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(tmp_path / "ev")
    before, last = torn_log(path)
    tail = segments(path)[-1]
    data = tail.read_bytes()
    ends = record_ends(data)
    assert len(ends) == len(last) + 1 and ends[-1] == len(data)
    caplog.set_level(logging.WARNING, logger="spillover.runtime.jobevents.log")
    for cut in range(len(data)):
        tail.write_bytes(data[:cut])
        caplog.clear()
        log = JobEventLog.open(path)
        kept = sum(1 for end in ends[:-1] if end <= cut)
        assert list(log.events()) == before + last[:kept], cut
        assert len(log.warnings) == 1 and "torn or corrupt tail" in log.warnings[0]
        assert any("torn or corrupt tail" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("cut", [0, 40, 64 + 10, -30, -1])
def test_a_writer_repairs_a_torn_tail_before_it_appends(tmp_path: Path, cut: int) -> None:
    path = str(tmp_path / "ev")
    before, _ = torn_log(path)
    tail = segments(path)[-1]
    data = tail.read_bytes()
    tail.write_bytes(data[:cut])
    log = JobEventLog.open(path, clock=clock())
    kept = list(log.events())[len(before) :]
    log.append(JobFinished("done"))
    log.flush()
    reread = JobEventLog.open(path)
    assert not reread.warnings
    assert list(reread.events()) == [*before, *kept, JobFinished("done")]
    assert [e.index for e in reread.entries()] == list(range(len(before) + len(kept) + 1))


def test_garbage_segments_after_a_torn_tail_are_ignored_and_cleared(tmp_path: Path) -> None:
    path = str(tmp_path / "ev")
    before, last = torn_log(path)
    (tmp_path / "ev" / "events-00000004.log").write_bytes(b"")  # published empty by a crash
    log = JobEventLog.open(path)
    assert list(log.events()) == before + last and len(log.warnings) == 1
    log.append(JobFinished())
    log.flush()
    assert list(JobEventLog.open(path).events()) == [*before, *last, JobFinished()]


# ----------------------------------------------------------------- corruption


@settings(max_examples=60)
@given(data=st.data())
def test_a_bit_flip_never_yields_a_wrong_event(data: st.DataObject) -> None:
    for path in temp_dir():
        before, last = torn_log(path)
        files = segments(path)
        k = data.draw(st.integers(0, len(files) - 1), label="segment")
        raw = bytearray(files[k].read_bytes())
        pos = data.draw(st.integers(0, len(raw) - 1), label="byte")
        raw[pos] ^= 1 << data.draw(st.integers(0, 7), label="bit")
        files[k].write_bytes(bytes(raw))
        try:
            log = JobEventLog.open(path)
        except (CorruptFrameError, ForeignFileError, UnsupportedVersionError) as e:
            assert "\n" not in str(e)
            continue
        # Every byte is under a checksum: only the tail may be dropped, with a warning.
        assert k == len(files) - 1, "a corrupt segment before the last was read"
        got = list(log.events())
        assert got == (before + last)[: len(got)] and len(got) >= len(before)
        assert log.warnings


def test_corruption_in_the_middle_is_an_error_naming_file_and_offset(tmp_path: Path) -> None:
    path = str(tmp_path / "ev")
    torn_log(path)
    tail = segments(path)[-1]
    raw = bytearray(tail.read_bytes())
    raw[SEGMENT_HEADER + RECORD_HEADER + 3] ^= 0x10  # the first record's payload
    tail.write_bytes(bytes(raw))
    with pytest.raises(CorruptFrameError) as info:
        JobEventLog.open(path)
    e = info.value
    assert e.path == str(tail) and e.offset == SEGMENT_HEADER
    assert "valid records follow" in str(e) and "\n" not in str(e)


def test_a_corrupt_segment_before_the_last_is_an_error(tmp_path: Path) -> None:
    path = str(tmp_path / "ev")
    torn_log(path)
    first = segments(path)[0]
    first.write_bytes(first.read_bytes()[:-3])
    with pytest.raises(CorruptFrameError, match="corrupt before its end"):
        JobEventLog.open(path)


def test_a_missing_segment_is_an_error(tmp_path: Path) -> None:
    path = str(tmp_path / "ev")
    torn_log(path)
    segments(path)[1].unlink()
    with pytest.raises(CorruptFrameError, match="missing"):
        JobEventLog.open(path)
    segments(path)[0].unlink()
    with pytest.raises(CorruptFrameError, match="start of the job event log is missing"):
        JobEventLog.open(path)


def test_a_newer_format_version_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "ev")
    torn_log(path)
    tail = segments(path)[-1]
    raw = bytearray(tail.read_bytes())
    raw[8:10] = struct.pack("<H", 3)
    tail.write_bytes(bytes(raw))
    with pytest.raises(UnsupportedVersionError, match="v3"):
        JobEventLog.open(path)


def test_a_log_of_the_first_format_is_read_and_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job whose log an older version wrote (format v1) resumes: its segments are
    read as they are, and the new ones (v2) may hold a stop."""
    from spillover.runtime.jobevents import segments as fmt

    path = str(tmp_path / "ev")
    with monkeypatch.context() as m:
        m.setattr(fmt, "LOG_FORMAT_VERSION", 1)
        write(at(path, False), [[JobSubmitted("job", "fp", 2)], [CheckpointCompleted(1, "m1")]])
    assert all(p.read_bytes()[8:10] == struct.pack("<H", 1) for p in segments(path))
    log = JobEventLog.open(path, clock=clock(), compact_after=None)
    log.append(StopRequested(drain=False, unaligned=True, savepoint_dir="/sp"))
    log.flush()
    assert segments(path)[-1].read_bytes()[8:10] == struct.pack("<H", 2)
    state = JobEventLog.open(path).replay()
    assert state.checkpoint == CheckpointCompleted(1, "m1") and state.stop is not None


def test_foreign_files_are_ignored(tmp_path: Path) -> None:
    path = tmp_path / "ev"
    before, last = torn_log(str(path))
    for name in ("notes.txt", "events-1.log", "events-00000001.log.bak", "_lease", ".events"):
        (path / name).write_bytes(os.urandom(100))
    (path / "events-00000009.log.d").mkdir()
    log = JobEventLog.open(path)
    assert list(log.events()) == before + last and not log.warnings


def test_a_segment_of_another_log_is_refused(tmp_path: Path) -> None:
    torn_log(str(tmp_path / "a"))
    torn_log(str(tmp_path / "b"))
    segments(str(tmp_path / "b"))[-1].replace(segments(str(tmp_path / "a"))[-1])
    with pytest.raises(ForeignFileError, match="another job event log"):
        JobEventLog.open(tmp_path / "a")
    renamed = tmp_path / "a" / "events-00000004.log"
    segments(str(tmp_path / "b"))[0].replace(renamed)
    with pytest.raises(ForeignFileError, match="another segment's number"):
        JobEventLog.open(tmp_path / "a")


def test_an_unknown_event_kind_is_refused(tmp_path: Path) -> None:
    log = JobEventLog.open(tmp_path, clock=clock())
    log.append(JobFinished())
    # As a writer that knows more kinds would write it (checksummed as usual).
    log._pending[0] = log._pending[0].replace(b"job-finished", b"job-vanished")
    log.flush()
    with pytest.raises(UnsupportedVersionError, match="job-vanished"):
        JobEventLog.open(tmp_path)


# ----------------------------------------------------------------- compaction


@backends
@settings(max_examples=30)
@given(groups=batches, compact_at=st.sets(st.integers(0, 3)))
# A history that summarises to nothing (a stop abandoned before any job) is compacted
# too: its segments went on growing.
@example(
    groups=[[StopAbandoned("0")], [StopAbandoned("0")], [JobSubmitted("0", "0", 0, {}, "0")]],
    compact_at={0, 1},
)
def test_compaction_preserves_replay(
    groups: list[list[Event]], compact_at: set[int], arrow: bool
) -> None:
    for path in temp_dir():
        log = JobEventLog.open(at(path, arrow), clock=clock(), compact_after=None)
        for i, group in enumerate(groups):
            for e in group:
                log.append(e)
            log.flush()
            if i in compact_at:
                log.compact()
                assert len(segments(path)) == 1
        expected = JobLogState.replay(e for g in groups for e in g)
        assert log.replay() == expected
        reread = JobEventLog.open(at(path, arrow))
        assert reread.replay() == expected and not reread.warnings
        assert [e.index for e in reread.entries()] == sorted({e.index for e in reread.entries()})


def test_compaction_keeps_a_long_log_small(tmp_path: Path) -> None:
    log = JobEventLog.open(tmp_path, clock=clock(), compact_after=4)
    log.append(JobSubmitted("job", "fp", 2))
    for cid in range(1, 40):
        log.append(CheckpointCompleted(cid, f"chk-{cid}/_metadata"))
        log.flush()
    assert len(segments(str(tmp_path))) <= 5
    reread = JobEventLog.open(tmp_path)
    assert reread.replay().checkpoint == CheckpointCompleted(39, "chk-39/_metadata")
    assert reread.replay().submitted == JobSubmitted("job", "fp", 2)
    assert len(list(reread.entries())) < 10
    assert any(e.snapshot for e in reread.entries())


def test_an_interrupted_compaction_reads_from_its_snapshot(tmp_path: Path) -> None:
    """A snapshot published but the older segments not yet deleted: readers start at
    the snapshot, and the next writer deletes the leftovers."""
    path = str(tmp_path)
    torn_log(path)
    kept = {p.name: p.read_bytes() for p in segments(path)}
    log = JobEventLog.open(path, clock=clock())
    state = log.replay()
    log.compact()
    for name, data in kept.items():
        (tmp_path / name).write_bytes(data)
    reread = JobEventLog.open(path, clock=clock())
    assert reread.replay() == state and all(e.snapshot for e in reread.entries())
    reread.append(JobFinished())
    reread.flush()
    assert [p.name for p in segments(path)] == ["events-00000004.log", "events-00000005.log"]


def test_a_torn_snapshot_falls_back_to_the_segments_it_summarised(tmp_path: Path) -> None:
    path = str(tmp_path)
    before, last = torn_log(path)
    kept = {p.name: p.read_bytes() for p in segments(path)}
    log = JobEventLog.open(path, clock=clock())
    log.compact()
    snapshot = segments(path)[-1]
    snapshot.write_bytes(snapshot.read_bytes()[:-10])
    for name, data in kept.items():
        (tmp_path / name).write_bytes(data)
    reread = JobEventLog.open(path, clock=clock())
    assert list(reread.events()) == before + last
    assert "snapshot incomplete" in reread.warnings[0]
    reread.append(JobFinished())
    reread.flush()
    again = JobEventLog.open(path)
    assert not again.warnings and list(again.events()) == [*before, *last, JobFinished()]


def test_a_torn_snapshot_alone_is_an_error(tmp_path: Path) -> None:
    torn_log(str(tmp_path))
    log = JobEventLog.open(tmp_path, clock=clock())
    log.compact()
    snapshot = segments(str(tmp_path))[-1]
    snapshot.write_bytes(snapshot.read_bytes()[:-10])
    with pytest.raises(CorruptFrameError, match="snapshot is incomplete"):
        JobEventLog.open(tmp_path)


# ---------------------------------------------------------------- the summary


def test_replay_summarises_the_current_run() -> None:
    old = [JobSubmitted("job", "fp", 2), CheckpointCompleted(3, "m3"), SavepointCompleted(4, "sp")]
    run = [
        JobSubmitted("job", "fp2", 4),
        GenerationStarted(1, 4, "submitted"),
        TaskFinished("src", 0, 1),
        TaskFinished("src", 0, 2, ({"uri": "p"},)),
        SplitsAssigned("src", {0: ("a",)}),
        SplitsAssigned("src", {0: ("a", "b")}),
        GenerationEnded(1, "task failed"),
        RescaleDecided(4, 2, "lost a worker"),
        GenerationStarted(2, 2, "restart", "m3"),
        JobFailed("too many restarts"),
    ]
    s = JobLogState.replay(old + run)
    assert s.submitted == JobSubmitted("job", "fp2", 4)
    assert s.checkpoint is None and s.savepoints == (SavepointCompleted(4, "sp"),)
    assert s.generation == GenerationStarted(2, 2, "restart", "m3") and s.generation_end is None
    assert s.finished_tasks == {("src", 0): TaskFinished("src", 0, 2, ({"uri": "p"},))}
    assert s.splits["src"].assignment == {0: ("a", "b")}
    assert s.rescale == RescaleDecided(4, 2, "lost a worker")
    assert s.status == "failed" and JobLogState().status == "empty"
    assert JobLogState.replay(s.to_events()) == s


def test_a_stop_is_pending_until_given_up_or_the_run_ends() -> None:
    """What a resuming master reads: the stop it must carry out, if any."""
    submitted = JobSubmitted("job", "fp", 2)
    stop = StopRequested(drain=False, unaligned=True, savepoint_dir="/sp")
    assert JobLogState.replay([submitted, stop]).stop == stop
    assert JobLogState.replay([submitted, stop, StopAbandoned("aborted")]).stop is None
    assert JobLogState.replay([submitted, stop, JobCancelled("stopped")]).stop is None
    assert JobLogState.replay([stop, submitted]).stop is None  # an earlier run's
    again = StopRequested(drain=True, unaligned=False, savepoint_dir="/sp2")
    assert JobLogState.replay([submitted, stop, StopAbandoned(), again]).stop == again


def test_replay_keeps_the_latest_operator_commands() -> None:
    commands = [CommandReceived("savepoint", f"#{i}") for i in range(150)]
    s = JobLogState.replay([JobSubmitted("job", "fp", 2), *commands])
    assert s.commands == tuple(commands[-100:])
    assert JobLogState.replay(s.to_events()) == s


# --------------------------------------------------------------- other stores


def test_is_event_log(tmp_path: Path) -> None:
    assert not is_event_log(Location.parse(tmp_path / "nothing"))
    torn_log(str(tmp_path / "ev"))
    assert is_event_log(Location.parse(tmp_path / "ev"))
    assert not is_event_log(Location.parse(segments(str(tmp_path / "ev"))[0]))


def test_a_sub_tree_filesystem(tmp_path: Path) -> None:
    fs = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    before, last = torn_log(str(tmp_path / "job" / "_events"))
    log = JobEventLog.open("job/_events", filesystem=fs, clock=clock())
    assert list(log.events()) == before + last
    log.compact()
    assert list(JobEventLog.open("job/_events", filesystem=fs).replay().to_events())


@pytest.mark.s3
def test_on_an_object_store(s3_server: dict[str, str]) -> None:
    uri = s3_uri(s3_server, f"log-{uuid.uuid4().hex}/_events")
    log = JobEventLog.open(uri, clock=clock())
    log.append(JobSubmitted("job", "fp", 2))
    log.flush()
    log.append(CheckpointCompleted(1, "m1"))
    log.flush()
    assert is_event_log(Location.parse(uri))
    reread = JobEventLog.open(uri, clock=clock())
    assert list(reread.events()) == [JobSubmitted("job", "fp", 2), CheckpointCompleted(1, "m1")]
    reread.compact()
    reread.append(JobFinished())
    reread.flush()
    final = JobEventLog.open(uri)
    assert final.replay().status == "finished" and not final.warnings
    log.append(JobFinished())
    with pytest.raises(StateFileExistsError):  # a stale writer: its next segment exists
        log.flush()
