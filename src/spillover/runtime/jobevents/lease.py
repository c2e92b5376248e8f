"""One master per job: a lease file (``_lease``) in the job's event log directory.

The lease names its holder (host, pid, a random token) and when it expires; the
holder renews it well before then (every third of its time to live, say). A master
that finds a live lease of another holder refuses to start; an expired lease is
taken over, and so is one whose holder was a process of this host that is gone (a
killed driver restarted on the same machine need not wait for the expiry). Expiry is
wall-clock time, so the masters' clocks must roughly agree.

Race windows, honestly:

- Local disks: a lease is created with a hard link (never replaces a file) and an
  expired one is replaced only by the master that created the exclusive marker
  ``_lease.takeover-<old token>``, so two masters never both take it. A holder that
  renews in the instant its lease expires (a pause between its check and its write
  longer than what was left) can overwrite a fresh taker's lease.
- Object stores cannot create exclusively: a master writes its lease, waits
  ``settle_s``, reads it back and keeps it only when its token is still there. Two
  masters whose read, write and read-back overlap within ``settle_s`` can both
  believe they hold it. The event log's segments are never overwritten, so the
  second of two masters to flush the same segment fails instead of losing events.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

from spillover.errors import (
    SpilloverError,
    StateFileExistsError,
    StateFileNotFoundError,
    UnsupportedVersionError,
)
from spillover.runtime.jobevents.log import publish
from spillover.storage.location import Location

__all__ = [
    "LEASE_FILE",
    "JobLease",
    "Lease",
    "LeaseError",
    "LeaseHeldError",
    "LeaseHolder",
    "LeaseLostError",
]

LEASE_FILE = "_lease"
LEASE_FORMAT = "spillover-job-lease"
LEASE_VERSION = 1


class LeaseError(SpilloverError, RuntimeError):
    """The job's lease cannot be had or kept."""


class LeaseHeldError(LeaseError):
    """Another master holds the job's lease and it has not expired."""


class LeaseLostError(LeaseError):
    """This master's lease expired or another master took it."""


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds")


@dataclass(frozen=True)
class LeaseHolder:
    """Who holds a lease: the token tells two masters on one host and pid apart."""

    host: str
    pid: int
    token: str

    @classmethod
    def this_process(cls) -> LeaseHolder:
        return cls(socket.gethostname(), os.getpid(), uuid.uuid4().hex)

    def __str__(self) -> str:
        return f"{self.host} pid {self.pid} (token {self.token[:12]})"

    def gone(self) -> bool:
        """True when this holder is a process of this host that no longer exists (a
        killed driver): its lease need not wait for its expiry."""
        if self.host != socket.gethostname() or self.pid == os.getpid() or self.pid <= 0:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except OSError:  # it exists, as another user's process
            return False
        return _zombie(self.pid)


def _zombie(pid: int) -> bool:
    """A killed child its parent has not reaped yet holds nothing any more."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


@dataclass(frozen=True)
class Lease:
    """The content of a lease file; times are seconds since the epoch."""

    holder: LeaseHolder
    acquired_at: float
    expires_at: float

    def live(self, now: float) -> bool:
        return now < self.expires_at

    def to_bytes(self) -> bytes:
        body = {
            "format": LEASE_FORMAT,
            "version": LEASE_VERSION,
            "holder": {
                "host": self.holder.host,
                "pid": self.holder.pid,
                "token": self.holder.token,
            },
            "acquired_at": self.acquired_at,
            "expires_at": self.expires_at,
            "expires": _when(self.expires_at),  # for people; expires_at is what counts
        }
        return json.dumps(body, indent=1, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Lease:
        try:
            body = json.loads(data)
            if body.get("format") != LEASE_FORMAT:
                raise ValueError(f"format {body.get('format')!r}")
            if body["version"] != LEASE_VERSION:
                raise UnsupportedVersionError(
                    "the job's lease was written in a newer format",
                    path=where,
                    detail=f"version {body['version']}; this reader knows {LEASE_VERSION}",
                    hint="run the job with the spillover version of its other master",
                )
            h = body["holder"]
            pid = int(h["pid"])
            if not -(2**31) <= pid < 2**31:
                raise ValueError(f"pid {pid} is not a process id")
            return cls(
                LeaseHolder(str(h["host"]), pid, str(h["token"])),
                float(body["acquired_at"]),
                float(body["expires_at"]),
            )
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as e:
            if isinstance(e, SpilloverError):
                raise
            raise LeaseError(
                "the job's lease file is unreadable",
                path=where,
                detail=f"{type(e).__name__}: {e}",
                hint="delete it once you are sure no master of this job runs",
            ) from e


class JobLease:
    """This process's claim on a job: :meth:`acquire`, then :meth:`renew` well within
    ``ttl_s``, :meth:`release` at the end (or use it as a context manager).

    ``clock`` is wall-clock seconds (injected in tests); ``settle_s`` is the wait
    before an object store's lease is read back (none on local disks).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | Location,
        *,
        filesystem: Any = None,
        ttl_s: float = 60.0,
        clock: Callable[[], float] = time.time,
        holder: LeaseHolder | None = None,
        settle_s: float | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        loc = (
            directory if isinstance(directory, Location) else Location.parse(directory, filesystem)
        )
        self.directory = loc
        self.location = loc.child(LEASE_FILE)
        self.ttl_s = ttl_s
        self.clock = clock
        self.holder = holder or LeaseHolder.this_process()
        self.settle_s = (0.0 if loc.local else 1.0) if settle_s is None else settle_s
        self.sleep = sleep
        self.held: Lease | None = None

    def read(self) -> Lease | None:
        """The lease as stored, or None when there is none (one request: a missing
        file is told by the read)."""
        try:
            data = self.location.read_bytes("job lease")
        except StateFileNotFoundError:
            return None
        return Lease.from_bytes(data, self.location.uri)

    def acquire(self) -> Lease:
        """Takes the lease: refuses (:class:`LeaseHeldError`, naming the holder and
        its expiry) while another holder's lease is live, takes an expired one over,
        or one whose holder was a process of this host that is gone."""
        now = float(self.clock())
        mine = Lease(self.holder, now, now + self.ttl_s)
        if not self.location.local:
            return self._acquire_remote(mine)
        for _ in range(3):  # a lease released between our create and read: again
            try:
                self._write(mine, overwrite=False)
                self.held = mine
                return mine
            except StateFileExistsError:
                current = self.read()
            if current is None:
                continue
            if current.holder != self.holder and current.live(now) and not current.holder.gone():
                raise self._held(current)
            self._take_over(current, mine)
            self.held = mine
            return mine
        raise LeaseHeldError(
            "the job's lease keeps changing hands",
            path=self.location.uri,
            hint="another master of this job is starting; run one at a time",
        )

    def renew(self) -> Lease:
        """Pushes the expiry ``ttl_s`` on; :class:`LeaseLostError` when the lease
        expired first or another master holds it now."""
        held = self.check()
        current = self.read()
        if current is None or current.holder != self.holder:
            self.held = None
            raise LeaseLostError(
                "another master took the job's lease",
                path=self.location.uri,
                detail=f"held by {current.holder}" if current else "the lease file is gone",
                hint="this master must stop: another one runs the job",
            )
        now = float(self.clock())
        renewed = Lease(self.holder, held.acquired_at, now + self.ttl_s)
        self._write(renewed, overwrite=True)
        self.held = renewed
        return renewed

    def check(self) -> Lease:
        """The lease while it is held and live by the clock (no I/O), else
        :class:`LeaseLostError`."""
        held = self.held
        if held is None:
            raise LeaseLostError(
                "this master does not hold the job's lease", path=self.location.uri
            )
        if not held.live(float(self.clock())):
            self.held = None
            raise LeaseLostError(
                "the job's lease expired before it was renewed",
                path=self.location.uri,
                detail=f"it expired at {_when(held.expires_at)}",
                hint="renew well within execution's lease time (a third of it)",
            )
        return held

    def release(self) -> None:
        """Gives the lease up (deletes the file when it is still this holder's)."""
        if self.held is None:
            return
        self.held = None
        current = self.read()
        if current is not None and current.holder == self.holder:
            self.location.delete(what="job lease")

    def __enter__(self) -> JobLease:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def _write(self, lease: Lease, *, overwrite: bool) -> None:
        publish(self.location, lease.to_bytes(), overwrite=overwrite, fsync=False, what="job lease")

    def _held(self, current: Lease) -> LeaseHeldError:
        return LeaseHeldError(
            "another master runs this job",
            path=self.location.uri,
            detail=(
                f"the lease is held by {current.holder} since {_when(current.acquired_at)} "
                f"and expires at {_when(current.expires_at)}"
            ),
            hint="stop that master, or wait for its lease to expire if it died",
        )

    def _take_over(self, expired: Lease, mine: Lease) -> None:
        """Replaces an expired lease (or our own) on a local disk; the exclusive
        marker makes sure that one master only replaces it."""
        marker = self.directory.child(f"{LEASE_FILE}.takeover-{expired.holder.token}")
        try:
            publish(marker, b"", overwrite=False, fsync=False, what="lease takeover marker")
        except StateFileExistsError as e:
            raise LeaseHeldError(
                "another master is taking over the job's expired lease",
                path=self.location.uri,
                detail=f"the expired lease was {expired.holder}'s",
                hint="run one master per job",
            ) from e
        try:
            current = self.read()
            if current != expired:
                if current is not None and current.holder != self.holder:
                    raise self._held(current)
                raise LeaseHeldError(
                    "the job's lease changed while this master took it over",
                    path=self.location.uri,
                    hint="another master of this job is starting; run one at a time",
                )
            self._write(mine, overwrite=True)
        finally:
            marker.delete(what="lease takeover marker")

    def _acquire_remote(self, mine: Lease) -> Lease:
        current = self.read()
        if (
            current is not None
            and current.holder != self.holder
            and current.live(mine.acquired_at)
            and not current.holder.gone()
        ):
            raise self._held(current)
        self._write(mine, overwrite=True)
        self.sleep(self.settle_s)
        back = self.read()
        if back is None or back.holder != self.holder:
            if back is not None:
                raise self._held(back)
            raise LeaseHeldError(
                "the job's lease vanished while this master took it",
                path=self.location.uri,
                hint="another master of this job is starting; run one at a time",
            )
        self.held = mine
        return mine
