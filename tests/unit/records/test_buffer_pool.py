"""Buffers a packer hands out (RecordWriter, FrameJoiner, KeyGroupDemux) go back to
the packer's pool when their last view dies and are reused for its next buffers;
a buffer still referenced anywhere is never reused, and buffers may outlive their
packer or die on another thread."""

from __future__ import annotations

import gc
import threading
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from spillover.records import FrameJoiner, RecordReader, RecordWriter, read_records

SIZE = 64 << 10


def _address(buf: Any) -> int:
    return int(np.asarray(buf).__array_interface__["data"][0])


def _join(joiner: FrameJoiner, payload: np.ndarray[Any, Any], channel: int) -> list[Any]:
    out = np.array([channel], np.int32)
    offsets = np.zeros(1, np.int64)
    lengths = np.array([len(payload)], np.int64)
    return [b for _, b in joiner.put_frames(payload, offsets, lengths, out)]


def test_a_dropped_buffer_is_reused_for_the_next() -> None:
    joiner = FrameJoiner(1, SIZE)
    first = _join(joiner, np.ones(SIZE, np.uint8), 0)
    where = {_address(b) for b in first}
    del first
    assert joiner._packer.spares() == 1
    again = _join(joiner, np.full(SIZE, 2, np.uint8), 0)
    assert {_address(b) for b in again} == where
    assert (np.asarray(again[0]) == 2).all()
    assert joiner._packer.spares() == 0


def test_a_referenced_buffer_is_never_reused() -> None:
    """A view alone keeps its buffer out of the pool; once it dies, the buffer is
    the next one handed out."""
    joiner = FrameJoiner(1, SIZE)
    buf = _join(joiner, np.full(SIZE, 3, np.uint8), 0)[0]
    where = _address(buf)
    view = memoryview(buf)[10:20]
    del buf
    gc.collect()
    later = [_join(joiner, np.full(SIZE, 4 + i, np.uint8), 0)[0] for i in range(8)]
    assert where not in {_address(b) for b in later}
    assert bytes(view) == bytes([3]) * 10
    del later
    del view  # given back last: the first spare to be reused
    gc.collect()
    assert _address(_join(joiner, np.zeros(SIZE, np.uint8), 0)[0]) == where


def test_spares_are_bounded() -> None:
    joiner = FrameJoiner(1, 1 << 20)
    bufs = [_join(joiner, np.zeros(1 << 20, np.uint8), 0)[0] for _ in range(32)]
    del bufs
    assert 2 <= joiner._packer.spares() <= 8  # 8 MiB of 1 MiB buffers


def test_buffers_outlive_their_packer() -> None:
    w = RecordWriter(4096)
    bufs = [b for i in range(2000) for b in w.write(i.to_bytes(4, "little") * 8)]
    last = w.flush()
    assert last is not None
    bufs.append(last)
    del w
    gc.collect()
    records = read_records(bufs)
    assert records == [i.to_bytes(4, "little") * 8 for i in range(2000)]
    del bufs
    gc.collect()


def test_buffers_die_on_other_threads_while_packing() -> None:
    """A consumer thread decodes and drops buffers while the producer packs more:
    every record arrives intact and in order."""
    w = RecordWriter(8192)
    handoff: list[Any] = []
    cv = threading.Condition()
    seen: list[bytes] = []

    def consume() -> None:
        reader = RecordReader()
        while True:
            with cv:
                while not handoff:
                    cv.wait()
                buf = handoff.pop(0)
            if buf is None:
                return
            seen.extend(r for batch in reader.feed(buf) for r in batch.to_list())

    t = threading.Thread(target=consume)
    t.start()
    n = 20_000
    for i in range(n):
        for buf in w.write(i.to_bytes(8, "little") * (1 + i % 13)):
            with cv:
                handoff.append(buf)
                cv.notify()
    last = w.flush()
    with cv:
        handoff.extend([last, None])
        cv.notify()
    t.join()
    assert seen == [i.to_bytes(8, "little") * (1 + i % 13) for i in range(n)]


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2), st.binary(min_size=1, max_size=3000)), max_size=60),
    st.lists(st.booleans(), min_size=1),
)
def test_reuse_never_changes_what_was_joined(frames: Any, keep: list[bool]) -> None:
    """Whichever buffers the caller keeps or drops, each channel's kept buffers hold
    exactly its bytes at their place in the stream."""
    joiner = FrameJoiner(3, 4096)
    streams: dict[int, bytes] = {0: b"", 1: b"", 2: b""}
    kept: list[tuple[int, int, Any]] = []  # channel, start in its stream, buffer
    at = {0: 0, 1: 0, 2: 0}
    for i, (ch, data) in enumerate(frames):
        streams[ch] += data
        payload = np.frombuffer(data, np.uint8)
        for buf in _join(joiner, payload, ch):
            if keep[i % len(keep)]:
                kept.append((ch, at[ch], buf))
            at[ch] += len(buf)
    for ch, start, buf in kept:
        assert bytes(buf) == streams[ch][start : start + len(buf)]
