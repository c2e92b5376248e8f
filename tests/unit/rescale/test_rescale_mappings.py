"""Rescale mappings against a brute-force model of where each in-flight record belongs.

Each test builds synthetic old in-flight state that is consistent with how the
old job partitioned its records, replays it through the mapping the way the
runtime will (each old channel, input piece then output piece, at the reading
downstream subtask), and compares where every record lands with its true new
owner, computed independently.
"""

from __future__ import annotations

import functools
import pickle
import random
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillover.errors import ConfigError, RescaleError, SpilloverError
from spillover.rescale import (
    FORCE_FORWARD_OPTION,
    ChannelSource,
    EdgeMapping,
    EdgeType,
    Filtering,
    Side,
    broadcast_source,
    key_group_table,
    map_edge,
    replay_owner,
)

ALL_TO_ALL = [EdgeType.KEY_BY, EdgeType.REBALANCE, EdgeType.BROADCAST, EdgeType.CUSTOM]

SCALE_PAIRS = [(1, 2), (2, 3), (3, 7), (4, 8), (20, 21), (12, 7), (7, 2), (5, 2), (3, 5)]
BOTH_WAYS = SCALE_PAIRS + [(b, a) for a, b in SCALE_PAIRS]


def owner_of_key_group(max_p: int, p: int, kg: int) -> int:
    """Brute force: the subtask whose key-group range holds ``kg``, by scanning."""
    owners = [i for i in range(p) if (i * max_p + p - 1) // p <= kg <= ((i + 1) * max_p - 1) // p]
    assert len(owners) == 1
    return owners[0]


def partitioner(key: int, n: int) -> int:
    """A deterministic user partitioner: record key -> channel."""
    return ((key * 2654435761) >> 7) % n


@dataclass(frozen=True)
class Rec:
    """One in-flight record: where it sits in the old job."""

    rid: int
    key: int  # key group for key_by, partitioner key for custom
    side: Side
    old_subtask: int
    old_channel: int


@dataclass(frozen=True)
class Par:
    up_old: int
    down_old: int
    up_new: int
    down_new: int
    max_p: int

    def map(self, et: EdgeType, force: bool = False) -> EdgeMapping:
        return map_edge(
            et,
            old_upstream=self.up_old,
            old_downstream=self.down_old,
            new_upstream=self.up_new,
            new_downstream=self.down_new,
            max_parallelism=self.max_p,
            force=force,
        )


def old_state(et: EdgeType, par: Par, rng: random.Random, n: int) -> list[Rec]:
    """Records in old input and output state, placed as the old job would have placed them."""
    kgs = [rng.randrange(par.max_p) for _ in range(n)]
    if et is EdgeType.KEY_BY:
        # Range boundaries, old and new, are where off-by-one errors live.
        for p in (par.down_old, par.down_new):
            for i in range(p):
                kgs += [(i * par.max_p + p - 1) // p, ((i + 1) * par.max_p - 1) // p]
    recs = []
    for rid, kg in enumerate(kgs):
        u = rng.randrange(par.up_old)
        if et is EdgeType.KEY_BY:
            d = owner_of_key_group(par.max_p, par.down_old, kg)
        elif et is EdgeType.CUSTOM:
            d = partitioner(kg, par.down_old)
        elif et is EdgeType.FORWARD:
            d = u
        else:
            d = rng.randrange(par.down_old)
        side = rng.choice([Side.INPUT, Side.OUTPUT])
        if et is EdgeType.FORWARD:
            recs.append(Rec(rid, kg, side, u, 0))
        elif side is Side.INPUT:
            recs.append(Rec(rid, kg, side, d, u))
        else:
            recs.append(Rec(rid, kg, side, u, d))
    return recs


def true_owner(et: EdgeType, par: Par, rec: Rec) -> int:
    """Brute force: the new downstream subtask that must process ``rec``."""
    if et is EdgeType.KEY_BY:
        return owner_of_key_group(par.max_p, par.down_new, rec.key)
    if et is EdgeType.CUSTOM:
        return partitioner(rec.key, par.down_new)
    # Unkeyed: the documented placement keeps old downstream d's records at d mod P_new.
    old_d = rec.old_subtask if rec.side is Side.INPUT or et is EdgeType.FORWARD else rec.old_channel
    return old_d % par.down_new


def output_piece(et: EdgeType, src: ChannelSource) -> tuple[int, int]:
    """The output piece (upstream, subpartition) of the old channel an input source names."""
    if et is EdgeType.FORWARD:
        return src.old_subtask, 0
    return src.old_channel, src.old_subtask


def replay(m: EdgeMapping, par: Par, recs: list[Rec]) -> dict[int, Counter[int]]:
    """Apply the mapping: rid -> how many times each new downstream subtask receives it.

    A reader of an old channel reads its input piece and its output piece.
    """
    readers: dict[tuple[Side, int, int], list[tuple[int, ChannelSource]]] = {}
    for new, src in m.input:
        readers.setdefault((Side.INPUT, src.old_subtask, src.old_channel), []).append((new, src))
        tail = output_piece(m.edge_type, src)
        readers.setdefault((Side.OUTPUT, *tail), []).append((new, src))
    assert not any(m.output.sources), "new upstream subtasks re-send nothing"
    got: dict[int, Counter[int]] = {r.rid: Counter() for r in recs}
    for r in recs:
        for new, src in readers.get((r.side, r.old_subtask, r.old_channel), []):
            channels = src.route(key_group=r.key, partition=partitioner(r.key, par.down_new))
            got[r.rid][new] += len(channels)
    return got


def check_exactly_once(et: EdgeType, par: Par, m: EdgeMapping, recs: list[Rec]) -> None:
    got = replay(m, par, recs)
    for r in recs:
        assert got[r.rid] == Counter({true_owner(et, par, r): 1}), r


def check_structure(et: EdgeType, par: Par, m: EdgeMapping) -> None:
    """Shape rules a retriever relies on, whatever the records."""
    assert m.output.new_parallelism == par.up_new and m.input.new_parallelism == par.down_new
    # Every old channel is read whole (input piece, then output piece) by the
    # downstream readers of its input piece, on the input channel fed by the
    # documented new upstream, so the old channel's order survives; new
    # upstream subtasks re-send nothing.
    for _, src in m.input:
        assert 0 <= src.old_subtask < m.input.old_parallelism
        assert 0 <= src.old_channel < m.input.old_channels
        assert all(0 <= t.channel < m.input.new_channels for t in src.targets)
        assert m.output_piece_of(src) == output_piece(et, src)
    assert not any(m.output.sources)
    assert set(m.output.joined) == {output_piece(et, s) for _, s in m.input}
    if et is EdgeType.FORWARD:
        for new, src in m.input:
            assert new == replay_owner(src.old_subtask, par.up_new)
        return
    for _, src in m.input:
        assert {t.channel for t in src.targets} == {replay_owner(src.old_channel, par.up_new)}
    if et is not EdgeType.BROADCAST:
        assert m.output.discarded == () and m.input.discarded == ()


@functools.cache
def key_ranges(max_p: int, p: int) -> tuple[frozenset[int], ...]:
    """Brute force: each subtask's key groups, by assigning every key group one by one."""
    groups: list[set[int]] = [set() for _ in range(p)]
    for kg in range(max_p):
        groups[kg * p // max_p].add(kg)
    return tuple(frozenset(g) for g in groups)


def key_range(max_p: int, p: int, i: int) -> frozenset[int]:
    return key_ranges(max_p, p)[i]


@st.composite
def parallelisms(draw: st.DrawFn, forward: bool = False) -> Par:
    up_old, down_old, up_new, down_new = (draw(st.integers(1, 32)) for _ in range(4))
    if forward:
        down_old, down_new = up_old, up_new
    lo = max(up_old, down_old, up_new, down_new)
    max_p = draw(st.one_of(st.integers(lo, 4 * lo), st.sampled_from([128, 4096, 32768])))
    return Par(up_old, down_old, up_new, down_new, max_p)


@settings(max_examples=60, deadline=None)
@given(
    et=st.sampled_from([EdgeType.KEY_BY, EdgeType.REBALANCE, EdgeType.CUSTOM]),
    par=parallelisms(),
    seed=st.integers(0, 2**32),
)
def test_every_record_reaches_its_true_owner_exactly_once(
    et: EdgeType, par: Par, seed: int
) -> None:
    m = par.map(et)
    check_structure(et, par, m)
    check_exactly_once(et, par, m, old_state(et, par, random.Random(seed), 150))


@settings(max_examples=40, deadline=None)
@given(par=parallelisms(forward=True), seed=st.integers(0, 2**32))
def test_forced_forward_rescales_like_rebalance(par: Par, seed: int) -> None:
    m = par.map(EdgeType.FORWARD, force=True)
    check_structure(EdgeType.FORWARD, par, m)
    check_exactly_once(
        EdgeType.FORWARD, par, m, old_state(EdgeType.FORWARD, par, random.Random(seed), 100)
    )
    # Input and output state of one old pair land at the same new pair, in that order.
    for new, src in m.input:
        assert new == src.old_subtask % par.down_new


@settings(max_examples=40, deadline=None)
@given(par=parallelisms(), data=st.data())
def test_key_by_reads_only_intersecting_old_subtasks_and_filters_only_when_needed(
    par: Par, data: st.DataObject
) -> None:
    m = par.map(EdgeType.KEY_BY)
    for new in range(par.down_new):
        new_range = key_range(par.max_p, par.down_new, new)
        intersecting = {
            d for d in range(par.down_old) if key_range(par.max_p, par.down_old, d) & new_range
        }
        assert set(m.input.old_subtasks(new)) == intersecting
        for src in m.input.for_subtask(new):
            old_range = key_range(par.max_p, par.down_old, src.old_subtask)
            (target,) = src.targets
            kept = old_range if target.key_groups is None else set(target.key_groups)
            assert kept == old_range & new_range
            assert (src.filtering is Filtering.NONE) == (old_range <= new_range)
    new, src = data.draw(st.sampled_from(list(m.input)))
    old_range = key_range(par.max_p, par.down_old, src.old_subtask)
    table = src.key_group_table(par.max_p)
    kg = data.draw(st.sampled_from(sorted(old_range)))
    mine = owner_of_key_group(par.max_p, par.down_new, kg) == new
    channel = replay_owner(src.old_channel, par.up_new)
    assert table[kg] == (channel if mine else -1)
    assert src.route(key_group=kg) == ([channel] if mine else [])


@settings(max_examples=60, deadline=None)
@given(par=parallelisms(), seed=st.integers(0, 2**32))
def test_broadcast_gives_each_new_subtask_every_record_once(par: Par, seed: int) -> None:
    rng = random.Random(seed)
    m = par.map(EdgeType.BROADCAST)
    check_structure(EdgeType.BROADCAST, par, m)
    # Each broadcast record has, at every old downstream subtask, been processed
    # (it lives in that subtask's operator state) or sits in its input state or
    # in its upstream's output state for it.
    where: dict[tuple[int, int], str] = {}
    recs: list[Rec] = []
    for rid in range(40):
        u = rng.randrange(par.up_old)
        for d in range(par.down_old):
            where[rid, d] = rng.choice(["processed", "input", "output", "input", "output"])
            if where[rid, d] == "input":
                recs.append(Rec(rid, 0, Side.INPUT, d, u))
            elif where[rid, d] == "output":
                recs.append(Rec(rid, 0, Side.OUTPUT, u, d))
    got = replay(m, par, recs)
    for rid in range(40):
        for new in range(par.down_new):
            inherited = broadcast_source(new, par.down_old)
            processed = where[rid, inherited] == "processed"
            assert got.get(rid, Counter())[new] + processed == 1, (rid, new)
    for new in range(min(par.down_old, par.down_new)):
        assert broadcast_source(new, par.down_old) == new
    # Copies held for old subtasks without an heir are left on both sides.
    heirless = set(range(par.down_old)) - {
        broadcast_source(n, par.down_old) for n in range(par.down_new)
    }
    assert set(m.input.discarded) == {(d, u) for d in heirless for u in range(par.up_old)}
    assert set(m.output.discarded) == {(u, d) for u in range(par.up_old) for d in heirless}


@settings(max_examples=30, deadline=None)
@given(par=parallelisms(forward=True))
def test_forward_refuses_to_rescale_unless_forced(par: Par) -> None:
    if par.up_old == par.up_new:
        assert par.map(EdgeType.FORWARD).is_identity
        return
    with pytest.raises(RescaleError) as info:
        par.map(EdgeType.FORWARD)
    assert isinstance(info.value, ValueError) and isinstance(info.value, SpilloverError)
    assert info.value.hint is not None and FORCE_FORWARD_OPTION in info.value.hint
    assert "force=True" in info.value.hint


def test_forward_with_unequal_parallelisms_is_refused_even_when_forced() -> None:
    with pytest.raises(RescaleError):
        map_edge(
            "forward",
            old_upstream=2,
            old_downstream=2,
            new_upstream=3,
            new_downstream=4,
            max_parallelism=128,
            force=True,
        )


@settings(max_examples=40, deadline=None)
@given(par=parallelisms(), et=st.sampled_from([*ALL_TO_ALL, EdgeType.FORWARD]))
def test_identity_exactly_when_nothing_changes(par: Par, et: EdgeType) -> None:
    if et is EdgeType.FORWARD:
        par = Par(par.up_old, par.up_old, par.up_new, par.up_new, par.max_p)
    same = Par(par.up_old, par.down_old, par.up_old, par.down_old, par.max_p)
    assert same.map(et).is_identity
    if (par.up_old, par.down_old) != (par.up_new, par.down_new):
        assert not par.map(et, force=True).is_identity


@pytest.mark.parametrize("old,new", BOTH_WAYS)
@pytest.mark.parametrize("et", [*ALL_TO_ALL, EdgeType.FORWARD])
@pytest.mark.parametrize("max_p", [128, 21])
def test_named_rescale_pairs_deliver_every_key_group(
    old: int, new: int, et: EdgeType, max_p: int
) -> None:
    # Rescale both operators of the edge; every key group, upstream and side.
    par = Par(old, old, new, new, max_p)
    m = par.map(et, force=True)
    check_structure(et, par, m)
    recs: list[Rec] = []
    for kg in range(max_p):
        for u in range(old):
            if et is EdgeType.BROADCAST:
                # One copy per old downstream, input and output side by turns.
                for d in range(old):
                    side = Side.INPUT if (kg + u + d) % 2 else Side.OUTPUT
                    where = (d, u) if side is Side.INPUT else (u, d)
                    recs.append(Rec(kg * old + u, kg, side, *where))
                continue
            if et is EdgeType.FORWARD:
                pieces = [(u, 0), (u, 0)]
            else:
                d = {
                    EdgeType.KEY_BY: owner_of_key_group(max_p, old, kg),
                    EdgeType.CUSTOM: partitioner(kg, old),
                }.get(et, (kg + u) % old)
                pieces = [(d, u), (u, d)]
            recs.append(Rec(len(recs), kg, Side.INPUT, *pieces[0]))
            recs.append(Rec(len(recs), kg, Side.OUTPUT, *pieces[1]))
    if et is not EdgeType.BROADCAST:
        check_exactly_once(et, par, m, recs)
        return
    got = replay(m, par, recs)
    assert all(got[rid] == Counter(range(new)) for rid in got)


@pytest.mark.parametrize(
    "old,new,reads",
    [
        (3, 2, [(0, 1), (1, 2)]),
        (10, 4, [(0, 1, 2), (2, 3, 4), (5, 6, 7), (7, 8, 9)]),
        (2, 3, [(0,), (0, 1), (1,)]),
        (1, 7, [(0,)] * 7),
    ],
)
def test_documented_key_by_examples(old: int, new: int, reads: list[tuple[int, ...]]) -> None:
    m = Par(1, old, 1, new, 128).map(EdgeType.KEY_BY)
    assert [m.input.old_subtasks(i) for i in range(new)] == reads


def test_mixed_edges_all_rescale() -> None:
    # source -key_by-> keyed A -rebalance-> stateless B -key_by-> keyed C -broadcast-> D -custom-> E
    chain = [
        EdgeType.KEY_BY,
        EdgeType.REBALANCE,
        EdgeType.KEY_BY,
        EdgeType.BROADCAST,
        EdgeType.CUSTOM,
    ]
    old = [3, 5, 2, 7, 4, 6]
    new = [4, 2, 6, 3, 5, 1]
    rng = random.Random(7)
    for i, et in enumerate(chain):
        par = Par(old[i], old[i + 1], new[i], new[i + 1], 64)
        m = par.map(et)
        check_structure(et, par, m)
        if et is not EdgeType.BROADCAST:
            check_exactly_once(et, par, m, old_state(et, par, rng, 200))


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 64), extra=st.integers(0, 200))
def test_key_group_table_matches_key_group_ownership(p: int, extra: int) -> None:
    max_p = p + extra
    owners = key_group_table(max_p, p)
    assert owners.dtype == np.int32 and owners.shape == (max_p,)
    assert owners.tolist() == [owner_of_key_group(max_p, p, kg) for kg in range(max_p)]
    sub = p // 2
    mine = key_group_table(max_p, p, sub)
    assert mine.tolist() == [sub if o == sub else -1 for o in owners.tolist()]


def test_bad_arguments_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        map_edge(
            "key_by",
            old_upstream=1,
            old_downstream=200,
            new_upstream=1,
            new_downstream=2,
            max_parallelism=128,
        )
    with pytest.raises(ConfigError):
        map_edge(
            "zigzag",
            old_upstream=1,
            old_downstream=1,
            new_upstream=1,
            new_downstream=1,
            max_parallelism=128,
        )
    with pytest.raises(ConfigError):
        key_group_table(128, 4, 4)
    assert EdgeType.parse("hash") is EdgeType.KEY_BY
    assert EdgeType.parse("Round-Robin") is EdgeType.REBALANCE


def test_rescale_error_survives_pickling() -> None:
    err = RescaleError("no", detail="d", hint="h")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is RescaleError and back.hint == "h" and str(back) == str(err)


def test_custom_partitioner_routing_needs_the_partitioners_choice() -> None:
    m = Par(2, 3, 2, 4, 128).map(EdgeType.CUSTOM)
    src = m.input.for_subtask(0)[0]
    assert src.filtering is Filtering.PARTITIONER
    with pytest.raises(RescaleError):
        src.route(key_group=3)
    with pytest.raises(RescaleError):
        src.key_group_table(128)
