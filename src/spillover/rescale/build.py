"""Building filtering retrievers: what one new subtask replays of a rescaled edge, from
its :class:`~spillover.rescale.mappings.EdgeMapping` and the old subtasks' state
handles (:func:`rescaled_retriever`); and old channels' streams replayed under a typed
:class:`~spillover.rescale.filters.Filter` (:func:`filter_retriever`), as a
checkpoint taken during a replay references them (docs/rescaling.md)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from spillover.errors import ConfigError, RescaleError
from spillover.keygroups import KeyGroupRange, key_group_range_for_operator
from spillover.records import (
    DEFAULT_BUFFER_SIZE,
    MAX_RECORD_SIZE,
    FieldKey,
    Key,
    partitioner_name,
    partitions_of,
)
from spillover.rescale.filters import (
    Filter,
    KeepAll,
    KeyGroupFilter,
    PartitionerChoice,
    PartitionerFilter,
)
from spillover.rescale.mappings import ChannelSource, EdgeMapping, Filtering, Side
from spillover.rescale.pieces import Piece
from spillover.rescale.retriever import FilteringRetriever
from spillover.rescale.shared import SharedReplay, SharedReplayPart
from spillover.rescale.streams import DEFAULT_KEY, OnEvent, RecordStream
from spillover.storage import GateKind, GateStateHandle

__all__ = [
    "check_partitioner",
    "filter_retriever",
    "rescaled_retriever",
    "rescaled_retrievers",
]

Partitioner = Callable[[npt.NDArray[np.int64], int], npt.ArrayLike]


def _handle(
    handles: Mapping[int, GateStateHandle | None], index: int, kind: GateKind, who: str
) -> GateStateHandle | None:
    if index not in handles:
        raise RescaleError(
            f"no state handle for old {who} {index}",
            hint="pass None for a subtask that stored no in-flight data on this edge",
        )
    handle = handles[index]
    if handle is not None and handle.gate_kind is not kind:
        raise ConfigError(
            f"old {who} {index}: expected an {kind.name.lower()} gate, "
            f"got {handle.gate_kind.name.lower()} ({handle.uri})"
        )
    return handle


def _stream_of(
    mapping: EdgeMapping,
    src: ChannelSource,
    input_handles: Mapping[int, GateStateHandle | None],
    output_handles: Mapping[int, GateStateHandle | None],
    input_references: Mapping[int, Mapping[int, Sequence[Piece]]] | None = None,
) -> RecordStream:
    if len(src.targets) != 1:
        raise RescaleError(f"an input source needs one target, got {len(src.targets)}")
    upstream, subpartition = mapping.output_piece_of(src)
    # Recovered state the old downstream had not replayed yet comes first.
    pieces = list((input_references or {}).get(src.old_subtask, {}).get(src.old_channel, ()))
    head = _handle(input_handles, src.old_subtask, GateKind.INPUT, "downstream")
    if head is not None:
        pieces.append(Piece(head, src.old_channel))
    tail = _handle(output_handles, upstream, GateKind.OUTPUT, "upstream")
    if tail is not None:
        pieces.append(Piece(tail, subpartition))
    return RecordStream.of(pieces, upstream, src.old_subtask, src.targets[0].channel)


def rescaled_retriever(
    mapping: EdgeMapping,
    side: Side | str,
    new_subtask: int,
    *,
    input_handles: Mapping[int, GateStateHandle | None],
    output_handles: Mapping[int, GateStateHandle | None],
    key: Key = DEFAULT_KEY,
    buffer_size: int = DEFAULT_BUFFER_SIZE,
    on_event: OnEvent = "refuse",
    max_record_size: int = MAX_RECORD_SIZE,
    filesystem: Any = None,
    partitioner: Callable[[npt.NDArray[np.int64], int], npt.ArrayLike] | None = None,
    coalesce: bool = False,
    input_references: Mapping[int, Mapping[int, Sequence[Piece]]] | None = None,
    **retriever_options: Any,
) -> FilteringRetriever:
    """The retriever of what new subtask ``new_subtask`` on ``side`` of an edge replays.

    ``input_handles`` maps each old downstream subtask to its input gate's
    handle for this edge, ``output_handles`` each old upstream subtask to its
    output gate's handle (``None``: that subtask stored nothing there; a
    missing subtask is an error). A new downstream reads each of its old
    channels whole, input piece then output piece, on the new input channel
    the mapping names; when every channel is taken whole the buffers pass
    through unparsed, else records are kept by the subtask's key-group range.
    A new upstream replays nothing (the retriever is empty).

    ``input_references`` maps an old downstream to ``{channel: pieces}`` its
    checkpoint referenced instead of storing (:class:`~spillover.rescale.pieces.Piece`,
    see ``spillover.runtime.recovery.replay``): they are read
    before that channel's input piece. ``coalesce`` repacks whole channels into
    ``buffer_size`` buffers (needed with references when nothing is filtered).
    """
    streams, flt, n_channels = _subtask_plan(
        mapping,
        side,
        new_subtask,
        input_handles,
        output_handles,
        key,
        partitioner,
        input_references,
    )
    return filter_retriever(
        streams,
        flt,
        partitioner=partitioner,
        key=key,
        coalesce=coalesce,
        buffer_size=buffer_size,
        max_record_size=max_record_size,
        n_outputs=n_channels,
        on_event=on_event,
        filesystem=filesystem,
        **retriever_options,
    )


def rescaled_retrievers(
    mapping: EdgeMapping,
    side: Side | str,
    new_subtasks: Iterable[int],
    *,
    input_handles: Mapping[int, GateStateHandle | None],
    output_handles: Mapping[int, GateStateHandle | None],
    key: Key = DEFAULT_KEY,
    buffer_size: int = DEFAULT_BUFFER_SIZE,
    on_event: OnEvent = "refuse",
    max_record_size: int = MAX_RECORD_SIZE,
    filesystem: Any = None,
    partitioner: Callable[[npt.NDArray[np.int64], int], npt.ArrayLike] | None = None,
    input_references: Mapping[int, Mapping[int, Sequence[Piece]]] | None = None,
    max_queued_bytes: int | None = None,
    **retriever_options: Any,
) -> dict[int, FilteringRetriever | SharedReplayPart]:
    """What each of ``new_subtasks`` replays, as :func:`rescaled_retriever` gives it
    (``coalesce=True``), with each old channel read once for all of them where they
    filter by key group: the parts of one :class:`~spillover.rescale.shared.SharedReplay`
    per group of subtasks sharing old channels (2→4: two groups of two), to be drained
    at once (one thread each, or in turn; ``max_queued_bytes`` bounds what waits for
    each). Edges whose old channels are taken whole or split by a
    custom partitioner get one retriever per subtask."""
    subtasks = sorted(set(new_subtasks))
    common: dict[str, Any] = {
        "buffer_size": buffer_size,
        "on_event": on_event,
        "max_record_size": max_record_size,
        "filesystem": filesystem,
        **retriever_options,
    }
    plans = {
        i: _subtask_plan(
            mapping, side, i, input_handles, output_handles, key, partitioner, input_references
        )
        for i in subtasks
    }
    keyed = {i: (s, f) for i, (s, f, _) in plans.items() if isinstance(f, KeyGroupFilter) and s}
    out: dict[int, FilteringRetriever | SharedReplayPart] = {}
    for group in _sharing(keyed):
        if len(group) > 1:
            shared = SharedReplay(
                {i: keyed[i] for i in group},
                key=key,
                max_queued_bytes=max_queued_bytes,
                **common,
            )
            out.update(shared.parts)
    for i, (streams, flt, n_channels) in plans.items():
        if i not in out:
            out[i] = filter_retriever(
                streams,
                flt,
                partitioner=partitioner,
                key=key,
                coalesce=True,
                n_outputs=n_channels,
                **common,
            )
    return {i: out[i] for i in subtasks}


def _sharing(plans: Mapping[int, tuple[Sequence[RecordStream], Filter]]) -> list[list[int]]:
    """The subtasks in groups that share old channels, transitively: each group is read
    once, and groups that share nothing read at once, each on its subtasks' threads."""
    group = {i: i for i in plans}

    def root(i: int) -> int:
        while group[i] != i:
            group[i] = group[group[i]]
            i = group[i]
        return i

    reader: dict[tuple[int, int], int] = {}
    for i, (streams, _) in plans.items():
        for s in streams:
            j = reader.setdefault((s.old_upstream, s.old_downstream), i)
            group[root(i)] = root(j)
    out: dict[int, list[int]] = {}
    for i in plans:
        out.setdefault(root(i), []).append(i)
    return list(out.values())


def _subtask_plan(
    mapping: EdgeMapping,
    side: Side | str,
    new_subtask: int,
    input_handles: Mapping[int, GateStateHandle | None],
    output_handles: Mapping[int, GateStateHandle | None],
    key: Key,
    partitioner: Partitioner | None,
    input_references: Mapping[int, Mapping[int, Sequence[Piece]]] | None,
) -> tuple[list[RecordStream], Filter, int]:
    """One new subtask's streams, the filter of what it keeps and its new channels."""
    side = Side(side.strip().lower()) if isinstance(side, str) else side
    rm = mapping.side(side)
    if not 0 <= new_subtask < rm.new_parallelism:
        raise ConfigError(
            f"new subtask {new_subtask} out of range for parallelism {rm.new_parallelism}"
        )
    sources = rm.for_subtask(new_subtask)
    streams = [
        _stream_of(mapping, s, input_handles, output_handles, input_references) for s in sources
    ]
    flt: Filter
    if all(s.filtering is Filtering.NONE for s in sources):
        flt = KeepAll()
    elif any(s.filtering is Filtering.PARTITIONER for s in sources):
        check_partitioner((), partitioner)
        assert partitioner is not None
        offset = key.offset if isinstance(key, FieldKey) else 0
        name = partitioner_name(partitioner)
        flt = PartitionerFilter((PartitionerChoice(name, new_subtask, rm.new_parallelism, offset),))
    else:
        # Key-group sources keep the intersection of their old range and this
        # subtask's; whole ones lie inside it: one filter, this subtask's range.
        mine = key_group_range_for_operator(
            mapping.max_parallelism, rm.new_parallelism, new_subtask
        )
        for s in sources:
            kgs = s.targets[0].key_groups
            if kgs is not None and len(kgs) and not (mine.start <= kgs[0] and kgs[-1] <= mine.end):
                raise RescaleError(f"mapping keeps key groups {kgs} outside {mine!r}")
        offset = key.offset if isinstance(key, FieldKey) else 0
        flt = KeyGroupFilter(mine.start, mine.end, mapping.max_parallelism, offset)
    return streams, flt, rm.new_channels


def check_partitioner(names: Collection[str], partitioner: Partitioner | None) -> None:
    """Refuses (:class:`RescaleError`) to filter by custom partitioners ``names``
    (empty: the edge's own, whichever it is) with ``partitioner``, the edge's:
    without it, or with another one, a replay could not tell which records to keep."""
    have = partitioner_name(partitioner) if partitioner is not None else None
    if have is not None and (not names or set(names) == {have}):
        return
    wanted = sorted(names) if names else "the edge's custom partitioner"
    raise RescaleError(
        "in-flight data is filtered by another partitioner than the edge's",
        detail=f"filtered by: {wanted}, edge: {have}",
        hint="restore with the partitioner the checkpoint was taken with, or restore "
        "without in-flight data",
    )


def filter_retriever(
    streams: list[RecordStream],
    flt: Filter,
    *,
    partitioner: Partitioner | None,
    key: Key | None = None,
    coalesce: bool = True,
    buffer_size: int = DEFAULT_BUFFER_SIZE,
    **retriever_options: Any,
) -> FilteringRetriever:
    """A filtering retriever replaying ``streams`` (each with its new channel), keeping
    what ``flt`` keeps; ``partitioner`` is the edge's, which a partitioner filter must
    name (:func:`check_partitioner`). ``key`` reads the key (default: the filter's
    int64 at its offset); ``coalesce=False`` with :class:`KeepAll` passes buffers
    through unparsed. The retriever keeps ``flt`` (``FilteringRetriever.filter``)."""
    common: dict[str, Any] = {
        "buffer_size": buffer_size,
        "n_outputs": 1 + max((s.channel or 0 for s in streams), default=0),
        "keeps": flt,
        **retriever_options,
    }
    if isinstance(flt, KeepAll):
        return FilteringRetriever(streams, pass_through=True, coalesce=coalesce, **common)
    if isinstance(flt, KeyGroupFilter):
        return FilteringRetriever(
            streams,
            max_parallelism=flt.max_parallelism,
            key_group_table=KeyGroupRange(flt.start, flt.end),
            key=key or FieldKey(flt.key_offset, "int64"),
            **common,
        )
    check_partitioner(flt.names, partitioner)
    assert partitioner is not None
    if len(flt.choices) == 1:
        fn, index, n = partitioner, flt.choices[0].index, flt.choices[0].parallelism
    else:
        fn, index, n = _all_of(partitioner, [(c.index, c.parallelism) for c in flt.choices]), 0, 2
    return FilteringRetriever(
        streams,
        key=key or FieldKey(flt.choices[0].key_offset, "int64"),
        partitioner=fn,
        partition=index,
        n_partitions=n,
        **common,
    )


def _all_of(partitioner: Partitioner, keep: list[tuple[int, int]]) -> Partitioner:
    """A partitioner sending a record to 0 when ``partitioner`` picks ``index`` of
    ``parallelism`` for every pair of ``keep``, else to 1 (one numpy call per pair)."""

    def both(keys: npt.NDArray[np.int64], _n: int) -> npt.ArrayLike:
        ok = np.ones(len(keys), bool)
        for index, n in keep:
            ok &= partitions_of(partitioner, keys, n) == index
        return np.where(ok, 0, 1)

    both.__qualname__ = f"all_of({getattr(partitioner, '__qualname__', '?')})"
    return both
