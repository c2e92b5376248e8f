"""Stubs of the native record, key-group and filter module (see _records.pyx)."""

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer as _BufferLike

_U8 = npt.NDArray[np.uint8]
_I32 = npt.NDArray[np.int32]
_I64 = npt.NDArray[np.int64]
_U32 = npt.NDArray[np.uint32]

NOGIL_MIN_BYTES: int
NOGIL_MIN_SUMS_KEYS: int
NOGIL_MIN_HASH_BYTES: int
NOGIL_MIN_SCAN_BYTES: int
KEY_INT32: int
KEY_INT64: int
KEY_STR: int
KEY_BYTES: int
MAX_RECORD_LENGTH: int
SUMS_MAX_KEYS: int
SUMS_INDEX_MAX_KEYS: int

def key_groups_from_hashes(hashes: _I32, max_parallelism: int) -> _I32: ...
def key_groups_int32(keys: _I32, max_parallelism: int) -> _I32: ...
def key_groups_int64(keys: _I64, max_parallelism: int) -> _I32: ...
def java_hashes_packed(data: _BufferLike, offsets: _I64, kind: int) -> _I32: ...
def key_groups_packed(
    data: _BufferLike, offsets: _I64, kind: int, max_parallelism: int
) -> _I32: ...
def sums_add(
    keys: _I64,
    values: _I64 | None,
    max_parallelism: int,
    kg_lo: int,
    kg_hi: int,
    main_keys: _I64,
    main_sums: _I64,
    delta_keys: _I64,
    delta_sums: _I64,
    main_index: _U32 | None = None,
    delta_index: _U32 | None = None,
    ascending: bool = True,
    rows: bool = False,
) -> tuple[_I64, int, int] | None: ...
def sums_index(keys: _I64) -> _U32: ...
def route_frames(
    channel_ids: _U32, lengths: _I64, data_types: _U8, lut: _I32, n_streams: int
) -> tuple[_I32, int, _I64, _I64, bool]: ...
def scan_records(buf: _BufferLike, max_len: int) -> tuple[_I64, _I64, int]: ...
def key_groups_of_buffer(
    buf: _BufferLike, max_parallelism: int, kind: int, offset: int, prefixed: bool, max_len: int
) -> tuple[_I32, int]: ...

class Packer:
    def __init__(self, buffer_size: int, n_outputs: int, whole_records: bool = False) -> None: ...
    def put(self, output: int, record: object) -> list[tuple[int, _U8]]: ...
    def put_batch(self, output: int, records: object, offsets: _I64) -> list[tuple[int, _U8]]: ...
    def put_fixed(self, output: int, records: object, width: int) -> list[tuple[int, _U8]]: ...
    def put_frames(
        self, data: object, offsets: _I64, lengths: _I64, outputs: npt.NDArray[np.int32]
    ) -> list[tuple[int, _U8]]: ...
    def flush(self) -> list[tuple[int, _U8]]: ...
    def pending_bytes(self) -> int: ...
    def spares(self) -> int: ...

class Reassembler:
    def __init__(self, max_len: int) -> None: ...
    @property
    def pending_bytes(self) -> int: ...
    def pending_raw(self) -> bytes: ...
    def feed(self, buffer: object) -> tuple[_U8 | None, _I64, _I64]: ...
    def feed_fixed(self, buffer: object, width: int) -> tuple[_U8 | None, int, int, int]: ...
    def reset(self) -> None: ...

class Demux:
    def __init__(
        self,
        table: _I32,
        n_outputs: int,
        buffer_size: int,
        kind: int,
        offset: int,
        prefixed: bool,
        max_len: int,
        whole_records: bool = False,
    ) -> None: ...
    @property
    def routed(self) -> int: ...
    @property
    def dropped(self) -> int: ...
    def pending(self) -> dict[object, int]: ...
    def pending_output_bytes(self) -> int: ...
    def push(
        self, buffer: object, channel: object, selector: Callable[[bytes], int] | None
    ) -> list[tuple[int, _U8]]: ...
    def push_frames(
        self,
        data: object,
        offsets: _I64,
        lengths: _I64,
        slots: npt.NDArray[np.int32],
        channels: list[object],
    ) -> list[tuple[int, _U8]]: ...
    def push_rows(self, rows: npt.NDArray[np.uint8]) -> list[tuple[int, _U8]]: ...
    def set_keep_all(self, keep_all: bool) -> None: ...
    def flush(self) -> list[tuple[int, _U8]]: ...
    def drop_pending(self, channel: object) -> None: ...

def live_handles() -> int:
    """Native handles of this extension alive now; -1 when not a debug build."""

def generate_fill(
    out: npt.NDArray[np.void],
    offsets: tuple[int, int, int, int, int],
    parts: _I64,
    starts: _I64,
    counts: _I64,
    seed_mix: int,
    keys: int,
    pattern: _U8,
) -> None: ...
