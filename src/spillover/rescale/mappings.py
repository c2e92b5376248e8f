"""Which old in-flight channel state each new subtask replays after a rescale.

An edge joins an upstream operator to a downstream operator. In-flight state
sits on both sides of it: the **output** state of upstream subtask ``u`` holds
the buffers still queued in its subpartition ``d`` (one per downstream subtask),
and the **input** state of downstream subtask ``d`` holds the buffers received
on its channel ``u`` (one per upstream subtask) but not yet processed. Forward
edges have a single channel (index 0) per subtask pair.

:func:`map_edge` turns an edge type and the old and new parallelisms into an
:class:`EdgeMapping`: for every new subtask on each side, the old
``(subtask, channel)`` pieces it reads, and for each piece the new channels
its records go to and whether they must be filtered on the way (by key group,
or by a user partitioner). The rules are documented in ``docs/rescaling.md``.
This is small, pure data; the retrievers that apply it live elsewhere.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from spillover.errors import ConfigError, RescaleError

__all__ = [
    "FORCE_FORWARD_OPTION",
    "MAX_PARALLELISM_UPPER_BOUND",
    "ChannelSource",
    "EdgeMapping",
    "EdgeType",
    "Filtering",
    "RescaleMapping",
    "Side",
    "Target",
    "broadcast_source",
    "key_group_table",
    "map_edge",
    "replay_owner",
]

FORCE_FORWARD_OPTION = "execution.checkpointing.unaligned.forward-rescale.forced"
"""Config key (bool, default false) that lets forward edges with in-flight state rescale."""

MAX_PARALLELISM_UPPER_BOUND = 1 << 15
"""The largest max parallelism (number of key groups) a job may use, as in Flink."""


class EdgeType(enum.Enum):
    """How an edge partitions records over the downstream subtasks."""

    KEY_BY = "key_by"
    HASH = "key_by"
    REBALANCE = "rebalance"
    ROUND_ROBIN = "rebalance"
    BROADCAST = "broadcast"
    FORWARD = "forward"
    CUSTOM = "custom"

    @classmethod
    def parse(cls, text: str | EdgeType) -> EdgeType:
        """Read an edge type from a name or value, any case, ``-`` or ``_``."""
        if isinstance(text, EdgeType):
            return text
        name = text.strip().upper().replace("-", "_")
        if name in cls.__members__:
            return cls.__members__[name]
        names = ", ".join(n.lower() for n in cls.__members__)
        raise ConfigError(f"unknown edge type {text!r}", hint=f"use one of {names}")


class Side(enum.Enum):
    """Which side of an edge a piece of channel state was taken on."""

    OUTPUT = "output"
    """Upstream result partition: channel = downstream subtask index."""
    INPUT = "input"
    """Downstream input gate: channel = upstream subtask index."""


class Filtering(enum.Enum):
    """What a reader must look at, per record, to route an old piece of state."""

    NONE = "none"
    """Buffers are taken whole; records need not even be deserialized."""
    KEY_GROUPS = "key_groups"
    """Each record goes to the target whose key-group range holds its key group."""
    PARTITIONER = "partitioner"
    """Each record goes to the target the user partitioner picks for it."""


@dataclass(frozen=True, slots=True)
class Target:
    """One new channel that (some of) an old piece's records are replayed on.

    A record is delivered to the target when it passes the target's selector:
    ``key_groups`` keeps only records whose key group lies in that range;
    ``partition`` keeps only records for which the user partitioner, called
    with the new downstream parallelism, returns that subtask index. With
    neither, every record passes.
    """

    channel: int
    key_groups: range | None = None
    partition: int | None = None

    def accepts(self, key_group: int | None = None, partition: int | None = None) -> bool:
        """Tell whether a record with this key group / partitioner choice goes here."""
        if self.key_groups is not None:
            if key_group is None:
                raise RescaleError("records of this piece are routed by key group; pass key_group")
            return key_group in self.key_groups
        if self.partition is not None:
            if partition is None:
                raise RescaleError(
                    "records of this piece are routed by partitioner; pass partition"
                )
            return partition == self.partition
        return True


@dataclass(frozen=True, slots=True)
class ChannelSource:
    """One old piece of channel state a new subtask reads, and where its records go.

    ``old_subtask`` and ``old_channel`` name the piece (one channel of one gate
    of an old subtask; records spanning buffers are reassembled per piece).
    On the input side every target's ``channel`` is an input channel of the
    reading subtask; on the output side it is a subpartition of the replaying
    upstream subtask, i.e. a new downstream subtask index.
    """

    old_subtask: int
    old_channel: int
    targets: tuple[Target, ...]

    @property
    def filtering(self) -> Filtering:
        """Whether records must be inspected, and by what."""
        for t in self.targets:
            if t.key_groups is not None:
                return Filtering.KEY_GROUPS
            if t.partition is not None:
                return Filtering.PARTITIONER
        return Filtering.NONE

    def route(self, *, key_group: int | None = None, partition: int | None = None) -> list[int]:
        """New channels a record is delivered on (empty: the record is not this reader's).

        ``partition`` is the user partitioner's choice for the record at the
        new downstream parallelism; it is needed only when :attr:`filtering`
        is :attr:`Filtering.PARTITIONER`, as is ``key_group`` for key groups.
        """
        return [t.channel for t in self.targets if t.accepts(key_group, partition)]

    def key_group_table(self, max_parallelism: int) -> npt.NDArray[np.int32]:
        """Demultiplexing table: entry ``kg`` is the new channel for key group ``kg``, or -1.

        Only for pieces whose records each go to at most one channel and that
        are not routed by a partitioner.
        """
        if self.filtering is Filtering.PARTITIONER or (
            self.filtering is Filtering.NONE and len(self.targets) > 1
        ):
            raise RescaleError(
                "this piece cannot be routed by a key-group table",
                detail=f"filtering {self.filtering.value} with {len(self.targets)} targets",
            )
        table = np.full(max_parallelism, -1, dtype=np.int32)
        for t in self.targets:
            kgs = t.key_groups if t.key_groups is not None else range(max_parallelism)
            table[kgs.start : kgs.stop] = t.channel
        return table


@dataclass(frozen=True, slots=True)
class RescaleMapping:
    """For one side of an edge: the old pieces each new subtask reads, in replay order."""

    side: Side
    old_parallelism: int
    new_parallelism: int
    old_channels: int
    """Channels per old subtask on this side."""
    new_channels: int
    """Channels per new subtask on this side."""
    sources: tuple[tuple[ChannelSource, ...], ...]
    """Indexed by new subtask."""

    def for_subtask(self, new_subtask: int) -> tuple[ChannelSource, ...]:
        """The pieces new subtask ``new_subtask`` reads, ordered by old subtask then channel."""
        return self.sources[new_subtask]

    def old_subtasks(self, new_subtask: int) -> tuple[int, ...]:
        """The distinct old subtasks whose state files ``new_subtask`` opens."""
        return tuple(sorted({s.old_subtask for s in self.sources[new_subtask]}))

    def __iter__(self) -> Iterator[tuple[int, ChannelSource]]:
        """Yield ``(new_subtask, source)`` for every piece read."""
        for i, srcs in enumerate(self.sources):
            for s in srcs:
                yield i, s

    @property
    def is_identity(self) -> bool:
        """True when every subtask simply replays its own old state, unfiltered, as it was."""
        if self.old_parallelism != self.new_parallelism or self.old_channels != self.new_channels:
            return False
        return all(
            tuple(srcs) == _own_pieces(i, self.old_channels) for i, srcs in enumerate(self.sources)
        )

    @property
    def discarded(self) -> tuple[tuple[int, int], ...]:
        """Old ``(subtask, channel)`` pieces nobody reads (duplicate broadcast copies)."""
        read = {(s.old_subtask, s.old_channel) for _, s in self}
        return tuple(
            (o, c)
            for o in range(self.old_parallelism)
            for c in range(self.old_channels)
            if (o, c) not in read
        )


@dataclass(frozen=True, slots=True)
class EdgeMapping:
    """Both sides of one edge: ``output`` per new upstream, ``input`` per new downstream."""

    edge_type: EdgeType
    max_parallelism: int
    output: RescaleMapping
    input: RescaleMapping

    @property
    def is_identity(self) -> bool:
        """True when no piece on either side moves or needs filtering."""
        return self.output.is_identity and self.input.is_identity

    def side(self, side: Side) -> RescaleMapping:
        """The mapping of the given side."""
        return self.output if side is Side.OUTPUT else self.input


def _own_pieces(subtask: int, channels: int) -> tuple[ChannelSource, ...]:
    return tuple(ChannelSource(subtask, c, (Target(c),)) for c in range(channels))


def _kg_range(max_parallelism: int, parallelism: int, index: int) -> range:
    start = (index * max_parallelism + parallelism - 1) // parallelism
    end = ((index + 1) * max_parallelism - 1) // parallelism
    return range(start, end + 1)


def _operator_for(max_parallelism: int, parallelism: int, key_group: int) -> int:
    return key_group * parallelism // max_parallelism


def _intersect(a: range, b: range) -> range:
    return range(max(a.start, b.start), min(a.stop, b.stop))


def replay_owner(old_upstream: int, new_upstream_parallelism: int) -> int:
    """The new upstream subtask that replays old upstream subtask ``old_upstream``'s output.

    Round robin (``old mod new``), so each old output is replayed exactly once
    and scale-down spreads the work evenly. The same subtask's input channel
    carries the matching old input-side pieces, which keeps order per old channel.
    """
    return old_upstream % new_upstream_parallelism


def broadcast_source(new_subtask: int, old_parallelism: int) -> int:
    """The old downstream subtask whose view of a broadcast edge ``new_subtask`` inherits.

    ``new mod old``. The new subtask must also restore that old subtask's
    broadcast operator state: every broadcast record is then, for it, either
    already processed or replayed exactly once.
    """
    return new_subtask % old_parallelism


def key_group_table(
    max_parallelism: int, parallelism: int, subtask: int | None = None
) -> npt.NDArray[np.int32]:
    """Key group -> subtask table of size ``max_parallelism`` for a native demultiplexer.

    Without ``subtask``, entry ``kg`` is the subtask owning key group ``kg``.
    With it, entry ``kg`` is ``subtask`` if that subtask owns ``kg``, else -1:
    the filter a reader of key-by input state applies.
    """
    _check_parallelism("parallelism", parallelism, max_parallelism)
    kgs = np.arange(max_parallelism, dtype=np.int64)
    owners = (kgs * parallelism // max_parallelism).astype(np.int32)
    if subtask is None:
        return owners
    if not 0 <= subtask < parallelism:
        raise ConfigError(f"subtask {subtask} out of range for parallelism {parallelism}")
    return np.where(owners == subtask, np.int32(subtask), np.int32(-1)).astype(np.int32)


def _check_parallelism(name: str, value: int, max_parallelism: int) -> None:
    if not 1 <= value <= max_parallelism:
        raise ConfigError(
            f"{name} must be between 1 and the max parallelism {max_parallelism}, got {value}"
        )


def map_edge(
    edge_type: EdgeType | str,
    *,
    old_upstream: int,
    old_downstream: int,
    new_upstream: int,
    new_downstream: int,
    max_parallelism: int,
    force: bool = False,
) -> EdgeMapping:
    """Map one edge's in-flight state from the old parallelisms onto the new ones.

    ``force`` lets a forward edge rescale (see :data:`FORCE_FORWARD_OPTION`);
    it is then mapped like a rebalance edge. Raises :class:`ConfigError` for
    parallelisms outside ``1..max_parallelism`` and :class:`RescaleError` when
    the edge cannot be rescaled as asked.
    """
    et = EdgeType.parse(edge_type)
    if not 1 <= max_parallelism <= MAX_PARALLELISM_UPPER_BOUND:
        raise ConfigError(
            f"max parallelism must be between 1 and {MAX_PARALLELISM_UPPER_BOUND}, "
            f"got {max_parallelism}"
        )
    for name, value in (
        ("old upstream parallelism", old_upstream),
        ("old downstream parallelism", old_downstream),
        ("new upstream parallelism", new_upstream),
        ("new downstream parallelism", new_downstream),
    ):
        _check_parallelism(name, value, max_parallelism)
    e = _Edge(old_upstream, old_downstream, new_upstream, new_downstream, max_parallelism)
    if et is EdgeType.FORWARD:
        output, input_ = _forward(e, force)
    elif et is EdgeType.KEY_BY:
        output, input_ = _key_by(e)
    elif et is EdgeType.REBALANCE:
        output, input_ = _rebalance(e)
    elif et is EdgeType.BROADCAST:
        output, input_ = _broadcast(e)
    else:
        output, input_ = _custom(e)
    return EdgeMapping(et, max_parallelism, output, input_)


_Pair = tuple[RescaleMapping, RescaleMapping]


@dataclass(frozen=True, slots=True)
class _Edge:
    up_old: int
    down_old: int
    up_new: int
    down_new: int
    max_p: int

    def mappings(
        self, out: list[list[ChannelSource]], in_: list[list[ChannelSource]], pointwise: bool
    ) -> _Pair:
        """Wrap per-new-subtask source lists of both sides into mappings."""
        output = RescaleMapping(
            Side.OUTPUT,
            self.up_old,
            self.up_new,
            1 if pointwise else self.down_old,
            1 if pointwise else self.down_new,
            _sorted(out),
        )
        input_ = RescaleMapping(
            Side.INPUT,
            self.down_old,
            self.down_new,
            1 if pointwise else self.up_old,
            1 if pointwise else self.up_new,
            _sorted(in_),
        )
        return output, input_

    def replayed_by(self) -> list[list[int]]:
        """For each new upstream subtask, the old upstream subtasks whose output it replays."""
        owned: list[list[int]] = [[] for _ in range(self.up_new)]
        for u in range(self.up_old):
            owned[replay_owner(u, self.up_new)].append(u)
        return owned


def _sorted(sources: list[list[ChannelSource]]) -> tuple[tuple[ChannelSource, ...], ...]:
    return tuple(tuple(sorted(s, key=lambda x: (x.old_subtask, x.old_channel))) for s in sources)


def _empty(n: int) -> list[list[ChannelSource]]:
    return [[] for _ in range(n)]


def _key_by(e: _Edge) -> _Pair:
    old_ranges = [_kg_range(e.max_p, e.down_old, d) for d in range(e.down_old)]
    new_ranges = [_kg_range(e.max_p, e.down_new, d) for d in range(e.down_new)]

    def overlaps(old_d: int) -> list[tuple[int, range | None]]:
        # (new downstream, key groups it takes from old_d; None when all of them).
        rng = old_ranges[old_d]
        first = _operator_for(e.max_p, e.down_new, rng.start)
        last = _operator_for(e.max_p, e.down_new, rng[-1])
        result: list[tuple[int, range | None]] = []
        for nd in range(first, last + 1):
            part = _intersect(rng, new_ranges[nd])
            result.append((nd, None if part == rng else part))
        return result

    readers = [overlaps(d) for d in range(e.down_old)]
    out = _empty(e.up_new)
    for nu, olds in enumerate(e.replayed_by()):
        for u in olds:
            for d in range(e.down_old):
                targets = tuple(Target(nd, key_groups=kgs) for nd, kgs in readers[d])
                out[nu].append(ChannelSource(u, d, targets))
    in_ = _empty(e.down_new)
    for d in range(e.down_old):
        for nd, kgs in readers[d]:
            for u in range(e.up_old):
                target = Target(replay_owner(u, e.up_new), key_groups=kgs)
                in_[nd].append(ChannelSource(d, u, (target,)))
    return e.mappings(out, in_, pointwise=False)


def _rebalance(e: _Edge, pointwise: bool = False) -> _Pair:
    # Unkeyed records may go anywhere, so any one-to-one placement is correct;
    # old downstream d's records stay together at new downstream d mod P_new.
    out = _empty(e.up_new)
    in_ = _empty(e.down_new)
    if pointwise:
        # One channel (0) per subtask; new upstream u' only reaches downstream u'.
        for nu, olds in enumerate(e.replayed_by()):
            out[nu].extend(ChannelSource(u, 0, (Target(0),)) for u in olds)
        for d in range(e.down_old):
            in_[d % e.down_new].append(ChannelSource(d, 0, (Target(0),)))
        return e.mappings(out, in_, pointwise=True)
    for nu, olds in enumerate(e.replayed_by()):
        for u in olds:
            out[nu].extend(
                ChannelSource(u, d, (Target(d % e.down_new),)) for d in range(e.down_old)
            )
    for d in range(e.down_old):
        in_[d % e.down_new].extend(
            ChannelSource(d, u, (Target(replay_owner(u, e.up_new)),)) for u in range(e.up_old)
        )
    return e.mappings(out, in_, pointwise=False)


def _forward(e: _Edge, force: bool) -> _Pair:
    if e.up_old != e.down_old or e.up_new != e.down_new:
        raise RescaleError(
            "a forward edge needs the same parallelism upstream and downstream",
            detail=f"old {e.up_old}->{e.down_old}, new {e.up_new}->{e.down_new}",
            hint="declare the edge as rebalance (or key_by) if the parallelisms must differ",
        )
    if e.up_old != e.up_new and not force:
        raise RescaleError(
            "cannot rescale the in-flight state of a forward edge",
            detail=f"parallelism changes from {e.up_old} to {e.up_new}; a forward edge "
            "promises each record stays with its subtask, which no longer exists as such",
            hint=f"set {FORCE_FORWARD_OPTION}=true (force=True) to redistribute it like a "
            "rebalance edge, or make the edge rebalance/key_by",
        )
    return _rebalance(e, pointwise=True)


def _broadcast(e: _Edge) -> _Pair:
    # Each new downstream inherits one old downstream's whole view: its input
    # state and the output state every old upstream still held for it.
    heirs: list[list[int]] = [[] for _ in range(e.down_old)]
    for nd in range(e.down_new):
        heirs[broadcast_source(nd, e.down_old)].append(nd)
    out = _empty(e.up_new)
    for nu, olds in enumerate(e.replayed_by()):
        for u in olds:
            out[nu].extend(
                ChannelSource(u, d, tuple(Target(nd) for nd in heirs[d]))
                for d in range(e.down_old)
                if heirs[d]
            )
    in_ = _empty(e.down_new)
    for nd in range(e.down_new):
        d = broadcast_source(nd, e.down_old)
        in_[nd].extend(
            ChannelSource(d, u, (Target(replay_owner(u, e.up_new)),)) for u in range(e.up_old)
        )
    return e.mappings(out, in_, pointwise=False)


def _custom(e: _Edge) -> _Pair:
    if e.down_old == e.down_new or e.down_new == 1:
        # The partitioner would pick the same subtask again (same channel
        # count), or can only pick 0: place buffers whole, like rebalance.
        return _rebalance(e)
    # Read everything and let the partitioner route: replaying upstreams send
    # each record to the subpartition it picks; downstream readers keep only
    # the records it picks for them.
    everyone = tuple(Target(nd, partition=nd) for nd in range(e.down_new))
    out = _empty(e.up_new)
    for nu, olds in enumerate(e.replayed_by()):
        for u in olds:
            out[nu].extend(ChannelSource(u, d, everyone) for d in range(e.down_old))
    in_ = _empty(e.down_new)
    for nd in range(e.down_new):
        for d in range(e.down_old):
            in_[nd].extend(
                ChannelSource(d, u, (Target(replay_owner(u, e.up_new), partition=nd),))
                for u in range(e.up_old)
            )
    return e.mappings(out, in_, pointwise=False)
