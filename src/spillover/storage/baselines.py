"""The machine's own limits, measured with the engine's own I/O sizes: a raw batched
``writev`` of the same buffers (no framing) and a raw sequential read into one
reused block. Benchmarks and ``spillover demo`` compare the engine against them."""

from __future__ import annotations

from typing import Any

from spillover._native import _storage as _native


def raw_write(fd: int, buffers: list[Any], batch_bytes: int) -> int:
    """Writes ``buffers`` to ``fd`` in batches of ``batch_bytes`` (GIL released);
    returns the bytes written."""
    return _native.raw_write_baseline(fd, buffers, batch_bytes)


def raw_read(fd: int, block_bytes: int = 1 << 20) -> int:
    """Reads ``fd`` to its end into one reused block of ``block_bytes`` (GIL
    released); returns the bytes read."""
    return _native.raw_read_baseline(fd, _native.Block(block_bytes))
