"""The embeddable engine: persist a gate's in-flight buffers and stream them back."""

from spillover._native._storage import FORMAT_VERSION, OnRelease
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
    "FORMAT_VERSION",
    "Codec",
    "DataType",
    "FrameArrays",
    "GateKind",
    "GateStateHandle",
    "OnRelease",
    "RetrievedBuffer",
    "Retriever",
    "Storage",
    "StorageOptions",
    "Storer",
    "open_retriever",
    "open_storage",
]
