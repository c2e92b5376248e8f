"""One master per job: the lease refuses a second master, names the holder, is taken
over after expiry, renewed and released; on local disks and object stores."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from spillover.errors import UnsupportedVersionError
from spillover.runtime.jobevents import (
    JobEventLog,
    JobFinished,
    JobLease,
    LeaseError,
    LeaseHeldError,
    LeaseHolder,
    LeaseLostError,
)
from spillover.storage.location import Location
from support.s3 import s3_uri


class Clock:
    """Wall-clock seconds that move only when a test says so."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def holder(name: str) -> LeaseHolder:
    return LeaseHolder(f"host-{name}", 100, f"{name}-{uuid.uuid4().hex}")


def leases(directory: Location, clock: Clock) -> tuple[JobLease, JobLease]:
    def lease(name: str) -> JobLease:
        return JobLease(directory, holder=holder(name), ttl_s=30.0, clock=clock, sleep=no_sleep)

    return lease("a"), lease("b")


def no_sleep(seconds: float) -> None:
    pass


@pytest.fixture(params=["local", "arrow-local"])
def directory(request: pytest.FixtureRequest, tmp_path: Path) -> Location:
    fs = pafs.LocalFileSystem() if request.param == "arrow-local" else None
    return Location.parse(str(tmp_path / "_events"), fs)


def test_acquire_writes_the_holder_and_its_expiry(directory: Location) -> None:
    clock = Clock()
    a, _ = leases(directory, clock)
    lease = a.acquire()
    assert (lease.acquired_at, lease.expires_at) == (clock.now, clock.now + 30)
    assert a.read() == lease and a.check() == lease
    body = json.loads(Path(directory.path, "_lease").read_text())
    assert body["holder"]["token"] == a.holder.token and body["version"] == 1


def test_a_second_master_is_refused_naming_the_holder(directory: Location) -> None:
    clock = Clock()
    a, b = leases(directory, clock)
    a.acquire()
    clock.now += 29
    with pytest.raises(LeaseHeldError) as info:
        b.acquire()
    text = str(info.value)
    assert "host-a pid 100" in text and a.holder.token[:12] in text
    assert "expires at 2023-11-14T22:13:50+00:00" in text
    assert b.held is None and a.read() == a.held


def test_an_expired_lease_is_taken_over(directory: Location) -> None:
    clock = Clock()
    a, b = leases(directory, clock)
    a.acquire()
    clock.now += 30
    taken = b.acquire()
    assert taken.holder == b.holder and b.read() == taken
    assert not [p for p in Path(directory.path).iterdir() if "takeover" in p.name]
    with pytest.raises(LeaseLostError, match="expired"):
        a.renew()
    with pytest.raises(LeaseLostError):
        a.check()
    a.release()  # not held any more: leaves b's lease alone
    assert b.read() == taken


def _dead_pid() -> int:
    """The pid of a process of this host that has ended (and was reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_live_lease_of_a_process_of_this_host_that_is_gone_is_taken_over(
    directory: Location,
) -> None:
    """A killed driver restarted on the same machine need not wait for the expiry."""
    clock = Clock()
    dead = LeaseHolder(socket.gethostname(), _dead_pid(), uuid.uuid4().hex)
    assert dead.gone()
    JobLease(directory, holder=dead, ttl_s=30.0, clock=clock).acquire()
    _, b = leases(directory, clock)
    assert b.acquire().holder == b.holder


def test_a_live_holder_is_not_gone() -> None:
    here = socket.gethostname()
    assert not LeaseHolder(here, os.getpid(), "t").gone()  # this process
    assert not LeaseHolder(here, os.getppid(), "t").gone()  # alive
    assert not LeaseHolder("another-host", _dead_pid(), "t").gone()  # cannot tell: live


def test_a_lease_taken_while_its_holder_slept_is_lost_on_renewal(directory: Location) -> None:
    clock = Clock()
    a, b = leases(directory, clock)
    a.acquire()
    clock.now += 31
    b.acquire()
    clock.now -= 10  # a's clock says it is still live: the file says otherwise
    with pytest.raises(LeaseLostError, match="another master took"):
        a.renew()


def test_renewal_pushes_the_expiry_on(directory: Location) -> None:
    clock = Clock()
    a, b = leases(directory, clock)
    first = a.acquire()
    clock.now += 20
    renewed = a.renew()
    assert renewed.acquired_at == first.acquired_at and renewed.expires_at == clock.now + 30
    clock.now += 20  # past the first expiry, within the renewed one
    with pytest.raises(LeaseHeldError):
        b.acquire()


def test_release_lets_the_next_master_in(directory: Location) -> None:
    clock = Clock()
    a, b = leases(directory, clock)
    with a, pytest.raises(LeaseHeldError):
        b.acquire()
    assert a.read() is None
    assert b.acquire().holder == b.holder


def test_a_master_takes_its_own_lease_again(directory: Location) -> None:
    clock = Clock()
    a, _ = leases(directory, clock)
    a.acquire()
    clock.now += 5
    assert a.acquire().expires_at == clock.now + 30


def test_a_takeover_under_way_refuses_a_second_taker(tmp_path: Path) -> None:
    clock = Clock()
    a, b = leases(Location.parse(tmp_path), clock)
    a.acquire()
    clock.now += 60
    (tmp_path / f"_lease.takeover-{a.holder.token}").write_bytes(b"")  # another taker
    with pytest.raises(LeaseHeldError, match="taking over"):
        b.acquire()
    assert b.read() == a.held


def test_the_log_refuses_to_flush_on_an_expired_lease(tmp_path: Path) -> None:
    clock = Clock()
    a, _ = leases(Location.parse(tmp_path), clock)
    a.acquire()
    log = JobEventLog.open(tmp_path, clock=clock, lease=a)
    log.append(JobFinished())
    clock.now += 31
    with pytest.raises(LeaseLostError):
        log.flush()
    assert log.pending == 1


def test_bad_lease_files_are_errors_not_takeovers(tmp_path: Path) -> None:
    clock = Clock()
    a, _ = leases(Location.parse(tmp_path), clock)
    (tmp_path / "_lease").write_text("{not json")
    with pytest.raises(LeaseError, match="unreadable") as info:
        a.acquire()
    assert "no master of this job runs" in str(info.value)
    (tmp_path / "_lease").write_text(json.dumps({"format": "spillover-job-lease", "version": 9}))
    with pytest.raises(UnsupportedVersionError):
        a.acquire()


@pytest.mark.s3
def test_on_an_object_store(s3_server: dict[str, str]) -> None:
    clock = Clock()
    a, b = leases(Location.parse(s3_uri(s3_server, f"lease-{uuid.uuid4().hex}")), clock)
    a.acquire()
    with pytest.raises(LeaseHeldError, match="host-a"):
        b.acquire()
    clock.now += 30
    assert b.acquire().holder == b.holder
    with pytest.raises(LeaseLostError):
        a.renew()
    b.release()
    assert b.read() is None
