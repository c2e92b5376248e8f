"""Keyed state of one subtask, kept in memory as sorted numpy arrays, and its snapshots.

A :class:`HeapKeyedStateBackend` owns the key groups of one subtask and hands
out one state per :class:`~spillover.runtime.api.StateDescriptor` name:

* ``"value"`` (:class:`HeapValueState`): the last value written per key;
* ``"sum"`` (:class:`HeapSumState`): a running sum per key (int64 or float64);
* ``"list"`` (:class:`HeapListState`): every value appended per key, in order.

Every operation takes arrays of keys and works in a few numpy calls. A state
keeps a large run sorted by key and a small run of recent insertions, merged
into the large one when it grows past about ``32 * sqrt(n)`` rows, so a batch
of new keys costs far less than a copy of the whole state.

``snapshot()`` copies the state and returns ``write(directory_uri)``, which
writes one Arrow IPC file per state, rows sorted by key group, and returns a
JSON-able handle; ``restore(handles)`` reads back the rows whose key groups the
backend owns, so state taken at one parallelism restores at another. The file
format is described in ``docs/state.md``. ``split_even`` and ``union``
redistribute list-shaped operator state the way Flink does.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.fs as pafs

from spillover.errors import (
    BadMagicError,
    ConfigError,
    CorruptFrameError,
    CorruptHeaderError,
    ForeignFileError,
    FormatError,
    KeyGroupRangeError,
    RescaleError,
    StateFileExistsError,
    StorageError,
    TruncatedFileError,
    UnsupportedVersionError,
)
from spillover.keygroups import (
    KeyGroupRange,
    check_max_parallelism,
    key_group_range_for_operator,
    key_groups,
)
from spillover.runtime.api import KeyedState, StateDescriptor
from spillover.storage.location import Location

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "HeapKeyedStateBackend",
    "HeapListState",
    "HeapSumState",
    "HeapValueState",
    "split_even",
    "union",
]

FORMAT_NAME: Final = "spillover-keyed-state"
FORMAT_VERSION: Final = 1
"""Written into every snapshot file and handle; readers refuse other versions."""

KINDS: Final = ("value", "sum", "list")
_SUM_DTYPES: Final = (np.dtype(np.int64), np.dtype(np.float64))
_NUMERIC_KINDS: Final = "biuf"
_MIN_MERGE_ROWS: Final = 4096
_ARROW_MAGIC: Final = b"ARROW1"

Keys = npt.NDArray[np.int64]
Values = npt.NDArray[Any]
Positions = npt.NDArray[np.intp]
T = TypeVar("T")


# ---- array helpers ----


def _find(sorted_keys: Keys, queries: Keys) -> tuple[Positions, npt.NDArray[np.bool_]]:
    """Insertion positions of ``queries`` in ``sorted_keys`` and a mask of the ones present."""
    pos = np.searchsorted(sorted_keys, queries)
    if sorted_keys.size == 0:
        return pos, np.zeros(queries.size, dtype=np.bool_)
    found = sorted_keys[np.minimum(pos, sorted_keys.size - 1)] == queries
    return pos, found


def _expand(starts: Positions, counts: Positions) -> Positions:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])``, vectorised."""
    ends = np.cumsum(counts)
    total = int(ends[-1]) if ends.size else 0
    return np.repeat(starts - (ends - counts), counts) + np.arange(total)


def _group_starts(sorted_keys: Keys) -> Positions:
    """Index of the first entry of every run of equal keys in ``sorted_keys``."""
    first = np.empty(sorted_keys.size, dtype=np.bool_)
    first[:1] = True
    np.not_equal(sorted_keys[1:], sorted_keys[:-1], out=first[1:])
    return np.flatnonzero(first)


def _check_dtype(kind: str, dtype: np.dtype[Any], name: str) -> None:
    if kind not in KINDS:
        raise ConfigError(f"state {name!r}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "sum":
        if dtype not in _SUM_DTYPES:
            raise ConfigError(f"sum state {name!r} needs dtype int64 or float64, got {dtype}")
        return
    names, fields = dtype.names, dtype.fields
    scalars = [dtype] if names is None or fields is None else [fields[n][0] for n in names]
    for f in scalars:
        if f.kind not in _NUMERIC_KINDS or f.shape or not f.isnative:
            raise ConfigError(
                f"state {name!r}: dtype {dtype} is not supported",
                hint="use a numeric dtype in native byte order, or a structured dtype of those",
            )


def _dtype_to_json(dtype: np.dtype[Any]) -> Any:
    if dtype.names is None:
        return dtype.str
    fields = dtype.fields
    assert fields is not None
    return {
        "names": list(dtype.names),
        "formats": [fields[n][0].str for n in dtype.names],
        "offsets": [fields[n][1] for n in dtype.names],
        "itemsize": dtype.itemsize,
    }


def _dtype_from_json(obj: Any) -> np.dtype[Any]:
    dtype: np.dtype[Any] = np.dtype(obj)
    return dtype


def _arrow_type(dtype: np.dtype[Any]) -> pa.DataType:
    if dtype.names is None:
        return pa.from_numpy_dtype(dtype)
    fields = dtype.fields
    assert fields is not None
    return pa.struct([pa.field(n, pa.from_numpy_dtype(fields[n][0])) for n in dtype.names])


# ---- states ----


class _HeapState:
    """What every heap state shares: argument checks and the merge threshold."""

    kind: str

    def __init__(self, backend: HeapKeyedStateBackend, name: str, dtype: np.dtype[Any]) -> None:
        self.name = name
        self.dtype = dtype
        self._backend = backend

    def _keys(self, keys: npt.ArrayLike) -> Keys:
        arr = np.asarray(keys)
        if arr.ndim != 1:
            raise ValueError(
                f"state {self.name!r}: keys must be a 1-D array, got shape {arr.shape}"
            )
        if arr.dtype != np.int64:
            if arr.size and (arr.dtype.kind not in "iu" or not np.can_cast(arr.dtype, np.int64)):
                raise TypeError(f"state {self.name!r}: keys must be int64, got {arr.dtype}")
            arr = arr.astype(np.int64)
        self._backend._check_keys(arr)
        return arr

    def _values(self, values: npt.ArrayLike, n: int) -> Values:
        arr = values if isinstance(values, np.ndarray) else np.asarray(values, dtype=self.dtype)
        if arr.dtype != self.dtype:
            try:
                arr = arr.astype(self.dtype, casting="same_kind")
            except TypeError as e:
                raise TypeError(
                    f"state {self.name!r} holds {self.dtype}, got values of {arr.dtype}"
                ) from e
        if arr.shape != (n,):
            raise ValueError(f"state {self.name!r}: {n} keys but values of shape {arr.shape}")
        return arr

    def _merge_due(self, small: int, large: int) -> bool:
        fixed = self._backend._merge_rows
        limit = fixed if fixed is not None else max(_MIN_MERGE_ROWS, 32 * math.isqrt(large))
        return small > limit

    def get(self, keys: npt.ArrayLike) -> tuple[Values, npt.NDArray[np.bool_]]:
        raise NotImplementedError

    def put(self, keys: npt.ArrayLike, values: npt.ArrayLike) -> None:
        raise NotImplementedError

    def clear(self, keys: npt.ArrayLike) -> None:
        raise NotImplementedError

    def items(self) -> tuple[Keys, Values]:
        raise NotImplementedError

    def _load(self, keys: Keys, values: Values) -> None:
        raise NotImplementedError

    def nbytes(self) -> int:
        raise NotImplementedError


class _UniqueKeyState(_HeapState):
    """One value per key: a main run and a delta run, each sorted, with disjoint keys."""

    def __init__(self, backend: HeapKeyedStateBackend, name: str, dtype: np.dtype[Any]) -> None:
        super().__init__(backend, name, dtype)
        self._mk: Keys = np.empty(0, dtype=np.int64)
        self._mv: Values = np.empty(0, dtype=dtype)
        self._dk: Keys = np.empty(0, dtype=np.int64)
        self._dv: Values = np.empty(0, dtype=dtype)

    def _combine(self, keys: Keys, values: Values) -> tuple[Keys, Values]:
        """Sorted unique keys of one put and the value each contributes."""
        raise NotImplementedError

    def _update(self, target: Values, pos: Positions, values: Values) -> None:
        raise NotImplementedError

    def get(self, keys: npt.ArrayLike) -> tuple[Values, npt.NDArray[np.bool_]]:
        """Values of ``keys`` (zero where a key has none) and a mask of the keys that have one."""
        q = self._keys(keys)
        out = np.zeros(q.size, dtype=self.dtype)
        mask = np.zeros(q.size, dtype=np.bool_)
        for run_keys, run_values in ((self._mk, self._mv), (self._dk, self._dv)):
            pos, found = _find(run_keys, q)
            out[found] = run_values[pos[found]]
            mask |= found
        return out, mask

    def put(self, keys: npt.ArrayLike, values: npt.ArrayLike) -> None:
        q = self._keys(keys)
        v = self._values(values, q.size)
        if q.size:
            self._put_unique(*self._combine(q, v))

    def _put_unique(self, keys: Keys, values: Values) -> None:
        for run_keys, run_values in ((self._mk, self._mv), (self._dk, self._dv)):
            pos, found = _find(run_keys, keys)
            if found.any():
                self._update(run_values, pos[found], values[found])
                keys, values = keys[~found], values[~found]
        if keys.size:
            at = np.searchsorted(self._dk, keys)
            self._dk = np.insert(self._dk, at, keys)
            self._dv = np.insert(self._dv, at, values)
            if self._merge_due(self._dk.size, self._mk.size):
                self._compact()

    def clear(self, keys: npt.ArrayLike) -> None:
        q = np.unique(self._keys(keys))
        pos, found = _find(self._mk, q)
        if found.any():
            self._mk = np.delete(self._mk, pos[found])
            self._mv = np.delete(self._mv, pos[found])
        pos, found = _find(self._dk, q)
        if found.any():
            self._dk = np.delete(self._dk, pos[found])
            self._dv = np.delete(self._dv, pos[found])

    def items(self) -> tuple[Keys, Values]:
        """Every key (sorted) and its value, as copies."""
        self._compact()
        return self._mk.copy(), self._mv.copy()

    def _compact(self) -> None:
        if self._dk.size:
            at = np.searchsorted(self._mk, self._dk)
            self._mk = np.insert(self._mk, at, self._dk)
            self._mv = np.insert(self._mv, at, self._dv)
            self._dk = self._dk[:0]
            self._dv = self._dv[:0]

    def _load(self, keys: Keys, values: Values) -> None:
        if keys.size:
            self._put_unique(*self._combine(keys, values))

    def nbytes(self) -> int:
        return self._mk.nbytes + self._mv.nbytes + self._dk.nbytes + self._dv.nbytes


class HeapValueState(_UniqueKeyState):
    """Value state: ``put`` keeps the last value per key (the last in array order within a put)."""

    kind = "value"

    def _combine(self, keys: Keys, values: Values) -> tuple[Keys, Values]:
        order = np.argsort(keys, kind="stable")
        sorted_keys = keys[order]
        last = np.empty(keys.size, dtype=np.bool_)
        last[-1:] = True
        np.not_equal(sorted_keys[1:], sorted_keys[:-1], out=last[:-1])
        return sorted_keys[last], values[order[last]]

    def _update(self, target: Values, pos: Positions, values: Values) -> None:
        target[pos] = values


class HeapSumState(_UniqueKeyState):
    """Reducing state that adds: ``put`` adds every value to its key's sum (int64 wraps)."""

    kind = "sum"

    def _combine(self, keys: Keys, values: Values) -> tuple[Keys, Values]:
        order = np.argsort(keys, kind="stable")
        sorted_keys = keys[order]
        starts = _group_starts(sorted_keys)
        return sorted_keys[starts], np.add.reduceat(values[order], starts)

    def _update(self, target: Values, pos: Positions, values: Values) -> None:
        target[pos] += values  # positions are unique: no lost updates


class HeapListState(_HeapState):
    """List state: ``put`` appends values per key; order per key is the order of the puts.

    Rows live in a main run sorted by key (append order within a key) and a tail
    in append order, sorted lazily when read and merged when it grows.
    """

    kind = "list"

    def __init__(self, backend: HeapKeyedStateBackend, name: str, dtype: np.dtype[Any]) -> None:
        super().__init__(backend, name, dtype)
        self._mk: Keys = np.empty(0, dtype=np.int64)
        self._mv: Values = np.empty(0, dtype=dtype)
        self._tk: Keys = np.empty(0, dtype=np.int64)  # capacity; the first _tn rows are live
        self._tv: Values = np.empty(0, dtype=dtype)
        self._tn = 0
        self._sorted_tail: tuple[Keys, Values] | None = None

    def get_lists(self, keys: npt.ArrayLike) -> tuple[Values, npt.NDArray[np.int64]]:
        """Every value of ``keys``, grouped by key in the order of ``keys``, and offsets:
        the values of ``keys[i]`` are ``values[offsets[i]:offsets[i + 1]]``, oldest first."""
        q = self._keys(keys)
        tail_keys, tail_values = self._tail()
        lo = np.searchsorted(self._mk, q, side="left")
        main_counts = np.searchsorted(self._mk, q, side="right") - lo
        tlo = np.searchsorted(tail_keys, q, side="left")
        tail_counts = np.searchsorted(tail_keys, q, side="right") - tlo
        offsets = np.zeros(q.size + 1, dtype=np.int64)
        np.cumsum(main_counts + tail_counts, out=offsets[1:])
        out = np.empty(int(offsets[-1]), dtype=self.dtype)
        base = offsets[:-1].astype(np.intp)
        out[_expand(base, main_counts)] = self._mv[_expand(lo, main_counts)]
        out[_expand(base + main_counts, tail_counts)] = tail_values[_expand(tlo, tail_counts)]
        return out, offsets

    def get(self, keys: npt.ArrayLike) -> tuple[Values, npt.NDArray[np.bool_]]:
        """The values of ``get_lists(keys)`` (without offsets) and a mask of the keys that
        have at least one value."""
        values, offsets = self.get_lists(keys)
        return values, offsets[1:] > offsets[:-1]

    def put(self, keys: npt.ArrayLike, values: npt.ArrayLike) -> None:
        q = self._keys(keys)
        v = self._values(values, q.size)
        if q.size:
            self._append(q, v)

    def _append(self, keys: Keys, values: Values) -> None:
        n = self._tn + keys.size
        if n > self._tk.size:
            cap = max(n, 2 * self._tk.size, 64)
            tk = np.empty(cap, dtype=np.int64)
            tv = np.empty(cap, dtype=self.dtype)
            tk[: self._tn] = self._tk[: self._tn]
            tv[: self._tn] = self._tv[: self._tn]
            self._tk, self._tv = tk, tv
        self._tk[self._tn : n] = keys
        self._tv[self._tn : n] = values
        self._tn = n
        self._sorted_tail = None
        if self._merge_due(n, self._mk.size):
            self._compact()

    def _tail(self) -> tuple[Keys, Values]:
        if self._sorted_tail is None:
            keys = self._tk[: self._tn]
            order = np.argsort(keys, kind="stable")
            self._sorted_tail = keys[order], self._tv[: self._tn][order]
        return self._sorted_tail

    def clear(self, keys: npt.ArrayLike) -> None:
        q = np.unique(self._keys(keys))
        lo = np.searchsorted(self._mk, q, side="left")
        drop = _expand(lo, np.searchsorted(self._mk, q, side="right") - lo)
        if drop.size:
            self._mk = np.delete(self._mk, drop)
            self._mv = np.delete(self._mv, drop)
        if self._tn:
            keep = ~np.isin(self._tk[: self._tn], q)
            n = int(keep.sum())
            if n < self._tn:
                self._tk[:n] = self._tk[: self._tn][keep]
                self._tv[:n] = self._tv[: self._tn][keep]
                self._tn = n
                self._sorted_tail = None

    def items(self) -> tuple[Keys, Values]:
        """One row per appended value, sorted by key and oldest first per key, as copies."""
        self._compact()
        return self._mk.copy(), self._mv.copy()

    def _compact(self) -> None:
        if self._tn:
            keys, values = self._tail()
            # side="right": appended values go after the values a key already has.
            at = np.searchsorted(self._mk, keys, side="right")
            self._mk = np.insert(self._mk, at, keys)
            self._mv = np.insert(self._mv, at, values)
            self._tn = 0
            self._sorted_tail = None
        if self._tk.size > 4 * max(64, 32 * math.isqrt(self._mk.size)):
            self._tk = self._tk[:0].copy()
            self._tv = self._tv[:0].copy()

    def _load(self, keys: Keys, values: Values) -> None:
        if keys.size:
            self._append(keys, values)

    def nbytes(self) -> int:
        return self._mk.nbytes + self._mv.nbytes + self._tk.nbytes + self._tv.nbytes


_STATE_CLASSES: Final[dict[str, type[_HeapState]]] = {
    "value": HeapValueState,
    "sum": HeapSumState,
    "list": HeapListState,
}


# ---- the backend ----


class HeapKeyedStateBackend:
    """The keyed state of one subtask, which owns the key groups ``key_group_range``.

    ``name`` prefixes the snapshot files (give each keyed operator its own when
    several share a directory); ``merge_rows`` fixes how many rows a state's
    small run holds before it is merged (default: adaptive); ``fsync`` makes
    local snapshot files durable before ``write`` returns. Keys outside the range
    raise :class:`KeyGroupRangeError` unless ``check_key_groups`` is False.
    Not thread-safe: use it from the task's thread (``write`` of a snapshot may
    run on any thread).
    """

    def __init__(
        self,
        max_parallelism: int,
        key_group_range: KeyGroupRange,
        *,
        name: str = "keyed",
        merge_rows: int | None = None,
        fsync: bool = False,
        check_key_groups: bool = True,
    ) -> None:
        check_max_parallelism(max_parallelism)
        if len(key_group_range) and key_group_range.end >= max_parallelism:
            raise ConfigError(f"{key_group_range!r} exceeds max parallelism {max_parallelism}")
        if merge_rows is not None and merge_rows < 0:
            raise ConfigError(f"merge_rows must be >= 0, got {merge_rows}")
        self._max_p = max_parallelism
        self._range = key_group_range
        self._name = re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "keyed"
        self._merge_rows = merge_rows
        self._fsync = fsync
        self._check = check_key_groups and len(key_group_range) < max_parallelism
        self._states: dict[str, _HeapState] = {}

    @classmethod
    def for_subtask(
        cls, max_parallelism: int, parallelism: int, subtask_index: int, **kwargs: Any
    ) -> HeapKeyedStateBackend:
        """The backend of subtask ``subtask_index`` of ``parallelism`` (Flink's ranges)."""
        rng = key_group_range_for_operator(max_parallelism, parallelism, subtask_index)
        return cls(max_parallelism, rng, **kwargs)

    @property
    def max_parallelism(self) -> int:
        return self._max_p

    @property
    def key_group_range(self) -> KeyGroupRange:
        return self._range

    def state_names(self) -> list[str]:
        """Names of the states declared or restored so far, in creation order."""
        return list(self._states)

    def state(self, descriptor: StateDescriptor) -> KeyedState:
        """The state named ``descriptor.name``, created on first use.

        Raises :class:`ConfigError` when the kind or dtype is not supported or differs
        from the state's (declared earlier or restored)."""
        dtype = np.dtype(descriptor.dtype)
        return self._state(descriptor.name, descriptor.kind, dtype)

    def _state(
        self, name: str, kind: str, dtype: np.dtype[Any], source: str | None = None
    ) -> _HeapState:
        existing = self._states.get(name)
        if existing is not None:
            if existing.kind != kind or existing.dtype != dtype:
                raise ConfigError(
                    f"state {name!r} is {existing.kind} state of {existing.dtype}, "
                    f"not {kind} state of {dtype}",
                    path=source,
                    hint="a state keeps its kind and dtype across restores; use a new name",
                )
            return existing
        _check_dtype(kind, dtype, name)
        state = _STATE_CLASSES[kind](self, name, dtype)
        self._states[name] = state
        return state

    def _check_keys(self, keys: Keys) -> None:
        if not self._check or keys.size == 0:
            return
        kg = key_groups(keys, self._max_p)
        bad = (kg < self._range.start) | (kg > self._range.end)
        if bad.any():
            i = int(np.argmax(bad))
            raise KeyGroupRangeError(
                f"key {int(keys[i])} is in key group {int(kg[i])}, outside this subtask's "
                f"key groups {self._range.start}..{self._range.end}",
                detail=f"{int(bad.sum())} of {keys.size} keys are outside",
                hint="keyed state must be fed through a key_by edge on the same int64 key "
                "and max parallelism",
            )

    def state_bytes(self) -> int:
        """Approximate memory the states hold, in bytes (array buffers, spare capacity included)."""
        return sum(s.nbytes() for s in self._states.values())

    def snapshot(self) -> Callable[[str], dict[str, Any]]:
        """Copies every state now and returns ``write(directory_uri) -> handle``.

        ``write`` may run on another thread; it writes one Arrow IPC file per state
        under the directory (a local path or a ``pyarrow.fs`` URI) and returns the
        JSON-able handle described in ``docs/state.md``."""
        copies = [(s.name, s.kind, s.dtype, *s.items()) for s in self._states.values()]
        max_p, rng, prefix, fsync = self._max_p, self._range, self._name, self._fsync

        def write(directory_uri: str) -> dict[str, Any]:
            return _write_snapshot(directory_uri, copies, max_p, rng, prefix, fsync)

        return write

    def restore(self, handles: list[dict[str, Any]]) -> None:
        """Loads the rows of ``handles`` whose key groups lie in this backend's range.

        Pass the handles of every old subtask (those whose ranges miss this one are
        skipped without being opened). Restored rows are added as ``put`` would add
        them. Refuses handles and files of another format version
        (:class:`UnsupportedVersionError`), of another max parallelism or with
        overlapping key-group ranges (:class:`RescaleError`)."""
        chosen: list[tuple[KeyGroupRange, dict[str, Any]]] = []
        for handle in handles:
            covered = _check_handle(handle, self._max_p)
            overlap = covered.intersection(self._range)
            if len(overlap):
                chosen.append((overlap, handle))
        chosen.sort(key=lambda c: c[0].start)
        for (a, _), (b, _) in itertools.pairwise(chosen):
            if b.start <= a.end:
                raise RescaleError(
                    f"two keyed-state handles both hold key groups {b.start}..{min(a.end, b.end)}",
                    hint="pass each old subtask's handle once",
                )
        loaded: dict[str, tuple[str, np.dtype[Any], str, list[Keys], list[Values]]] = {}
        for overlap, handle in chosen:
            for entry in handle["states"]:
                name, kind, dtype, keys, values = _read_state_file(entry, handle, overlap)
                uri = str(entry["uri"])
                if name not in loaded:
                    loaded[name] = (kind, dtype, uri, [], [])
                first_kind, first_dtype, first_uri, key_parts, value_parts = loaded[name]
                if (kind, dtype) != (first_kind, first_dtype):
                    raise ForeignFileError(
                        f"state {name!r} is {kind} state of {dtype} here but "
                        f"{first_kind} state of {first_dtype} in {first_uri}",
                        path=uri,
                    )
                key_parts.append(keys)
                value_parts.append(values)
        for name, (kind, dtype, uri, key_parts, value_parts) in loaded.items():
            state = self._state(name, kind, dtype, source=uri)
            state._load(np.concatenate(key_parts), np.concatenate(value_parts))


# ---- snapshot files ----


def _meta(key: str) -> bytes:
    return f"spillover.{key}".encode()


def _write_snapshot(
    directory_uri: str,
    copies: list[tuple[str, str, np.dtype[Any], Keys, Values]],
    max_p: int,
    rng: KeyGroupRange,
    prefix: str,
    fsync: bool,
) -> dict[str, Any]:
    directory = Location.parse(directory_uri)
    fs, _ = directory.arrow()
    entries = []
    for i, (name, kind, dtype, keys, values) in enumerate(copies):
        kg = key_groups(keys, max_p)
        # Rows are sorted by key; a stable sort by key group keeps key and append order.
        order = np.argsort(kg, kind="stable")
        metadata = {
            _meta("format"): FORMAT_NAME,
            _meta("format_version"): str(FORMAT_VERSION),
            _meta("state.name"): name,
            _meta("state.kind"): kind,
            _meta("state.dtype"): json.dumps(_dtype_to_json(dtype)),
            _meta("max_parallelism"): str(max_p),
            _meta("key_group_range"): json.dumps([rng.start, rng.end]),
        }
        schema = pa.schema(
            [("key_group", pa.int32()), ("key", pa.int64()), ("value", _arrow_type(dtype))],
            metadata=metadata,
        )
        batch = pa.record_batch(
            [pa.array(kg[order]), pa.array(keys[order]), _to_arrow(values[order], dtype)],
            schema=schema,
        )
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64]
        file_name = f"{prefix}-kg{rng.start:05d}-{rng.end:05d}-{i:03d}-{safe}.arrow"
        where = directory.child(file_name)
        size = _write_file(fs, where.path, where.uri, batch, fsync and where.local)
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


def _write_file(
    fs: pafs.FileSystem, path: str, uri: str, batch: pa.RecordBatch, fsync: bool
) -> int:
    try:
        if fs.get_file_info(path).type != pafs.FileType.NotFound:
            raise StateFileExistsError(
                "keyed-state file already exists",
                path=uri,
                hint="each checkpoint needs its own directory, and each keyed operator "
                "sharing one its own backend name",
            )
        fs.create_dir(path.rsplit("/", 1)[0] if "/" in path else ".", recursive=True)
        with fs.open_output_stream(path) as sink:
            with pa.ipc.new_file(sink, batch.schema) as writer:
                writer.write_batch(batch)
            size = int(sink.tell())
        if fsync:
            for target, flags in ((path, os.O_RDONLY), (os.path.dirname(path), os.O_DIRECTORY)):
                fd = os.open(target, flags)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
    except StateFileExistsError:
        raise
    except OSError as e:
        raise StorageError(
            "cannot write keyed-state file",
            path=uri,
            errno=e.errno,
            detail=f"{type(e).__name__}: {e}",
            hint="check that the checkpoint directory is reachable and writable",
        ) from e
    return size


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


# ---- operator state redistribution ----


def split_even(partitions: Sequence[Sequence[T]], new_parallelism: int) -> list[list[T]]:
    """Flink's even-split redistribution of list operator state.

    The elements of every old subtask, concatenated in subtask order, are cut
    into ``new_parallelism`` consecutive slices whose sizes differ by at most
    one (the first slices get the extra elements)."""
    if new_parallelism < 1:
        raise ConfigError(f"new parallelism must be >= 1, got {new_parallelism}")
    elements = [x for part in partitions for x in part]
    base, extra = divmod(len(elements), new_parallelism)
    out: list[list[T]] = []
    start = 0
    for i in range(new_parallelism):
        end = start + base + (i < extra)
        out.append(elements[start:end])
        start = end
    return out


def union(partitions: Sequence[Sequence[T]]) -> list[T]:
    """Flink's union redistribution: every new subtask gets all elements of every old
    subtask, concatenated in subtask order."""
    return [x for part in partitions for x in part]
