"""The embeddable engine: persist a gate's in-flight buffers and stream them back."""

from spillover.storage.engine import (
    FrameArrays,
    RetrievedBuffer,
    Retriever,
    Storage,
    StorageOptions,
    Storer,
    open_retriever,
    open_storage,
)
from spillover.storage.handle import Codec, DataType, GateKind, GateStateHandle

__all__ = [
    "Codec",
    "DataType",
    "FrameArrays",
    "GateKind",
    "GateStateHandle",
    "RetrievedBuffer",
    "Retriever",
    "Storage",
    "StorageOptions",
    "Storer",
    "open_retriever",
    "open_storage",
]
