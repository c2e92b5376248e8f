"""Keyed-state snapshot files: one Arrow IPC file per state, rows sorted by key
group, written to any storage location and read back by key-group range."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from spillover.errors import (
    BadMagicError,
    ConfigError,
    CorruptFrameError,
    CorruptHeaderError,
    ForeignFileError,
    FormatError,
    RescaleError,
    TruncatedFileError,
    UnsupportedVersionError,
)
from spillover.keygroups import (
    KeyGroupRange,
    key_groups,
)
from spillover.runtime.state.heap import (
    _ARROW_MAGIC,
    FORMAT_NAME,
    FORMAT_VERSION,
    Keys,
    Values,
    _arrow_type,
    _check_dtype,
    _dtype_from_json,
    _dtype_to_json,
)
from spillover.runtime.state.ipcfile import Layout, learn, pyarrow_file
from spillover.storage.location import Location

# ---- snapshot files ----


def _meta(key: str) -> bytes:
    return f"spillover.{key}".encode()


def _write_snapshot(
    directory_uri: str,
    copies: Sequence[tuple[str, str, np.dtype[Any], Keys, Values, Layout | None]],
    max_p: int,
    rng: KeyGroupRange,
    prefix: str,
    fsync: bool,
) -> dict[str, Any]:
    directory = Location.parse(directory_uri)
    entries = []
    for i, (name, kind, dtype, keys, values, layout) in enumerate(copies):
        kg = key_groups(keys, max_p)
        # Rows are sorted by key; a stable sort by key group keeps key and append order
        # (key groups fit int16, max parallelism <= 32768: numpy then radix-sorts).
        order = np.argsort(kg.astype(np.int16, copy=False), kind="stable")
        data: pa.Buffer | npt.NDArray[np.uint8]
        if layout is not None and keys.size:  # pyarrow's bytes, the columns gathered in
            leaves = [values] if dtype.names is None else [values[n] for n in dtype.names]
            data = layout.write([kg, keys, *leaves], order)
        else:
            data = pyarrow_file(
                pa.record_batch(
                    [pa.array(kg[order]), pa.array(keys[order]), _to_arrow(values[order], dtype)],
                    schema=_schema(name, kind, dtype, max_p, rng.start, rng.end),
                )
            )
        where = directory.child(_file_name(prefix, rng.start, rng.end, i, name))
        size = _write_file(where, data, fsync)
        entries.append(
            {
                "name": name,
                "kind": kind,
                "dtype": _dtype_to_json(dtype),
                "uri": where.uri,
                "rows": int(keys.size),
                "bytes": size,
            }
        )
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "max_parallelism": max_p,
        "key_group_range": [rng.start, rng.end],
        "bytes": sum(e["bytes"] for e in entries),
        "states": entries,
    }


@functools.lru_cache(maxsize=1024)
def _schema(
    name: str, kind: str, dtype: np.dtype[Any], max_p: int, start: int, end: int
) -> pa.Schema:
    """A state file's schema with its metadata, the same at every checkpoint: built
    once (its JSON and pyarrow calls are most of a small state's write, and on a busy
    task process Python work is what waits for the GIL)."""
    metadata = {
        _meta("format"): FORMAT_NAME,
        _meta("format_version"): str(FORMAT_VERSION),
        _meta("state.name"): name,
        _meta("state.kind"): kind,
        _meta("state.dtype"): json.dumps(_dtype_to_json(dtype)),
        _meta("max_parallelism"): str(max_p),
        _meta("key_group_range"): json.dumps([start, end]),
    }
    return pa.schema(
        [("key_group", pa.int32()), ("key", pa.int64()), ("value", _arrow_type(dtype))],
        metadata=metadata,
    )


@functools.lru_cache(maxsize=1024)
def _layout(
    name: str, kind: str, dtype: np.dtype[Any], max_p: int, start: int, end: int
) -> Layout | None:
    return learn(_schema(name, kind, dtype, max_p, start, end))


def learn_layout(
    name: str, kind: str, dtype: np.dtype[Any], max_p: int, rng: KeyGroupRange
) -> Layout | None:
    """How the files of a state are laid out, so that its checkpoints write them
    without pyarrow's writer (``ipcfile.py``); None: pyarrow writes them. Learned as
    the state is declared or restored and kept with it (a dozen pyarrow files: 1-2
    ms, some 30 ms the first time in a process), so no checkpoint learns."""
    return _layout(name, kind, dtype, max_p, rng.start, rng.end)


@functools.lru_cache(maxsize=1024)
def _file_name(prefix: str, start: int, end: int, i: int, name: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64]
    return f"{prefix}-kg{start:05d}-{end:05d}-{i:03d}-{safe}.arrow"


def _to_arrow(values: Values, dtype: np.dtype[Any]) -> pa.Array:
    if dtype.names is None:
        return pa.array(values)
    names = list(dtype.names)
    return pa.StructArray.from_arrays(
        [pa.array(np.ascontiguousarray(values[n])) for n in names], names=names
    )


def _from_arrow(column: pa.ChunkedArray, dtype: np.dtype[Any]) -> Values:
    if dtype.names is None:
        return np.asarray(column.to_numpy(), dtype=dtype)
    struct = column.combine_chunks()
    out = np.empty(len(struct), dtype=dtype)
    for i, n in enumerate(dtype.names):
        out[n] = struct.field(i).to_numpy(zero_copy_only=False)
    return out


def _write_file(where: Location, data: pa.Buffer | npt.NDArray[np.uint8], fsync: bool) -> int:
    """Writes ``data``, an Arrow IPC file made in memory, as a new file at ``where``
    (never over one) and returns its size; ``fsync``: the file and its directory
    entry are durable. One call writes it (``Location.write_new``): on a busy task
    process every I/O call that lets the GIL go costs."""
    where.write_new(
        data,
        fsync=fsync,
        what="keyed-state file",
        hint="each checkpoint needs its own directory, and each keyed operator "
        "sharing one its own backend name",
    )
    return len(data)  # (bytes: a buffer, or a 1-D uint8 array)


def _check_handle(handle: Any, max_p: int) -> KeyGroupRange:
    """Checks a handle's format, version and max parallelism; returns its key-group range."""
    if not isinstance(handle, dict) or handle.get("format") != FORMAT_NAME:
        raise FormatError(
            "not a keyed-state handle",
            detail=f"expected format {FORMAT_NAME!r}, got {str(handle)[:200]}",
        )
    if handle.get("version") != FORMAT_VERSION:
        raise UnsupportedVersionError(
            f"keyed-state handle has format version {handle.get('version')!r}; "
            f"this reader knows version {FORMAT_VERSION}",
            hint="restore with the spillover version that took the checkpoint, or newer",
        )
    if handle.get("max_parallelism") != max_p:
        raise RescaleError(
            f"keyed state was taken at max parallelism {handle.get('max_parallelism')}, "
            f"this job has {max_p}",
            hint="max parallelism must stay the same across restores: key groups depend on it",
        )
    try:
        start, end = (int(x) for x in handle["key_group_range"])
        states = handle["states"]
        for e in states:
            _ = e["name"], e["kind"], e["dtype"], e["uri"], e["rows"]
    except (KeyError, TypeError, ValueError) as err:
        raise FormatError("malformed keyed-state handle", detail=repr(err)) from err
    return KeyGroupRange(start, end)


def _open_input(uri: str) -> pa.NativeFile:
    return Location.parse(uri).open_input("keyed-state file")


def _read_state_file(
    entry: dict[str, Any], handle: dict[str, Any], wanted: KeyGroupRange
) -> tuple[str, str, np.dtype[Any], Keys, Values]:
    """Reads one state file of ``handle``: its name, kind, dtype, and the keys and values
    of the key groups in ``wanted``, after checking the file against the handle."""
    uri = str(entry["uri"])
    source = _open_input(uri)
    try:
        if source.read_at(len(_ARROW_MAGIC), 0) != _ARROW_MAGIC:
            raise BadMagicError("not an Arrow IPC file, so not a keyed-state file", path=uri)
        try:
            table = pa.ipc.open_file(source).read_all()
        except (pa.ArrowInvalid, OSError) as e:
            raise TruncatedFileError(
                "keyed-state file is cut or damaged", path=uri, detail=str(e)
            ) from e
    finally:
        source.close()
    meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    if meta.get("spillover.format") != FORMAT_NAME:
        raise BadMagicError("an Arrow file, but not a spillover keyed-state file", path=uri)
    if meta.get("spillover.format_version") != str(FORMAT_VERSION):
        raise UnsupportedVersionError(
            f"keyed-state file has format version {meta.get('spillover.format_version')!r}; "
            f"this reader knows version {FORMAT_VERSION}",
            path=uri,
        )
    if meta.get("spillover.max_parallelism") != str(handle["max_parallelism"]):
        raise RescaleError(
            f"keyed-state file was written at max parallelism "
            f"{meta.get('spillover.max_parallelism')}, its handle says {handle['max_parallelism']}",
            path=uri,
        )
    name, kind = meta.get("spillover.state.name"), meta.get("spillover.state.kind")
    try:
        dtype = _dtype_from_json(json.loads(meta.get("spillover.state.dtype", "null")))
        handle_dtype = _dtype_from_json(entry["dtype"])
    except (TypeError, ValueError) as e:
        raise CorruptHeaderError("bad state dtype in keyed-state file", path=uri) from e
    covered = KeyGroupRange(*handle["key_group_range"])
    if (name, kind, dtype, table.num_rows, meta.get("spillover.key_group_range")) != (
        entry["name"],
        entry["kind"],
        handle_dtype,
        entry["rows"],
        json.dumps([covered.start, covered.end]),
    ):
        raise ForeignFileError(
            "keyed-state file does not match its handle",
            path=uri,
            detail=f"file holds {table.num_rows} rows of {kind} state {name!r} ({dtype}), "
            f"handle names {entry['rows']} rows of {entry['kind']} state {entry['name']!r}",
        )
    assert name is not None and kind is not None
    try:
        _check_dtype(kind, dtype, name)
    except ConfigError as e:
        raise CorruptHeaderError("keyed-state file holds an unknown state", path=uri) from e
    expected = pa.schema(
        [("key_group", pa.int32()), ("key", pa.int64()), ("value", _arrow_type(dtype))]
    )
    if not table.schema.remove_metadata().equals(expected):
        raise CorruptHeaderError(
            "keyed-state file has an unexpected schema", path=uri, detail=str(table.schema)
        )
    kg = table.column("key_group").to_numpy()
    if kg.size and (np.any(kg[1:] < kg[:-1]) or kg[0] < covered.start or kg[-1] > covered.end):
        raise CorruptFrameError(
            "keyed-state rows are not sorted by key group within the handle's range", path=uri
        )
    lo, hi = np.searchsorted(kg, [wanted.start, wanted.end + 1])
    part = table.slice(int(lo), int(hi - lo))
    keys = np.asarray(part.column("key").to_numpy(), dtype=np.int64)
    if not np.array_equal(key_groups(keys, int(handle["max_parallelism"])), kg[lo:hi]):
        raise CorruptFrameError("keyed-state rows do not match their key groups", path=uri)
    return name, kind, dtype, keys, _from_arrow(part.column("value"), dtype)
