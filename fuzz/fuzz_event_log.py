"""Fuzz target: the job event log's reader (``JobEventLog.open`` and ``replay``).

An input is a log directory: segments separated by ``@@segment@@``, each one byte
and the segment's bytes. The byte's low two bits step the segment number on from the
previous one (``events-<seq:08d>.log``; 0 overwrites it, 2 or 3 leave a gap) and bit
2 asks for the segment's checksums to be made right first, walking the records its
headers declare, so that mutations of the events get past them. An input that starts
with ``[`` is instead a JSON array of events, which the log's own encoder writes as
its one segment, so that mutations reach the events and their replay directly.

Opening the log and replaying it must work or raise a ``SpilloverError``; a torn or
corrupt tail is read with a warning. A log that opens can be written on: an event
appended and flushed is there when the log is opened again, after every entry read
before, without a warning.

    python fuzz/fuzz_event_log.py [libFuzzer flags] [corpus directories]
"""

from __future__ import annotations

import json
import logging
import struct

from _fuzzing import FUZZ_DIR, instrumented, main

with instrumented(__name__):
    import _harness as h
    from spillover.errors import SpilloverError
    from spillover.runtime.jobevents import JobEventLog, JobFinished
    from spillover.runtime.jobevents.log import KIND_EVENTS, segment_name
    from spillover.runtime.jobevents.segments import encode_segment
    from spillover.storage.reference import crc32c

DEFAULTS = {"-max_len": "8192", "-timeout": "30", "-dict": str(FUZZ_DIR / "dicts" / "log.dict")}
SEPARATOR = b"@@segment@@"
MAX_SEGMENTS = 8
HEADER_SIZE, RECORD_SIZE = 64, 28


def fix_segment(body: bytes) -> bytes:
    """``body`` with the CRCs of its segment header and of every record made right."""
    b = bytearray(body)
    if len(b) >= HEADER_SIZE:
        b[60:64] = struct.pack("<I", crc32c(b[:60]))
    off = HEADER_SIZE
    while len(b) - off >= RECORD_SIZE:
        (length,) = struct.unpack_from("<I", b, off + 16)
        start = off + RECORD_SIZE
        if start + length <= len(b):
            b[off + 20 : off + 24] = struct.pack("<I", crc32c(b[start : start + length]))
        b[off + 24 : off + 28] = struct.pack("<I", crc32c(b[off : off + 24]))
        off = start + length
    return bytes(b)


def segments(data: bytes) -> list[tuple[int, bytes]]:
    """``(seq, bytes)`` of each segment an input describes."""
    if data[:1] == b"[":
        return events_segment(data)
    out, seq = [], 0
    for chunk in data.split(SEPARATOR)[:MAX_SEGMENTS]:
        if not chunk:
            continue
        seq += chunk[0] & 3
        out.append((seq, fix_segment(chunk[1:]) if chunk[0] & 4 else chunk[1:]))
    return out


def events_segment(data: bytes) -> list[tuple[int, bytes]]:
    """A JSON array of event payloads as the first segment of a log, as the writer
    writes it (no segment if the input is not JSON)."""
    try:
        events = json.loads(data)
    except (ValueError, RecursionError):
        return []
    payloads = [json.dumps(e).encode() for e in events] if isinstance(events, list) else []
    return [(1, encode_segment(KIND_EVENTS, 1, 0, bytes(16), payloads))]


def TestOneInput(data: bytes) -> None:
    directory = h.fresh_dir() / "_events"
    directory.mkdir()
    for seq, body in segments(data):
        (directory / segment_name(seq)).write_bytes(body)
    try:
        log = JobEventLog.open(str(directory), compact_after=None)
        state = log.replay()
        state.to_events()
    except SpilloverError:
        return
    if state.status not in ("empty", "running", "finished", "failed", "cancelled"):
        raise h.OracleError(f"replay gave status {state.status!r}")
    before = [repr(e) for e in log.entries()]
    entry = log.append(JobFinished(cause="fuzz"))
    log.flush()
    again = JobEventLog.open(str(directory), compact_after=None)
    if again.warnings:
        raise h.OracleError(f"a log written on after a torn tail still warns: {again.warnings}")
    if [repr(e) for e in again.entries()] != [*before, repr(entry)]:
        raise h.OracleError("a log written on does not read back as it was plus the new event")


if __name__ == "__main__":
    logging.getLogger("spillover").addHandler(logging.NullHandler())  # torn tails warn
    main(TestOneInput, DEFAULTS)
