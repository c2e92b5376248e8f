"""Failing storage costs checkpoints, never the job or its data: with checkpoints on
a fault-injecting filesystem, errors on open, write, close and directory creation
(ENOSPC among them), a failed metadata write and a failed event-log record each
decline the checkpoints they hit with the cause in their stats; so do failing
renames on a local disk and a really full filesystem (a small tmpfs); failing
listings cost nothing. The job keeps running, a later checkpoint completes once
storage recovers, nothing half-written is left or restored, and the output is
exact. Slow storage times checkpoints out while processing goes on."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from spillover.config import Config
from spillover.deploy import create_executor
from spillover.runtime.connectors import GeneratorSource, ParquetSink
from spillover.runtime.graph import StreamEnvironment
from support.faults import Faults, enospc, fail, failing_renames, faulty_dir, hold

RECORDS = 40_000  # 4 partitions, 10,000 records/s per subtask: 2 s


def _job(out: Path) -> StreamEnvironment:
    env = StreamEnvironment("faults", parallelism=2)
    gen = GeneratorSource(
        partitions=4, records_per_partition=RECORDS // 4, payload_bytes=16, rate_per_subtask=10_000
    )
    env.from_source(gen, uid="src").rebalance().sink(ParquetSink(str(out)), uid="sink")
    return env


def _config(ckpt: str, **extra: Any) -> Config:
    return Config.from_dict(
        {
            "state.checkpoints.dir": ckpt,
            "execution.checkpointing.interval": "50 ms",
            "execution.checkpointing.unaligned.enabled": "true",
            "execution.checkpointing.tolerable-failed-checkpoints": 1_000_000,
            "restart-strategy.type": "none",  # a failed attempt would fail the test
            **extra,
        }
    )


def _exact(out: Path) -> None:
    t = pq.read_table(str(out))
    ids = t.column("partition").to_numpy().astype(np.int64) * 10**9 + t.column("seq").to_numpy()
    assert len(ids) == len(np.unique(ids)) == RECORDS


def _aborted(ex: Any) -> list[Any]:
    return [c for c in list(ex._current.coordinator.history) if c.status == "aborted"]


def _run_with_a_fault_window(
    tmp_path: Path,
    arm: Any,
    *,
    hits: str,
    local: bool = False,
    ckpt: Path | None = None,
    then: Any = None,
    **extra: Any,
) -> tuple[Any, Faults, Path, list[float]]:
    """Runs the job; once two checkpoints completed, ``arm(faults)`` until three
    checkpoints were aborted, then ``then(faults, ex, ended)`` (a later phase of the
    faults, if given) and storage recovers. ``sink_records`` holds the sink's records
    when the faults began and when they ended. ``local``: checkpoints on a plain
    path, whose renames consult the faults (:func:`failing_renames`); ``ckpt``: on
    that directory (a real filesystem, the faults unused)."""
    out = tmp_path / "out"
    with contextlib.ExitStack() as stack:
        if ckpt is not None:
            faults, uri = Faults(), str(ckpt)
        elif local:
            faults = stack.enter_context(failing_renames(Faults()))
            uri = str(tmp_path / "ckpt")
        else:
            uri, faults = stack.enter_context(faulty_dir(str(tmp_path / "ckpt")))
        ex = create_executor("local", _job(out), _config(uri, **extra))

        ended = threading.Event()
        sink_records: list[float] = []

        def window() -> None:
            while max(ex.completed_ids(), default=0) < 2:
                if ended.wait(0.005):
                    return
            arm(faults)
            sink_records.append(ex.live_metric("sink"))
            while not ended.wait(0.005) and len(_aborted(ex)) < 3:
                pass
            if then is not None and not ended.is_set():
                then(faults, ex, ended)
            sink_records.append(ex.live_metric("sink"))
            faults.rules, faults.latency_s = [], 0.0

        t = threading.Thread(target=window, daemon=True)
        t.start()
        try:
            result = ex.run(timeout=120)
        finally:
            ended.set()
            t.join()
    assert result.status == "finished" and result.attempts == 1, result.failures
    aborted = [c for c in result.checkpoints if c["status"] == "aborted"]
    assert len(aborted) >= 3, result.checkpoints
    # Under load a checkpoint may also be aborted for another reason in the window.
    assert any(hits in str(c["reason"]) for c in aborted), aborted
    last_abort = max(c["checkpoint_id"] for c in aborted)
    assert any(
        c["status"] == "completed" and c["checkpoint_id"] > last_abort for c in result.checkpoints
    ), "a checkpoint completed once storage recovered"
    # Declined checkpoints leave nothing behind: every directory left is complete.
    job = (ckpt or tmp_path / "ckpt") / "faults"
    assert all((d / "_metadata").exists() for d in job.glob("chk-*")), list(job.glob("chk-*"))
    _exact(out)
    return result, faults, job, sink_records


@pytest.mark.parametrize(
    ("ops", "error", "hits"),
    [
        ({"open"}, enospc, "No space left"),
        # A failed write once left the native writer's finish() waiting for ever: the
        # batch submitted after the error never woke its thread.
        ({"write"}, lambda: OSError(errno.EIO, "Input/output error"), "Input/output error"),
        ({"close"}, enospc, "No space left"),
        ({"mkdir"}, lambda: PermissionError(errno.EACCES, "Permission denied"), "Permission"),
    ],
    ids=["open-enospc", "write-eio", "close-enospc", "mkdir-eacces"],
)
def test_failing_state_writes_decline_checkpoints_and_the_job_goes_on(
    ops: set[str], error: Any, hits: str, tmp_path: Path
) -> None:
    def arm(faults: Faults) -> None:
        faults.rules = [fail(ops, "/chk-", error)]

    _, faults, _, _ = _run_with_a_fault_window(tmp_path, arm, hits=hits)
    assert sum(faults.counts.values()) > 0


def _eio() -> OSError:
    return OSError(errno.EIO, "Input/output error")


@pytest.mark.parametrize("where", ["/_metadata", "/events-"], ids=["metadata", "event-log-segment"])
def test_failing_renames_decline_checkpoints_on_a_local_disk(where: str, tmp_path: Path) -> None:
    """Checkpoint storage renames only on a local disk: the metadata is written to a
    temporary name and renamed into place, and a job event log segment is
    hard-linked (else renamed) to its name. (On pyarrow filesystems both are written
    straight to their names, so nothing there is renamed.) A rename that fails
    declines the checkpoint and leaves no temporary file."""

    def arm(faults: Faults) -> None:
        faults.rules = [fail({"rename"}, where, _eio)]

    _, faults, job, _ = _run_with_a_fault_window(
        tmp_path, arm, hits="Input/output error", local=True
    )
    assert faults.counts["rename"] > 0
    temporary = [p for p in job.rglob("*") if ".inprogress" in p.name or ".tmp-" in p.name]
    assert not temporary


def test_a_failing_listing_costs_no_checkpoint_and_not_the_job(tmp_path: Path) -> None:
    """While the job runs, checkpoint storage is listed after a checkpoint completes
    that follows an aborted one, to sweep what late writes into the aborted ones
    left. A listing that failed there once failed the attempt (the coordinator's
    thread raised after the checkpoint was recorded, before any task heard of it):
    now the completion stands and the sweep waits for the next one. Phase one:
    state files cannot be created (checkpoints declined) and listings fail; phase
    two: only listings fail, until a completion's sweep tried one; then storage
    recovers and a later completion sweeps."""

    def arm(faults: Faults) -> None:
        faults.rules = [fail({"open"}, "/chk-", enospc), fail({"list"}, "", _eio)]

    def listings_fail(faults: Faults, ex: Any, ended: threading.Event) -> None:
        faults.rules = [fail({"list"}, "", _eio)]
        failed = faults.counts.get("list", 0)  # only a completion's sweep lists
        while not ended.wait(0.005) and faults.counts.get("list", 0) == failed:
            pass

    _, faults, _, _ = _run_with_a_fault_window(
        tmp_path, arm, hits="No space left", then=listings_fail
    )
    assert faults.counts["list"] > 0


def test_a_failed_metadata_write_declines_the_checkpoint(tmp_path: Path) -> None:
    def arm(faults: Faults) -> None:
        faults.rules = [fail({"open"}, "/_metadata", enospc)]

    _run_with_a_fault_window(tmp_path, arm, hits="completing it failed")


def test_a_failed_event_log_record_declines_the_checkpoint(tmp_path: Path) -> None:
    """The checkpoint whose completion the log could not record never completed: no
    sink commits it, and the log never names it afterwards."""
    from spillover.runtime.jobevents import EVENTS_DIR, CheckpointCompleted, JobEventLog

    def arm(faults: Faults) -> None:
        faults.rules = [fail({"open"}, "/events-", enospc)]

    result, _, job, _ = _run_with_a_fault_window(tmp_path, arm, hits="completing it failed")
    aborted = {c["checkpoint_id"] for c in result.checkpoints if c["status"] == "aborted"}
    with faulty_dir(str(tmp_path / "ckpt")):
        named = {
            e.checkpoint_id
            for e in JobEventLog.open(job / EVENTS_DIR).events()
            if isinstance(e, CheckpointCompleted)
        }
    assert named and not named & aborted


def test_slow_storage_times_checkpoints_out_while_processing_goes_on(tmp_path: Path) -> None:
    """Every storage operation 150 ms slower than a 100 ms checkpoint timeout: the
    checkpoints time out; the records keep flowing (the task threads never wait on
    storage), and once storage is fast again checkpoints complete."""

    def arm(faults: Faults) -> None:
        faults.latency_s = 0.15

    _, _, _, (before, after) = _run_with_a_fault_window(
        tmp_path, arm, hits="timed out", **{"execution.checkpointing.timeout": "100 ms"}
    )
    assert after > before, "the sink got records while storage was slow"


def test_a_hung_state_file_creation_never_stops_the_records(tmp_path: Path) -> None:
    """Creating a channel-state file hangs (a request to an object store that does
    not answer) until the test lets it go: the task threads never wait for it, since
    remote files are created by the writer's own thread. While it hangs the sink's
    records keep advancing and the checkpoints time out; once it is let go a later
    checkpoint completes and the output is exact."""
    release, held = threading.Event(), threading.Event()
    during: list[float] = []

    def arm(faults: Faults) -> None:
        faults.rules = [hold({"open"}, "/channels/", release, held)]

    def while_held(faults: Faults, ex: Any, ended: threading.Event) -> None:
        try:
            while not held.wait(0.005):
                if ended.is_set():
                    return
            start, aborted = ex.live_metric("sink"), len(_aborted(ex))
            # The coordinator times checkpoints out on its own thread, whatever the
            # tasks do: more of them bound the wait for the sink to move. Twenty (two
            # seconds of timeouts at least) leave a starved machine's task threads
            # time to move; a task thread that waits for the file never moves at all.
            while not ended.wait(0.005) and len(_aborted(ex)) < aborted + 20:
                if ex.live_metric("sink") > start:
                    break
            during[:] = [start, ex.live_metric("sink")]
        finally:
            release.set()

    try:
        _run_with_a_fault_window(
            tmp_path,
            arm,
            hits="timed out",
            then=while_held,
            **{"execution.checkpointing.timeout": "100 ms"},
        )
    finally:
        release.set()
    assert held.is_set(), "a state file's creation was held"
    assert during[1] > during[0], "the sink got records while a state file's creation hung"


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs mounted for the test (root with CAP_SYS_ADMIN only), unmounted
    after it."""
    where = tmp_path / "tmpfs"
    where.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN) and mount(8)")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (no CAP_SYS_ADMIN?): {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _used(mount: Path) -> int:
    st = os.statvfs(mount)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _fill(path: Path) -> None:
    """Writes ``path`` until the filesystem has no space left."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    chunk = b"\0" * 65536
    try:
        while True:
            os.write(fd, chunk)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)


def test_a_really_full_filesystem_declines_checkpoints_and_gives_the_space_back(
    small_tmpfs: Path, tmp_path: Path
) -> None:
    """Checkpoints on a 4 MiB tmpfs that a ballast file fills: real ENOSPC from the
    kernel (state files, metadata, event-log segments) declines checkpoints while
    the job goes on; once the ballast is gone a later checkpoint completes. Nothing
    of a declined checkpoint holds space afterwards: what the filesystem counts as
    used is exactly the files still there (a file deleted while a writer kept it open
    would still count), and with those removed it is as empty as it was mounted."""
    ckpt = small_tmpfs / "ckpt"
    empty = _used(small_tmpfs)
    ballast = small_tmpfs / "ballast"

    def arm(faults: Faults) -> None:
        _fill(ballast)

    def free_the_space(faults: Faults, ex: Any, ended: threading.Event) -> None:
        ballast.unlink()

    _run_with_a_fault_window(tmp_path, arm, hits="No space left", ckpt=ckpt, then=free_the_space)
    files = [p for p in small_tmpfs.rglob("*") if p.is_file()]
    assert _used(small_tmpfs) - empty == sum(p.stat().st_blocks * 512 for p in files)
    shutil.rmtree(ckpt)
    assert _used(small_tmpfs) == empty
