"""Shared set-up of the benchmark suites: collection, sizes, data, fairness and rates.

Settings come from environment variables (see docs/benchmarks.md):
``SPILLOVER_BENCH_BYTES`` (bytes per measurement, default 1 GiB; ``64M``-style suffixes),
``SPILLOVER_BENCH_ROUNDS`` (timed rounds, default 3), ``SPILLOVER_BENCH_REFERENCE_BYTES``
(cap for the pure-Python reference, default the same as the engine),
``SPILLOVER_BENCH_DIR`` (where files go, default a pytest temporary directory) and
``SPILLOVER_BENCH_DROP_CACHES=1`` (read from disk instead of the page cache; needs root).
"""

from __future__ import annotations

import os
import random
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lz4.block
import pytest

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

_SUFFIXES = {"k": KiB, "m": MiB, "g": GiB}
_DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    """Collects ``bench_*.py`` under bench/ (the project's python_files match ``test_*``)."""
    if (
        file_path.suffix == ".py"
        and file_path.name.startswith("bench_")
        and not parent.session.isinitpath(file_path)  # named on the command line: collected
    ):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A benchmark runs as long as its sizes make it (a 3 GB batch round takes tens of
    minutes): the tests' 900 s timeout (pyproject.toml) does not apply under bench/."""
    for item in items:
        if "bench" in Path(str(item.fspath)).parts[-2:-1]:
            item.add_marker(pytest.mark.timeout(0))


def parse_bytes(text: str) -> int:
    """``"1073741824"``, ``"64M"``, ``"1GiB"`` or ``"512k"`` as a byte count."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = _SUFFIXES.get(t[-1:], 1)
    number = t[:-1] if scale > 1 else t
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise pytest.UsageError(f"not a byte count: {text!r}") from None
    if value <= 0:
        raise pytest.UsageError(f"byte count must be positive: {text!r}")
    return value


def _env_bytes(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if not value else parse_bytes(value)


def record_stream(nbytes: int, seed: int = 7) -> bytes:
    """Realistic, partly compressible in-flight data: length-prefixed JSON event records.

    Field names repeat in every record, most values are small ints, and a random 64-bit
    session id in hex keeps it from being trivially compressible; LZ4 shrinks 32 KiB
    buffers of it about 2.5x. Records run across buffer boundaries, as they do in a
    network buffer stream.
    """
    rng = random.Random(seed)
    actions = ("view", "click", "add_to_cart", "purchase", "scroll")
    parts = []
    size = 0
    ts = 1_712_000_000_000
    while size < nbytes:
        ts += rng.randrange(50)
        rec = (
            f'{{"user_id":{rng.randrange(100_000)},"item_id":{rng.randrange(1_000_000)},'
            f'"action":"{rng.choice(actions)}","ts":{ts},"price_cents":{rng.randrange(10_000)},'
            f'"qty":{rng.randrange(1, 5)},"session":"{rng.getrandbits(64):016x}"}}'
        ).encode()
        parts.append(struct.pack("<I", len(rec)) + rec)
        size += 4 + len(rec)
    return b"".join(parts)[:nbytes]


@dataclass
class Workload:
    """What one measurement appends: ``buffers[i]`` goes to channel ``channels[i]``.

    The buffers are a pool of distinct buffers reused round-robin, so building the data
    costs nothing inside the timing.
    """

    buffer_bytes: int
    pool: list[bytes]
    buffers: list[bytes]
    channels: list[int]
    lz4_ratio: float

    @property
    def nbytes(self) -> int:
        return self.buffer_bytes * len(self.buffers)

    @property
    def description(self) -> str:
        return (
            f"{len(self.pool)} distinct {self.buffer_bytes // KiB} KiB buffers of "
            f"length-prefixed JSON event records (lz4 {self.lz4_ratio:.2f}x), "
            "reused round-robin over 8 channels"
        )


@dataclass
class BenchEnv:
    """Settings of the run, the data, fairness steps and the rates measured so far."""

    total_bytes: int
    reference_bytes: int
    rounds: int
    root: Path
    drop_caches: bool
    pool_bytes: int = 8 * MiB
    channels: int = 8
    _stream: bytes | None = None
    _workloads: dict[tuple[int, int], Workload] = field(default_factory=dict)
    # (group, role) -> bytes per second, for ratios against baselines run earlier.
    rates: dict[tuple[str, str], float] = field(default_factory=dict)

    @property
    def cache_mode(self) -> str:
        return "cold (caches dropped)" if self.drop_caches else "warm (page cache)"

    def workdir(self, name: str) -> Path:
        """An empty directory of its own under the benchmark root."""
        path = self.root / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def workload(self, buffer_bytes: int, nbytes: int | None = None) -> Workload:
        """``nbytes`` (default: the run's size) of buffers of ``buffer_bytes``."""
        total = self.total_bytes if nbytes is None else nbytes
        count = max(1, total // buffer_bytes)
        key = (buffer_bytes, count)
        if key not in self._workloads:
            if self._stream is None:
                self._stream = record_stream(self.pool_bytes)
            n = max(16, self.pool_bytes // buffer_bytes)
            pool = [self._stream[i * buffer_bytes : (i + 1) * buffer_bytes] for i in range(n)]
            pool = [b for b in pool if len(b) == buffer_bytes]
            stored = sum(len(lz4.block.compress(b, store_size=False)) for b in pool)
            self._workloads[key] = Workload(
                buffer_bytes,
                pool,
                [pool[i % len(pool)] for i in range(count)],
                [i % self.channels for i in range(count)],
                buffer_bytes * len(pool) / stored,
            )
        return self._workloads[key]

    def before_write(self, directory: Path) -> None:
        """Deletes the previous round's files and flushes dirty pages, so writeback from
        one measurement does not slow the next."""
        for p in directory.iterdir():
            p.unlink()
        os.sync()

    def before_read(self, path: Path, warm: Any) -> None:
        """Puts ``path`` in the same cache state before every round: dropped from the page
        cache, or read whole into it by ``warm(path)``."""
        if self.drop_caches:
            os.sync()
            _DROP_CACHES.write_text("3\n")
        else:
            warm(path)

    def record(
        self,
        benchmark: Any,
        *,
        role: str,
        nbytes: int,
        baselines: tuple[str, ...] = (),
        **info: Any,
    ) -> None:
        """Adds bytes, GB/s and the ratio to each baseline of the group (when measured
        earlier in this run) to the benchmark's extra_info; report.py recomputes them."""
        group = benchmark.group
        benchmark.extra_info.update(role=role, bytes=nbytes, **info)
        stats = benchmark.stats
        if not stats:  # --benchmark-disable
            return
        rate = nbytes / stats["median"]
        self.rates[(group, role)] = rate
        benchmark.extra_info["gb_per_s"] = round(rate / 1e9, 3)
        for base in baselines:
            if (group, base) in self.rates:
                benchmark.extra_info[f"ratio_to_{base}"] = round(rate / self.rates[group, base], 3)


@pytest.fixture(scope="session")
def bench_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BenchEnv]:
    total = _env_bytes("SPILLOVER_BENCH_BYTES", GiB)
    drop = os.environ.get("SPILLOVER_BENCH_DROP_CACHES", "") not in ("", "0")
    if drop and not os.access(_DROP_CACHES, os.W_OK):
        pytest.fail(
            f"SPILLOVER_BENCH_DROP_CACHES=1 needs write access to {_DROP_CACHES} (root); "
            "unset it to read from the page cache"
        )
    base = os.environ.get("SPILLOVER_BENCH_DIR")
    root = Path(base) / "spillover-bench" if base else tmp_path_factory.mktemp("bench")
    root.mkdir(parents=True, exist_ok=True)
    env = BenchEnv(
        total_bytes=total,
        reference_bytes=min(total, _env_bytes("SPILLOVER_BENCH_REFERENCE_BYTES", total)),
        rounds=int(os.environ.get("SPILLOVER_BENCH_ROUNDS", "3")),
        root=root,
        drop_caches=drop,
    )
    yield env
    shutil.rmtree(root, ignore_errors=True)
