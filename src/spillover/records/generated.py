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


FillLayout = tuple[int, int, int, int, int]
"""Byte offsets of ``partition``, ``seq``, ``key`` and ``payload``, and the payload's
length, in a record dtype (:func:`fill_layout`)."""


def fill_layout(dtype: np.dtype[Any]) -> FillLayout:
    """Where :func:`fill_generated` writes in records of ``dtype`` (fields ``partition``
    i4, ``seq`` i8, ``key`` i8, ``payload`` S<n>; others are left alone): worked out
    once per dtype, not per batch."""
    fields: dict[str, Any] = dict(dtype.fields or {})
    want = {"partition": "<i4", "seq": "<i8", "key": "<i8"}
    if any(f not in fields or fields[f][0] != np.dtype(d) for f, d in want.items()) or (
        "payload" not in fields or fields["payload"][0].kind != "S"
    ):
        raise ValueError(f"records to generate need {want} and an S payload, got {dtype}")
    payload = fields["payload"]
    return (
        fields["partition"][1],
        fields["seq"][1],
        fields["key"][1],
        payload[1],
        payload[0].itemsize,
    )


def fill_generated(
    out: npt.NDArray[Any],
    parts: _I64,
    starts: _I64,
    counts: _I64,
    seed_mix: int,
    keys: int,
    pattern: npt.NDArray[np.uint8],
    layout: FillLayout | None = None,
) -> None:
    """Fills the records of ``out`` block after block: ``counts[b]`` records of
    partition ``parts[b]``, seq counting up from ``starts[b]``, each keyed
    ``splitmix64(seq + partition * 0x9E3779B97F4A7C15 + seed_mix) % keys`` (``keys`` 0:
    the key field is left alone) and with the payload ``pattern[seq % 26:]``.
    ``layout`` is :func:`fill_layout` of ``out.dtype`` (None: worked out here; the
    native side checks that it fits the records). One pass in C, the GIL released
    from ``NOGIL_MIN_BYTES``."""
    if layout is None:
        layout = fill_layout(out.dtype)
    _records.generate_fill(out, layout, parts, starts, counts, seed_mix, keys, pattern)
