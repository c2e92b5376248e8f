"""Rescaling of in-flight channel state: who replays which old channel, filtered how.

See ``docs/rescaling.md`` for the rules per edge type, with worked examples.
"""

from __future__ import annotations

from spillover.rescale.build import (
    check_partitioner,
    filter_retriever,
    rescaled_retriever,
    rescaled_retrievers,
)
from spillover.rescale.filters import (
    Filter,
    KeepAll,
    KeyGroupFilter,
    PartitionerChoice,
    PartitionerFilter,
    compose,
    filter_from_dict,
)
from spillover.rescale.mappings import (
    FORCE_FORWARD_OPTION,
    MAX_PARALLELISM_UPPER_BOUND,
    ChannelSource,
    EdgeMapping,
    EdgeType,
    Filtering,
    RescaleMapping,
    Side,
    SourceBlock,
    Target,
    broadcast_source,
    key_group_table,
    map_edge,
    replay_owner,
)
from spillover.rescale.pieces import Piece, Reference
from spillover.rescale.retriever import FilteringRetriever
from spillover.rescale.shared import SharedReplay, SharedReplayPart
from spillover.rescale.streams import OnEvent, RecordStream, ReplayBuffer

__all__ = [
    "FORCE_FORWARD_OPTION",
    "MAX_PARALLELISM_UPPER_BOUND",
    "ChannelSource",
    "EdgeMapping",
    "EdgeType",
    "Filter",
    "Filtering",
    "FilteringRetriever",
    "KeepAll",
    "KeyGroupFilter",
    "OnEvent",
    "PartitionerChoice",
    "PartitionerFilter",
    "Piece",
    "RecordStream",
    "Reference",
    "ReplayBuffer",
    "RescaleMapping",
    "SharedReplay",
    "SharedReplayPart",
    "Side",
    "SourceBlock",
    "Target",
    "broadcast_source",
    "check_partitioner",
    "compose",
    "filter_from_dict",
    "filter_retriever",
    "key_group_table",
    "map_edge",
    "replay_owner",
    "rescaled_retriever",
    "rescaled_retrievers",
]
