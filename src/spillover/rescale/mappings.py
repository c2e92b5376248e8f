"""Which old in-flight channel state each new subtask replays after a rescale.

An edge joins an upstream operator to a downstream operator. In-flight state
sits on both sides of it: the **output** state of upstream subtask ``u`` holds
the buffers still queued in its subpartition ``d`` (one per downstream subtask),
and the **input** state of downstream subtask ``d`` holds the buffers received
on its channel ``u`` (one per upstream subtask) but not yet processed. Forward
edges have a single channel (index 0) per subtask pair.

Together the two pieces of one old channel ``u -> d`` (``d``'s input piece,
then ``u``'s output piece) are one byte stream, and a record may be cut
between them. So both are read by the same new downstream subtask, one after
the other; new upstream subtasks re-send nothing.

:func:`map_edge` turns an edge type and the old and new parallelisms into an
:class:`EdgeMapping`: for every new downstream subtask, the old channels it
reads, and for each the new input channel its records go to and whether they
must be filtered on the way (by key group, or by a user partitioner). The
rules are documented in ``docs/rescaling.md``. This is small, pure data;
:mod:`spillover.rescale.retriever` applies it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from spillover.errors import ConfigError, RescaleError
from spillover.keygroups import (
    KeyGroupRange,
    key_group_range_for_operator,
    operator_index_for_key_group,
)
from spillover.keygroups import key_group_table as _ranges_table

__all__ = [
    "FORCE_FORWARD_OPTION",
    "MAX_PARALLELISM_UPPER_BOUND",
    "ChannelSource",
    "EdgeMapping",
    "EdgeType",
    "Filtering",
    "RescaleMapping",
    "Side",
    "SourceBlock",
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
    """One old channel a new downstream subtask reads, and where its records go.

    ``old_subtask`` and ``old_channel`` name its input piece (one channel of the
    old downstream's input gate); the old channel goes on in the output piece
    :meth:`EdgeMapping.output_piece_of` names, and records spanning buffers are
    reassembled across both. Every target's ``channel`` is an input channel of
    the reading subtask.
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
class SourceBlock:
    """Every old channel of one old subtask that a new subtask reads, under one
    selector: the compact form of ``old_channels`` :class:`ChannelSource`\\ s.

    Old channel ``c`` of old subtask ``old_subtask`` goes to new channel
    ``replay_owner(c, new_channels)`` (``c``'s own on a pointwise edge, which has
    one channel), with this block's ``key_groups``/``partition`` as its
    :class:`Target`'s selector. A mapping holds O(old + new subtasks) blocks
    whatever the channel count; a reader expands its own (:meth:`expand`)."""

    old_subtask: int
    key_groups: range | None = None
    partition: int | None = None

    def expand(self, old_channels: int, new_channels: int) -> tuple[ChannelSource, ...]:
        """The block's sources, by old channel."""
        d, kgs, part = self.old_subtask, self.key_groups, self.partition
        return tuple(
            ChannelSource(d, c, (Target(replay_owner(c, new_channels), kgs, part),))
            for c in range(old_channels)
        )


@dataclass(frozen=True, slots=True)
class RescaleMapping:
    """For one side of an edge: the old pieces each new subtask reads, in replay order.

    On the input side each source stands for a whole old channel: its input
    piece, then the output piece :meth:`EdgeMapping.output_piece_of` names. The
    output side reads nothing itself (``sources`` are empty); ``joined`` lists
    its pieces that input-side readers take as those tails.

    The mapping is held as :class:`SourceBlock`\\ s (``blocks``, per new subtask,
    by old subtask), O(old + new subtasks) on a key_by edge; ``sources``,
    ``joined`` and iteration expand them to every channel (O(channels): for
    tests and small edges), :meth:`for_subtask` only one new subtask's.
    """

    side: Side
    old_parallelism: int
    new_parallelism: int
    old_channels: int
    """Channels per old subtask on this side."""
    new_channels: int
    """Channels per new subtask on this side."""
    blocks: tuple[tuple[SourceBlock, ...], ...]
    """Indexed by new subtask: the old subtasks it reads (input side; empty on the
    output side), by old subtask."""
    joined_from: tuple[int, ...] = ()
    """Output side: the old downstream subtasks whose channels the downstream reads
    (each with every old upstream's output piece for it), ascending."""
    pointwise: bool = False
    """One channel per subtask pair (a forward edge): old downstream ``d``'s channel
    ends in upstream ``d``'s output piece 0."""

    @property
    def sources(self) -> tuple[tuple[ChannelSource, ...], ...]:
        """Indexed by new subtask: every old channel it reads (expanded)."""
        return tuple(self.for_subtask(i) for i in range(len(self.blocks)))

    @property
    def joined(self) -> tuple[tuple[int, int], ...]:
        """Output side: old ``(subtask, channel)`` pieces read by the downstream with
        their channel, ascending (expanded)."""
        if self.pointwise:
            return tuple((d, 0) for d in self.joined_from)
        return tuple((u, d) for u in range(self.old_parallelism) for d in self.joined_from)

    def for_subtask(self, new_subtask: int) -> tuple[ChannelSource, ...]:
        """The pieces new subtask ``new_subtask`` reads, ordered by old subtask then channel."""
        return tuple(
            s
            for b in self.blocks[new_subtask]
            for s in b.expand(self.old_channels, self.new_channels)
        )

    def old_subtasks(self, new_subtask: int) -> tuple[int, ...]:
        """The distinct old subtasks whose state files ``new_subtask`` opens."""
        return tuple(sorted({b.old_subtask for b in self.blocks[new_subtask]}))

    def __iter__(self) -> Iterator[tuple[int, ChannelSource]]:
        """Yield ``(new_subtask, source)`` for every piece read."""
        for i in range(len(self.blocks)):
            for s in self.for_subtask(i):
                yield i, s

    @property
    def is_identity(self) -> bool:
        """True when every old piece stays with its own subtask and channel, unfiltered."""
        if self.old_parallelism != self.new_parallelism or self.old_channels != self.new_channels:
            return False
        if self.side is Side.OUTPUT:
            return not any(self.blocks) and not self.discarded
        return all(blocks == (SourceBlock(i),) for i, blocks in enumerate(self.blocks))

    @property
    def discarded(self) -> tuple[tuple[int, int], ...]:
        """Old ``(subtask, channel)`` pieces nobody reads (duplicate broadcast copies)."""
        if self.side is Side.OUTPUT:
            read = set(self.joined_from)
            if self.pointwise:
                return tuple((o, 0) for o in range(self.old_parallelism) if o not in read)
            return tuple(
                (o, c)
                for o in range(self.old_parallelism)
                for c in range(self.old_channels)
                if c not in read
            )
        read = {b.old_subtask for bs in self.blocks for b in bs}
        return tuple(
            (o, c)
            for o in range(self.old_parallelism)
            if o not in read
            for c in range(self.old_channels)
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

    def output_piece_of(self, source: ChannelSource) -> tuple[int, int]:
        """The old output piece ``(upstream, subpartition)`` that ends an input source's channel."""
        if self.edge_type is EdgeType.FORWARD:
            return source.old_subtask, 0
        return source.old_channel, source.old_subtask


def _as_range(key_groups: KeyGroupRange) -> range:
    return range(key_groups.start, key_groups.end + 1)


def replay_owner(old_upstream: int, new_upstream_parallelism: int) -> int:
    """The new upstream subtask that takes over old upstream ``old_upstream``'s channels.

    Round robin (``old mod new``), so scale-down spreads old channels evenly.
    A downstream subtask replays each old channel from ``old_upstream`` (input
    piece, then output piece) on its input channel fed by this new subtask,
    before that channel's new records, so order per old channel holds.
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
    if subtask is None:
        return _ranges_table(
            max_parallelism,
            [
                key_group_range_for_operator(max_parallelism, parallelism, i)
                for i in range(parallelism)
            ],
        )
    if not 0 <= subtask < parallelism:
        raise ConfigError(f"subtask {subtask} out of range for parallelism {parallelism}")
    mine = _ranges_table(
        max_parallelism, [key_group_range_for_operator(max_parallelism, parallelism, subtask)]
    )
    return np.where(mine == 0, np.int32(subtask), np.int32(-1)).astype(np.int32)


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

    def mappings(self, in_: list[list[SourceBlock]], pointwise: bool) -> _Pair:
        """Wrap the input side's per-new-subtask blocks, and the output side they imply."""
        # An input source (d, u) also reads the output piece (u, d) of its old
        # channel, (d, 0) on a forward edge: every old upstream's piece for d.
        joined = tuple(sorted({b.old_subtask for blocks in in_ for b in blocks}))
        output = RescaleMapping(
            Side.OUTPUT,
            self.up_old,
            self.up_new,
            1 if pointwise else self.down_old,
            1 if pointwise else self.down_new,
            tuple(() for _ in range(self.up_new)),
            joined,
            pointwise,
        )
        input_ = RescaleMapping(
            Side.INPUT,
            self.down_old,
            self.down_new,
            1 if pointwise else self.up_old,
            1 if pointwise else self.up_new,
            tuple(tuple(sorted(b, key=lambda x: x.old_subtask)) for b in in_),
            (),
            pointwise,
        )
        return output, input_


def _empty(n: int) -> list[list[SourceBlock]]:
    return [[] for _ in range(n)]


def _key_by(e: _Edge) -> _Pair:
    # One block per (old downstream, new downstream) whose key-group ranges
    # intersect: O(old + new) blocks, each standing for every old upstream's channel.
    new_ranges = [key_group_range_for_operator(e.max_p, e.down_new, d) for d in range(e.down_new)]
    in_ = _empty(e.down_new)
    for d in range(e.down_old):
        rng = key_group_range_for_operator(e.max_p, e.down_old, d)
        first = operator_index_for_key_group(e.max_p, e.down_new, rng.start)
        last = operator_index_for_key_group(e.max_p, e.down_new, rng.end)
        for nd in range(first, last + 1):
            part = rng.intersection(new_ranges[nd])
            in_[nd].append(SourceBlock(d, None if part == rng else _as_range(part)))
    return e.mappings(in_, pointwise=False)


def _rebalance(e: _Edge, pointwise: bool = False) -> _Pair:
    # Unkeyed records may go anywhere, so any one-to-one placement is correct;
    # old downstream d's channels stay together at new downstream d mod P_new
    # (one channel, 0, per subtask pair when pointwise).
    in_ = _empty(e.down_new)
    for d in range(e.down_old):
        in_[d % e.down_new].append(SourceBlock(d))
    return e.mappings(in_, pointwise=pointwise)


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
    # Each new downstream inherits one old downstream's whole view: its old
    # channels, input pieces and the output pieces every old upstream held for it.
    in_ = [[SourceBlock(broadcast_source(nd, e.down_old))] for nd in range(e.down_new)]
    return e.mappings(in_, pointwise=False)


def _custom(e: _Edge) -> _Pair:
    if e.down_old == e.down_new or e.down_new == 1:
        # The partitioner would pick the same subtask again (same channel
        # count), or can only pick 0: place channels whole, like rebalance.
        return _rebalance(e)
    # Every new downstream reads every old channel and keeps the records the
    # partitioner picks for it.
    in_ = [[SourceBlock(d, partition=nd) for d in range(e.down_old)] for nd in range(e.down_new)]
    return e.mappings(in_, pointwise=False)
