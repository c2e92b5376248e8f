"""Pieces of old channel state: the frames of one channel in one state file, less
a skipped head, as checkpoints taken during a replay reference them and as both
replays (a restored task's own state, and the filtering retriever of a rescale)
read them; and the one error for a file that holds fewer of them than its handle
says."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from spillover.errors import CorruptHeaderError, FormatError
from spillover.storage import GateStateHandle

__all__ = ["Piece", "missing_frames"]


@dataclass
class Piece:
    """Frames of one channel in one state file, less the first ``skip`` bytes."""

    handle: GateStateHandle
    channel: int
    skip: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the channel in the file (the handle's count)."""
        return self.handle.channels.get(self.channel, (0, 0))[1]

    def to_dict(self) -> dict[str, Any]:
        return {"handle": self.handle.to_dict(), "channel": self.channel, "skip": self.skip}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Piece:
        try:
            return cls(GateStateHandle.from_dict(d["handle"]), int(d["channel"]), int(d["skip"]))
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise FormatError("malformed channel-state reference", detail=str(e)) from e


def missing_frames(uri: str, missing: int, channels: Iterable[int]) -> CorruptHeaderError:
    """A state file holds fewer frames of ``channels`` than its handle counts: the file
    was replaced or the handle belongs to another file (never a silent loss)."""
    return CorruptHeaderError(
        "state file holds fewer frames of a channel than its handle says",
        path=uri,
        detail=f"{missing} frames of channels {sorted(channels)} missing",
        hint="the file was replaced, or the handle belongs to another file",
    )
