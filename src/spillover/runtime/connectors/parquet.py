"""Parquet: a source reading a directory of files, split by file across
subtasks, and an exactly-once sink (two-phase commit, see ``collecting.py``)."""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from spillover.errors import (
    ConfigError,
    StateFileExistsError,
    StateFileNotFoundError,
    StorageError,
)
from spillover.runtime.api import Batch, Operator, OperatorContext, OperatorSnapshot
from spillover.runtime.connectors.collecting import (
    _pending_from_state,
    _pending_state,
)
from spillover.storage.location import FileKind, Location

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

    @property
    def bounded(self) -> bool:
        return True

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


# ---- Parquet ----


# A committed output file: part-<subtask>-a<attempt>-c<checkpoint>-<counter>[-<writer>].parquet
_PART_FILE = re.compile(r"part-(\d+)-a(\d+)-c\d+-\d+(?:-([0-9a-f]+))?\.parquet")


def _of_run(name: str, tag: str, attempt: int | None = None) -> bool:
    """Whether a part file's writer id starts with the run's ``tag`` (and, unless
    ``attempt`` is None, the file was written by that attempt)."""
    m = _PART_FILE.fullmatch(name)
    if m is None or m.group(3) is None or not m.group(3).startswith(tag):
        return False
    return attempt is None or int(m.group(2)) == attempt


def batch_to_arrow(batch: Batch) -> Any:
    """A structured array as a pyarrow Table, column by column: numeric and bool
    fields keep their type, ``S<n>`` fields become ``fixed_size_binary(n)``."""
    import pyarrow as pa

    batch = np.ascontiguousarray(batch)
    arrays = []
    names = batch.dtype.names or ()
    for name in names:
        field = batch.dtype[name]
        if field.subdtype is not None or field.kind not in "biufSU":
            raise ConfigError(f"field {name!r} of type {field} cannot be written to Parquet")
        if field.kind == "S":
            data = np.ascontiguousarray(byte_matrix(batch, name))
            arrays.append(
                pa.FixedSizeBinaryArray.from_buffers(
                    pa.binary(field.itemsize), len(batch), [None, pa.py_buffer(data)]
                )
            )
        else:
            arrays.append(pa.array(np.ascontiguousarray(batch[name])))
    return pa.Table.from_arrays(arrays, names=list(names))


class ParquetSink(Operator):
    """Writes records to Parquet files under ``directory_uri``, exactly once.

    Each subtask writes an in-progress file in ``<dir>/_staging/`` (readers of
    the directory skip names starting with ``_``), buffering up to
    ``row_group_rows`` rows per row group. ``snapshot(c)`` closes the file (in
    ``finalize``, off the task thread) and makes it pending for ``c``;
    ``notify_checkpoint_complete(c)`` publishes every pending file of a
    checkpoint ``<= c`` by renaming it into ``<dir>/`` (atomic on local disks; a
    copy and delete on object stores), idempotently. ``restore`` publishes the
    restored checkpoint's pending files and deletes this subtask's other staged
    files (left by the failed attempt); so does the first write of an attempt
    > 0 that restored nothing (no checkpoint had completed). See the module
    docstring for the whole protocol. File names:
    ``part-<subtask>-a<attempt>-c<last checkpoint>-<counter>-<writer>.parquet``,
    ``<writer>`` fresh for every opened sink: a run started again over the same
    directory never names a file like one published before (which publishing,
    idempotent by name, would otherwise drop).

    ``mode`` says what a run that restored nothing does with output already
    committed in the directory (another run's): ``error`` (the default) refuses it
    with :class:`ConfigError`, ``append`` adds to it, ``overwrite`` deletes it first
    (each subtask the parts of the old subtasks it owns). A run that resumes from a
    checkpoint always continues its own output.

    ``pyarrow.parquet.read_table(directory)`` reads the committed output.
    """

    MODES = ("error", "append", "overwrite")

    def __init__(
        self,
        directory_uri: str,
        *,
        filesystem: Any = None,
        row_group_rows: int = 65536,
        compression: str | None = "snappy",
        mode: str = "error",
    ) -> None:
        if row_group_rows < 1:
            raise ConfigError(f"row_group_rows must be >= 1, got {row_group_rows}")
        if mode not in self.MODES:
            raise ConfigError(
                f"unknown ParquetSink mode {mode!r}", hint=f"choose one of {', '.join(self.MODES)}"
            )
        self.mode = mode
        self.directory_uri = directory_uri
        self.filesystem = filesystem
        self.row_group_rows = row_group_rows
        self.compression = compression

    def open(self, ctx: OperatorContext) -> None:
        super().open(ctx)
        self._dir = Location.parse(self.directory_uri, self.filesystem)
        self._fs, root = self._dir.arrow()
        self._root = root.rstrip("/")
        self._staging = f"{self._root}/_staging"
        self._fs.create_dir(self._staging, recursive=True)
        self._prefix = f"part-{ctx.subtask_index:05d}-"
        self._pending: dict[int, list[str]] = {}
        self._counter = 0
        # A batch job's tasks name their files after the run: a task that runs again
        # finds (and deletes) what an earlier run of it published. A streaming sink's
        # names start with its run's tag (its other subtasks' files are not "another
        # run's" output) and end fresh for every opened sink (a master that resumes
        # the run never names a file like one published before).
        if ctx.batch_run is not None:
            self._run_tag = self._writer_id = ctx.batch_run[:12]
        else:
            self._run_tag = (ctx.job_run or uuid.uuid4().hex)[:6]
            self._writer_id = self._run_tag + uuid.uuid4().hex[:6]
        self._last_checkpoint = 0
        self._cleaned = ctx.attempt == 0
        self._name: str | None = None  # the open transaction's file
        self._writer: Any = None
        self._buffer: list[Batch] = []
        self._buffered = 0
        self._started = False  # restored, or checked the directory as ``mode`` says

    def _start(self) -> None:
        """Before a run that restored nothing writes: what ``mode`` says of the
        output already committed in the directory."""
        self._started = True
        if self.ctx.batch_run is not None:
            self._start_batch_task()
        if self.mode == "append":
            return
        # A streaming attempt that restored nothing writes its run's output again from
        # the start: what an earlier attempt of the run committed (a subtask's own end
        # commits it without checkpoints) is not this attempt's, or it would be there
        # twice. A batch run's tasks of every attempt write one output.
        own_attempt = None if self.ctx.batch_run is not None else self.ctx.attempt
        parts = [
            e
            for e in self._dir.children("the sink's directory")
            if e.kind == FileKind.FILE
            and _PART_FILE.fullmatch(e.name) is not None
            and not _of_run(e.name, self._run_tag, own_attempt)
        ]
        if self.mode == "error" and parts:
            raise ConfigError(
                "the sink's directory holds committed output of another run",
                detail=f"{len(parts)} part file(s) in {self.directory_uri}, e.g. {parts[0].name}",
                hint="give the run another directory, or ParquetSink(mode='append' or "
                "'overwrite'); a job that resumes its own run continues its output",
            )
        me, p = self.ctx.subtask_index, self.ctx.parallelism
        for entry in parts:  # overwrite: each old subtask's parts have one owner
            m = _PART_FILE.fullmatch(entry.name)
            assert m is not None
            if int(m.group(1)) % p == me:
                entry.location.delete(what="output file")

    def _start_batch_task(self) -> None:
        """A batch task's run, before it writes: what earlier runs of it left (staged
        files, and files published by a run whose end the job's log never recorded)
        goes, so that its output is there exactly once. It owns the files of old
        subtask ``j`` with ``j % parallelism == subtask`` (all of them re-run when the
        sink's parallelism changed)."""
        self._delete_staged()
        me, p = self.ctx.subtask_index, self.ctx.parallelism
        for entry in self._dir.children("the sink's directory"):
            if not _of_run(entry.name, self._run_tag):
                continue
            m = _PART_FILE.fullmatch(entry.name)
            if m is not None and int(m.group(1)) % p == me:
                entry.location.delete(what="output file")

    def process(self, batch: Batch, input_index: int = 0) -> None:
        if not len(batch):
            return
        if not self._started:
            self._start()
        if self._name is None:
            self._name = self._new_name()
        self._buffer.append(batch.copy())  # the caller may reuse its batch
        self._buffered += len(batch)
        if self._buffered >= self.row_group_rows:
            self._writer = self._write(self._name, self._writer, self._take_buffer())

    def _new_name(self) -> str:
        if not self._cleaned:
            self._delete_staged()
        name = (
            f"{self._prefix}a{self.ctx.attempt:04d}-c{self._last_checkpoint:06d}"
            f"-{self._counter:06d}-{self._writer_id}.parquet"
        )
        self._counter += 1
        return name

    def _take_buffer(self) -> Batch | None:
        if not self._buffer:
            return None
        rows = np.concatenate(self._buffer) if len(self._buffer) > 1 else self._buffer[0]
        self._buffer, self._buffered = [], 0
        return rows

    def _write(self, name: str, writer: Any, rows: Batch | None) -> Any:
        import pyarrow.parquet as pq

        if rows is None:
            return writer
        table = batch_to_arrow(rows)
        if writer is None:
            writer = pq.ParquetWriter(
                f"{self._staging}/{name}",
                table.schema,
                filesystem=self._fs,
                compression=self.compression,
            )
        writer.write_table(table, row_group_size=self.row_group_rows)
        return writer

    def snapshot(self, checkpoint_id: int) -> OperatorSnapshot:
        if not self._started:
            self._start()
        finalize: Callable[[str], None] | None = None
        if self._name is not None:
            name, writer, rows = self._name, self._writer, self._take_buffer()
            self._pending.setdefault(checkpoint_id, []).append(name)
            self._name, self._writer = None, None

            def close_file(directory_uri: str) -> None:
                self._write(name, writer, rows).close()

            finalize = close_file
        self._last_checkpoint = checkpoint_id
        state = {
            "pending": _pending_state(self._pending),
            "counter": self._counter,
            "checkpoint": checkpoint_id,
        }
        return OperatorSnapshot(state, finalize)

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        for c in sorted(c for c in self._pending if c <= checkpoint_id):
            for name in self._pending[c]:
                self._publish(name)
            del self._pending[c]

    def restore(self, state: Any) -> None:
        self._started = True  # the directory's output is this run's
        if state is None:
            return
        for _, names in sorted(_pending_from_state(state).items()):
            for name in names:
                self._publish(name)
        self._counter = int(state["counter"])
        self._last_checkpoint = int(state["checkpoint"])
        self._delete_staged()

    def restore_rescaled(self, states: list[Any]) -> None:
        """Publishes the pending files of the old subtasks this subtask owns and
        continues the file counter past all of them.

        Old subtask ``j``'s files have exactly one owner, new subtask
        ``j % parallelism``: two new subtasks publishing the same file race on its
        rename (one of them finds the staged file gone). The owner also deletes the
        owned old subtasks' other staged files, as :meth:`restore` does for its own."""
        self._started = True
        live = [st for st in states if st is not None]
        if not live:
            return
        me, p = self.ctx.subtask_index, self.ctx.parallelism
        owned = [j for j in range(len(states)) if j % p == me]
        for j in owned:
            if states[j] is None:
                continue
            for _, names in sorted(_pending_from_state(states[j]).items()):
                for name in names:
                    self._publish(name)
        self._counter = max(int(st["counter"]) for st in live)
        self._last_checkpoint = max(int(st["checkpoint"]) for st in live)
        self._delete_staged()
        for j in owned:
            if j != me:
                self._delete_staged(f"part-{j:05d}-")

    def _publish(self, name: str) -> None:
        import pyarrow.fs as pafs

        src, dst = f"{self._staging}/{name}", f"{self._root}/{name}"
        src_info, dst_info = self._fs.get_file_info([src, dst])
        if dst_info.type == pafs.FileType.File:
            if src_info.type == pafs.FileType.File:
                if src_info.size != dst_info.size:  # not this file: never drop it
                    raise StateFileExistsError(
                        "an output file of another run has the name of a file to publish",
                        path=dst,
                        detail=f"staged {src_info.size} bytes, published {dst_info.size}",
                        hint="give each run its own output directory",
                    )
                self._fs.delete_file(src)  # a copy-and-delete move cut short
            return
        if src_info.type != pafs.FileType.File:
            raise StateFileNotFoundError(
                "a pending output file of a completed checkpoint is missing",
                path=src,
                hint="the staging directory was changed while the job ran",
            )
        self._fs.move(src, dst)

    def _delete_staged(self, prefix: str | None = None) -> None:
        """Deletes every staged file of this subtask (called before it writes any), or
        of the old subtask whose files start with ``prefix`` (after a rescale)."""
        prefix = prefix or self._prefix
        for entry in self._dir.child("_staging").children("the sink's staging directory"):
            if entry.kind == FileKind.FILE and entry.name.startswith(prefix):
                entry.location.delete(what="staged output file")
        self._cleaned = True

    def close(self) -> None:
        # An unfinished file stays in staging; the next attempt's restore deletes it.
        if getattr(self, "_writer", None) is not None:
            self._writer.close()
            self._writer = None
