"""Rescaling of in-flight channel state: who replays which old channel, filtered how.

See ``docs/rescaling.md`` for the rules per edge type, with worked examples.
"""

from __future__ import annotations

from spillover.rescale.build import rescaled_retriever
from spillover.rescale.mappings import (
    FORCE_FORWARD_OPTION,
    MAX_PARALLELISM_UPPER_BOUND,
    ChannelSource,
    EdgeMapping,
    EdgeType,
    Filtering,
    RescaleMapping,
    Side,
    Target,
    broadcast_source,
    key_group_table,
    map_edge,
    replay_owner,
)
from spillover.rescale.retriever import FilteringRetriever
from spillover.rescale.streams import OnEvent, RecordStream, ReplayBuffer

__all__ = [
    "FORCE_FORWARD_OPTION",
    "MAX_PARALLELISM_UPPER_BOUND",
    "ChannelSource",
    "EdgeMapping",
    "EdgeType",
    "Filtering",
    "FilteringRetriever",
    "OnEvent",
    "RecordStream",
    "ReplayBuffer",
    "RescaleMapping",
    "Side",
    "Target",
    "broadcast_source",
    "key_group_table",
    "map_edge",
    "replay_owner",
    "rescaled_retriever",
]
