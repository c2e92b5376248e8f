"""Built-in sources: a deterministic record generator and a Parquet reader.

Both are replayable: their operator state is a position (next sequence number
per partition, or file / row group / row), so a job restored from a checkpoint
resumes right after the last record emitted before that checkpoint's barrier.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from spillover.errors import ConfigError, StorageError
from spillover.runtime.api import Batch, Operator, OperatorContext, OperatorSnapshot
from spillover.storage.location import Location

__all__ = [
    "GeneratorSource",
    "ParquetSource",
    "arrow_to_batch",
    "byte_matrix",
    "filesystem_for",
]

_U64 = np.uint64
_PACE_INTERVAL = 0.01  # rate-limited sources emit at most ~1/_PACE_INTERVAL batches a second
_MASK64 = (1 << 64) - 1


def _splitmix64(z: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """The splitmix64 finalizer, vectorised (uint64 arithmetic wraps)."""
    z = z + _U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


class GeneratorSource(Operator):
    """Generates records ``(partition, seq, key, payload)``; see :meth:`dtype`.

    ``partitions`` logical partitions are spread over the subtasks (subtask
    ``i`` of ``p`` owns partitions ``i, i+p, ...``); each partition counts
    ``seq`` up from 0, up to ``records_per_partition`` (None: forever). A batch
    holds up to ``batch_size`` records taken round-robin from the owned
    partitions, each partition's in ``seq`` order. Keys and payloads are pure
    functions of ``(partition, seq, seed)``, so a rerun or a restore emits
    identical records: keys are ``splitmix64`` of them, reduced to ``keys``
    distinct values uniformly or Zipf-distributed (exponent ``zipf_exponent``,
    key 0 the hottest); the payload is ``payload_bytes`` letters starting at
    ``'A' + seq % 26``.

    ``rate_per_subtask`` (records/s) paces each subtask by sleeping in
    ``on_timer``, never spinning; after a stall (backpressure) it catches up by
    at most one batch. ``clock`` and ``sleep`` exist for tests.

    Operator state: ``{"next_seq": {"<partition>": seq}}``; ``restore`` takes the
    entries of the partitions this subtask owns (missing ones start at 0), so
    the union of every subtask's state also restores at another parallelism.
    """

    is_source = True

    def __init__(
        self,
        partitions: int,
        records_per_partition: int | None = None,
        rate_per_subtask: float | None = None,
        payload_bytes: int = 100,
        keys: int = 10_000,
        key_distribution: str = "uniform",
        batch_size: int = 1024,
        seed: int = 0,
        *,
        zipf_exponent: float = 1.1,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if partitions < 1:
            raise ConfigError(f"partitions must be >= 1, got {partitions}")
        if records_per_partition is not None and records_per_partition < 0:
            raise ConfigError(f"records_per_partition must be >= 0, got {records_per_partition}")
        if rate_per_subtask is not None and not rate_per_subtask > 0:
            raise ConfigError(f"rate_per_subtask must be > 0 or None, got {rate_per_subtask}")
        if keys < 1 or batch_size < 1:
            raise ConfigError(f"keys and batch_size must be >= 1, got {keys} and {batch_size}")
        if key_distribution not in ("uniform", "zipf"):
            raise ConfigError(
                f"key_distribution must be 'uniform' or 'zipf', got {key_distribution!r}"
            )
        if key_distribution == "zipf" and not zipf_exponent > 0:
            raise ConfigError(f"zipf_exponent must be > 0, got {zipf_exponent}")
        self.partitions = partitions
        self.records_per_partition = records_per_partition
        self.rate = rate_per_subtask
        self.payload_bytes = payload_bytes
        self.keys = keys
        self.key_distribution = key_distribution
        self.zipf_exponent = zipf_exponent
        self.batch_size = batch_size
        self.seed = seed
        self.clock = clock
        self.sleep = sleep
        self.out_dtype = self.dtype(payload_bytes)
        self._zipf_cdf: npt.NDArray[np.float64] | None = None

    @staticmethod
    def dtype(payload_bytes: int = 100) -> np.dtype[Any]:
        """The record dtype: ``partition`` i4, ``seq`` i8, ``key`` i8, ``payload`` S<n>."""
        if payload_bytes < 1:
            raise ConfigError(f"payload_bytes must be >= 1, got {payload_bytes}")
        return np.dtype(
            [("partition", "<i4"), ("seq", "<i8"), ("key", "<i8"), ("payload", f"S{payload_bytes}")]
        )

    def open(self, ctx: OperatorContext) -> None:
        super().open(ctx)
        self._parts = np.arange(ctx.subtask_index, self.partitions, ctx.parallelism, dtype=np.int64)
        self._next = np.zeros(len(self._parts), dtype=np.int64)
        self._turn = 0  # rotates which partitions get the remainder of a batch
        self._ref: float | None = None  # pacing: the time up to which records are "paid"
        self._chunk = 1.0
        if self.rate is not None:
            self._chunk = min(max(self.rate * _PACE_INTERVAL, 1.0), float(self.batch_size))
        letters = (np.arange(26)[:, None] + np.arange(self.payload_bytes)[None, :]) % 26 + 65
        self._letters = letters.astype(np.uint8)

    def restore(self, state: Any) -> None:
        next_seq = {int(p): int(s) for p, s in dict(state["next_seq"]).items()}
        self._next = np.array([next_seq.get(int(p), 0) for p in self._parts], dtype=np.int64)

    def restore_rescaled(self, states: list[Any]) -> None:
        """Partitions move between subtasks: merge every old subtask's offsets, keep ours."""
        merged: dict[str, int] = {}
        for st in states:
            if st is not None:
                merged.update({str(p): int(q) for p, q in dict(st["next_seq"]).items()})
        self.restore({"next_seq": merged})

    def snapshot(self, checkpoint_id: int) -> OperatorSnapshot:
        next_seq = {str(p): int(s) for p, s in zip(self._parts, self._next, strict=True)}
        return OperatorSnapshot({"next_seq": next_seq})

    def keys_of(self, partition: npt.ArrayLike, seq: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """The key of each ``(partition, seq)`` (the same function the records use)."""
        seed_mix = _U64((self.seed * 0xD1B54A32D192ED03) & _MASK64)
        p = np.asarray(partition, dtype=np.int64).astype(np.uint64)
        s = np.asarray(seq, dtype=np.int64).astype(np.uint64)
        h = _splitmix64(s + p * _U64(0x9E3779B97F4A7C15) + seed_mix)
        if self.key_distribution == "uniform":
            return (h % _U64(self.keys)).astype(np.int64)
        cdf = self._zipf_cdf
        if cdf is None:
            cdf = np.cumsum(np.arange(1, self.keys + 1, dtype=np.float64) ** -self.zipf_exponent)
            cdf /= cdf[-1]
            self._zipf_cdf = cdf
        u = (h >> _U64(11)).astype(np.float64) * 2.0**-53
        ranks = np.searchsorted(cdf, u, side="right")
        return np.minimum(ranks, self.keys - 1).astype(np.int64)

    def _allowance(self) -> int:
        """Records the pace allows now, sleeping first until at least one chunk is due."""
        assert self.rate is not None
        now = self.clock()
        ref = now if self._ref is None else max(self._ref, now - self.batch_size / self.rate)
        missing = self._chunk - (now - ref) * self.rate
        if missing > 0:
            self.sleep(missing / self.rate)
            now = self.clock()
        self._ref = ref
        return int(min((now - ref) * self.rate + 1e-9, self.batch_size))

    def on_timer(self) -> bool:
        limit = self.records_per_partition
        active = (
            np.arange(len(self._parts)) if limit is None else np.flatnonzero(self._next < limit)
        )
        if not len(active):
            return False
        n = self.batch_size if self.rate is None else self._allowance()
        if n == 0:
            return True
        m = len(active)
        counts = np.full(m, n // m, dtype=np.int64)
        counts[(np.arange(m) - self._turn) % m < n % m] += 1
        self._turn = (self._turn + n % m) % m
        if limit is not None:
            counts = np.minimum(counts, limit - self._next[active])
        total = int(counts.sum())
        if self.rate is not None:
            assert self._ref is not None
            self._ref += total / self.rate
        if total:
            self.ctx.output.emit(self._batch(active, counts, total))
        return limit is None or bool((self._next < limit).any())

    def _batch(
        self, active: npt.NDArray[np.intp], counts: npt.NDArray[np.int64], total: int
    ) -> Batch:
        starts = self._next[active]
        block_starts = np.cumsum(counts) - counts
        seq = np.repeat(starts - block_starts, counts) + np.arange(total, dtype=np.int64)
        part = np.repeat(self._parts[active], counts)
        self._next[active] += counts
        out = np.empty(total, dtype=self.out_dtype)
        out["partition"] = part
        out["seq"] = seq
        out["key"] = self.keys_of(part, seq)
        byte_matrix(out, "payload")[:] = np.take(self._letters, seq % 26, axis=0)
        return out


# ---- Parquet ----


def filesystem_for(uri: str | os.PathLike[str], filesystem: Any = None) -> tuple[Any, str]:
    """``(pyarrow filesystem, path)`` of a local path, a ``file://`` URI or any URI
    ``pyarrow.fs`` understands (``s3://bucket/dir?endpoint_override=...``)."""
    return Location.parse(uri, filesystem).arrow()


def byte_matrix(batch: Batch, name: str) -> npt.NDArray[np.uint8]:
    """The bytes of field ``name`` of a C-contiguous batch: an ``(n, itemsize)`` view."""
    fields = batch.dtype.fields
    assert fields is not None and batch.flags.c_contiguous
    field, offset = fields[name][:2]
    raw = batch.view(np.uint8).reshape(len(batch), batch.dtype.itemsize)
    return raw[:, offset : offset + field.itemsize]


def _fill_bytes_field(out: Batch, name: str, arr: Any) -> None:
    """Copies an Arrow binary/string column into the ``S`` field ``name`` of ``out``
    (zero-padded), moving bytes in bulk, never one value at a time."""
    import pyarrow as pa

    dest = byte_matrix(out, name)
    n, width = dest.shape
    t = arr.type
    too_long = ConfigError(
        f"column {name!r} holds values longer than its declared width {width}",
        hint="declare a larger width in bytes_widths= or dtype=",
    )
    bufs = arr.buffers()
    if pa.types.is_fixed_size_binary(t):
        w = t.byte_width
        data = np.frombuffer(bufs[1], np.uint8) if bufs[1] is not None else np.empty(0, np.uint8)
        mat = data[arr.offset * w : (arr.offset + n) * w].reshape(n, w)
        if w > width and mat[:, width:].any():
            raise too_long
        k = min(w, width)
        dest[:, :k] = mat[:, :k]
        dest[:, k:] = 0
        return
    large = pa.types.is_large_binary(t) or pa.types.is_large_string(t)
    if not (large or pa.types.is_binary(t) or pa.types.is_string(t)):
        raise ConfigError(f"column {name!r} of type {t} cannot become fixed-width bytes")
    raw = np.frombuffer(bufs[1], np.int64 if large else np.int32)
    offsets = raw[arr.offset : arr.offset + n + 1].astype(np.int64)
    data = np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None else np.empty(0, np.uint8)
    data = data[offsets[0] : offsets[-1]]
    lengths = np.diff(offsets)
    if n and int(lengths.max()) > width:
        raise too_long
    if n and bool((lengths == width).all()):
        dest[:] = data.reshape(n, width)
        return
    dest[:] = 0
    # Byte i of the column lands at i + (its row's field start in out - its value's start).
    field_offset = out.dtype.fields[name][1]  # type: ignore[index]
    shift = np.arange(n, dtype=np.int64) * out.dtype.itemsize + field_offset
    shift -= offsets[:-1] - offsets[0]
    out.view(np.uint8)[np.arange(len(data), dtype=np.int64) + np.repeat(shift, lengths)] = data


def arrow_to_batch(table: Any, dtype: np.dtype[Any]) -> Batch:
    """A pyarrow Table (or RecordBatch) as a structured array of ``dtype``, column by
    column. Every field of ``dtype`` must be a column without nulls; ``S`` fields
    take fixed- or variable-width binary and string columns."""
    out = np.empty(table.num_rows, dtype=dtype)
    for name in dtype.names or ():
        col = table.column(name)
        if hasattr(col, "combine_chunks"):
            col = col.combine_chunks()
        if col.null_count:
            raise ConfigError(
                f"column {name!r} has {col.null_count} nulls; records are fixed-width",
                hint="fill the nulls before reading, e.g. with pyarrow.compute.fill_null",
            )
        if dtype[name].kind == "S":
            _fill_bytes_field(out, name, col)
        else:
            out[name] = col.to_numpy(zero_copy_only=False)
    return out


def _dtype_of_schema(
    schema: Any, columns: Sequence[str] | None, widths: dict[str, int]
) -> np.dtype[Any]:
    import pyarrow as pa

    fields = []
    for name in columns if columns is not None else schema.names:
        t = schema.field(name).type
        if pa.types.is_fixed_size_binary(t):
            fields.append((name, f"S{widths.get(name, t.byte_width)}"))
        elif (
            pa.types.is_binary(t)
            or pa.types.is_string(t)
            or pa.types.is_large_binary(t)
            or (pa.types.is_large_string(t))
        ):
            if name not in widths:
                raise ConfigError(
                    f"column {name!r} is variable-width {t}",
                    hint=f"declare its width in bytes: bytes_widths={{{name!r}: n}}",
                )
            fields.append((name, f"S{widths[name]}"))
        elif pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
            fields.append((name, np.dtype(t.to_pandas_dtype()).newbyteorder("<")))
        else:
            raise ConfigError(f"column {name!r} of type {t} is not supported", hint="cast it")
    return np.dtype(fields)


def _list_parquet(fs: Any, path: str) -> list[str]:
    import pyarrow.fs as pafs

    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        return [path]
    if info.type != pafs.FileType.Directory:
        raise StorageError("Parquet input not found", path=path)
    root = path.rstrip("/")
    found = []
    for i in fs.get_file_info(pafs.FileSelector(root, recursive=True)):
        rel = i.path[len(root) + 1 :]
        # Like pyarrow datasets: skip names starting with "_" or "." (staging, metadata).
        if i.type == pafs.FileType.File and not any(
            part.startswith(("_", ".")) for part in rel.split("/")
        ):
            found.append(i.path)
    return sorted(found)


class ParquetSource(Operator):
    """Reads Parquet files (bounded) and emits their rows as structured batches.

    ``paths_or_dataset``: a file, a directory (its files, sorted, names starting
    with ``_`` or ``.`` skipped), a list of those, or a ``pyarrow.dataset``
    FileSystemDataset; local paths or URIs. The dtype is ``dtype`` if given, else
    derived from the first file's schema (``columns`` to pick some): numeric and
    boolean columns keep their type, fixed-size binary becomes ``S<width>``, and
    binary/string columns need a width in ``bytes_widths``.

    The row groups of all files, in order, are dealt round-robin to the subtasks
    (subtask ``i`` of ``p`` reads row groups ``i, i+p, ...``). Operator state is
    the position of the next row, ``{"file", "path", "row_group", "row"}`` (or
    ``{"done": true}``), so a restore resumes at the exact row.
    """

    is_source = True

    def __init__(
        self,
        paths_or_dataset: Any,
        batch_size: int = 8192,
        *,
        columns: Sequence[str] | None = None,
        dtype: npt.DTypeLike | None = None,
        bytes_widths: dict[str, int] | None = None,
        filesystem: Any = None,
    ) -> None:
        import pyarrow.parquet as pq

        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.fs, self.files = self._resolve(paths_or_dataset, filesystem)
        if not self.files:
            raise ConfigError("no Parquet files to read", detail=repr(paths_or_dataset))
        if dtype is None:
            schema = pq.read_schema(self.files[0], filesystem=self.fs)
            self.out_dtype = _dtype_of_schema(schema, columns, dict(bytes_widths or {}))
        else:
            self.out_dtype = np.dtype(dtype)
            if self.out_dtype.names is None:
                raise ConfigError(f"dtype must be structured, got {self.out_dtype}")

    @staticmethod
    def _resolve(src: Any, filesystem: Any) -> tuple[Any, list[str]]:
        if hasattr(src, "files") and hasattr(src, "filesystem"):  # a FileSystemDataset
            return src.filesystem, list(src.files)
        items = [src] if isinstance(src, str | os.PathLike) else list(src)
        fs = None
        files: list[str] = []
        for item in items:
            item_fs, path = filesystem_for(item, filesystem)
            fs = fs if fs is not None else item_fs
            if type(item_fs) is not type(fs):
                raise ConfigError("all Parquet inputs must be on one filesystem")
            files += _list_parquet(item_fs, path)
        return fs, files

    def open(self, ctx: OperatorContext) -> None:
        import pyarrow.parquet as pq

        super().open(ctx)
        units = []
        for fi, path in enumerate(self.files):
            meta = pq.read_metadata(path, filesystem=self.fs)
            units += [(fi, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)]
        self._units: list[tuple[int, int, int]] = units[ctx.subtask_index :: ctx.parallelism]
        self._unit = 0
        self._row = 0
        self._file: Any = None
        self._file_index = -1
        self._table: Any = None

    def restore(self, state: Any) -> None:
        if state.get("done"):
            self._unit = len(self._units)
            return
        fi, g = int(state["file"]), int(state["row_group"])
        if fi >= len(self.files) or self.files[fi] != state.get("path", self.files[fi]):
            raise ConfigError(
                "the Parquet input changed since the checkpoint",
                detail=f"file {fi} was {state.get('path')!r}",
                hint="restore with the same input files",
            )
        where = [i for i, (f, r, _) in enumerate(self._units) if (f, r) == (fi, g)]
        if not where:
            raise ConfigError(
                "the restored position is not a row group of this subtask",
                detail=f"file {fi} row group {g}",
                hint="restore at the parallelism of the checkpoint",
            )
        self._unit, self._row = where[0], int(state["row"])

    def snapshot(self, checkpoint_id: int) -> OperatorSnapshot:
        if self._unit >= len(self._units):
            return OperatorSnapshot({"done": True})
        fi, g, _ = self._units[self._unit]
        return OperatorSnapshot(
            {"file": fi, "path": self.files[fi], "row_group": g, "row": self._row}
        )

    def on_timer(self) -> bool:
        import pyarrow.parquet as pq

        while self._unit < len(self._units) and self._row >= self._units[self._unit][2]:
            self._next_unit()
        if self._unit >= len(self._units):
            self.close()
            return False
        fi, g, rows = self._units[self._unit]
        if self._table is None:
            if self._file_index != fi:
                self.close()
                self._file = pq.ParquetFile(self.files[fi], filesystem=self.fs)
                self._file_index = fi
            self._table = self._file.read_row_group(g, columns=list(self.out_dtype.names))
        n = min(self.batch_size, rows - self._row)
        self.ctx.output.emit(arrow_to_batch(self._table.slice(self._row, n), self.out_dtype))
        self._row += n
        if self._row >= rows:
            self._next_unit()
        return self._unit < len(self._units)

    def _next_unit(self) -> None:
        self._unit += 1
        self._row = 0
        self._table = None

    def close(self) -> None:
        if getattr(self, "_file", None) is not None:
            self._file.close()
            self._file = None
            self._file_index = -1
