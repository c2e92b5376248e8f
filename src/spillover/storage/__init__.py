"""The embeddable engine: persist a gate's in-flight buffers and stream them back."""

from spillover._native._storage import FORMAT_VERSION, OnRelease
from spillover.storage.handle import Codec, DataType, GateKind, GateStateHandle
from spillover.storage.options import StorageOptions
from spillover.storage.retriever import (
    FrameArrays,
    RetrievedBuffer,
    Retriever,
    check_ends,
    open_retriever,
)
from spillover.storage.storer import Storage, Storer, open_storage

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
    "check_ends",
    "open_retriever",
    "open_storage",
]
