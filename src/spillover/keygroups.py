"""Key groups, bit-compatible with Flink's ``KeyGroupRangeAssignment``.

A key's group is ``murmur(javaHashCode(key)) % max_parallelism``, where
``murmur`` is Flink's ``MathUtils.murmurHash``; key group ``kg`` belongs to
operator ``kg * parallelism // max_parallelism``. A key therefore lands on the
same subtask here as in a Flink job with the same max parallelism.

Java hash codes by key type:

* ``int32``: the value (``Integer.hashCode``);
* ``int64``: ``(int)(v ^ (v >>> 32))`` (``Long.hashCode``);
* ``str``: ``String.hashCode`` over UTF-16 code units (a character above
  U+FFFF counts as its surrogate pair);
* ``bytes``: ``java.util.Arrays.hashCode(byte[])`` with signed bytes. Flink
  itself refuses arrays as keys (their ``hashCode`` is identity-based); this is
  spillover's convention, stable across versions.

A Python ``int`` key hashes as ``int32`` when it fits in 32 signed bits and as
``int64`` otherwise; pass ``key_type`` to force one (a Java ``Long`` key of
value 5 hashes like an ``Integer`` 5 anyway, so only negative values need
care: ``Long.hashCode(-1) == 0`` while ``Integer.hashCode(-1) == -1``).

The scalar functions here are plain Python (and serve as the reference); the
``key_groups*`` functions are the native batch versions, and :func:`add_key_sums`
adds a batch's keys into sums kept by key (keyed state), checking their key groups.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Final, Literal

import numpy as np
import numpy.typing as npt

from spillover._native import _records
from spillover.errors import ConfigError

__all__ = [
    "ADD_KEY_SUMS_MAX_KEYS",
    "DEFAULT_LOWER_BOUND_MAX_PARALLELISM",
    "UPPER_BOUND_MAX_PARALLELISM",
    "KeyGroupRange",
    "KeyType",
    "add_key_sum_rows",
    "add_key_sums",
    "assign_to_key_group",
    "check_max_parallelism",
    "compute_default_max_parallelism",
    "compute_key_group_for_key_hash",
    "java_hash_code",
    "key_group_range_for_operator",
    "key_group_table",
    "key_groups",
    "key_groups_from_hashes",
    "key_groups_packed",
    "murmur_hash",
    "operator_index_for_key_group",
]

KeyType = Literal["int32", "int64", "str", "bytes"]

UPPER_BOUND_MAX_PARALLELISM: Final = 1 << 15
"""Largest max parallelism Flink allows (32768)."""

DEFAULT_LOWER_BOUND_MAX_PARALLELISM: Final = 1 << 7
"""Smallest default max parallelism Flink picks (128)."""

_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_M32 = 0xFFFFFFFF


class KeyGroupRange:
    """The key groups ``start .. end``, both inclusive (as in Flink); empty when ``end < start``.

    All empty ranges are equal (and normalised to ``KeyGroupRange(0, -1)``).
    """

    __slots__ = ("end", "start")

    start: int
    end: int

    def __init__(self, start: int, end: int) -> None:
        if start < 0:
            raise ConfigError(f"key group range start must be >= 0, got {start}")
        if end < start:
            start, end = 0, -1
        self.start = start
        self.end = end

    @classmethod
    def empty(cls) -> KeyGroupRange:
        """The range with no key group."""
        return cls(0, -1)

    def __len__(self) -> int:
        return self.end - self.start + 1

    def __contains__(self, key_group: object) -> bool:
        return isinstance(key_group, int) and self.start <= key_group <= self.end

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end + 1))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KeyGroupRange):
            return NotImplemented
        return (self.start, self.end) == (other.start, other.end)

    def __hash__(self) -> int:
        return hash((self.start, self.end))

    def __repr__(self) -> str:
        return f"KeyGroupRange({self.start}, {self.end})"

    def intersection(self, other: KeyGroupRange) -> KeyGroupRange:
        """The key groups in both ranges (possibly empty)."""
        return KeyGroupRange(max(self.start, other.start), min(self.end, other.end))


def check_max_parallelism(max_parallelism: int) -> None:
    """Raises :class:`ConfigError` unless ``1 <= max_parallelism <= 32768``."""
    if not 1 <= max_parallelism <= UPPER_BOUND_MAX_PARALLELISM:
        raise ConfigError(
            f"max parallelism must be in 1..{UPPER_BOUND_MAX_PARALLELISM}, got {max_parallelism}",
            hint="Flink's pipeline.max-parallelism has the same bounds",
        )


def _check_parallelism(max_parallelism: int, parallelism: int) -> None:
    check_max_parallelism(max_parallelism)
    if not 1 <= parallelism <= max_parallelism:
        raise ConfigError(
            f"parallelism must be in 1..max parallelism ({max_parallelism}), got {parallelism}"
        )


def murmur_hash(code: int) -> int:
    """Flink's ``MathUtils.murmurHash(int)``: a non-negative int32 from a Java hash code."""
    h = (code & _M32) * 0xCC9E2D51 & _M32
    h = ((h << 15) | (h >> 17)) & _M32
    h = h * 0x1B873593 & _M32
    h = ((h << 13) | (h >> 19)) & _M32
    h = (h * 5 + 0xE6546B64) & _M32
    h ^= 4
    h ^= h >> 16
    h = h * 0x85EBCA6B & _M32
    h ^= h >> 13
    h = h * 0xC2B2AE35 & _M32
    h ^= h >> 16
    if h < 0x80000000:
        return h
    # Java returns -h for a negative int, and 0 for Integer.MIN_VALUE.
    return (1 << 32) - h if h != 0x80000000 else 0


def _to_int32(v: int) -> int:
    v &= _M32
    return v - (1 << 32) if v & 0x80000000 else v


def _infer_key_type(key: object) -> KeyType:
    if isinstance(key, bool):
        raise TypeError("bool keys are ambiguous; pass key_type or hash the key yourself")
    if isinstance(key, np.integer):
        return "int32" if key.dtype.itemsize <= 4 and key.dtype.kind == "i" else "int64"
    if isinstance(key, int):
        return "int32" if _INT32_MIN <= key <= _INT32_MAX else "int64"
    if isinstance(key, str):
        return "str"
    if isinstance(key, bytes | bytearray | memoryview):
        return "bytes"
    raise TypeError(
        f"no Java hash code for keys of type {type(key).__name__}; compute the hash yourself "
        "and use compute_key_group_for_key_hash()"
    )


def java_hash_code(key: object, key_type: KeyType | None = None) -> int:
    """The Java ``hashCode()`` (an int32) a JVM would compute for ``key``; see the module doc."""
    kt = key_type or _infer_key_type(key)
    if kt == "int32" or kt == "int64":
        if not isinstance(key, int | np.integer) or isinstance(key, bool):
            raise TypeError(f"key_type {kt!r} needs an int key, got {type(key).__name__}")
        v = int(key)
        lo, hi = (_INT32_MIN, _INT32_MAX) if kt == "int32" else (_INT64_MIN, _INT64_MAX)
        if not lo <= v <= hi:
            raise ValueError(f"key {v} does not fit in {kt}")
        if kt == "int32":
            return v
        u = v & 0xFFFFFFFFFFFFFFFF
        return _to_int32(u ^ (u >> 32))
    if kt == "str":
        if not isinstance(key, str):
            raise TypeError(f"key_type 'str' needs a str key, got {type(key).__name__}")
        h = 0
        for ch in key:
            cp = ord(ch)
            if cp < 0x10000:  # one UTF-16 unit (a lone surrogate stays one unit, as in Java)
                h = (31 * h + cp) & _M32
            else:
                cp -= 0x10000
                h = (31 * h + (0xD800 | cp >> 10)) & _M32
                h = (31 * h + (0xDC00 | cp & 0x3FF)) & _M32
        return _to_int32(h)
    if kt == "bytes":
        if not isinstance(key, bytes | bytearray | memoryview):
            raise TypeError(f"key_type 'bytes' needs a bytes-like key, got {type(key).__name__}")
        h = 1
        for b in bytes(key):
            h = (31 * h + (b - 256 if b > 127 else b)) & _M32
        return _to_int32(h)
    raise ValueError(f"unknown key type {kt!r}; expected int32, int64, str or bytes")


def compute_key_group_for_key_hash(hash_code: int, max_parallelism: int) -> int:
    """Key group of a Java hash code (an int32): ``murmur_hash(hash_code) % max_parallelism``."""
    check_max_parallelism(max_parallelism)
    if not _INT32_MIN <= hash_code <= _INT32_MAX:
        raise ValueError(f"a Java hash code is an int32, got {hash_code}")
    return murmur_hash(hash_code) % max_parallelism


def assign_to_key_group(key: object, max_parallelism: int, key_type: KeyType | None = None) -> int:
    """Key group of ``key``, as Flink assigns it for the same key value."""
    return compute_key_group_for_key_hash(java_hash_code(key, key_type), max_parallelism)


def operator_index_for_key_group(max_parallelism: int, parallelism: int, key_group: int) -> int:
    """Index of the subtask (of ``parallelism``) that owns ``key_group``."""
    _check_parallelism(max_parallelism, parallelism)
    if not 0 <= key_group < max_parallelism:
        raise ConfigError(f"key group must be in 0..{max_parallelism - 1}, got {key_group}")
    return key_group * parallelism // max_parallelism


def key_group_range_for_operator(
    max_parallelism: int, parallelism: int, operator_index: int
) -> KeyGroupRange:
    """The key groups subtask ``operator_index`` of ``parallelism`` owns (Flink's rounding)."""
    _check_parallelism(max_parallelism, parallelism)
    if not 0 <= operator_index < parallelism:
        raise ConfigError(f"operator index must be in 0..{parallelism - 1}, got {operator_index}")
    start = (operator_index * max_parallelism + parallelism - 1) // parallelism
    end = ((operator_index + 1) * max_parallelism - 1) // parallelism
    return KeyGroupRange(start, end)


def compute_default_max_parallelism(parallelism: int) -> int:
    """Flink's default max parallelism: 1.5 x parallelism rounded up to a power of 2, clamped
    to 128..32768."""
    if not 1 <= parallelism <= UPPER_BOUND_MAX_PARALLELISM:
        raise ConfigError(
            f"parallelism must be in 1..{UPPER_BOUND_MAX_PARALLELISM}, got {parallelism}"
        )
    target = parallelism + parallelism // 2
    power = 1 << (target - 1).bit_length()
    return min(max(power, DEFAULT_LOWER_BOUND_MAX_PARALLELISM), UPPER_BOUND_MAX_PARALLELISM)


def key_group_table(max_parallelism: int, ranges: Sequence[KeyGroupRange]) -> npt.NDArray[np.int32]:
    """Key group -> index of the range holding it (-1 for none): a demux routing table.

    ``key_group_table(maxp, [key_group_range_for_operator(maxp, p, i) for i in range(p)])``
    maps every key group to its subtask at parallelism ``p``.
    """
    check_max_parallelism(max_parallelism)
    table = np.full(max_parallelism, -1, dtype=np.int32)
    for i, r in enumerate(ranges):
        if len(r) and r.end >= max_parallelism:
            raise ConfigError(f"{r!r} exceeds max parallelism {max_parallelism}")
        if (table[r.start : r.end + 1] >= 0).any():
            raise ConfigError(f"{r!r} overlaps an earlier range")
        table[r.start : r.end + 1] = i
    return table


# ---- native batch versions ----


def key_groups(keys: npt.ArrayLike, max_parallelism: int) -> npt.NDArray[np.int32]:
    """Key group of every key of an int32 or int64 array (native; other ints are refused).

    The dtype decides the Java type: int32 hashes like ``Integer``, int64 like ``Long``.
    """
    check_max_parallelism(max_parallelism)
    arr = np.asarray(keys)
    if arr.dtype == np.int32:
        return _records.key_groups_int32(np.ascontiguousarray(arr).ravel(), max_parallelism)
    if arr.dtype == np.int64:
        return _records.key_groups_int64(np.ascontiguousarray(arr).ravel(), max_parallelism)
    raise TypeError(f"keys must be an int32 or int64 array, got {arr.dtype}")


def key_groups_from_hashes(hashes: npt.ArrayLike, max_parallelism: int) -> npt.NDArray[np.int32]:
    """Key group of every Java hash code of an int32 array (native)."""
    check_max_parallelism(max_parallelism)
    arr = np.asarray(hashes)
    if arr.dtype != np.int32:
        raise TypeError(f"hash codes must be an int32 array, got {arr.dtype}")
    return _records.key_groups_from_hashes(np.ascontiguousarray(arr).ravel(), max_parallelism)


def key_groups_packed(
    data: object,
    offsets: npt.ArrayLike,
    max_parallelism: int,
    key_type: Literal["str", "bytes"] = "str",
) -> npt.NDArray[np.int32]:
    """Key group of each key ``data[offsets[i]:offsets[i+1]]`` (native).

    ``data`` is any contiguous buffer holding the keys back to back (UTF-8 for
    ``str``; malformed UTF-8 decodes as Java's decoder does, one U+FFFD per
    maximal bad subsequence); ``offsets`` has one more entry than there are
    keys, like an Arrow string array's offsets.
    """
    check_max_parallelism(max_parallelism)
    kind = _packed_kind(key_type)
    off = np.ascontiguousarray(offsets, dtype=np.int64)
    return _records.key_groups_packed(_byte_view(data), off, kind, max_parallelism)


_I64 = npt.NDArray[np.int64]

ADD_KEY_SUMS_MAX_KEYS: Final[int] = _records.SUMS_MAX_KEYS
"""Most keys one :func:`add_key_sums` call takes (2**31)."""

KEY_SUMS_INDEX_MAX_KEYS: Final[int] = _records.SUMS_INDEX_MAX_KEYS
"""Most keys a run's hash index (:func:`key_sums_index`) takes (2**32 - 2)."""


def key_sums_index(keys: _I64) -> npt.NDArray[np.uint32]:
    """The hash index of a run's keys (sorted, distinct, contiguous int64) for
    :func:`add_key_sums`: a uint32 table of at least 1.5 slots per key, each 0 or 1 +
    a key's position, so that a key is found by one probe sequence, not a binary
    search. It describes the keys as they are: build a new one when they change."""
    return _records.sums_index(keys)


def add_key_sums(
    keys: _I64,
    values: _I64 | None,
    main: tuple[_I64, _I64],
    delta: tuple[_I64, _I64],
    max_parallelism: int = 0,
    key_group_range: KeyGroupRange | None = None,
    indexes: tuple[npt.NDArray[np.uint32] | None, npt.NDArray[np.uint32] | None] = (None, None),
    ascending: bool = True,
) -> tuple[_I64, _I64, _I64] | None:
    """Adds ``values[i]`` (1 each when None: a count) to the sum of ``keys[i]`` in one
    native pass: a hash aggregate of the batch, then one search per distinct key.

    ``main`` and ``delta`` are runs of ``(keys, sums)``, keys sorted, distinct and
    disjoint between the two; a key's batch sum is added in place in the run that
    holds it (int64 wraps). ``indexes`` are the runs' hash indexes
    (:func:`key_sums_index` of their keys as they are, or None: a binary search).
    Returns the distinct keys (ascending; with ``ascending`` false in the order the
    batch first has them, which spares a sort), their new sums (a key in neither run:
    its batch sum) and the indices of the keys in neither run, ascending, for the
    caller to insert. ``keys`` and ``values`` are int64 arrays, strided ones
    (a field of a record batch) read in place. With a ``key_group_range`` (of a valid
    ``max_parallelism``), returns None and changes nothing if a key's group lies
    outside it. The GIL is released from ``NOGIL_MIN_SUMS_KEYS`` (4,096) keys.
    """
    got = _sums_add(keys, values, main, delta, max_parallelism, key_group_range, indexes, ascending)
    if got is None:
        return None
    out, n_out, n_new = got
    return out[0, :n_out], out[1, :n_out], out[2, :n_new]


def _sums_add(
    keys: _I64,
    values: _I64 | None,
    main: tuple[_I64, _I64],
    delta: tuple[_I64, _I64],
    max_parallelism: int,
    key_group_range: KeyGroupRange | None,
    indexes: tuple[npt.NDArray[np.uint32] | None, npt.NDArray[np.uint32] | None],
    ascending: bool,
    rows: bool = False,
) -> tuple[_I64, int, int] | None:
    """The native pass of :func:`add_key_sums` (``rows``: of :func:`add_key_sum_rows`)."""
    lo, hi = (0, 0) if key_group_range is None else (key_group_range.start, key_group_range.end)
    maxp = 0 if key_group_range is None else max_parallelism
    m, d = main, delta
    return _records.sums_add(
        keys, values, maxp, lo, hi, m[0], m[1], d[0], d[1], *indexes, ascending, rows
    )


def add_key_sum_rows(
    keys: _I64,
    values: _I64 | None,
    main: tuple[_I64, _I64],
    delta: tuple[_I64, _I64],
    max_parallelism: int = 0,
    key_group_range: KeyGroupRange | None = None,
    indexes: tuple[npt.NDArray[np.uint32] | None, npt.NDArray[np.uint32] | None] = (None, None),
    ascending: bool = True,
) -> tuple[_I64, _I64] | None:
    """:func:`add_key_sums`, with the distinct keys and their new sums as rows: returns
    ``(rows, new)``, ``rows`` a C-contiguous ``(n, 2)`` int64 array of ``(key, sum)``
    written by the same native pass, so that a record batch of two int64 fields is
    ``rows.view(dtype)`` with no copy (a keyed count's output: two field assignments
    of a batch's length each let the GIL go and wait to take it back), and ``new``
    the indices of the rows whose keys are in neither run."""
    got = _sums_add(
        keys, values, main, delta, max_parallelism, key_group_range, indexes, ascending, True
    )
    if got is None:
        return None
    out, n_out, n_new = got
    n = len(keys)
    return out[: 2 * n_out].reshape(n_out, 2), out[2 * n : 2 * n + n_new]


def _packed_kind(key_type: str) -> int:
    if key_type == "str":
        return _records.KEY_STR
    if key_type == "bytes":
        return _records.KEY_BYTES
    raise ValueError(f"key_type must be 'str' or 'bytes', got {key_type!r}")


def _byte_view(buffer: object) -> memoryview:
    """A flat unsigned-byte view of any contiguous buffer, without a copy."""
    mv = buffer if isinstance(buffer, memoryview) else memoryview(buffer)  # type: ignore[arg-type]
    if mv.format == "B" and mv.ndim == 1:
        return mv
    if not mv.c_contiguous:
        raise ValueError("buffer must be contiguous")
    return mv.cast("B")
