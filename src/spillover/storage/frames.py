"""Frames handed out a block at a time (``Retriever.poll_frames``), by either reader."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["FrameArrays"]


@dataclass(frozen=True, slots=True)
class FrameArrays:
    """The frames of one read-ahead block at once (``Retriever.poll_frames``).

    Frame ``i`` has payload ``data[offsets[i]:offsets[i] + lengths[i]]`` (raw bytes,
    decoded if it was compressed), channel ``channel_ids[i]``, ``data_types[i]``
    (0 data, 1 event) and its frame header at byte ``file_offsets[i]`` of the file.
    ``data`` is a read-only view of the block (no copy) and keeps it alive.
    """

    data: Any
    channel_ids: Any
    offsets: Any
    lengths: Any
    data_types: Any
    file_offsets: Any

    def __len__(self) -> int:
        return len(self.channel_ids)

    @property
    def nbytes(self) -> int:
        """Payload bytes of the frames."""
        return int(self.lengths.sum())
