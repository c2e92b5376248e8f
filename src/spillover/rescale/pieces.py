"""Pieces of old channel state: the frames of one channel in one state file, less
a skipped head, as checkpoints taken during a replay reference them and as the
filtering retriever (the one replay of pieces) reads them; a :class:`Reference`, one
input channel's pieces still to replay with the filter they are kept by; and the one
error for a file that holds fewer frames than its handle says."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from spillover.errors import CorruptHeaderError, FormatError
from spillover.rescale.filters import Filter, filter_from_dict
from spillover.storage import GateStateHandle

__all__ = ["Piece", "Reference", "missing_frames"]


@dataclass(frozen=True, slots=True)
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
        """The piece as docs/format.md gives it (inside a reference's ``pieces``)."""
        return {"handle": self.handle.to_dict(), "channel": self.channel, "skip": self.skip}

    @classmethod
    def from_dict(cls, d: Any, index_uri: str | None = None) -> Piece:
        """A piece as :meth:`to_dict` wrote it; :class:`FormatError` when malformed.
        ``index_uri``: the channel index of the checkpoint whose metadata holds it."""
        try:
            handle = GateStateHandle.from_dict(d["handle"], index_uri)
            return cls(handle, int(d["channel"]), int(d["skip"]))
        except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as e:
            raise FormatError("malformed channel-state reference", detail=str(e)) from e


@dataclass(frozen=True, slots=True)
class Reference:
    """Input channel ``channel`` of gate ``gate`` still has ``pieces`` to replay, in
    order. With a ``filter`` it is one old channel's stream of a rescaled replay
    (``channel`` is only the one it was replayed on), kept by that filter; without,
    the channel's own recovered state, ahead of its file in the checkpoint."""

    gate: int
    channel: int
    pieces: tuple[Piece, ...]
    filter: Filter | None = None

    def to_dict(self) -> dict[str, Any]:
        """The reference as docs/format.md gives it (a subtask's ``references``)."""
        d: dict[str, Any] = {
            "gate": self.gate,
            "channel": self.channel,
            "pieces": [p.to_dict() for p in self.pieces],
        }
        if self.filter is not None:
            d["filter"] = self.filter.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Any, index_uri: str | None = None) -> Reference:
        """A reference as :meth:`to_dict` wrote it; :class:`FormatError` when malformed.
        ``index_uri``: the channel index of the checkpoint whose metadata holds it."""
        try:
            flt = d.get("filter")
            return cls(
                int(d["gate"]),
                int(d["channel"]),
                tuple(Piece.from_dict(p, index_uri) for p in d["pieces"]),
                filter_from_dict(flt) if flt is not None else None,
            )
        except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as e:
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
