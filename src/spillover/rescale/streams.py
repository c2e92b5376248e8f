"""The units a filtering retriever reads and hands out: an old channel's stream of
pieces (:class:`RecordStream`) and a replayed buffer (:class:`ReplayBuffer`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt

from spillover.errors import ConfigError
from spillover.records import FieldKey
from spillover.rescale.pieces import Piece
from spillover.storage import DataType, GateStateHandle

__all__ = ["DEFAULT_KEY", "OnEvent", "RecordStream", "ReplayBuffer"]

DEFAULT_KEY = FieldKey(0, "int64")
"""The key both builders assume unless told: a little-endian int64 at the start of each record."""

OnEvent = Literal["refuse", "forward"]
"""What a retriever does with an event buffer found in channel state (see the class)."""


class ReplayBuffer(np.ndarray[Any, np.dtype[np.uint8]]):
    """One buffer to replay: a ``uint8`` array with the new ``channel_id`` and its ``data_type``.

    Filtered buffers are new arrays; pass-through buffers and events are
    read-only, zero-copy views of the read-ahead block they were read into
    (holding one keeps that block alive, as with a ``RetrievedBuffer``).
    """

    channel_id: int
    data_type: DataType

    def __array_finalize__(self, obj: npt.NDArray[Any] | None, /) -> None:
        self.channel_id = getattr(obj, "channel_id", 0)
        self.data_type = getattr(obj, "data_type", DataType.DATA)

    @property
    def is_event(self) -> bool:
        """True for an event buffer, False for data."""
        return self.data_type == DataType.EVENT


def replay_buffer(data: object, channel: int, data_type: DataType) -> ReplayBuffer:
    if isinstance(data, np.ndarray):
        arr: npt.NDArray[np.uint8] = data
    else:
        arr = np.frombuffer(data, dtype=np.uint8)  # type: ignore[call-overload]
    out = arr.view(ReplayBuffer)
    out.channel_id = channel
    out.data_type = data_type
    return out


class PolledReplay(Protocol):
    """A replay read by polling: ``poll_next()`` hands out a buffer if one is ready,
    ``wait()`` blocks until one may be, ``finished`` says nothing more comes."""

    def poll_next(self) -> ReplayBuffer | None: ...

    def wait(self, timeout: float | None = None) -> bool: ...

    @property
    def finished(self) -> bool: ...


def iter_replay(replay: PolledReplay) -> Iterator[ReplayBuffer]:
    """Every buffer of ``replay`` in order, waiting whenever none is ready yet."""
    while True:
        buf = replay.poll_next()
        if buf is not None:
            yield buf
        elif replay.finished:
            return
        else:
            replay.wait()


@dataclass(frozen=True, slots=True)
class RecordStream:
    """The in-flight records of one old channel ``old_upstream -> old_downstream``.

    ``pieces`` are ``(state handle, channel id)`` in stream order, usually the
    old downstream's input gate with channel ``old_upstream``, then the old
    upstream's output gate with subpartition ``old_downstream``. Together they
    start and end on a record boundary; a record may be cut anywhere in
    between, also where one piece ends and the next begins. ``channel`` is the
    new channel the stream's records are replayed on; ``None`` lets the
    retriever's key-group table pick one per record.
    """

    pieces: tuple[tuple[GateStateHandle, int], ...]
    old_upstream: int
    old_downstream: int
    channel: int | None = None
    # Per piece, bytes of its channel to skip first (a reference to recovered state
    # that was partly replayed when its checkpoint was taken); empty: none.
    skips: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        pieces, skips = [], []
        for piece in self.pieces:
            pieces.append((piece[0], piece[1]))
            skips.append(int(piece[2]) if len(piece) > 2 else 0)
        if self.skips:
            if len(self.skips) != len(pieces):
                raise ConfigError("skips needs one entry per piece")
            skips = [int(x) for x in self.skips]
        object.__setattr__(self, "pieces", tuple(pieces))
        object.__setattr__(self, "skips", tuple(skips) if any(skips) else ())
        if any(x < 0 for x in skips):
            raise ConfigError("a piece's skip must be >= 0")
        for handle, channel in self.pieces:
            if not isinstance(handle, GateStateHandle):
                raise ConfigError(f"a piece needs a GateStateHandle, got {type(handle).__name__}")
            if not 0 <= channel < 1 << 32:
                raise ConfigError(f"a piece's channel id must fit in 32 bits, got {channel}")
        if self.old_upstream < 0 or self.old_downstream < 0:
            raise ConfigError(f"bad old channel {self.old_upstream} -> {self.old_downstream}")
        if self.channel is not None and self.channel < 0:
            raise ConfigError(f"the new channel must be >= 0, got {self.channel}")

    @classmethod
    def of(
        cls,
        pieces: Iterable[Piece],
        old_upstream: int,
        old_downstream: int,
        channel: int | None = None,
    ) -> RecordStream:
        """The stream of ``pieces`` (each with its skip), in order."""
        ps = tuple(pieces)
        return cls(
            tuple((p.handle, p.channel) for p in ps),
            old_upstream,
            old_downstream,
            channel,
            skips=tuple(p.skip for p in ps),
        )

    @property
    def name(self) -> str:
        """``old channel u -> d``, for reports."""
        return f"old channel {self.old_upstream} -> {self.old_downstream}"

    def describe(self) -> str:
        """The stream and its pieces in one line, for error messages."""
        pieces = "; ".join(f"{h.uri} channel {c}" for h, c in self.pieces) or "no pieces"
        return f"{self.name} ({pieces})"


def frames_in(handle: GateStateHandle, channel: int) -> int | None:
    """Frames the handle records for ``channel``; None when it has no per-channel counts."""
    if sum(frames for frames, _ in handle.channels.values()) != handle.frame_count:
        return None
    return handle.channels.get(channel, (0, 0))[0]
