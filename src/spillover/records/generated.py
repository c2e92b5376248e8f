"""Generated records in one native pass: the batches of ``GeneratorSource``."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from spillover._native import _records

_I64 = npt.NDArray[np.int64]


def letter_pattern(payload_bytes: int) -> npt.NDArray[np.uint8]:
    """The letters ``A..Z`` repeated over ``26 + payload_bytes`` bytes: the payload of
    a record of ``seq`` is its ``payload_bytes`` bytes from ``seq % 26``."""
    return (np.arange(26 + payload_bytes) % 26 + 65).astype(np.uint8)


def fill_generated(
    out: npt.NDArray[Any],
    parts: _I64,
    starts: _I64,
    counts: _I64,
    seed_mix: int,
    keys: int,
    pattern: npt.NDArray[np.uint8],
) -> None:
    """Fills the records of ``out`` (fields ``partition`` i4, ``seq`` i8, ``key`` i8,
    ``payload`` S<n>; others untouched) block after block: ``counts[b]`` records of
    partition ``parts[b]``, seq counting up from ``starts[b]``, each keyed
    ``splitmix64(seq + partition * 0x9E3779B97F4A7C15 + seed_mix) % keys`` (``keys`` 0:
    the key field is left alone) and with the payload ``pattern[seq % 26:]``. One pass
    in C, the GIL released from ``NOGIL_MIN_BYTES``."""
    fields: dict[str, Any] = dict(out.dtype.fields or {})
    want = {"partition": "<i4", "seq": "<i8", "key": "<i8"}
    if any(f not in fields or fields[f][0] != np.dtype(d) for f, d in want.items()) or (
        "payload" not in fields or fields["payload"][0].kind != "S"
    ):
        raise ValueError(f"records to generate need {want} and an S payload, got {out.dtype}")
    payload = fields["payload"]
    offsets = (
        fields["partition"][1],
        fields["seq"][1],
        fields["key"][1],
        payload[1],
        payload[0].itemsize,
    )
    _records.generate_fill(out, offsets, parts, starts, counts, seed_mix, keys, pattern)
