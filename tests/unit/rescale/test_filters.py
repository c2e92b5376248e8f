"""Typed filters and references: their JSON is the shape docs/format.md gives, and
every value survives the round trip through the checkpoint metadata."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spillover.errors import FormatError
from spillover.rescale import (
    Filter,
    KeepAll,
    KeyGroupFilter,
    PartitionerChoice,
    PartitionerFilter,
    Piece,
    Reference,
    compose,
    filter_from_dict,
)
from spillover.storage import GateKind, GateStateHandle

ints = st.integers(0, 2**31 - 1)
choices = st.builds(PartitionerChoice, st.text(min_size=1, max_size=20), ints, ints, ints)
filters: st.SearchStrategy[Filter] = st.one_of(
    st.just(KeepAll()),
    st.builds(KeyGroupFilter, ints, ints, ints, ints),
    st.builds(PartitionerFilter, st.lists(choices, min_size=1, max_size=3).map(tuple)),
)


def _handle(uri: str, channel: int) -> GateStateHandle:
    return GateStateHandle(
        uri=uri,
        gate_id=0,
        gate_kind=GateKind.INPUT,
        checkpoint_id=1,
        subtask_index=0,
        file_id="01" * 16,
        size=100,
        frame_count=1,
        raw_bytes=10,
        stored_bytes=10,
        channels={channel: (1, 10)},
        channel_ranges={channel: (40, 74)},
    )


pieces = st.builds(
    lambda uri, ch, skip: Piece(_handle(uri, ch), ch, skip),
    st.text("abc/", min_size=1, max_size=10),
    st.integers(0, 7),
    st.integers(0, 10),
)
references = st.builds(
    Reference,
    st.integers(0, 3),
    st.integers(0, 7),
    st.lists(pieces, max_size=3).map(tuple),
    st.none() | filters,
)


@given(filters)
def test_a_filter_round_trips_through_json(flt: Filter) -> None:
    assert filter_from_dict(json.loads(json.dumps(flt.to_dict()))) == flt


@given(references)
def test_a_reference_round_trips_through_json(ref: Reference) -> None:
    assert Reference.from_dict(json.loads(json.dumps(ref.to_dict()))) == ref


def test_the_json_is_the_documented_shape() -> None:
    assert KeepAll().to_dict() == {"kind": "none"}
    assert KeyGroupFilter(0, 42, 128, 8).to_dict() == {
        "kind": "key_groups",
        "start": 0,
        "end": 42,
        "max_parallelism": 128,
        "key_offset": 8,
    }
    one = PartitionerChoice("m.mod", 1, 3, 0)
    assert PartitionerFilter((one,)).to_dict() == {
        "kind": "partitioner",
        "name": "m.mod",
        "index": 1,
        "parallelism": 3,
        "key_offset": 0,
    }
    assert PartitionerFilter((one, one)).to_dict() == {
        "kind": "partitioner",
        "all": [one.to_dict(), one.to_dict()],
    }
    ref = Reference(0, 2, (Piece(_handle("/f", 2), 2, 5),))
    assert set(ref.to_dict()) == {"gate", "channel", "pieces"}  # no filter: none written


@given(filters, filters)
def test_composing_keeps_what_both_keep(a: Filter, b: Filter) -> None:
    try:
        both = compose(a, b)
    except FormatError:
        assert type(a) is not type(b) and KeepAll() not in (a, b)
        return
    if isinstance(a, KeyGroupFilter) and isinstance(b, KeyGroupFilter):
        lo, hi = max(a.start, b.start), min(a.end, b.end)
        assert both == (
            None if hi < lo else KeyGroupFilter(lo, hi, a.max_parallelism, a.key_offset)
        )
    elif isinstance(a, PartitionerFilter) and isinstance(b, PartitionerFilter):
        assert both == PartitionerFilter(a.choices + b.choices)
    else:
        assert both == (b if isinstance(a, KeepAll) else a)


@pytest.mark.parametrize(
    "bad",
    [
        {"kind": "shuffle"},
        {"kind": "key_groups", "start": 0},
        {"kind": "partitioner", "all": []},
        {"kind": "partitioner", "all": [{"name": "x"}]},
        "none",
        {},
    ],
)
def test_a_malformed_filter_is_a_format_error(bad: Any) -> None:
    with pytest.raises(FormatError):
        filter_from_dict(bad)


def test_a_malformed_reference_is_a_format_error() -> None:
    with pytest.raises(FormatError):
        Reference.from_dict({"gate": 0, "channel": 0, "pieces": [{"channel": 1}]})
    with pytest.raises(FormatError):
        Reference.from_dict({"gate": 0, "channel": 0, "pieces": [], "filter": {"kind": 3}})
