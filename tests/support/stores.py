"""A storage directory on one backend, with raw access to its files (contract tests)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spillover.storage.location import Location


@dataclass
class Store:
    """A fresh storage directory on one backend, and raw access to its files."""

    kind: str
    uri: str
    filesystem: Any = None
    options: dict[str, Any] = field(default_factory=dict)

    def location(self, uri: str) -> Location:
        return Location.parse(uri, self.filesystem)

    def read_bytes(self, uri: str) -> bytes:
        fs, path = self.location(uri).arrow()
        with fs.open_input_stream(path) as f:
            return bytes(f.read())

    def write_bytes(self, uri: str, data: bytes) -> None:
        fs, path = self.location(uri).arrow()
        with fs.open_output_stream(path) as f:
            f.write(data)

    @property
    def reopen(self) -> dict[str, Any]:
        """What ``open_retriever`` needs besides a handle to reach this backend."""
        return {"filesystem": self.filesystem} if self.filesystem is not None else {}
