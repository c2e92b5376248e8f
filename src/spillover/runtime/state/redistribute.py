"""Operator state redistribution on rescale: even splits and union."""

from __future__ import annotations

from collections.abc import Sequence

from spillover.errors import (
    ConfigError,
)
from spillover.runtime.state.heap import (
    T,
)

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
