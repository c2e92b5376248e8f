"""What a filtering replay keeps of old channels' records, as one typed value.

A :class:`~spillover.rescale.retriever.FilteringRetriever` keeps every record
(:class:`KeepAll`), those of a key-group range (:class:`KeyGroupFilter`), or those a
custom partitioner sends to one subtask (:class:`PartitionerFilter`, possibly several
such choices that must all hold). A checkpoint taken during a rescaled replay records
the filter beside the pieces it references; restoring them at yet another
parallelism keeps what both filters keep (:func:`compose`). ``to_dict``/
:func:`filter_from_dict` are the JSON shape docs/format.md gives ("References to
older state files"); nothing else reads the dicts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from spillover.errors import FormatError

__all__ = [
    "Filter",
    "KeepAll",
    "KeyGroupFilter",
    "PartitionerChoice",
    "PartitionerFilter",
    "compose",
    "filter_from_dict",
]


@dataclass(frozen=True, slots=True)
class KeepAll:
    """Every record is kept (whole old channels, repacked)."""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "none"}


@dataclass(frozen=True, slots=True)
class KeyGroupFilter:
    """Records whose int64 key at ``key_offset`` falls in key groups ``start..end``."""

    start: int
    end: int
    max_parallelism: int
    key_offset: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "key_groups",
            "start": self.start,
            "end": self.end,
            "max_parallelism": self.max_parallelism,
            "key_offset": self.key_offset,
        }


@dataclass(frozen=True, slots=True)
class PartitionerChoice:
    """Records the partitioner ``name`` sends to ``index`` of ``parallelism``, by the
    int64 key at ``key_offset``."""

    name: str
    index: int
    parallelism: int
    key_offset: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "index": self.index,
            "parallelism": self.parallelism,
            "key_offset": self.key_offset,
        }


@dataclass(frozen=True, slots=True)
class PartitionerFilter:
    """Records every one of ``choices`` keeps (one, or a composition of several)."""

    choices: tuple[PartitionerChoice, ...]

    def __post_init__(self) -> None:
        if not self.choices:
            raise FormatError("a partitioner filter needs at least one choice")

    @property
    def names(self) -> frozenset[str]:
        """The partitioners it applies (a restore refuses another one)."""
        return frozenset(c.name for c in self.choices)

    def to_dict(self) -> dict[str, Any]:
        if len(self.choices) == 1:
            return {"kind": "partitioner", **self.choices[0].to_dict()}
        return {"kind": "partitioner", "all": [c.to_dict() for c in self.choices]}


Filter = KeepAll | KeyGroupFilter | PartitionerFilter
"""What a filtering replay keeps."""


def _choice(d: Mapping[str, Any]) -> PartitionerChoice:
    return PartitionerChoice(
        str(d["name"]), int(d["index"]), int(d["parallelism"]), int(d["key_offset"])
    )


def filter_from_dict(d: Mapping[str, Any]) -> Filter:
    """The filter a reference records; :class:`FormatError` when it is malformed."""
    try:
        kind = d["kind"]
        if kind == "none":
            return KeepAll()
        if kind == "key_groups":
            return KeyGroupFilter(
                int(d["start"]), int(d["end"]), int(d["max_parallelism"]), int(d["key_offset"])
            )
        if kind == "partitioner":
            return PartitionerFilter(tuple(_choice(c) for c in d.get("all", [d])))
    except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as e:
        raise FormatError("malformed channel-state reference filter", detail=str(e)) from e
    raise FormatError("unknown channel-state reference filter", detail=f"kind {kind!r}")


def compose(old: Filter, new: Filter | None) -> Filter | None:
    """The filter keeping what both keep (``new`` None: what ``old`` keeps); None when
    nothing can pass. Filters of one edge are of one kind (its kind never changes)."""
    if new is None or isinstance(new, KeepAll):
        return old
    if isinstance(old, KeepAll):
        return new
    if isinstance(old, KeyGroupFilter) and isinstance(new, KeyGroupFilter):
        start, end = max(old.start, new.start), min(old.end, new.end)
        return None if end < start else replace(old, start=start, end=end)
    if isinstance(old, PartitionerFilter) and isinstance(new, PartitionerFilter):
        return PartitionerFilter(old.choices + new.choices)
    raise FormatError(
        "a reference's filter does not fit the edge", detail=f"{old.to_dict()} and {new.to_dict()}"
    )
