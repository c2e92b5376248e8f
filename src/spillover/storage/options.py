"""The engine's options: how state files are written and read back."""

from __future__ import annotations

import os
from dataclasses import dataclass

from spillover.errors import ConfigError
from spillover.storage.handle import Codec

__all__ = ["KiB", "MiB", "StorageOptions", "check_u32", "pure_selected"]

KiB = 1024
MiB = 1024 * KiB


@dataclass(frozen=True)
class StorageOptions:
    """Tuning of a storage; every field has a keyword of the same name in open_storage.

    - ``compression``: ``None`` or ``"lz4"`` (per buffer; kept only where it shrinks it).
    - ``blocking``: append writes from the caller's thread without copying (the buffer is
      referenced until its batch is written), or, when False, copies into a bounded pool
      that a native writer thread persists.
    - ``batch_bytes``: bytes gathered per hand-off to the I/O thread in blocking mode
      (each written with one vectored write); at most four batches are in flight, so
      the storer references at most four times this much of the caller's memory.
    - ``pool_bytes``: the non-blocking pool; append waits while it is full.
    - ``fsync``: make files (and the directory entry) durable on close.
    - ``read_ahead_bytes`` / ``read_block_bytes``: the retriever reads blocks of
      ``read_block_bytes`` and keeps at most ``read_ahead_bytes`` of them ahead.
    - ``verify_checksums``: check every payload's CRC32C while reading.
    - ``defer_create``: on a ``pyarrow.fs`` filesystem, ``create_storer`` returns at
      once and the file is created (exists check, directory, stream) by the writer's
      I/O thread before its first write, so the caller never waits on remote storage;
      an existing file is then reported by a later ``append`` or by ``close()``, not by
      ``create_storer``. Local files are always created at once.
    """

    compression: str | None = None
    blocking: bool = True
    batch_bytes: int = 1 * MiB
    pool_bytes: int = 16 * MiB
    fsync: bool = False
    read_ahead_bytes: int = 4 * MiB
    read_block_bytes: int = 1 * MiB
    verify_checksums: bool = True
    defer_create: bool = False

    def __post_init__(self) -> None:
        if self.compression not in (None, "none", "lz4"):
            raise ConfigError(
                f"unknown compression {self.compression!r}",
                hint="use compression=None or compression='lz4'",
            )
        for name, low in (
            ("batch_bytes", 4 * KiB),
            ("pool_bytes", 64 * KiB),
            ("read_block_bytes", 4 * KiB),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an int of at least {low}, not {value!r}")
        if self.read_ahead_bytes < self.read_block_bytes:
            raise ConfigError(
                "read_ahead_bytes must be at least read_block_bytes",
                detail=f"{self.read_ahead_bytes} < {self.read_block_bytes}",
            )

    @property
    def codec(self) -> Codec:
        return Codec.parse(self.compression)


def check_u32(name: str, value: int) -> None:
    if not isinstance(value, int) or not 0 <= value < 2**32:
        raise ValueError(f"{name} must be an int in [0, 2**32), not {value!r}")


def pure_selected() -> bool:
    """Whether ``SPILLOVER_PURE=1`` asks for the pure-Python twin of the engine
    (``pure.py``); read at every open, so a test may switch it."""
    return os.environ.get("SPILLOVER_PURE", "") == "1"
