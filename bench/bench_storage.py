"""Storage engine throughput and retrieval memory, each next to its baselines.

Every group measures one operation on the same data: the engine, the raw C write or
read of the same bytes with the same I/O sizes (the machine's own limit), the
pure-Python reference of format v1 and, for lz4, the codec alone. Rates count payload
bytes, so the engine's frame headers and trailer count against it.
docs/benchmarks.md gives the rules; bench/report.py turns the JSON into the table.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lz4.block
import pytest

import spillover
from spillover._native._storage import Block, raw_read_baseline, raw_write_baseline
from spillover.storage.reference import (
    CODEC_LZ4,
    CODEC_NONE,
    CRC_IMPLEMENTATION,
    ReferenceWriter,
    iter_frames,
)

KiB = 1024
DEFAULTS = spillover.StorageOptions()
BATCH = DEFAULTS.batch_bytes
READ_AHEAD = DEFAULTS.read_ahead_bytes
READ_BLOCK = DEFAULTS.read_block_bytes

SIZES = [32 * KiB, 4 * KiB]
SIZE_IDS = ["32KiB", "4KiB"]
by_size = pytest.mark.parametrize("buffer_bytes", SIZES, ids=SIZE_IDS)
by_codec = pytest.mark.parametrize("codec", [None, "lz4"], ids=["none", "lz4"])
by_mode = pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])


def _label(benchmark: Any, op: str, buffer_bytes: int, codec: str | None = None) -> None:
    """Groups the benchmark and tags it with what report.py selects on."""
    benchmark.group = f"{op} {buffer_bytes // KiB}KiB {codec or 'none'}"
    benchmark.extra_info.update(op=op, buffer_bytes=buffer_bytes, codec=codec or "none")


def _write_engine_file(directory: Path, work: Any) -> Path:
    """Stores ``work`` uncompressed through the engine into ``directory``; returns the file."""
    storage = spillover.open_storage(directory, batch_bytes=BATCH)
    storer = storage.create_storer(0)
    for ch, buf in zip(work.channels, work.buffers, strict=True):
        storer.append(ch, buf)
    storer.close()
    (path,) = directory.iterdir()
    return path


def _warm(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        raw_read_baseline(fd, Block(READ_BLOCK))
    finally:
        os.close(fd)


# -- append ---------------------------------------------------------------------------


@by_size
def test_append_raw_write(benchmark: Any, bench_env: Any, buffer_bytes: int) -> None:
    """The storer's batched writev of the same buffers with no framing: the disk's limit."""
    _label(benchmark, "append", buffer_bytes, None)
    work = bench_env.workload(buffer_bytes)
    d = bench_env.workdir("append-raw")
    path = d / "raw.bin"

    def setup() -> tuple[tuple[int], dict[str, Any]]:
        bench_env.before_write(d)
        return (os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644),), {}

    def write(fd: int) -> None:
        try:
            assert raw_write_baseline(fd, work.buffers, BATCH) == work.nbytes
        finally:
            os.close(fd)

    benchmark.pedantic(write, setup=setup, rounds=bench_env.rounds)
    bench_env.record(
        benchmark, role="raw", nbytes=work.nbytes, batch_bytes=BATCH, data=work.description
    )


@by_size
def test_lz4_compress_alone(benchmark: Any, bench_env: Any, buffer_bytes: int) -> None:
    """``lz4.block.compress`` over the same buffers and nothing else: the codec's speed."""
    _label(benchmark, "append", buffer_bytes, "lz4")
    work = bench_env.workload(buffer_bytes)
    d = bench_env.workdir("append-lz4")
    compress = lz4.block.compress

    def run() -> None:
        for buf in work.buffers:
            compress(buf, store_size=False)

    benchmark.pedantic(run, setup=lambda: bench_env.before_write(d), rounds=bench_env.rounds)
    bench_env.record(benchmark, role="codec", nbytes=work.nbytes, data=work.description)


@by_codec
@by_size
def test_append_reference(
    benchmark: Any, bench_env: Any, buffer_bytes: int, codec: str | None
) -> None:
    """The pure-Python ReferenceWriter writing the same buffers to a buffered file."""
    _label(benchmark, "append", buffer_bytes, codec)
    work = bench_env.workload(buffer_bytes, bench_env.reference_bytes)
    d = bench_env.workdir("append-reference")
    path = d / "reference.spill"

    def setup() -> tuple[tuple[Any], dict[str, Any]]:
        bench_env.before_write(d)
        return (open(path, "wb"),), {}

    def write(f: Any) -> None:
        with f:
            w = ReferenceWriter(f, codec=CODEC_LZ4 if codec else CODEC_NONE)
            for ch, buf in zip(work.channels, work.buffers, strict=True):
                w.append(ch, buf)
            w.close()

    benchmark.pedantic(write, setup=setup, rounds=bench_env.rounds)
    bench_env.record(
        benchmark,
        role="reference",
        nbytes=work.nbytes,
        crc32c=CRC_IMPLEMENTATION,
        data=work.description,
    )


@by_mode
@by_codec
@by_size
def test_append_engine(
    benchmark: Any, bench_env: Any, buffer_bytes: int, codec: str | None, blocking: bool
) -> None:
    """Storer.append of every buffer then close() (which writes the trailer)."""
    _label(benchmark, "append", buffer_bytes, codec)
    work = bench_env.workload(buffer_bytes)
    d = bench_env.workdir("append-engine")
    handles = []

    def setup() -> tuple[tuple[Any], dict[str, Any]]:
        bench_env.before_write(d)
        storage = spillover.open_storage(d, compression=codec, blocking=blocking, batch_bytes=BATCH)
        return (storage.create_storer(0),), {}

    def write(storer: Any) -> None:
        append = storer.append
        for ch, buf in zip(work.channels, work.buffers, strict=True):
            append(ch, buf)
        handles.append(storer.close())

    benchmark.pedantic(write, setup=setup, rounds=bench_env.rounds)
    handle = handles[-1]
    assert handle.raw_bytes == work.nbytes
    bench_env.record(
        benchmark,
        role="engine",
        nbytes=work.nbytes,
        baselines=("codec" if codec else "raw", "reference"),
        mode="blocking" if blocking else "non-blocking",
        batch_bytes=BATCH,
        stored_bytes=handle.stored_bytes,
        file_bytes=handle.size,
        data=work.description,
    )


# -- retrieval ------------------------------------------------------------------------


@dataclass
class StoredFiles:
    """A state file written by the engine, and a smaller one when the reference is capped."""

    buffer_bytes: int
    path: Path
    reference_path: Path
    nbytes: int
    reference_nbytes: int


@pytest.fixture(scope="module", params=SIZES, ids=SIZE_IDS)
def stored(request: pytest.FixtureRequest, bench_env: Any) -> Iterator[StoredFiles]:
    size = request.param
    root = bench_env.workdir(f"retrieve-{size}")
    work = bench_env.workload(size)
    path = _write_engine_file(root / "full", work)
    ref_work = bench_env.workload(size, bench_env.reference_bytes)
    ref_path = path if ref_work is work else _write_engine_file(root / "ref", ref_work)
    yield StoredFiles(size, path, ref_path, work.nbytes, ref_work.nbytes)
    shutil.rmtree(root)


def test_retrieve_raw_read(benchmark: Any, bench_env: Any, stored: StoredFiles) -> None:
    """read() of the engine's own file to its end into one reused block: the read limit."""
    _label(benchmark, "retrieve", stored.buffer_bytes, None)
    block = Block(READ_BLOCK)
    size = stored.path.stat().st_size

    def setup() -> tuple[tuple[int], dict[str, Any]]:
        bench_env.before_read(stored.path, _warm)
        return (os.open(stored.path, os.O_RDONLY),), {}

    def read(fd: int) -> None:
        try:
            assert raw_read_baseline(fd, block) == size
        finally:
            os.close(fd)

    benchmark.pedantic(read, setup=setup, rounds=bench_env.rounds)
    bench_env.record(
        benchmark,
        role="raw",
        nbytes=stored.nbytes,
        file_bytes=size,
        block_bytes=READ_BLOCK,
        cache=bench_env.cache_mode,
    )


def test_retrieve_reference(benchmark: Any, bench_env: Any, stored: StoredFiles) -> None:
    """The pure-Python reference reader (iter_frames) over a file the engine wrote."""
    _label(benchmark, "retrieve", stored.buffer_bytes, None)
    path = stored.reference_path

    def read() -> None:
        n = 0
        with open(path, "rb") as f:
            for frame in iter_frames(f, path=str(path)):
                n += len(frame.data)
        assert n == stored.reference_nbytes

    benchmark.pedantic(
        read, setup=lambda: bench_env.before_read(path, _warm), rounds=bench_env.rounds
    )
    bench_env.record(
        benchmark,
        role="reference",
        nbytes=stored.reference_nbytes,
        crc32c=CRC_IMPLEMENTATION,
        cache=bench_env.cache_mode,
    )


def test_retrieve_engine(benchmark: Any, bench_env: Any, stored: StoredFiles) -> None:
    """open_retriever, then iterate every buffer and take its length."""
    _label(benchmark, "retrieve", stored.buffer_bytes, None)

    def read() -> None:
        n = 0
        with spillover.open_retriever(
            str(stored.path), read_ahead_bytes=READ_AHEAD, read_block_bytes=READ_BLOCK
        ) as r:
            for buf in r:
                n += len(buf)
        assert n == stored.nbytes

    benchmark.pedantic(
        read, setup=lambda: bench_env.before_read(stored.path, _warm), rounds=bench_env.rounds
    )
    bench_env.record(
        benchmark,
        role="engine",
        nbytes=stored.nbytes,
        baselines=("raw", "reference"),
        read_ahead_bytes=READ_AHEAD,
        read_block_bytes=READ_BLOCK,
        cache=bench_env.cache_mode,
    )


# Runs in a fresh interpreter so nothing else the suite allocated counts. Writing 5 to
# clear_refs resets VmHWM (the peak RSS) to the current RSS; sampling VmRSS is the
# fallback where that is not allowed.
_RSS_CHILD = r"""
import json, sys
import spillover

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)

path, ahead, block = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    method = "VmHWM after reset"
except OSError:
    method = "VmRSS sampled every 64 buffers"
base = peak = status("VmRSS")
n = 0
with spillover.open_retriever(path, read_ahead_bytes=ahead, read_block_bytes=block) as r:
    for i, buf in enumerate(r):
        n += len(buf)
        if not i & 63:
            peak = max(peak, status("VmRSS"))
if method.startswith("VmHWM"):
    peak = max(peak, status("VmHWM"))
print(json.dumps({"baseline": base, "peak": peak, "bytes": n, "method": method}))
"""


@by_size
def test_retrieve_peak_rss(benchmark: Any, bench_env: Any, buffer_bytes: int) -> None:
    """Peak RSS growth while a fresh process retrieves a file of at least 16x the
    read-ahead window."""
    benchmark.group = "retrieve peak RSS"
    benchmark.extra_info.update(op="retrieve-rss", buffer_bytes=buffer_bytes, codec="none")
    nbytes = max(16 * READ_AHEAD, bench_env.total_bytes // 4)
    work = bench_env.workload(buffer_bytes, nbytes)
    path = _write_engine_file(bench_env.workdir("retrieve-rss"), work)
    src = str(Path(spillover.__file__).resolve().parents[1])
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))
    )
    argv = [sys.executable, "-c", _RSS_CHILD, str(path), str(READ_AHEAD), str(READ_BLOCK)]
    result: dict[str, Any] = {}

    def run() -> None:
        out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
        result.update(json.loads(out.stdout.strip().splitlines()[-1]))

    benchmark.pedantic(run, rounds=1)
    path.unlink()
    assert result["bytes"] == work.nbytes
    growth = result["peak"] - result["baseline"]
    benchmark.extra_info.update(
        role="engine",
        bytes=work.nbytes,
        read_ahead_bytes=READ_AHEAD,
        read_block_bytes=READ_BLOCK,
        rss_baseline_bytes=result["baseline"],
        rss_peak_bytes=result["peak"],
        rss_growth_bytes=growth,
        growth_per_window=round(growth / READ_AHEAD, 3),
        rss_method=result["method"],
    )
