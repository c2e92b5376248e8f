"""Keyed states on the heap: values, sums and lists per int64 key, kept sorted
so that every operation is a vectorised search, never a Python loop per record."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, TypeVar

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from spillover.errors import (
    ConfigError,
)
from spillover.keygroups import (
    ADD_KEY_SUMS_MAX_KEYS,
    KEY_SUMS_INDEX_MAX_KEYS,
    add_key_sum_rows,
    add_key_sums,
    key_sums_index,
)

if TYPE_CHECKING:
    from spillover.runtime.state.backend import HeapKeyedStateBackend


FORMAT_NAME: Final = "spillover-keyed-state"
FORMAT_VERSION: Final = 1
"""Written into every snapshot file and handle; readers refuse other versions."""

KINDS: Final = ("value", "sum", "list", "timers")
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
    if kind == "timers":
        if dtype != np.dtype(np.int64):
            raise ConfigError(f"timer state {name!r} holds int64 timestamps, not {dtype}")
        return
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
        """``keys`` as int64, checked against the backend's key groups."""
        arr = self._as_keys(keys)
        self._backend._check_keys(arr)
        return arr

    def _as_keys(self, keys: npt.ArrayLike) -> Keys:
        arr = np.asarray(keys)
        if arr.ndim != 1:
            raise ValueError(
                f"state {self.name!r}: keys must be a 1-D array, got shape {arr.shape}"
            )
        if arr.dtype != np.int64:
            if arr.size and (arr.dtype.kind not in "iu" or not np.can_cast(arr.dtype, np.int64)):
                raise TypeError(f"state {self.name!r}: keys must be int64, got {arr.dtype}")
            arr = arr.astype(np.int64)
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
        self._insert_new(keys, values)

    def _insert_new(self, keys: Keys, values: Values) -> None:
        """Adds keys that are in neither run (sorted, distinct) to the delta run."""
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

    def __init__(self, backend: HeapKeyedStateBackend, name: str, dtype: np.dtype[Any]) -> None:
        super().__init__(backend, name, dtype)
        # Per run (main, delta): the keys array an index was built for, and the index.
        self._indexes: list[tuple[Keys, npt.NDArray[np.uint32]] | None] = [None, None]

    def _combine(self, keys: Keys, values: Values) -> tuple[Keys, Values]:
        order = np.argsort(keys, kind="stable")
        sorted_keys = keys[order]
        starts = _group_starts(sorted_keys)
        return sorted_keys[starts], np.add.reduceat(values[order], starts)

    def _update(self, target: Values, pos: Positions, values: Values) -> None:
        target[pos] += values  # positions are unique: no lost updates

    def put(self, keys: npt.ArrayLike, values: npt.ArrayLike) -> None:
        if self.dtype == np.int64:
            self.add(keys, values)
        else:
            super().put(keys, values)

    def add(self, keys: npt.ArrayLike, values: npt.ArrayLike | None = None) -> tuple[Keys, Values]:
        """:meth:`put`, returning the keys it touched (distinct, in no promised order)
        with their new sums: what ``put`` then ``get`` give. ``values`` None adds 1 per
        key (a count).

        int64 sums take one native pass (:func:`~spillover.keygroups.add_key_sums`:
        key groups checked, the batch hash-aggregated, each distinct key found in the
        runs by their hash indexes, kept beside them and rebuilt when a run's keys
        change), keys in the order the batch first has them; float64 sums (and batches
        past ``ADD_KEY_SUMS_MAX_KEYS``) the numpy path (:meth:`_add_numpy`), whose
        order of additions they keep, keys ascending."""
        q = self._as_keys(keys)
        v = None if values is None else self._values(values, q.size)
        if self.dtype != np.int64 or q.size > ADD_KEY_SUMS_MAX_KEYS:
            self._backend._check_keys(q)
            return self._add_numpy(q, np.ones(q.size, self.dtype) if v is None else v)
        uniq, totals, new = self._native_pass(add_key_sums, q, v)
        if new.size:
            self._insert_unsorted(uniq[new], totals[new])
        return uniq, totals

    def add_rows(self, keys: npt.ArrayLike, values: npt.ArrayLike | None = None) -> Keys:
        """:meth:`add` of an int64 sum, its result as a C-contiguous ``(n, 2)`` int64
        array of ``(key, new sum)`` rows written by the same native pass: the memory of
        a record batch of the two fields, with no copy after it."""
        if self.dtype != np.int64:
            raise TypeError(f"add_rows needs int64 sums, the state holds {self.dtype}")
        q = self._as_keys(keys)
        v = None if values is None else self._values(values, q.size)
        if q.size > ADD_KEY_SUMS_MAX_KEYS:
            uniq, totals = self.add(q, v)
            return np.stack([uniq, totals], axis=1)
        rows, new = self._native_pass(add_key_sum_rows, q, v)
        if new.size:
            self._insert_unsorted(rows[new, 0], rows[new, 1])
        return rows

    def _native_pass(self, add: Callable[..., T | None], q: Keys, v: Keys | None) -> T:
        """``add`` (:func:`add_key_sums` or :func:`add_key_sum_rows`) of ``q`` over the
        runs, keys in the batch's order; raises as the backend does for a key outside
        its key groups."""
        backend = self._backend
        got = add(
            q,
            v,
            (self._mk, self._mv),
            (self._dk, self._dv),
            backend._max_p,
            backend._checked_range,
            indexes=(self._index_of(0, self._mk), self._index_of(1, self._dk)),
            ascending=False,
        )
        if got is None:
            backend._check_keys(q)  # raises: a key lies outside the key groups
            raise AssertionError(f"{add.__name__} refused keys that the backend accepts")
        return got

    def _insert_unsorted(self, fresh: Keys, sums: Keys) -> None:
        order = np.argsort(fresh)
        self._insert_new(fresh[order], sums[order])

    def _index_of(self, run: int, run_keys: Keys) -> npt.NDArray[np.uint32] | None:
        """The hash index of a run's keys, rebuilt when the run is another array
        (every change of a run's keys makes a new one; sums change in place)."""
        built = self._indexes[run]
        if built is not None and built[0] is run_keys:
            return built[1]
        if not run_keys.size or run_keys.size > KEY_SUMS_INDEX_MAX_KEYS:
            return None
        index = key_sums_index(run_keys)
        self._indexes[run] = (run_keys, index)
        return index

    def nbytes(self) -> int:
        return super().nbytes() + sum(b[1].nbytes for b in self._indexes if b is not None)

    def _add_numpy(self, q: Keys, v: Values) -> tuple[Keys, Values]:
        """:meth:`add` in numpy calls (a sort, then a search per run), for checked keys:
        the path of float64 sums and the reference of the native one."""
        if not q.size:
            return q, v.copy()
        uniq, sums = self._combine(q, v)
        totals = sums.copy()  # a key new to the state: its sum is its total
        todo: Positions | None = None  # indices into uniq not found yet (None: all)
        for run_keys, run_values in ((self._mk, self._mv), (self._dk, self._dv)):
            if not run_keys.size:
                continue
            k = uniq if todo is None else uniq[todo]
            if not k.size:
                break
            pos, found = _find(run_keys, k)
            if not found.any():
                continue
            at = pos[found]
            idx = np.flatnonzero(found) if todo is None else todo[found]
            run_values[at] += sums[idx]
            totals[idx] = run_values[at]
            todo = np.flatnonzero(~found) if todo is None else todo[~found]
        if todo is None:
            self._insert_new(uniq, sums)
        elif todo.size:
            self._insert_new(uniq[todo], sums[todo])
        return uniq, totals


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


class HeapTimerState(_HeapState):
    """Event-time timers: a set of ``(key, timestamp)`` pairs (registering one twice
    keeps one), kept sorted by timestamp, then key, so the timers a watermark passes
    are a prefix. ``put(keys, times)`` registers, ``get(keys)`` gives each key's
    earliest timer, ``clear(keys)`` drops every timer of the keys,
    :meth:`pop_until` takes the due ones. Timers are keyed state: snapshotted,
    restored and redistributed by key group like the other kinds.

    New timers wait in a tail, merged (one sort) when timers are read.
    """

    kind = "timers"

    def __init__(self, backend: HeapKeyedStateBackend, name: str, dtype: np.dtype[Any]) -> None:
        super().__init__(backend, name, dtype)
        self._t: Values = np.empty(0, dtype=np.int64)  # sorted by (time, key), unique
        self._k: Keys = np.empty(0, dtype=np.int64)
        self._tail: list[tuple[Keys, Values]] = []

    def _merge(self) -> None:
        if not self._tail:
            return
        keys = np.concatenate([self._k, *(k for k, _ in self._tail)])
        times = np.concatenate([self._t, *(t for _, t in self._tail)])
        self._tail = []
        order = np.lexsort((keys, times))
        keys, times = keys[order], times[order]
        keep = np.ones(keys.size, dtype=np.bool_)
        keep[1:] = (keys[1:] != keys[:-1]) | (times[1:] != times[:-1])
        self._k, self._t = keys[keep], times[keep]

    def put(self, keys: npt.ArrayLike, values: npt.ArrayLike) -> None:
        q = self._keys(keys)
        v = self._values(values, q.size)
        if q.size:
            self._tail.append((q.copy(), v.copy()))
            if self._merge_due(sum(k.size for k, _ in self._tail), self._k.size):
                self._merge()

    def get(self, keys: npt.ArrayLike) -> tuple[Values, npt.NDArray[np.bool_]]:
        """The earliest timer of each key (0 where it has none) and a mask of keys with one."""
        q = self._keys(keys)
        self._merge()
        out = np.zeros(q.size, dtype=np.int64)
        if not self._k.size:
            return out, np.zeros(q.size, dtype=np.bool_)
        # The first row of a key in (time, key) order is its earliest timer.
        by_key = np.argsort(self._k, kind="stable")
        sorted_keys = self._k[by_key]
        pos, found = _find(sorted_keys, q)
        out[found] = self._t[by_key[pos[found]]]
        return out, found

    def clear(self, keys: npt.ArrayLike) -> None:
        q = np.unique(self._keys(keys))
        self._merge()
        keep = ~np.isin(self._k, q)
        self._k, self._t = self._k[keep], self._t[keep]

    def delete(self, keys: npt.ArrayLike, times: npt.ArrayLike) -> None:
        """Drops the timers ``(keys[i], times[i])`` (absent ones are ignored)."""
        q = self._keys(keys)
        t = self._values(times, q.size)
        self._merge()
        if not q.size or not self._k.size:
            return
        # Mark the pairs to drop by sorting them in among the timers.
        keys = np.concatenate([self._k, q])
        allt = np.concatenate([self._t, t])
        mine = np.concatenate([np.ones(self._k.size, np.bool_), np.zeros(q.size, np.bool_)])
        order = np.lexsort((~mine, keys, allt))  # per pair: the timer, then the drops
        k, tt, m = keys[order], allt[order], mine[order]
        same_next = np.zeros(k.size, dtype=np.bool_)
        same_next[:-1] = (k[1:] == k[:-1]) & (tt[1:] == tt[:-1]) & ~m[1:]
        keep = m & ~same_next
        self._k, self._t = k[keep], tt[keep]

    def pop_until(self, timestamp: int) -> tuple[Keys, Values]:
        """Removes and returns every timer at or before ``timestamp``, in timestamp
        order (ties by key)."""
        self._merge()
        n = int(np.searchsorted(self._t, timestamp, side="right"))
        keys, times = self._k[:n], self._t[:n]
        self._k, self._t = self._k[n:], self._t[n:]
        return keys, times

    def __len__(self) -> int:
        self._merge()
        return int(self._k.size)

    def items(self) -> tuple[Keys, Values]:
        """Every timer as ``(key, timestamp)``, sorted by key, then timestamp, as copies."""
        self._merge()
        order = np.lexsort((self._t, self._k))
        return self._k[order], self._t[order]

    def _load(self, keys: Keys, values: Values) -> None:
        if keys.size:
            self._tail.append((keys, values.astype(np.int64, copy=False)))

    def nbytes(self) -> int:
        return self._k.nbytes + self._t.nbytes + sum(k.nbytes + t.nbytes for k, t in self._tail)


_STATE_CLASSES: Final[dict[str, type[_HeapState]]] = {
    "value": HeapValueState,
    "sum": HeapSumState,
    "list": HeapListState,
    "timers": HeapTimerState,
}
