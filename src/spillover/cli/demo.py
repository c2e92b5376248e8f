"""``spillover demo``: the engine's throughput against the raw disk."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np

import spillover
from spillover.cli.options import env_option, fmt_bytes, yes_no
from spillover.errors import ConfigError, SpilloverError, StorageError
from spillover.storage import baselines
from spillover.storage.location import Location, fsync_directory


def cmd_demo(args: argparse.Namespace) -> int:
    """Spills and restores a few hundred MB and compares with the raw disk."""

    total = args.size_mb * 1024 * 1024
    size = args.buffer_size
    n = max(1, total // size)
    rng = np.random.default_rng(7)
    # Partly compressible buffers: small integers next to random bytes.
    pool = []
    for _ in range(64):
        b = rng.integers(0, 256, size, dtype=np.uint8)
        b[: size // 2] = rng.integers(0, 4, size // 2, dtype=np.uint8)
        pool.append(b.tobytes())
    buffers = [pool[i % len(pool)] for i in range(n)]
    root = args.dir or tempfile.gettempdir()
    created = not args.dir or not os.path.exists(root)
    try:  # before any work: the directory takes a file
        if args.dir:
            os.makedirs(root, exist_ok=True)
        else:
            root = tempfile.mkdtemp(prefix="spillover-demo-")
        fd, probe = tempfile.mkstemp(dir=root, prefix=".spillover-demo-")
        os.close(fd)
        os.remove(probe)
    except OSError as e:  # a bad --dir: configuration, before any work
        bad = _cannot("cannot write to the demo directory", root, e)
        raise ConfigError(bad.message, path=bad.path, detail=bad.detail, hint=bad.hint) from e
    try:
        return _spill_and_restore(root, buffers, size, sync=args.sync)
    except SpilloverError:
        raise
    except OSError as e:  # the disk filled up, the directory went away, ...
        raise _cannot("the demo failed writing or reading", root, e) from e
    finally:
        if not args.keep:  # only what the demo made: --dir may hold the user's files
            shutil.rmtree(root if created else os.path.join(root, "spill"), ignore_errors=True)
            if not created:
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(root, "raw.bin"))


def _cannot(message: str, root: str, e: OSError) -> StorageError:
    hint = "give --dir (or SPILLOVER_DEMO_DIR) a directory you can write"
    return Location.parse(root).error(message, e, hint=hint)


def _spill_and_restore(root: str, buffers: list[bytes], size: int, *, sync: bool) -> int:
    """Times the raw disk and the engine on ``buffers`` under ``root``; prints the table.

    With ``sync`` every timed write ends durable, the raw baseline's as the engine's
    (``fsync`` of the file and its directory, inside the timing); without, both end
    in the page cache. Never one of each: the ratio would compare a disk with memory.
    """

    n = len(buffers)
    nbytes = n * size
    print(
        f"spilling {fmt_bytes(nbytes)} in {n} buffers of {fmt_bytes(size)} "
        f"over 8 channels to {root}"
    )
    rows = []

    def fresh(path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)
        os.sync()

    raw_path = os.path.join(root, "raw.bin")
    fresh(raw_path)
    fd = os.open(raw_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    t = time.perf_counter()
    baselines.raw_write(fd, buffers, spillover.StorageOptions().batch_bytes)
    if sync:  # as the engine's close(): the file, then its directory entry
        os.fsync(fd)
        fsync_directory(root)
    os.close(fd)
    raw_write = nbytes / (time.perf_counter() - t)
    rows.append(("raw sequential write (baseline)", raw_write, 1.0))
    for label, opts in (
        ("spill, blocking (zero-copy)", {"blocking": True}),
        ("spill, non-blocking (pooled)", {"blocking": False}),
        ("spill, blocking + lz4", {"blocking": True, "compression": "lz4"}),
    ):
        d = os.path.join(root, "spill")
        fresh(d)
        storage = spillover.open_storage(d, fsync=sync, **opts)
        t = time.perf_counter()
        st = storage.create_storer(0)
        append = st.append
        for i, b in enumerate(buffers):
            append(i & 7, b)
        handle = st.close()
        rate = nbytes / (time.perf_counter() - t)
        rows.append((label, rate, rate / raw_write))
    # Restore the last (lz4) file, then an uncompressed one, against a raw read.
    fresh(os.path.join(root, "spill"))
    st = spillover.open_storage(os.path.join(root, "spill")).create_storer(0)
    for i, b in enumerate(buffers):
        st.append(i & 7, b)
    handle = st.close()
    fd = os.open(raw_path, os.O_RDONLY)
    t = time.perf_counter()
    baselines.raw_read(fd, 1 << 20)
    os.close(fd)
    raw_read = nbytes / (time.perf_counter() - t)
    rows.append(("raw sequential read (baseline)", raw_read, 1.0))
    t = time.perf_counter()
    count = 0
    with spillover.open_retriever(handle) as r:
        for buf in r:
            count += len(buf)
    rate = nbytes / (time.perf_counter() - t)
    assert count == nbytes
    rows.append(("restore, streaming", rate, rate / raw_read))
    written = "writes synced to disk" if sync else "writes to the page cache (not synced)"
    print(f"\n{written:34} {'GB/s':>7} {'vs raw':>7}")
    for label, rate, ratio in rows:
        print(f"{label:34} {rate / 1e9:7.2f} {ratio:7.2f}")
    print("\n(reads come from the page cache; see docs/benchmarks.md for the full suite)")
    return 0


def add_parser(sub: Any) -> None:
    """Adds the command to the ``spillover`` parser."""
    p = sub.add_parser("demo", help="spill and restore a few hundred MB; print throughput")
    env_option(
        p,
        "--size-mb",
        env="SPILLOVER_DEMO_SIZE_MB",
        type=int,
        default=512,
        help="how much to spill",
    )
    env_option(
        p,
        "--buffer-size",
        env="SPILLOVER_DEMO_BUFFER_SIZE",
        type=int,
        default=32768,
        help="bytes per buffer",
    )
    env_option(
        p,
        "--dir",
        env="SPILLOVER_DEMO_DIR",
        type=str,
        default=None,
        help="where to spill (a temporary directory by default)",
    )
    env_option(
        p,
        "--sync",
        env="SPILLOVER_DEMO_SYNC",
        type=yes_no,
        nargs="?",
        const=True,
        default=True,
        help="every timed write, the raw baseline's and the engine's, ends with fsync "
        "(the disk); --no-sync: both end in the page cache (memory speed)",
    )
    p.add_argument("--no-sync", dest="sync", action="store_false", help="see --sync")
    p.add_argument("--keep", action="store_true", help="keep the files")
    p.set_defaults(func=cmd_demo)
