"""Building the filtering retriever of what one new subtask replays of a rescaled edge,
from its :class:`~spillover.rescale.mappings.EdgeMapping` and the old subtasks' state
handles (docs/rescaling.md)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from spillover.errors import ConfigError, RescaleError
from spillover.keygroups import key_group_range_for_operator
from spillover.records import DEFAULT_BUFFER_SIZE, MAX_RECORD_SIZE, Key
from spillover.rescale.mappings import ChannelSource, EdgeMapping, Filtering, Side
from spillover.rescale.retriever import FilteringRetriever
from spillover.rescale.streams import DEFAULT_KEY, OnEvent, RecordStream
from spillover.storage import GateKind, GateStateHandle

__all__ = ["rescaled_retriever"]


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
    input_references: Mapping[int, Mapping[int, Any]] | None = None,
) -> RecordStream:
    if len(src.targets) != 1:
        raise RescaleError(f"an input source needs one target, got {len(src.targets)}")
    upstream, subpartition = mapping.output_piece_of(src)
    pieces: list[tuple[GateStateHandle, int, int]] = []
    # Recovered state the old downstream had not replayed yet comes first.
    for ref in (input_references or {}).get(src.old_subtask, {}).get(src.old_channel, []):
        pieces.append((ref.handle, ref.channel, ref.skip))
    head = _handle(input_handles, src.old_subtask, GateKind.INPUT, "downstream")
    if head is not None:
        pieces.append((head, src.old_channel, 0))
    tail = _handle(output_handles, upstream, GateKind.OUTPUT, "upstream")
    if tail is not None:
        pieces.append((tail, subpartition, 0))
    return RecordStream(
        tuple((h, c) for h, c, _ in pieces),
        upstream,
        src.old_subtask,
        src.targets[0].channel,
        skips=tuple(k for _, _, k in pieces),
    )


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
    input_references: Mapping[int, Mapping[int, Any]] | None = None,
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
    checkpoint referenced instead of storing (objects with ``handle``,
    ``channel``, ``skip``; see ``spillover.runtime.recovery.replay``): they are read
    before that channel's input piece. ``coalesce`` repacks whole channels into
    ``buffer_size`` buffers (needed with references when nothing is filtered).
    """
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
    common: dict[str, Any] = {
        "n_outputs": rm.new_channels,
        "on_event": on_event,
        "filesystem": filesystem,
        **retriever_options,
    }
    if all(s.filtering is Filtering.NONE for s in sources):
        return FilteringRetriever(
            streams, pass_through=True, coalesce=coalesce, buffer_size=buffer_size, **common
        )
    if any(s.filtering is Filtering.PARTITIONER for s in sources):
        if partitioner is None:
            raise RescaleError(
                "channel state of a custom-partitioned edge needs its partitioner to be rescaled",
                detail=f"new subtask {new_subtask} of {rm.new_parallelism}",
                hint="pass partitioner=, the edge's partitioner",
            )
        return FilteringRetriever(
            streams,
            key=key,
            buffer_size=buffer_size,
            max_record_size=max_record_size,
            partitioner=partitioner,
            partition=new_subtask,
            n_partitions=rm.new_parallelism,
            **common,
        )
    # Key-group sources keep the intersection of their old range and this
    # subtask's; whole ones lie inside it: one filter, this subtask's range.
    mine = key_group_range_for_operator(mapping.max_parallelism, rm.new_parallelism, new_subtask)
    for s in sources:
        kgs = s.targets[0].key_groups
        if kgs is not None and len(kgs) and not (mine.start <= kgs[0] and kgs[-1] <= mine.end):
            raise RescaleError(f"mapping keeps key groups {kgs} outside {mine!r}")
    return FilteringRetriever(
        streams,
        max_parallelism=mapping.max_parallelism,
        key_group_table=mine,
        key=key,
        buffer_size=buffer_size,
        max_record_size=max_record_size,
        **common,
    )
