"""spillover: persist, stream back and rescale the in-flight data of streaming dataflows."""

from __future__ import annotations

from spillover.errors import SpilloverError
from spillover.storage import (
    Codec,
    DataType,
    GateKind,
    GateStateHandle,
    RetrievedBuffer,
    Retriever,
    Storage,
    StorageOptions,
    Storer,
    open_retriever,
    open_storage,
)

__version__ = "0.1.0"

__all__ = [
    "Codec",
    "DataType",
    "GateKind",
    "GateStateHandle",
    "RetrievedBuffer",
    "Retriever",
    "SpilloverError",
    "Storage",
    "StorageOptions",
    "Storer",
    "open_retriever",
    "open_storage",
]
