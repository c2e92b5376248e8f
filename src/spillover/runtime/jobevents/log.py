"""The job event log: what a job master decided and saw, durable and append-only, so
that a master started after the previous one died can pick up where it stopped.

The log is a directory of immutable **segments** (``events-<seq>.log``), each
written completely and published at once, so it works on object stores that cannot
append. Appends wait in memory until :meth:`JobEventLog.flush` writes them as the
next segment; :meth:`JobEventLog.compact` writes a **snapshot** segment that says
everything the older ones said and deletes those. Every record is checksummed: a
torn or corrupt tail is ignored with a warning, corruption followed by valid records
is an error. The exact bytes: docs/format.md, "Job event log (format v1)".
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spillover.errors import (
    CorruptFrameError,
    ForeignFileError,
    StorageError,
)
from spillover.runtime.jobevents.events import (
    Event,
    JobLogState,
    LogEntry,
    decode_event,
    encode_event,
)
from spillover.runtime.jobevents.segments import (
    KIND_EVENTS,
    KIND_SNAPSHOT,
    LOG_FORMAT_VERSION,
    Segment,
    encode_segment,
    parse_segment,
    valid_record_after,
)
from spillover.storage.location import Location, Publication, publish_in_order

if TYPE_CHECKING:
    from spillover.runtime.jobevents.lease import JobLease

__all__ = ["EVENTS_DIR", "LOG_FORMAT_VERSION", "JobEventLog", "is_event_log", "segment_name"]

logger = logging.getLogger(__name__)

EVENTS_DIR = "_events"  # the log's directory inside a job's checkpoint directory
_SEGMENT_RE = re.compile(r"events-(\d{8})\.log")
_TEMP_RE = re.compile(r"events-\d{8}\.log\.tmp-[0-9a-f]+")


def segment_name(seq: int) -> str:
    """The file name of segment ``seq``."""
    return f"events-{seq:08d}.log"


# ---------------------------------------------------------------------- storage


_ONE_WRITER = (
    "another job master writes this log: run one master per job (the lease in the "
    "log's directory says which)"
)


def publish(location: Location, data: bytes, *, overwrite: bool, fsync: bool, what: str) -> None:
    """:meth:`Location.publish`, with the log's word for a file that exists already:
    without ``overwrite`` a second writer of the same name (another master) fails
    instead of replacing what the first one published."""
    location.publish(data, overwrite=overwrite, fsync=fsync, what=what, hint=_ONE_WRITER)


# -------------------------------------------------------------------------- log


@dataclass
class _Contents:
    """A log as read: its entries and what a writer needs to go on from it."""

    entries: list[LogEntry] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    log_id: bytes | None = None
    next_seq: int = 1
    next_index: int = 0
    chain: int = 0  # segments from the newest snapshot on
    stale: list[Location] = field(default_factory=list)  # to delete before writing on
    rewrite: Segment | None = None  # a torn tail whose valid records are written anew


def _read_log(directory: Location) -> _Contents:
    found = sorted(
        (int(m.group(1)), name)
        for name in directory.list("the job event log")
        if (m := _SEGMENT_RE.fullmatch(name))
    )
    out = _Contents()
    if not found:
        return out

    def load(i: int) -> Segment:
        seq, name = found[i]
        loc = directory.child(name)
        return parse_segment(seq, loc, loc.read_bytes("job event log segment"))

    def warn(message: str) -> None:
        logger.warning("job event log %s: %s", directory.uri, message)
        out.warnings.append(message)

    # The newest complete snapshot is the base; a torn newest snapshot is skipped
    # when the segments it summarised are still there (it was never the base).
    loaded: dict[int, Segment] = {}
    base, end = 0, len(found)
    for i in range(len(found) - 1, -1, -1):
        seg = loaded[i] = load(i)
        if not seg.snapshot:
            continue
        if not seg.complete and i == end - 1 and i > 0 and not seg.valid_after:
            warn(f"{seg.location.name}: snapshot incomplete ({seg.reason}); read without it")
            out.stale.append(seg.location)
            end -= 1
            continue
        base = i
        break
    out.stale += [directory.child(name) for _, name in found[:base]]
    chain = [loaded[i] for i in range(base, end)]

    expected_index: int | None = None
    for k, seg in enumerate(chain):
        if seg.seq != chain[0].seq + k:
            raise CorruptFrameError(
                "a segment of the job event log is missing",
                path=directory.uri,
                detail=f"{segment_name(chain[0].seq + k)} is not there; later segments are",
                hint="the log cannot be trusted; resume by hand from a checkpoint",
            )
        h = seg.header
        if h is not None:
            if out.log_id is not None and h.log_id != out.log_id:
                raise ForeignFileError(
                    "a segment belongs to another job event log",
                    path=seg.location.uri,
                    detail=f"log id {h.log_id.hex()}, the others {out.log_id.hex()}",
                )
            out.log_id = h.log_id
            if expected_index is None and h.kind == KIND_EVENTS and h.first_index != 0:
                raise CorruptFrameError(
                    "the start of the job event log is missing",
                    path=seg.location.uri,
                    detail=f"the oldest segment starts at record {h.first_index}, not 0",
                    hint="the log cannot be trusted; resume by hand from a checkpoint",
                )
            if expected_index is not None and h.first_index != expected_index:
                raise CorruptFrameError(
                    "records of the job event log are missing",
                    path=seg.location.uri,
                    detail=f"the segment starts at record {h.first_index}, not {expected_index}",
                )
            for index, off, payload in seg.records:
                at, event = decode_event(payload, seg.location.uri, off)
                out.entries.append(LogEntry(index, at, event, seg.snapshot))
            expected_index = h.first_index + len(seg.records)
        out.next_seq = seg.seq + 1
        if seg.complete:
            continue
        if seg.valid_after or any(valid_record_after(s.data, 0) for s in chain[k + 1 :]):
            raise CorruptFrameError(
                "the job event log is corrupt before its end",
                path=seg.location.uri,
                offset=seg.bad_offset,
                detail=f"{seg.reason}; valid records follow",
                hint="the log cannot be trusted past this point; resume by hand from a checkpoint",
            )
        if seg.snapshot:
            raise CorruptFrameError(
                "the job event log's snapshot is incomplete and the segments it replaced are gone",
                path=seg.location.uri,
                offset=seg.bad_offset,
                detail=seg.reason,
                hint="resume by hand from a checkpoint",
            )
        kept = len(seg.records)
        warn(
            f"{seg.location.name}: torn or corrupt tail at offset {seg.bad_offset} "
            f"({seg.reason}); {kept} record(s) kept, the rest ignored"
        )
        # Garbage after the tail goes; the tail is written anew with its valid records
        # (one atomic replace) or goes too.
        out.stale += [s.location for s in chain[k + 1 :]] + ([] if kept else [seg.location])
        out.rewrite = seg if kept else None
        out.next_seq = seg.seq + (1 if kept else 0)
        out.chain = k + (1 if kept else 0)
        break
    else:
        out.chain = len(chain)
    out.next_index = expected_index or 0
    return out


def is_event_log(directory: Location) -> bool:
    """Whether ``directory`` holds job event log segments."""
    try:
        return any(_SEGMENT_RE.fullmatch(n) for n in directory.list("the job event log"))
    except StorageError:
        return False


class JobEventLog:
    """The event log of one job in ``directory``: reads it when opened, then appends.

    Appends stay in memory until :meth:`flush`, which publishes them as one new
    segment (nothing is written otherwise; a reader such as ``spillover inspect``
    never changes the log). One process writes a log at a time: hold the job's
    :class:`~spillover.runtime.jobevents.lease.JobLease` and pass it as ``lease``,
    and every flush first checks that it has not expired.
    """

    def __init__(
        self,
        directory: Location,
        *,
        clock: Callable[[], float] = time.time,
        fsync: bool = True,
        compact_after: int | None = 64,
        lease: JobLease | None = None,
    ) -> None:
        self.location = directory
        self.clock = clock
        self.fsync = fsync
        self.compact_after = compact_after
        self.lease = lease
        self._lock = threading.Lock()
        contents = _read_log(directory)
        self.warnings: list[str] = contents.warnings
        self._entries = contents.entries
        self._log_id = contents.log_id or uuid.uuid4().bytes
        self._seq = contents.next_seq
        self._index = contents.next_index
        self._chain = contents.chain
        self._stale = contents.stale
        self._rewrite = contents.rewrite
        self._pending: list[bytes] = []

    @classmethod
    def open(
        cls,
        directory: str | os.PathLike[str] | Location,
        *,
        filesystem: Any = None,
        clock: Callable[[], float] = time.time,
        fsync: bool = True,
        compact_after: int | None = 64,
        lease: JobLease | None = None,
    ) -> JobEventLog:
        """The log in ``directory`` (a path, a URI, or a :class:`Location`; it need not
        exist yet). ``compact_after``: compact once that many segments follow the
        newest snapshot (None: only when asked). ``fsync`` (the default): local segments
        survive a machine crash too."""
        loc = (
            directory if isinstance(directory, Location) else Location.parse(directory, filesystem)
        )
        return cls(loc, clock=clock, fsync=fsync, compact_after=compact_after, lease=lease)

    @property
    def log_id(self) -> str:
        return self._log_id.hex()

    def append(self, event: Event) -> LogEntry:
        """Adds ``event``; durable after the next :meth:`flush`."""
        at = float(self.clock())
        payload = encode_event(event, at)
        with self._lock:
            entry = LogEntry(self._index, at, event)
            self._index += 1
            self._pending.append(payload)
            self._entries.append(entry)
        return entry

    def flush(self, before: Sequence[Publication] = ()) -> None:
        """Publishes the appended events as one new segment. On failure they stay
        pending and the next flush tries the same segment again.

        ``before``: files published first, in order, none of the events visible
        before they are (:func:`~spillover.storage.location.publish_in_order`): a
        checkpoint's metadata, and then the record that it completed."""
        with self._lock:
            if not self._pending:
                publish_in_order(before)
                return
            self._prepare()
            first = self._index - len(self._pending)
            self._publish(KIND_EVENTS, first, self._pending, before)
            self._pending = []
            self._chain += 1
            due = self.compact_after is not None and self._chain > self.compact_after
        if due:
            # The segment is published: a failing compaction must not make the caller
            # take the flush for failed (a checkpoint the log names would be declined).
            # A snapshot not written is tried after the next segment; older segments
            # not deleted go at the next compaction (readers start at the snapshot).
            try:
                self.compact()
            except (OSError, StorageError) as e:
                logger.warning("job event log %s: compaction failed: %s", self.location.uri, e)

    def discard_pending(self) -> None:
        """Forgets the events appended since the last flush (one that failed, say,
        whose events must not be published by a later flush)."""
        with self._lock:
            n = len(self._pending)
            if n:
                self._pending = []
                self._index -= n
                del self._entries[-n:]

    def compact(self) -> None:
        """Writes a snapshot of :meth:`replay` as a new segment, then deletes every
        older segment. Later readers see the snapshot's events instead of the
        history they summarise."""
        self.flush()
        with self._lock:
            # A history that summarises to nothing still gets its (empty) snapshot:
            # the older segments go, and the log stays bounded.
            events = self._state().to_events()
            self._prepare()
            at = float(self.clock())
            payloads = [encode_event(e, at) for e in events]
            seq, first = self._seq, self._index
            self._publish(KIND_SNAPSHOT, first, payloads)
            self._index += len(payloads)
            self._entries = [
                LogEntry(first + i, at, e, snapshot=True) for i, e in enumerate(events)
            ]
            self._chain = 1
            for name in self.location.list("the job event log"):
                m = _SEGMENT_RE.fullmatch(name)
                if (m and int(m.group(1)) < seq) or _TEMP_RE.fullmatch(name):
                    self.location.child(name).delete(what="job event log segment")

    def entries(self) -> Iterator[LogEntry]:
        """Every entry the log holds, the appended but not yet flushed included."""
        with self._lock:
            entries = list(self._entries)
        return iter(entries)

    def events(self) -> Iterator[Event]:
        return (e.event for e in self.entries())

    def replay(self) -> JobLogState:
        """The summary of the job's current run."""
        with self._lock:
            return self._state()

    @property
    def pending(self) -> int:
        """Events appended since the last flush."""
        return len(self._pending)

    def _state(self) -> JobLogState:
        return JobLogState.replay(e.event for e in self._entries)

    def _prepare(self) -> None:
        """Before the first write: drops a torn tail (writing its valid records anew)
        and the leftovers of an interrupted compaction."""
        if self.lease is not None:
            self.lease.check()
        for loc in self._stale:
            loc.delete(what="job event log segment")
        self._stale = []
        seg, self._rewrite = self._rewrite, None
        if seg is not None and seg.header is not None:
            data = encode_segment(
                seg.header.kind,
                seg.seq,
                seg.header.first_index,
                self._log_id,
                [p for _, _, p in seg.records],
            )
            publish(seg.location, data, overwrite=True, fsync=self.fsync, what="segment")

    def _publish(
        self, kind: int, first: int, payloads: Sequence[bytes], before: Sequence[Publication] = ()
    ) -> None:
        data = encode_segment(kind, self._seq, first, self._log_id, payloads)
        loc = self.location.child(segment_name(self._seq))
        segment = Publication(
            loc,
            data,
            fsync=self.fsync,
            overwrite=False,
            what="job event log segment",
            hint=_ONE_WRITER,
        )
        publish_in_order([*before, segment])
        self._seq += 1
