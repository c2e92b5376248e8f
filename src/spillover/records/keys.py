"""Keys of records and their Flink-compatible key groups."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from spillover._native import _records
from spillover.errors import ConfigError, CorruptRecordError
from spillover.keygroups import (
    KeyType,
    _byte_view,
    assign_to_key_group,
    check_max_parallelism,
)
from spillover.records.framing import (
    MAX_RECORD_SIZE,
)

# ---- keys ----

_KINDS = {
    "int32": _records.KEY_INT32,
    "int64": _records.KEY_INT64,
    "str": _records.KEY_STR,
    "bytes": _records.KEY_BYTES,
}


@dataclass(frozen=True, slots=True)
class FieldKey:
    """The key is a field of each payload, read natively.

    ``int32``/``int64``: a little-endian integer at byte ``offset``.
    ``str``/``bytes``: with ``length_prefixed`` (default), a 4-byte
    little-endian length then that many bytes (UTF-8 for ``str``) at
    ``offset``; without, the payload from ``offset`` to its end.
    """

    offset: int
    type: KeyType
    length_prefixed: bool = True

    def __post_init__(self) -> None:
        if self.type not in _KINDS:
            raise ConfigError(f"key type must be one of {sorted(_KINDS)}, got {self.type!r}")
        if not 0 <= self.offset < 1 << 31:
            raise ConfigError(f"key offset must be in 0..2**31-1, got {self.offset}")


@dataclass(frozen=True, slots=True)
class SelectorKey:
    """The key is what a Python function returns for a payload (``bytes``).

    The slow path: one Python call per record. The key is hashed as
    :func:`~spillover.keygroups.assign_to_key_group` does, with ``key_type``.
    """

    selector: Callable[[bytes], object]
    key_type: KeyType | None = None


Key = FieldKey | SelectorKey


def _key_group_fn(key: SelectorKey, max_parallelism: int) -> Callable[[bytes], int]:
    sel, kt = key.selector, key.key_type
    return lambda payload: assign_to_key_group(sel(payload), max_parallelism, kt)


def key_groups_of(
    buffer: object, max_parallelism: int, key: Key = FieldKey(0, "int64")
) -> npt.NDArray[np.int32]:
    """Key group (int32) of every record of a buffer that holds whole records only."""
    check_max_parallelism(max_parallelism)
    mv = _byte_view(buffer)
    if isinstance(key, FieldKey):
        kgs, end = _records.key_groups_of_buffer(
            mv, max_parallelism, _KINDS[key.type], key.offset, key.length_prefixed, MAX_RECORD_SIZE
        )
    else:
        offsets, lengths, end = _records.scan_records(mv, MAX_RECORD_SIZE)
        fn = _key_group_fn(key, max_parallelism)
        kgs = np.fromiter(
            (
                fn(bytes(mv[o : o + n]))
                for o, n in zip(offsets.tolist(), lengths.tolist(), strict=True)
            ),
            dtype=np.int32,
            count=len(offsets),
        )
    if end != len(mv):
        raise CorruptRecordError(
            "the buffer does not end on a record boundary",
            detail=f"{len(mv) - end} bytes of an incomplete record at byte {end}",
            hint="use KeyGroupDemux for buffers whose records span buffers",
        )
    return kgs
