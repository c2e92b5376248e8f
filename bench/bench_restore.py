"""Restore of a checkpoint's in-flight data: same parallelism, 4->2 and 2->4.

The checkpoint is built with the engine alone: a key_by edge from P old upstream
subtasks to P old downstream subtasks, every old channel ``u -> d`` a stream of
100-byte records (an int64 key of ``d``'s key groups, then payload) in 32 KiB
buffers, its first half in ``d``'s input state and the rest in ``u``'s output
state. Each case replays all of it, every new subtask on its own thread at once as
the runtime runs them (``SPILLOVER_BENCH_RESTORE_SCHEDULE=serial``: one after the
other), decoding every record into numpy batches, next to a raw read of the same
files and the pure-Python reference of the same replay work
(``spillover.storage.reference``) in the same run.
docs/benchmarks.md ("Restore") gives the rules and the targets.

``SPILLOVER_BENCH_RESTORE_BYTES`` sets the in-flight bytes per checkpoint (default
1 GiB); ``SPILLOVER_BENCH_RESTORE_EVICT=1`` reads cold by evicting the checkpoint's
own files from the page cache (``SPILLOVER_BENCH_DROP_CACHES=1`` drops it all). Run
as a script, the module replays one case in a fresh interpreter and prints its peak
RSS growth (see ``test_restore_peak_rss``).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import spillover
from spillover._native._storage import Block, raw_read_baseline
from spillover.keygroups import assign_to_key_group, key_group_range_for_operator, key_groups
from spillover.records import (
    FieldKey,
    FixedWidthSerializer,
    FrameJoiner,
    RecordReader,
    RecordWriter,
)
from spillover.rescale import EdgeType, map_edge, rescaled_retriever, rescaled_retrievers
from spillover.storage import GateStateHandle
from spillover.storage.reference import iter_frames

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

MAX_PARALLELISM = 128
BUFFER = 32 * KiB
REPLAY_BUFFER = 1 * MiB  # replayed records go to the operator, not the network
RECORD = np.dtype([("key", "<i8"), ("payload", "V92")])  # 100 bytes
FRAMED = RECORD.itemsize + 4  # with its length prefix
KEY = FieldKey(0, "int64")
EDGE = 0  # the edge's input gate at the downstream, its result partition upstream
CHECKPOINT_ID = 7
READ_BLOCK = spillover.StorageOptions().read_block_bytes
FIRST_RECORD_TARGET_S = 1.0
THROUGHPUT_TARGET = 0.7


@dataclass(frozen=True)
class Case:
    """Old parallelism (both operators) and new parallelism (both operators)."""

    old: int
    new: int

    @property
    def name(self) -> str:
        return f"{self.old}->{self.new}"


CASES = [Case(4, 4), Case(4, 2), Case(2, 4)]
by_case = pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])


def restore_bytes() -> int:
    """``SPILLOVER_BENCH_RESTORE_BYTES`` (``1G``, ``64M``, ...); default 1 GiB."""
    text = os.environ.get("SPILLOVER_BENCH_RESTORE_BYTES", "").strip().lower()
    if not text:
        return GiB
    t = text.removesuffix("ib").removesuffix("b")
    scale = {"k": KiB, "m": MiB, "g": GiB}.get(t[-1:], 1)
    return int(float(t[:-1] if scale > 1 else t) * scale)


# -- the checkpoint -------------------------------------------------------------------


@dataclass
class Checkpoint:
    """The in-flight state of one key_by edge at old parallelism ``p``."""

    p: int
    inputs: dict[int, GateStateHandle]  # old downstream d -> its input gate
    outputs: dict[int, GateStateHandle]  # old upstream u -> its result partition
    records: int
    key_sum: int  # sum of every key, mod 2**64
    payload_bytes: int  # buffer bytes stored, records framed

    @property
    def files(self) -> list[Path]:
        return [Path(h.uri) for h in [*self.inputs.values(), *self.outputs.values()]]

    @property
    def file_bytes(self) -> int:
        return sum(h.size for h in [*self.inputs.values(), *self.outputs.values()])

    def to_dict(self) -> dict[str, Any]:
        return {
            "p": self.p,
            "inputs": {d: h.to_dict() for d, h in self.inputs.items()},
            "outputs": {u: h.to_dict() for u, h in self.outputs.items()},
            "records": self.records,
            "key_sum": self.key_sum,
            "payload_bytes": self.payload_bytes,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Checkpoint:
        return cls(
            d["p"],
            {int(k): GateStateHandle.from_dict(h) for k, h in d["inputs"].items()},
            {int(k): GateStateHandle.from_dict(h) for k, h in d["outputs"].items()},
            d["records"],
            d["key_sum"],
            d["payload_bytes"],
        )


def _keys_of_each_subtask(p: int, rng: np.random.Generator, n: int = 4096) -> list[Any]:
    """``n`` random int64 keys per old downstream, each in that subtask's key groups."""
    pool = rng.integers(-(2**63), 2**63 - 1, size=4 * n * p, dtype=np.int64)
    owner = key_groups(pool, MAX_PARALLELISM).astype(np.int64) * p // MAX_PARALLELISM
    return [pool[owner == d][:n] for d in range(p)]


class _Channel:
    """One old channel's buffers, generated on demand: ``records`` records, keys of ``keys``."""

    CHUNK = 8192

    def __init__(self, keys: Any, records: int, payload: Any, rng: np.random.Generator) -> None:
        self.keys, self.left, self.payload, self.rng = keys, records, payload, rng
        self.writer = RecordWriter(BUFFER)
        self.ser = FixedWidthSerializer(RECORD)
        self.key_sum = 0
        self.buffers = self._buffers()

    def _buffers(self) -> Iterator[Any]:
        while self.left:
            n = min(self.CHUNK, self.left)
            self.left -= n
            recs = np.empty(n, RECORD)
            recs["key"] = self.keys[self.rng.integers(0, len(self.keys), n)]
            start = int(self.rng.integers(0, len(self.payload) - n))
            recs["payload"] = self.payload[start : start + n]
            self.key_sum += int(recs["key"].sum())  # int64 wraps: mod 2**64
            yield from self.writer.write_batch(*self.ser.serialize_batch(recs))
        last = self.writer.flush()
        if last is not None:
            yield last


def build_checkpoint(root: Path, p: int, total: int, seed: int = 11) -> Checkpoint:
    """Writes at least ``total`` in-flight bytes over the ``p * p`` old channels.

    Each channel's first half of buffers (most cuts fall inside a record) is the
    downstream's input state, the channels' buffers interleaved one by one, as a
    task persists what it processes until each channel's barrier; the rest is the
    upstream's output state, subpartition after subpartition, as the barrier
    overtakes each queue.
    """
    rng = np.random.default_rng(seed)
    keys = _keys_of_each_subtask(p, rng)
    payload = np.frombuffer(rng.bytes(92 * 4 * _Channel.CHUNK), dtype="V92")
    per_channel = -(-total // (p * p * FRAMED))
    channels = {
        (u, d): _Channel(keys[d], per_channel, payload, rng) for u in range(p) for d in range(p)
    }
    buffers = -(-per_channel * FRAMED // BUFFER)
    head = buffers // 2

    def storage(kind: str, i: int) -> Any:
        return spillover.open_storage(
            root / f"{kind}-{i}", checkpoint_id=CHECKPOINT_ID, subtask_index=i
        )

    inputs, outputs = {}, {}
    for d in range(p):
        storer = storage("downstream", d).create_storer(EDGE, kind="input")
        for _ in range(head):
            for u in range(p):
                storer.append(u, next(channels[u, d].buffers))
        inputs[d] = storer.close()
    for u in range(p):
        storer = storage("upstream", u).create_storer(EDGE, kind="output")
        for d in range(p):
            for buf in channels[u, d].buffers:
                storer.append(d, buf)
        outputs[u] = storer.close()
    stored = sum(h.raw_bytes for h in [*inputs.values(), *outputs.values()])
    assert stored == p * p * per_channel * FRAMED
    key_sum = sum(c.key_sum for c in channels.values()) % 2**64
    return Checkpoint(p, inputs, outputs, p * p * per_channel, key_sum, stored)


# -- replay ---------------------------------------------------------------------------


def _cpu_s() -> float:
    """CPU seconds this process has used so far, every thread (reader threads too)."""
    t = os.times()
    return t.user + t.system


def _io() -> dict[str, int]:
    """This process's read counters: ``rchar`` (read calls) and ``read_bytes`` (disk)."""
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def as_records(batch: Any) -> Any:
    """A batch of 100-byte records as a strided numpy view of its buffer, as
    ``FixedWidthSerializer`` makes one, with scalar checks instead of array ones."""
    n, off, lengths = len(batch), batch.offsets, batch.lengths
    if (
        lengths[0] != RECORD.itemsize
        or lengths[n - 1] != RECORD.itemsize
        or (off[n - 1] - off[0] != (n - 1) * FRAMED)
    ):
        raise AssertionError("a batch that is no run of 100-byte records")
    return np.ndarray((n,), RECORD, buffer=batch.data, offset=int(off[0]), strides=(FRAMED,))


@dataclass
class Decoder:
    """A RecordReader per channel; every batch becomes a numpy view whose keys are summed.

    Threads replaying at once each use their own Decoder; they may share ``readers``
    as long as no two feed one channel at the same time."""

    readers: dict[Any, RecordReader] = field(default_factory=dict)
    records: int = 0
    key_sum: int = 0
    bytes: int = 0

    def feed(self, channel: Any, buf: Any) -> int:
        """Decodes one buffer of ``channel``; returns the records that ended in it."""
        reader = self.readers.get(channel)
        if reader is None:
            reader = self.readers[channel] = RecordReader()
        self.bytes += len(buf)
        n = 0
        for batch in reader.feed(buf):
            recs = as_records(batch)
            self.key_sum += int(recs["key"].sum())
            n += len(recs)
        self.records += n
        return n

    def finish(self) -> None:
        for reader in self.readers.values():
            reader.finish()


@dataclass
class Subtask:
    """What one subtask's replay took: times from opening its retriever."""

    name: str
    first_buffer_s: float = float("nan")
    first_record_s: float = float("nan")
    total_s: float = 0.0
    bytes: int = 0


def _drain(name: str, open_: Any, channel_of: Any, decoder: Decoder) -> Subtask:
    """Opens a retriever with ``open_()``, feeds every buffer to ``decoder``, times it."""
    st = Subtask(name)
    before = decoder.bytes
    t0 = time.perf_counter()
    with open_() as r:
        it = iter(r)
        for buf in it:  # up to the first record
            if st.first_buffer_s != st.first_buffer_s:
                st.first_buffer_s = time.perf_counter() - t0
            if decoder.feed(channel_of(buf), buf):
                st.first_record_s = time.perf_counter() - t0
                break
        for buf in it:
            decoder.feed(channel_of(buf), buf)
    st.total_s = time.perf_counter() - t0
    st.bytes = decoder.bytes - before
    return st


def _drain_blocks(name: str, handle: GateStateHandle, channel_of: Any, decoder: Decoder) -> Subtask:
    """A state file's frames block by block (``Retriever.iter_frames``), each channel's
    buffers joined natively into 1 MiB buffers (``FrameJoiner``), as the runtime replays
    its own input state; every joined buffer is decoded."""
    st = Subtask(name)
    before = decoder.bytes
    t0 = time.perf_counter()
    n = 1 + max(handle.channels, default=0)
    joiner = FrameJoiner(n, REPLAY_BUFFER)

    def feed(pairs: list[tuple[int, Any]]) -> None:
        for ch, buf in pairs:
            if st.first_buffer_s != st.first_buffer_s:
                st.first_buffer_s = time.perf_counter() - t0
            if decoder.feed(channel_of(ch), buf) and st.first_record_s != st.first_record_s:
                st.first_record_s = time.perf_counter() - t0

    with spillover.open_retriever(handle) as r:
        for frames in r.iter_frames():
            feed(joiner.put_frames(frames.data, frames.offsets, frames.lengths, frames.channel_ids))
            if st.first_record_s != st.first_record_s:
                feed(joiner.flush())  # the first records at once, not after 1 MiB
    feed(joiner.flush())
    st.total_s = time.perf_counter() - t0
    st.bytes = decoder.bytes - before
    return st


def _channel(buf: Any) -> int:
    return int(buf.channel_id)


def _drain_in_turn(parts: dict[int, Any], decoders: list[Decoder]) -> list[Subtask]:
    """The parts of one shared read drained in turn on this thread (the serial schedule:
    one part after the other would hold the read back once another's queue is full)."""
    t0 = time.perf_counter()
    subtasks = {i: Subtask(f"new downstream {i}") for i in parts}
    left = dict(parts)
    decoder_of = dict(zip(parts, decoders, strict=True))
    while left:
        moved = False
        for i, part in list(left.items()):
            st, dec = subtasks[i], decoder_of[i]
            while (buf := part.poll_next()) is not None:
                moved = True
                if st.first_buffer_s != st.first_buffer_s:
                    st.first_buffer_s = time.perf_counter() - t0
                if dec.feed(_channel(buf), buf) and st.first_record_s != st.first_record_s:
                    st.first_record_s = time.perf_counter() - t0
                st.bytes += len(buf)
            if part.finished:
                st.total_s = time.perf_counter() - t0
                part.close()
                del left[i]
        if not moved and left:
            next(iter(left.values())).wait(0.05)
    return list(subtasks.values())


def shared_read() -> bool:
    """``SPILLOVER_BENCH_RESTORE_SHARED``: ``1`` (default) reads each old channel once for
    every new subtask sharing it (``rescaled_retrievers``); ``0``, once per subtask."""
    return os.environ.get("SPILLOVER_BENCH_RESTORE_SHARED", "1").strip() not in ("0", "")


def _pair(d: int, u: int) -> tuple[int, int]:
    """Old channel (u, d) seen from downstream d's input gate (channel u)."""
    return d, u


def _pair_up(u: int, d: int) -> tuple[int, int]:
    """Old channel (u, d) seen from upstream u's result partition (subpartition d)."""
    return d, u


def schedule() -> str:
    """``SPILLOVER_BENCH_RESTORE_SCHEDULE``: ``parallel`` (default) or ``serial``."""
    value = os.environ.get("SPILLOVER_BENCH_RESTORE_SCHEDULE", "").strip() or "parallel"
    if value not in ("parallel", "serial"):
        raise ValueError(f"SPILLOVER_BENCH_RESTORE_SCHEDULE must be parallel or serial: {value!r}")
    return value


def _phase(jobs: list[Any], parallel: bool) -> list[Subtask]:
    """Runs every job (a function giving a Subtask): each on its own thread, or in turn."""
    if not parallel or len(jobs) == 1:
        return [job() for job in jobs]
    with ThreadPoolExecutor(len(jobs), thread_name_prefix="replay") as pool:
        return list(pool.map(lambda job: job(), jobs))


def replay(
    case: Case, ckpt: Checkpoint, parallel: bool | None = None
) -> tuple[list[Subtask], list[Decoder]]:
    """Replays the checkpoint at ``case.new``.

    ``parallel`` (default: :func:`schedule`): the subtasks replay at once, each on
    its own thread, as the runtime runs a task thread per subtask; otherwise one
    after the other on the calling thread.

    Same parallelism: as the runtime does for an unchanged edge, each downstream
    replays its own input file, then each upstream its own output file, whose
    buffers go on the downstream's channel (same reader, so records cut between
    the pieces join); each file block by block, channels joined into 1 MiB buffers.
    Rescaled: ``rescaled_retrievers(..., buffer_size=1 MiB)``, one read of each old
    channel for every new downstream sharing it, each part drained on its own thread
    (serial: in turn on one thread), as a job's restore reads it for the subtasks of
    one process; with ``SPILLOVER_BENCH_RESTORE_SHARED=0``,
    ``rescaled_retriever(..., buffer_size=1 MiB, coalesce=True)`` per new downstream,
    as a subtask that shares nothing reads. A reader per new channel.
    """
    if parallel is None:
        parallel = schedule() == "parallel"
    subtasks: list[Subtask] = []
    decoders: list[Decoder] = []

    def decoder(readers: dict[Any, RecordReader] | None = None) -> Decoder:
        decoders.append(Decoder() if readers is None else Decoder(readers))
        return decoders[-1]

    if case.old == case.new:
        # Old channel (u, d) is fed by downstream d's thread, then by upstream u's:
        # the shared readers never see two threads at once.
        readers: dict[Any, RecordReader] = {}
        subtasks += _phase(
            [
                partial(
                    _drain_blocks, f"downstream {d} input", h, partial(_pair, d), decoder(readers)
                )
                for d, h in ckpt.inputs.items()
            ],
            parallel,
        )
        subtasks += _phase(
            [
                partial(
                    _drain_blocks, f"upstream {u} output", h, partial(_pair_up, u), decoder(readers)
                )
                for u, h in ckpt.outputs.items()
            ],
            parallel,
        )
    else:
        mapping = map_edge(
            EdgeType.KEY_BY,
            old_upstream=case.old,
            old_downstream=case.old,
            new_upstream=case.new,
            new_downstream=case.new,
            max_parallelism=MAX_PARALLELISM,
        )

        options: dict[str, Any] = {
            "input_handles": ckpt.inputs,
            "output_handles": ckpt.outputs,
            "key": KEY,
            "buffer_size": REPLAY_BUFFER,
        }
        if shared_read():
            parts = rescaled_retrievers(mapping, "input", range(case.new), **options)
            if parallel:
                jobs = [
                    partial(_drain, f"new downstream {i}", lambda p=p: p, _channel, decoder())
                    for i, p in parts.items()
                ]
                subtasks += _phase(jobs, parallel)
            else:
                subtasks += _drain_in_turn(parts, [decoder() for _ in parts])
        else:

            def rescaled(i: int, dec: Decoder) -> Subtask:
                return _drain(
                    f"new downstream {i}",
                    lambda: rescaled_retriever(mapping, "input", i, coalesce=True, **options),
                    _channel,
                    dec,
                )

            subtasks += _phase([partial(rescaled, i, decoder()) for i in range(case.new)], parallel)
    for dec in decoders:
        dec.finish()
    records = sum(dec.records for dec in decoders)
    key_sum = sum(dec.key_sum for dec in decoders) % 2**64
    assert (records, key_sum) == (ckpt.records, ckpt.key_sum), "records lost or duplicated"
    return subtasks, decoders


_LENGTH = struct.Struct("<I")
_KEY = struct.Struct("<q")


@dataclass
class _RefStream:
    """One old channel, decoded in Python: a record cut between frames (or between its
    input and output piece) waits in ``tail``; ``keep(key)`` filters, None keeps all."""

    keep: Any = None
    tail: bytes = b""
    records: int = 0
    key_sum: int = 0
    bytes: int = 0

    def feed(self, payload: bytes) -> None:
        self.bytes += len(payload)
        data = self.tail + payload if self.tail else payload
        pos, end = 0, len(data)
        while pos + 4 <= end:
            (n,) = _LENGTH.unpack_from(data, pos)
            if pos + 4 + n > end:
                break
            (key,) = _KEY.unpack_from(data, pos + 4)
            if self.keep is None or self.keep(key):
                self.records += 1
                self.key_sum += key
            pos += 4 + n
        self.tail = data[pos:]


def _reference_file(path: str, streams: dict[int, list[_RefStream]]) -> None:
    """Every frame of one state file through the pure-Python reader, to each stream of
    its channel (none: the frame is skipped)."""
    with open(path, "rb") as f:
        for frame in iter_frames(f, path=path):
            for stream in streams.get(frame.channel_id, ()):
                stream.feed(frame.data)


def replay_reference(case: Case, ckpt: Checkpoint) -> tuple[int, int, int]:
    """The replay of :func:`replay` with the pure-Python reference: every state file is
    read once with ``reference.iter_frames`` (input files before output files, so each
    old channel's input piece comes before its output piece), each frame handed to the
    stream of every new subtask that owns its old channel; each stream reassembles its
    records and keeps those of its subtask's key groups (computed in Python only where
    an old range reaches outside the new one). Returns records, key sum and bytes
    replayed (summed over the streams: a frame two new subtasks share counts twice)."""
    # Old downstream d -> channel u of its input file -> the streams of old channel (u, d);
    # old upstream u -> subpartition d of its output file -> the same streams.
    by_input: dict[int, dict[int, list[_RefStream]]] = {d: {} for d in range(case.old)}
    by_output: dict[int, dict[int, list[_RefStream]]] = {u: {} for u in range(case.old)}
    streams: list[_RefStream] = []
    for i in range(case.new):
        new = key_group_range_for_operator(MAX_PARALLELISM, case.new, i)
        for d in range(case.old):
            old = key_group_range_for_operator(MAX_PARALLELISM, case.old, d)
            if case.old == case.new and d != i:
                continue
            if not len(old.intersection(new)):
                continue
            inside = new.start <= old.start and old.end <= new.end

            def keep(key: int, lo: int = new.start, hi: int = new.end) -> bool:
                return lo <= assign_to_key_group(key, MAX_PARALLELISM) <= hi

            for u in range(case.old):
                stream = _RefStream(None if inside else keep)
                streams.append(stream)
                by_input[d].setdefault(u, []).append(stream)
                by_output[u].setdefault(d, []).append(stream)
    for d, by_channel in by_input.items():
        _reference_file(ckpt.inputs[d].uri, by_channel)
    for u, by_channel in by_output.items():
        _reference_file(ckpt.outputs[u].uri, by_channel)
    assert all(not s.tail for s in streams), "a stream ended inside a record"
    records = sum(s.records for s in streams)
    key_sum = sum(s.key_sum for s in streams) % 2**64
    assert (records, key_sum) == (ckpt.records, ckpt.key_sum), "records lost or duplicated"
    return records, key_sum, sum(s.bytes for s in streams)


def raw_read(files: list[Path]) -> int:
    """``raw_read_baseline`` of every file once, into one reused block."""
    block = Block(READ_BLOCK)
    total = 0
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            total += raw_read_baseline(fd, block)
        finally:
            os.close(fd)
    return total


# -- benchmarks -----------------------------------------------------------------------


@dataclass
class Checkpoints:
    """The run's checkpoints by old parallelism, each built on first use."""

    total: int
    root: Path
    built: dict[int, Checkpoint] = field(default_factory=dict)
    build_s: dict[int, float] = field(default_factory=dict)

    def get(self, p: int) -> Checkpoint:
        if p not in self.built:
            t0 = time.perf_counter()
            self.built[p] = build_checkpoint(self.root / f"p{p}", p, self.total)
            os.sync()
            self.build_s[p] = time.perf_counter() - t0
        return self.built[p]


@pytest.fixture(scope="module")
def checkpoints(bench_env: Any) -> Iterator[Checkpoints]:
    yield Checkpoints(restore_bytes(), bench_env.workdir("restore"))


def _evict(files: list[Path]) -> None:
    """Drops these files, and only these, from the page cache (fair to other users)."""
    os.sync()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _evicting() -> bool:
    return os.environ.get("SPILLOVER_BENCH_RESTORE_EVICT", "") not in ("", "0")


def _cache_mode(bench_env: Any) -> str:
    if _evicting() and not bench_env.drop_caches:
        return "cold (files evicted with posix_fadvise)"
    return str(bench_env.cache_mode)


def _same_cache_state(bench_env: Any, ckpt: Checkpoint) -> None:
    """Every file of the checkpoint read once into the page cache, or out of it."""
    files = ckpt.files
    bench_env.before_read(files[0], lambda _: _evict(files) if _evicting() else raw_read(files))


def _label(benchmark: Any, case: Case, ckpt: Checkpoint) -> None:
    benchmark.group = f"restore {case.name}"
    benchmark.extra_info.update(
        suite="restore",
        case=case.name,
        old_parallelism=case.old,
        new_parallelism=case.new,
        files=len(ckpt.files),
        file_bytes=ckpt.file_bytes,
        records=ckpt.records,
    )


@by_case
def test_restore_raw_read(benchmark: Any, bench_env: Any, checkpoints: Any, case: Case) -> None:
    """Every state file of the checkpoint read once with raw_read_baseline: the read limit."""
    ckpt = checkpoints.get(case.old)
    _label(benchmark, case, ckpt)

    def run() -> None:
        assert raw_read(ckpt.files) == ckpt.file_bytes

    benchmark.pedantic(
        run, setup=lambda: _same_cache_state(bench_env, ckpt), rounds=bench_env.rounds
    )
    bench_env.record(
        benchmark,
        role="raw",
        nbytes=ckpt.payload_bytes,
        block_bytes=READ_BLOCK,
        cache=_cache_mode(bench_env),
        build_s=round(checkpoints.build_s.get(case.old, 0.0), 2),
    )


@by_case
def test_restore_reference(benchmark: Any, bench_env: Any, checkpoints: Any, case: Case) -> None:
    """The same replay with the pure-Python reader of format v1 and Python decoding."""
    ckpt = checkpoints.get(case.old)
    _label(benchmark, case, ckpt)
    replayed: list[int] = []

    def run() -> None:
        replayed.append(replay_reference(case, ckpt)[2])

    benchmark.pedantic(
        run, setup=lambda: _same_cache_state(bench_env, ckpt), rounds=bench_env.rounds
    )
    bench_env.record(
        benchmark,
        role="reference",
        nbytes=ckpt.payload_bytes,
        baselines=("raw",),
        cache=_cache_mode(bench_env),
        replayed_bytes=replayed[-1],
    )


@by_case
def test_restore_engine(benchmark: Any, bench_env: Any, checkpoints: Any, case: Case) -> None:
    """Every new subtask's replay, each on its own thread at once (one after the other
    with ``SPILLOVER_BENCH_RESTORE_SCHEDULE=serial``), every record decoded into a batch."""
    ckpt = checkpoints.get(case.old)
    _label(benchmark, case, ckpt)
    rounds: list[dict[str, Any]] = []
    paired_raw: list[float] = []

    def setup() -> None:
        # A raw read of the same files in the same cache state just before each round:
        # on a shared machine the ratio of the two varies far less than either alone.
        _same_cache_state(bench_env, ckpt)
        t0 = time.perf_counter()
        raw_read(ckpt.files)
        paired_raw.append(time.perf_counter() - t0)
        _same_cache_state(bench_env, ckpt)

    def run() -> None:
        io0, cpu0 = _io(), _cpu_s()
        t0 = time.perf_counter()
        subtasks, decoders = replay(case, ckpt)
        wall = time.perf_counter() - t0
        io1, cpu1 = _io(), _cpu_s()
        rounds.append(
            {
                "subtasks": subtasks,
                "replayed": sum(d.bytes for d in decoders),
                "read": io1["rchar"] - io0["rchar"],
                "disk": io1["read_bytes"] - io0["read_bytes"],
                "cpu": cpu1 - cpu0,
                "wall": wall,
            }
        )

    benchmark.pedantic(run, setup=setup, rounds=bench_env.rounds)
    first_buffer = [max(s.first_buffer_s for s in r["subtasks"]) for r in rounds]
    first_record = [max(s.first_record_s for s in r["subtasks"]) for r in rounds]
    last = rounds[-1]
    read = float(np.median([r["read"] for r in rounds]))
    bench_env.record(
        benchmark,
        role="engine",
        nbytes=ckpt.payload_bytes,
        baselines=("raw", "reference"),
        cache=_cache_mode(bench_env),
        schedule=schedule(),
        subtasks=len(last["subtasks"]),
        first_buffer_s=round(float(np.median(first_buffer)), 4),
        first_record_s=round(float(np.median(first_record)), 4),
        first_record_s_max=round(max(first_record), 4),
        replayed_bytes=last["replayed"],
        read_bytes=int(read),
        read_amplification=round(read / ckpt.file_bytes, 3),
        disk_read_bytes=int(np.median([r["disk"] for r in rounds])),
        paired_ratio_to_raw=round(
            float(np.median([raw / r["wall"] for raw, r in zip(paired_raw, rounds, strict=False)])),
            3,
        ),
        cpu_s_per_gb=round(
            float(np.median([r["cpu"] for r in rounds])) / (ckpt.file_bytes / 1e9), 3
        ),
        per_subtask=[
            {
                "name": s.name,
                "first_buffer_s": round(s.first_buffer_s, 4),
                "first_record_s": round(s.first_record_s, 4),
                "total_s": round(s.total_s, 3),
                "bytes": s.bytes,
            }
            for s in last["subtasks"]
        ],
    )
    info = benchmark.extra_info
    if benchmark.stats:
        median = benchmark.stats["median"]
        info["records_per_s"] = round(ckpt.records / median)
        info["read_gb_per_s"] = round(read / median / 1e9, 3)
    info["first_record_target_met"] = info["first_record_s_max"] < FIRST_RECORD_TARGET_S
    if "ratio_to_raw" in info:
        info["throughput_target_met"] = info["ratio_to_raw"] >= THROUGHPUT_TARGET


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """Replays one case in this (fresh) interpreter; peak RSS over the RSS before."""
    case, ckpt = Case(*spec["case"]), Checkpoint.from_dict(spec["checkpoint"])
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        method = "VmHWM after reset"
    except OSError:
        method = "VmRSS at the end (reset refused)"
    base = _status("VmRSS")
    _, decoders = replay(case, ckpt)
    peak = max(_status("VmRSS"), _status("VmHWM") if method.startswith("VmHWM") else 0)
    return {
        "baseline": base,
        "peak": peak,
        "bytes": sum(d.bytes for d in decoders),
        "method": method,
    }


@by_case
def test_restore_peak_rss(benchmark: Any, bench_env: Any, checkpoints: Any, case: Case) -> None:
    """Peak RSS growth of a fresh interpreter replaying the case once."""
    ckpt = checkpoints.get(case.old)
    benchmark.group = "restore peak RSS"
    benchmark.extra_info.update(suite="restore-rss", case=case.name)
    src = str(Path(spillover.__file__).resolve().parents[1])
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))
    )
    spec = json.dumps({"case": [case.old, case.new], "checkpoint": ckpt.to_dict()})
    result: dict[str, Any] = {}

    def run() -> None:
        out = subprocess.run(
            [sys.executable, __file__], input=spec, env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        result.update(json.loads(out.stdout.strip().splitlines()[-1]))

    _same_cache_state(bench_env, ckpt)
    benchmark.pedantic(run, rounds=1)
    growth = result["peak"] - result["baseline"]
    benchmark.extra_info.update(
        role="engine",
        bytes=result["bytes"],
        rss_baseline_bytes=result["baseline"],
        rss_peak_bytes=result["peak"],
        rss_growth_bytes=growth,
        rss_growth_mib=round(growth / MiB, 1),
        rss_method=result["method"],
    )


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.stdin.read()))))
