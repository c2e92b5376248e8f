"""Replaying a restored task's own input state: throughput and the longest step.

Run: ``PYTHONPATH=src .venv/bin/python bench/bench_own_replay.py``

Input: one input gate file of 64 channels, 32 KiB frames of 100-byte framed
records interleaved across channels, 128 MiB in all (page-cached after the
first round). Per round, in the same process, alternating:

- ``raw read``: the retriever's blocks (``poll_frames``), nothing done with
  them: the floor.
- ``own replay``: :class:`~spillover.runtime.recovery.replay.InputRecovery`, as a
  restored task runs it, step by step (one native frame join per block).
- ``pure python``: the same work in Python over the pure-Python reader of format v1
  (``storage/reference.py``): every frame appended to its channel's buffer, handed
  on by ``JOIN_BYTES``: the reference the native path is measured against.
- ``filtering``: the same channels as keep-all streams through a
  :class:`~spillover.rescale.FilteringRetriever` and ``StreamRecovery`` (the
  per-channel demultiplexing path a rescaled edge takes).

The consumer drops every buffer. Reported: GB/s (best of ``ROUNDS``) and the
longest single step (a barrier waits at most that long), worst over rounds.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import spillover
from spillover.records import RecordWriter
from spillover.rescale import KeepAll, Piece, RecordStream, filter_retriever
from spillover.runtime.recovery import replay
from spillover.storage import GateStateHandle, open_retriever
from spillover.storage.reference import iter_frames

CHANNELS = 64
FRAME = 32 * 1024
TOTAL = 128 * 1024 * 1024
ROUNDS = int(os.environ.get("SPILLOVER_BENCH_ROUNDS", "3"))


def write_gate(root: Path) -> GateStateHandle:
    """A gate file of ``CHANNELS`` channels, each the same stream of ``FRAME``-byte
    frames of whole records (cut anywhere), interleaved frame by frame."""
    w = RecordWriter(FRAME)
    rec = bytes(96)
    frames: list[bytes] = []
    for _ in range(TOTAL // CHANNELS // 100):
        frames += [bytes(b) for b in w.write(rec)]
    last = w.flush()
    frames += [bytes(last)] if last is not None else []
    storer = spillover.open_storage(root).create_storer(0)
    for frame in frames:
        for ch in range(CHANNELS):
            storer.append(ch, frame)
    return storer.close()


def raw(handle: GateStateHandle) -> tuple[int, float]:
    n, worst = 0, 0.0
    with open_retriever(handle, read_block_bytes=replay.STEP_BYTES) as r:
        while True:
            t = time.perf_counter()
            frames = r.poll_frames() if r.wait() else None
            worst = max(worst, time.perf_counter() - t)
            if frames is None:
                if r.finished:
                    return n, worst
                continue
            n += int(frames.lengths.sum())


def _steps(step: Callable[[], bool]) -> float:
    """Runs ``step`` to the end; the longest step's seconds."""
    worst = 0.0
    more = True
    while more:
        t = time.perf_counter()
        more = step()
        worst = max(worst, time.perf_counter() - t)
    return worst


def own(handle: GateStateHandle) -> tuple[int, float]:
    got = [0]
    r = replay.InputRecovery({0: (handle, {})}, lambda g, c, b: got.__setitem__(0, got[0] + len(b)))
    worst = _steps(r.step)
    r.close()
    return got[0], worst


def pure(handle: GateStateHandle) -> tuple[int, float]:
    """The own replay's work in Python: frames read by the reference reader, joined
    per channel and handed on in ``JOIN_BYTES`` chunks (its longest step: one frame)."""
    got, worst = 0, 0.0
    joined: dict[int, bytearray] = {}
    with open(handle.uri.removeprefix("file://"), "rb") as f:
        frames = iter_frames(f)
        while True:
            t = time.perf_counter()
            frame = next(frames, None)
            if frame is None:
                break
            buf = joined.setdefault(frame.channel_id, bytearray())
            buf += frame.data
            if len(buf) >= replay.JOIN_BYTES:
                got += len(buf)
                joined[frame.channel_id] = bytearray()
            worst = max(worst, time.perf_counter() - t)
    return got + sum(len(b) for b in joined.values()), worst


def filtering(handle: GateStateHandle) -> tuple[int, float]:
    streams = [RecordStream.of([Piece(handle, c)], c, 0, c) for c in range(CHANNELS)]
    r = filter_retriever(
        streams,
        KeepAll(),
        partitioner=None,
        buffer_size=replay.JOIN_BYTES,
        read_block_bytes=replay.STEP_BYTES,
        read_ahead_bytes=4 * replay.STEP_BYTES,
    )
    got = [0]
    sr = replay.StreamRecovery(
        [(0, r, KeepAll())], lambda g, b: got.__setitem__(0, got[0] + len(b))
    )
    worst = _steps(sr.step)
    sr.close()
    return got[0], worst


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        handle = write_gate(Path(d))
        size = sum(n for _, n in handle.channels.values())
        variants = {"raw read": raw, "own replay": own, "pure python": pure, "filtering": filtering}
        best = dict.fromkeys(variants, 0.0)
        worst = dict.fromkeys(variants, 0.0)
        for _ in range(ROUNDS):
            for name, fn in variants.items():
                t = time.perf_counter()
                n, w = fn(handle)
                dt = time.perf_counter() - t
                assert n == size, (name, n, size)
                best[name] = max(best[name], n / dt / 1e9)
                worst[name] = max(worst[name], w)
        print(f"{CHANNELS} channels, {FRAME // 1024} KiB frames, {size / 2**20:.0f} MiB")
        for name in variants:
            print(f"{name:>11}: {best[name]:5.2f} GB/s, longest step {worst[name] * 1e3:6.1f} ms")


if __name__ == "__main__":
    sys.exit(main())
