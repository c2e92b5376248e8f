"""The feedback edge's partition: never blocks, spills in FIFO order, reads back lazily."""

from __future__ import annotations

import os
import struct
import sys
import time
import tracemalloc
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillover.errors import ClosedError, ConfigError
from spillover.runtime.iteration.feedback import FeedbackPartition
from spillover.runtime.network.buffers import BufferPool, NetworkBuffer, NetworkTimeoutError
from spillover.runtime.network.errors import ChannelCancelledError, ChannelFailedError
from spillover.runtime.network.events import (
    BarrierKind,
    CheckpointBarrier,
    EndOfPartition,
    Event,
    Watermark,
    deserialize,
    to_buffer,
)
from spillover.runtime.network.gate import InputGate
from spillover.runtime.network.local import connect
from spillover.runtime.network.partition import ResultPartition
from support.threads import JOIN, Worker

Item = bytes | Event


def feedback_edge(
    spill_dir: str | os.PathLike[str],
    subs: int = 2,
    exclusive: int = 2,
    segment_size: int = 64,
    segments: int = 4,
    **options: Any,
) -> tuple[FeedbackPartition, InputGate]:
    """A feedback partition over a real partition whose subpartitions feed the
    channels of one gate (the iteration head's), no floating credit."""
    inner = ResultPartition(subs, BufferPool(segment_size, segments, "tail"), "tail->head")
    gate = InputGate(subs, floating_buffers=0, buffers_per_channel=exclusive, name="head")
    for s in range(subs):
        connect(inner, s, gate, s)
    return FeedbackPartition(inner, spill_dir, **options), gate


def payload(n: int, size: int = 8) -> bytes:
    """Unique bytes: a counter, padded to ``size``."""
    return struct.pack("<I", n) + bytes([n % 251]) * (size - 4)


def poll(gate: InputGate, limit: int | None = None) -> list[tuple[int, Item]]:
    """Up to ``limit`` deliverable buffers, released, as (channel, bytes or event)."""
    out: list[tuple[int, Item]] = []
    while limit is None or len(out) < limit:
        got = gate.poll(0)
        if got is None:
            break
        ch, buf = got
        out.append((ch, deserialize(buf) if buf.is_event else bytes(buf)))
        buf.release()
    return out


def is_unaligned(item: Item) -> bool:
    return isinstance(item, CheckpointBarrier) and item.is_unaligned


def run_out(fp: FeedbackPartition, gate: InputGate) -> list[tuple[int, Item]]:
    """Consumes and pumps in turn, on this thread, until nothing is left anywhere."""
    out: list[tuple[int, Item]] = []
    deadline = time.monotonic() + JOIN
    while True:
        empty = fp.pump()
        got = poll(gate)
        out += got
        if empty and not got:
            return out
        if not got:
            assert time.monotonic() < deadline, "the spilled buffers never came"
            time.sleep(0.0005)


def per_channel(items: Iterable[tuple[int, Item]], n: int) -> list[list[Item]]:
    out: list[list[Item]] = [[] for _ in range(n)]
    for ch, item in items:
        out[ch].append(item)
    return out


def spill_files(root: str | os.PathLike[str]) -> list[Path]:
    return sorted(Path(root).rglob("*.spill"))


def resident_bytes() -> int | None:
    """The process's resident memory (Linux), or None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def contents(bufs: Iterable[NetworkBuffer]) -> list[bytes]:
    """The bytes of each buffer, each released."""
    out = []
    for b in bufs:
        out.append(bytes(b))
        b.release()
    return out


# ---- FIFO order ----

UNALIGNED = BarrierKind.UNALIGNED
ops = st.lists(
    st.one_of(
        st.tuples(st.just("data"), st.integers(0, 1), st.integers(4, 64)),
        st.tuples(st.just("broadcast"), st.just(0), st.integers(4, 64)),
        st.tuples(st.just("watermark"), st.integers(0, 1), st.just(0)),
        st.tuples(st.just("barrier"), st.just(0), st.just(0)),
        st.tuples(st.just("unaligned"), st.just(0), st.just(0)),
        st.tuples(st.just("poll"), st.integers(1, 4), st.just(0)),
        st.tuples(st.just("pump"), st.just(0), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=60)
@given(ops=ops, exclusive=st.integers(1, 2))
def test_each_subpartition_delivers_exactly_what_was_sent_in_order(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, int, int]], exclusive: int
) -> None:
    # Three pool segments for up to four credits: without the permit the partition
    # keeps free, the producer's own wrap would wait behind the feedback edge.
    spill_dir = tmp_path_factory.getbasetemp() / "fifo"  # shared: each has its own files
    fp, gate = feedback_edge(spill_dir, exclusive=exclusive, segments=3)
    try:
        check_fifo(fp, gate, ops)
    finally:
        fp.close()
    assert not os.path.exists(fp.spill_path)


def check_fifo(fp: FeedbackPartition, gate: InputGate, ops: list[tuple[str, int, int]]) -> None:
    pool = fp.pool
    expected: list[list[Item]] = [[], []]
    received: list[list[Item]] = [[], []]
    counter = 0

    def wrap(size: int) -> NetworkBuffer:
        nonlocal counter
        counter += 1
        assert pool.available > 0, "the producer would wait for a pool segment"
        return pool.wrap(payload(counter, size), timeout=0)

    for i, (op, arg, size) in enumerate(ops):
        if op == "data":
            buf = wrap(size)
            expected[arg].append(bytes(buf))
            fp.emit(arg, buf, timeout=0)
        elif op == "broadcast":
            buf = wrap(size)
            for e in expected:
                e.append(bytes(buf))
            fp.broadcast(buf, timeout=0)
        elif op == "watermark":
            expected[arg].append(Watermark(i))
            fp.emit(arg, to_buffer(Watermark(i)))
        elif op == "barrier":
            for e in expected:
                e.append(CheckpointBarrier(i, 0))
            assert fp.broadcast_event(CheckpointBarrier(i, 0)) == [[], []]
        elif op == "unaligned":
            barrier = CheckpointBarrier(i, 0, UNALIGNED)
            overtaken = fp.broadcast_event(barrier, priority=True)
            for sub, (e, r) in enumerate(zip(expected, received, strict=True)):
                at = len(r)  # behind the priority events not yet delivered
                while at < len(e) and is_unaligned(e[at]):
                    at += 1
                data_ahead = [x for x in e[at:] if isinstance(x, bytes)]
                e.insert(at, barrier)
                assert contents(overtaken[sub]) == data_ahead
        elif op == "poll":
            for ch, item in poll(gate, arg):
                received[ch].append(item)
        else:
            fp.pump()
        assert fp.credit(0) == fp.credit(1) == sys.maxsize
        for e, r in zip(expected, received, strict=True):
            assert r == e[: len(r)]
    fp.finish()
    assert fp.finished
    for ch, item in run_out(fp, gate):
        received[ch].append(item)
    assert received == [[*e, EndOfPartition()] for e in expected]
    assert gate.finished
    assert fp.queued_buffers == 0
    assert pool.available == pool.num_segments  # every buffer went back
    assert spill_files(fp.spill_path) == []  # used segments are deleted as they go


@pytest.mark.parametrize(
    ("pure", "compression"), [(False, None), (False, "lz4"), (True, None)], ids=str
)
def test_the_producer_never_waits_and_the_spill_comes_back_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pure: bool, compression: str | None
) -> None:
    monkeypatch.setenv("SPILLOVER_PURE", "1" if pure else "0")
    # Two feedback edges spilling into one directory do not collide.
    edges = [feedback_edge(tmp_path, compression=compression) for _ in range(2)]
    n = 50 * 4  # fifty times the pool (and twice that the credit)
    expected: list[list[list[Item]]] = []
    for fp, _gate in edges:
        want: list[list[Item]] = [[], []]
        for i in range(n):
            sub = i % 2
            buf = fp.pool.wrap(payload(i), timeout=0)  # a segment is always free
            want[sub].append(bytes(buf))
            fp.emit(sub, buf, timeout=0)  # would raise if it waited for credit
            if i % 10 == 9:
                fp.broadcast_event(Watermark(i))
                for w in want:
                    w.append(Watermark(i))
        expected.append(want)
        assert fp.credit(0) == sys.maxsize
        assert fp.spilled_bytes > 0 and fp.spilled_buffers > n // 2
        assert fp.queued_buffers == fp.spilled_buffers
        assert fp.backlog(0) == (2 + n // 2 - 2, 8 * (n // 2))
        assert fp.emitted(0) == (n // 2, 8 * (n // 2))
        fp.finish()
        assert fp.finished
        with pytest.raises(ClosedError):
            fp.emit(0, NetworkBuffer.unpooled(b"late"))
    assert spill_files(tmp_path)
    assert len(os.listdir(tmp_path)) == 2

    for (fp, gate), want in zip(edges, expected, strict=True):

        def consume(gate: InputGate = gate) -> list[tuple[int, Item]]:
            out: list[tuple[int, Item]] = []
            while not gate.finished:
                got = gate.poll(JOIN)
                assert got is not None
                ch, buf = got
                out.append((ch, deserialize(buf) if buf.is_event else bytes(buf)))
                buf.release()
            return out

        consumer = Worker(consume)
        fp.pump_blocking(timeout=JOIN)  # the task's end: waits for credit
        got = per_channel(consumer.finish(), 2)
        assert got == [[*w, EndOfPartition()] for w in want]
        assert fp.queued_buffers == 0 and fp.backlog(0) == (0, 0)
        assert fp.pool.available == fp.pool.num_segments
        fp.close()
        fp.close()  # idempotent
    assert spill_files(tmp_path) == [] and os.listdir(tmp_path) == []


def test_memory_stays_bounded_whatever_the_spill_size(tmp_path: Path) -> None:
    size, count = 32 * 1024, 640  # 20 MiB through four 32 KiB segments
    fp, gate = feedback_edge(tmp_path, subs=1, segment_size=size, segments=4)
    pool = fp.pool
    rss_before = resident_bytes()
    tracemalloc.start()
    try:
        for i in range(count):
            seg = pool.request_segment(timeout=0)  # as a task's writer does
            seg[:8] = np.frombuffer(struct.pack("<Q", i), np.uint8)
            seg[8:] = i % 251
            fp.emit(0, pool.wrap(seg), timeout=0)
            assert pool.in_use <= 3  # channel's two credits; one permit kept free
        assert fp.spilled_bytes >= (count - 2) * size
        rss_spilled = resident_bytes()
        # On disk, but for what the storer's copy pool (256 KiB) has not written yet.
        on_disk = sum(p.stat().st_size for p in spill_files(tmp_path))
        assert on_disk >= fp.spilled_bytes - 512 * 1024
        fp.finish()
        seen = 0
        deadline = time.monotonic() + JOIN
        while not gate.finished:
            fp.pump()
            got = gate.poll(0)
            if got is None:
                assert time.monotonic() < deadline
                time.sleep(0.0005)
                continue
            _, buf = got
            if not buf.is_event:
                assert struct.unpack("<Q", bytes(buf[:8]))[0] == seen
                assert len(buf) == size and bool(np.all(buf[8:] == seen % 251))
                seen += 1
            buf.release()
            assert pool.in_use <= 3
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert seen == count
    # Python-side memory (numpy included) is a few segments, not the spill; the
    # engine's native buffers are bounded by its options (a few hundred KiB).
    assert peak < 2 * 1024 * 1024, f"peak {peak} bytes"
    if rss_before is not None and rss_spilled is not None:  # native memory too (Linux)
        assert rss_spilled - rss_before < 8 * 1024 * 1024
    assert spill_files(tmp_path) == []
    fp.close()


# ---- priority events ----


def test_unaligned_barrier_overtakes_channel_then_spilled_data(tmp_path: Path) -> None:
    fp, gate = feedback_edge(tmp_path, subs=2, exclusive=2, segments=8)
    pool = fp.pool
    for i in range(6):
        fp.emit(0, pool.wrap(payload(i)))  # two into the channel, four spilled
        if i == 3:
            fp.emit(0, to_buffer(Watermark(3)))  # spilled, in line
    assert fp.queued_buffers == 5
    assert poll(gate, 1) == [(0, payload(0))]  # one credit back
    deadline = time.monotonic() + JOIN
    while fp.inner.backlog(0)[0] < 2:  # the spill is read back: payload 2 moves on
        assert not fp.pump() and time.monotonic() < deadline
    assert not fp.pump()  # payload 3 is read back too, but waits for credit
    barrier = CheckpointBarrier(7, 1, UNALIGNED)
    before = pool.available
    overtaken = fp.broadcast_event(barrier, priority=True)
    assert isinstance(overtaken[1], list) and overtaken[1] == []  # nothing there
    assert not isinstance(overtaken[0], list)  # lazy: reads the segments as it goes
    # The channel's two (retained for us), then copies of the spilled data.
    assert contents(overtaken[0]) == [payload(i) for i in range(1, 6)]
    assert pool.available == before  # the copies are outside the pool
    # The queue is unchanged: the barrier first, then everything in order.
    fp.finish()
    got = per_channel(run_out(fp, gate), 2)
    assert got[0] == [
        barrier,
        *[payload(i) for i in range(1, 4)],
        Watermark(3),
        *[payload(i) for i in range(4, 6)],
        EndOfPartition(),
    ]
    assert got[1] == [barrier, EndOfPartition()]
    assert pool.available == pool.num_segments
    fp.close()


def test_an_abandoned_overtaken_iterator_gives_back_what_it_holds(tmp_path: Path) -> None:
    fp, gate = feedback_edge(tmp_path, subs=1, exclusive=2, segments=8)
    pool = fp.pool
    for i in range(5):
        fp.emit(0, pool.wrap(payload(i)))
    (overtaken,) = fp.broadcast_event(CheckpointBarrier(1, 0, UNALIGNED), priority=True)
    it = iter(overtaken)
    first = next(it)
    assert bytes(first) == payload(0)  # the channel's, retained for us
    first.release()
    del it, overtaken  # the channel's second buffer was never taken: released now
    assert pool.in_use == 2
    fp.finish()
    got = per_channel(run_out(fp, gate), 1)[0]
    assert got == [CheckpointBarrier(1, 0, UNALIGNED), *map(payload, range(5)), EndOfPartition()]
    assert pool.available == pool.num_segments and spill_files(tmp_path) == []
    fp.close()


def test_overtaken_buffers_cut_short_by_a_failure_raise(tmp_path: Path) -> None:
    fp, _ = feedback_edge(tmp_path, subs=1, exclusive=1, segments=8)
    for i in range(4):
        fp.emit(0, fp.pool.wrap(payload(i)))
    (overtaken,) = fp.broadcast_event(CheckpointBarrier(1, 0, UNALIGNED), priority=True)
    it = iter(overtaken)
    assert contents([next(it), next(it)]) == [payload(0), payload(1)]
    fp.cancel()  # from another thread: the reading producer is not pulled from under
    assert contents([next(it)]) == [payload(2)]
    fp.close()  # the producer ends: the rest is gone, and the reader says so
    with pytest.raises(ClosedError):
        next(it)
    assert os.listdir(tmp_path) == []


# ---- the loop ----


def run_loop(spill_dir: Path, spilling: bool) -> tuple[list[Any], list[BaseException | None]]:
    """A two-task loop: the head emits ``N`` records into the body, then passes the
    feedback back in; the tail sends each record round ``K`` more times. Credit is
    one buffer per channel. Returns each task's result and error."""
    n, k, wait = 12, 3, 0.5  # a blocked emit waits ``wait`` seconds, then raises
    rec = struct.Struct("<II")
    body = ResultPartition(1, BufferPool(16, 4, "head"), "head->tail")
    body_gate = InputGate(1, floating_buffers=0, buffers_per_channel=1, name="tail")
    connect(body, 0, body_gate, 0)
    feedback, fb_gate = feedback_edge(
        spill_dir, subs=1, exclusive=1, segment_size=16, spilling=spilling
    )

    def head() -> int:
        for i in range(n):  # a burst from the loop's input, as fast as credit allows
            body.emit(0, body.pool.wrap(rec.pack(i, k), timeout=wait), timeout=wait)
        passed = 0
        while True:
            got = fb_gate.poll(wait)
            if got is None:
                raise TimeoutError("no feedback came")
            _, buf = got
            if buf.is_event:  # EndOfPartition: the tail ended the loop
                buf.release()
                body.finish()
                return passed
            data = bytes(buf)
            buf.release()
            body.emit(0, body.pool.wrap(data, timeout=wait), timeout=wait)
            passed += 1

    def tail() -> int:
        done = passes = 0
        idle_since = time.monotonic()
        while True:
            feedback.pump()
            got = body_gate.poll(0.001)
            if got is None:
                if time.monotonic() - idle_since > wait:
                    raise TimeoutError("no input came")
                continue
            idle_since = time.monotonic()
            _, buf = got
            if buf.is_event:
                buf.release()
                feedback.pump_blocking(wait)
                return passes
            rid, left = rec.unpack(bytes(buf))
            buf.release()
            passes += 1
            if left:
                out = feedback.pool.wrap(rec.pack(rid, left - 1), timeout=wait)
                feedback.emit(0, out, timeout=wait)
            else:
                done += 1
                if done == n:  # no record is left in the loop
                    feedback.finish()

    workers = [Worker(head), Worker(tail)]
    for w in workers:
        w.join(JOIN)
        if w.error is not None:  # a deadlock was detected: wake the other side
            body.cancel()
            feedback.cancel()
    for w in workers:
        w.join(JOIN)
        assert not w.is_alive()
    feedback.close()
    return [w.result for w in workers], [w.error for w in workers]


def test_a_loop_deadlocks_without_spilling_and_completes_with_it(tmp_path: Path) -> None:
    results, errors = run_loop(tmp_path, spilling=False)
    assert any(isinstance(e, NetworkTimeoutError) for e in errors), errors
    results, errors = run_loop(tmp_path, spilling=True)
    assert errors == [None, None]
    assert results == [12 * 3, 12 * 4]  # feedback passed by the head; body passes
    assert os.listdir(tmp_path) == []


# ---- without spilling, failures, misuse ----


def test_without_spilling_it_is_the_plain_blocking_partition(tmp_path: Path) -> None:
    fp, gate = feedback_edge(tmp_path, subs=1, exclusive=1, spilling=False)
    fp.emit(0, NetworkBuffer.unpooled(b"a"))
    assert fp.credit(0) == 0
    with pytest.raises(NetworkTimeoutError):
        fp.emit(0, NetworkBuffer.unpooled(b"b"), timeout=0.05)
    assert fp.pump() and fp.spilled_bytes == 0 and fp.emitted(0) == (1, 1)
    fp.finish()
    assert poll(gate) == [(0, b"a"), (0, EndOfPartition())]
    assert not os.path.exists(fp.spill_path)
    fp.close()


@pytest.mark.parametrize("how", ["fail", "cancel"])
def test_a_failure_is_raised_by_later_calls_and_close_deletes_the_spill(
    tmp_path: Path, how: str
) -> None:
    fp, gate = feedback_edge(tmp_path, subs=1, exclusive=1)
    for i in range(20):
        fp.emit(0, fp.pool.wrap(payload(i)))
    fp.broadcast_event(Watermark(1))
    assert spill_files(tmp_path)
    boom = RuntimeError("boom")
    failer = Worker(lambda: fp.fail(boom) if how == "fail" else fp.cancel())  # any thread
    failer.finish()
    error = ChannelCancelledError if how == "cancel" else ChannelFailedError
    with pytest.raises(error) as raised:
        fp.pump()
    if how == "fail":
        assert raised.value.__cause__ is boom
    with pytest.raises(error):
        fp.emit(0, NetworkBuffer.unpooled(b"x"))
    with pytest.raises(error):
        fp.pump_blocking(1)
    with pytest.raises(ChannelFailedError):
        gate.poll(0)
    # The files are the producer's to delete (its thread may be reading them): it
    # closes the partition as it ends.
    fp.close()
    assert spill_files(tmp_path) == [] and os.listdir(tmp_path) == []


def test_close_deletes_the_spill_and_refuses_later_use(tmp_path: Path) -> None:
    fp, _ = feedback_edge(tmp_path, subs=1, exclusive=1)
    for i in range(10):
        fp.emit(0, fp.pool.wrap(payload(i)))
    assert spill_files(tmp_path)
    fp.close()
    fp.close()
    assert os.listdir(tmp_path) == []
    with pytest.raises(ClosedError):
        fp.pump()
    with pytest.raises(ClosedError):
        fp.emit(0, NetworkBuffer.unpooled(b"x"))


def test_pump_blocking_gives_up_when_nobody_reads(tmp_path: Path) -> None:
    fp, _ = feedback_edge(tmp_path, subs=1, exclusive=1)
    for i in range(3):
        fp.emit(0, fp.pool.wrap(payload(i)))
    fp.finish()
    with pytest.raises(NetworkTimeoutError):
        fp.pump_blocking(timeout=0.05)
    assert fp.queued_buffers == 2 and fp.backpressured_seconds > 0
    fp.close()


def test_a_buffer_larger_than_a_pool_segment_is_refused_and_kept(tmp_path: Path) -> None:
    fp, _ = feedback_edge(tmp_path, subs=1, exclusive=1, segment_size=8)
    fp.emit(0, NetworkBuffer.unpooled(b"big enough"))  # has credit: straight through
    buf = NetworkBuffer.unpooled(b"too big to spill")
    with pytest.raises(ConfigError):
        fp.emit(0, buf)
    assert buf.refs == 1 and fp.queued_buffers == 0
    fp.close()


def test_pump_never_waits_even_when_the_credit_it_saw_is_gone(tmp_path: Path) -> None:
    """Floating credit is shared by the head's channels: another producer can take
    the credit ``pump`` saw before it emits. Waiting for it there would deadlock the
    loop (the head may be blocked sending into the tail), so ``pump`` leaves the
    buffer spilled and returns."""
    fp, gate = feedback_edge(tmp_path, subs=1, exclusive=1)
    for i in range(3):
        fp.emit(0, fp.pool.wrap(payload(i)))
    assert fp.queued_buffers == 2  # the first took the only credit
    fp.inner.credit = lambda sub: 1  # type: ignore[method-assign]  # a stale snapshot

    def pump_a_while() -> bool:
        for _ in range(50):  # long enough for the spilled buffers to be read back
            if fp.pump():
                return True
            time.sleep(0.002)
        return False

    assert Worker(pump_a_while).finish() is False
    assert fp.queued_buffers == 2
    fp.emit(0, fp.pool.wrap(payload(3)))  # nor does emit: it spills behind the rest
    assert fp.queued_buffers == 3
    assert [item for _, item in poll(gate)] == [payload(0)]
    del fp.inner.credit  # the real credit again
    assert [item for _, item in run_out(fp, gate)] == [payload(1), payload(2), payload(3)]
    fp.close()
