"""The compact rescale mapping (blocks per old subtask) against the channel-by-channel
mapping it replaced, kept here as the reference model: for every edge kind, scale
up and down, each old channel goes to the same new subtasks and channels under
the same filter, in the same order."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from spillover.errors import RescaleError
from spillover.keygroups import key_group_range_for_operator, operator_index_for_key_group
from spillover.rescale import ChannelSource, EdgeType, Target, map_edge, replay_owner
from spillover.rescale.mappings import broadcast_source

Sources = list[list[ChannelSource]]


@dataclass(frozen=True)
class Reference:
    """The mapping as it was: every old channel listed per new downstream."""

    sources: tuple[tuple[ChannelSource, ...], ...]
    joined: tuple[tuple[int, int], ...]
    input_channels: int


def reference(
    et: EdgeType, up_old: int, down_old: int, up_new: int, down_new: int, max_p: int
) -> Reference:
    """The channel-by-channel mapping (``map_edge`` before blocks), after the
    parallelisms were checked."""
    in_: Sources = [[] for _ in range(down_new)]
    pointwise = et is EdgeType.FORWARD

    def rebalance() -> None:
        for d in range(down_old):
            in_[d % down_new].extend(
                ChannelSource(d, u, (Target(replay_owner(u, up_new)),)) for u in range(up_old)
            )

    if pointwise:
        for d in range(down_old):
            in_[d % down_new].append(ChannelSource(d, 0, (Target(0),)))
    elif et is EdgeType.KEY_BY:
        new_ranges = [key_group_range_for_operator(max_p, down_new, d) for d in range(down_new)]
        for d in range(down_old):
            rng = key_group_range_for_operator(max_p, down_old, d)
            first = operator_index_for_key_group(max_p, down_new, rng.start)
            last = operator_index_for_key_group(max_p, down_new, rng.end)
            for nd in range(first, last + 1):
                part = rng.intersection(new_ranges[nd])
                kgs = None if part == rng else range(part.start, part.end + 1)
                for u in range(up_old):
                    target = Target(replay_owner(u, up_new), key_groups=kgs)
                    in_[nd].append(ChannelSource(d, u, (target,)))
    elif et is EdgeType.REBALANCE:
        rebalance()
    elif et is EdgeType.BROADCAST:
        for nd in range(down_new):
            d = broadcast_source(nd, down_old)
            in_[nd].extend(
                ChannelSource(d, u, (Target(replay_owner(u, up_new)),)) for u in range(up_old)
            )
    elif down_old == down_new or down_new == 1:
        rebalance()
    else:
        for nd in range(down_new):
            for d in range(down_old):
                in_[nd].extend(
                    ChannelSource(d, u, (Target(replay_owner(u, up_new), partition=nd),))
                    for u in range(up_old)
                )
    joined = {
        (s.old_subtask, 0) if pointwise else (s.old_channel, s.old_subtask)
        for srcs in in_
        for s in srcs
    }
    return Reference(
        tuple(tuple(sorted(s, key=lambda x: (x.old_subtask, x.old_channel))) for s in in_),
        tuple(sorted(joined)),
        1 if pointwise else up_old,
    )


Routes = dict[tuple[int, int], list[tuple[int, int, range | None, int | None]]]


def effective(sources: tuple[tuple[ChannelSource, ...], ...]) -> Routes:
    """Old channel ``(downstream, upstream)`` -> ``[(new subtask, new channel, filter)]``."""
    out: Routes = {}
    for new, srcs in enumerate(sources):
        for s in srcs:
            for t in s.targets:
                out.setdefault((s.old_subtask, s.old_channel), []).append(
                    (new, t.channel, t.key_groups, t.partition)
                )
    return out


@st.composite
def edges(draw: st.DrawFn) -> tuple[EdgeType, int, int, int, int, int, bool]:
    et = draw(st.sampled_from(list(dict.fromkeys(EdgeType))))
    up_old, down_old, up_new, down_new = (draw(st.integers(1, 24)) for _ in range(4))
    force = draw(st.booleans())
    if et is EdgeType.FORWARD:
        down_old, down_new = up_old, up_new
    max_p = draw(st.integers(max(up_old, down_old, up_new, down_new), 300))
    return et, up_old, down_old, up_new, down_new, max_p, force


@settings(max_examples=300, deadline=None)
@given(edge=edges())
def test_compact_mapping_equals_the_channel_by_channel_one(
    edge: tuple[EdgeType, int, int, int, int, int, bool],
) -> None:
    et, up_old, down_old, up_new, down_new, max_p, force = edge
    try:
        m = map_edge(
            et,
            old_upstream=up_old,
            old_downstream=down_old,
            new_upstream=up_new,
            new_downstream=down_new,
            max_parallelism=max_p,
            force=force,
        )
    except RescaleError:
        # only a forward edge whose parallelism changes, unforced, is refused
        assert et is EdgeType.FORWARD and up_old != up_new and not force
        return
    ref = reference(et, up_old, down_old, up_new, down_new, max_p)
    assert m.input.sources == ref.sources
    assert effective(m.input.sources) == effective(ref.sources)
    for i in range(down_new):
        assert m.input.for_subtask(i) == ref.sources[i]
        assert m.input.old_subtasks(i) == tuple(sorted({s.old_subtask for s in ref.sources[i]}))
    assert list(m.input) == [(i, s) for i, srcs in enumerate(ref.sources) for s in srcs]
    assert m.output.joined == ref.joined
    assert not any(m.output.sources)
    read = {(s.old_subtask, s.old_channel) for srcs in ref.sources for s in srcs}
    assert (
        set(m.input.discarded)
        == {(d, c) for d in range(down_old) for c in range(ref.input_channels)} - read
    )
    out_channels = 1 if et is EdgeType.FORWARD else down_old
    assert set(m.output.discarded) == {
        (u, c) for u in range(up_old) for c in range(out_channels)
    } - set(ref.joined)
    # Blocks: O(old + new subtasks) on every edge but a rescaled custom one.
    blocks = sum(len(b) for b in m.input.blocks)
    if et is not EdgeType.CUSTOM:
        assert blocks <= down_old + down_new
