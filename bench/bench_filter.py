"""Throughput of the native key-group filter against memcpy and a pure-Python reference.

Run: ``PYTHONPATH=src .venv/bin/python -m pytest bench/bench_filter.py --benchmark-only -q``

Input: 100-byte records (an int64 key first), framed with their 4-byte length,
packed into 32 KiB buffers (so records span buffers), 256 MiB in all: far
more than the caches, so every pass streams from memory. The filter routes
them to 2..128 outputs by key group (max parallelism 128), packing 32 KiB
output buffers that the consumer drops at once.
"""

from __future__ import annotations

import struct
import time
from typing import Any

import numpy as np
import pytest

from spillover.keygroups import assign_to_key_group, key_group_range_for_operator, key_group_table
from spillover.records import FieldKey, KeyGroupDemux

PAYLOAD = 100
FRAMED = 4 + PAYLOAD
BUFFER = 32 * 1024
TOTAL = 256 * 1024 * 1024
MAXP = 128
PY_SLICE = 2 * 1024 * 1024  # the pure-Python reference runs on this much


def _stream(total: int, seed: int = 7) -> np.ndarray:
    n = total // FRAMED
    rng = np.random.default_rng(seed)
    recs = rng.integers(0, 256, size=(n, FRAMED), dtype=np.uint8)
    recs[:, 0:4] = np.frombuffer(struct.pack("<I", PAYLOAD), dtype=np.uint8)
    recs[:, 4:12] = (
        rng.integers(-(2**63), 2**63 - 1, size=n, dtype=np.int64).view(np.uint8).reshape(n, 8)
    )
    return recs.reshape(-1)


@pytest.fixture(scope="module")
def stream() -> np.ndarray:
    return _stream(TOTAL)


def _buffers(stream: np.ndarray) -> list[np.ndarray]:
    return [stream[i : i + BUFFER] for i in range(0, len(stream), BUFFER)]


def _table(n_outputs: int) -> np.ndarray:
    ranges = [key_group_range_for_operator(MAXP, n_outputs, i) for i in range(n_outputs)]
    return key_group_table(MAXP, ranges)


def python_filter(buffers: list[bytes], table: list[int], n_outputs: int) -> list[bytearray]:
    """The same work in plain Python: reassemble, read key, hash, route, append framed records."""
    outs = [bytearray() for _ in range(n_outputs)]
    carry = b""
    for buf in buffers:
        data = carry + buf
        pos = 0
        while pos + 4 <= len(data):
            (length,) = struct.unpack_from("<I", data, pos)
            end = pos + 4 + length
            if end > len(data):
                break
            (key,) = struct.unpack_from("<q", data, pos + 4)
            out = table[assign_to_key_group(key, MAXP, "int64")]
            if out >= 0:
                outs[out] += data[pos:end]
            pos = end
        carry = data[pos:]
    return outs


def _record(benchmark: Any, role: str, n_bytes: int, **extra: object) -> float:
    """Adds records/s and GB/s (input bytes, 10^9/s) over the median round; returns records/s."""
    median = benchmark.stats.stats.median
    rps = n_bytes // FRAMED / median
    benchmark.extra_info.update(
        role=role,
        bytes=n_bytes,
        records_per_s=round(rps),
        gb_per_s=round(n_bytes / median / 1e9, 3),
        **extra,
    )
    return float(rps)


@pytest.fixture(scope="module")
def python_rate(stream: np.ndarray) -> float:
    """Records/s of the pure-Python reference (measured once, for the speed-up figures)."""
    bufs = [bytes(b) for b in _buffers(stream[:PY_SLICE])]
    table = _table(4).tolist()
    t = time.perf_counter()
    python_filter(bufs, table, 4)
    return (PY_SLICE // FRAMED) / (time.perf_counter() - t)


@pytest.mark.benchmark(group="filter")
@pytest.mark.parametrize("n_outputs", [2, 4, 16, 128])
def test_native_filter(
    benchmark: Any, stream: np.ndarray, n_outputs: int, python_rate: float
) -> None:
    buffers = _buffers(stream)
    table = _table(n_outputs)

    def run() -> int:
        demux = KeyGroupDemux(MAXP, table, n_outputs, key=FieldKey(0, "int64"), buffer_size=BUFFER)
        out = 0
        for b in buffers:
            for _, ob in demux.push(b):
                out += len(ob)
        for _, ob in demux.finish():
            out += len(ob)
        return out

    out_bytes = benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=1)
    assert out_bytes == len(stream) // FRAMED * FRAMED  # every record routed once
    rps = _record(benchmark, "engine", len(stream), outputs=n_outputs)
    benchmark.extra_info["speedup_vs_python"] = round(rps / python_rate)


@pytest.mark.benchmark(group="filter")
@pytest.mark.parametrize("out_size", [BUFFER, 1024 * 1024])
def test_native_keep_all(benchmark: Any, stream: np.ndarray, out_size: int) -> None:
    """A channel taken whole (a rescaled edge that keeps every record): records joined
    again and repacked into ``out_size`` buffers without reading a key, 32 input buffers
    per ``push_frames`` call as a replay passes a read-ahead block."""
    offsets = np.arange(0, len(stream), BUFFER, dtype=np.int64)
    lengths = np.minimum(BUFFER, len(stream) - offsets).astype(np.int64)
    slots = np.zeros(len(offsets), np.int32)

    def run() -> int:
        demux = KeyGroupDemux(1, np.zeros(1, np.int32), 1, FieldKey(0, "int32"), out_size)
        demux.keep_all()
        out = 0
        for i in range(0, len(offsets), 32):
            part = slice(i, i + 32)
            for _, ob in demux.push_frames(
                stream, offsets[part], lengths[part], slots[part], ["c"]
            ):
                out += len(ob)
        for _, ob in demux.finish():
            out += len(ob)
        return out

    out_bytes = benchmark.pedantic(run, rounds=5, iterations=1, warmup_rounds=1)
    assert out_bytes == len(stream) // FRAMED * FRAMED  # every record kept once
    _record(benchmark, "engine", len(stream), outputs=1, keep_all=True, out_size=out_size)


@pytest.mark.benchmark(group="filter")
def test_memcpy_baseline(benchmark: Any, stream: np.ndarray) -> None:
    dst = np.empty_like(stream)
    dst.fill(0)  # fault the pages in before timing
    benchmark.pedantic(np.copyto, args=(dst, stream), rounds=5, iterations=1, warmup_rounds=1)
    _record(benchmark, "raw", len(stream))


@pytest.mark.benchmark(group="filter")
def test_python_reference(benchmark: Any, stream: np.ndarray) -> None:
    part = stream[:PY_SLICE]
    bufs = [bytes(b) for b in _buffers(part)]
    table = _table(4).tolist()
    benchmark.pedantic(python_filter, args=(bufs, table, 4), rounds=2, iterations=1)
    _record(benchmark, "reference", len(part), outputs=4)
