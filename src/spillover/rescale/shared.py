"""One read of a rescaled edge's old channels for several new subtasks at once.

When an old key-group range is split between new subtasks (2→4: each old channel
feeds two), a :class:`~spillover.rescale.retriever.FilteringRetriever` per new
subtask reads and hashes every old channel once per subtask that shares it.
:class:`SharedReplay` reads each state file once for a group of new subtasks, in
one :class:`FilteringRetriever` whose outputs are ``(part, new channel)`` pairs:
every record is hashed once and routed, in the native demultiplexer, straight to
the one part whose key-group range holds it. Each new subtask consumes its
:class:`SharedReplayPart`, which polls like a retriever. See
``docs/rescaling.md``, section "One read for several new subtasks".
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from spillover.errors import ClosedError, ConfigError
from spillover.rescale.filters import KeyGroupFilter
from spillover.rescale.pieces import Piece
from spillover.rescale.retriever import FilteringRetriever
from spillover.rescale.streams import RecordStream, ReplayBuffer, iter_replay, replay_buffer

__all__ = ["SharedReplay", "SharedReplayPart"]

MiB = 1024 * 1024


class SharedReplay:
    """Reads a rescaled edge's old channels once for several new subtasks (parts).

    ``parts`` maps each part (a new subtask) to the streams it replays and the
    :class:`KeyGroupFilter` of its key groups (disjoint between parts, one max
    parallelism and key offset for all). A stream several parts name (the same
    old channel, the same pieces, the same new channel) is read once; each of its
    records goes to the part whose range holds its key group, on the stream's new
    channel: what each part's own retriever keeps when, as on a key_by edge, each
    old channel holds key groups of its old range only and every part whose range
    meets that range names the stream. Order per old channel is kept in each
    part, as with one retriever per part.

    Whichever part finds its queue empty reads the next read-ahead block for all
    (one native call per block, the GIL released). Memory stays bounded: no part
    reads while another part's queue holds ``max_queued_bytes`` or more, so the
    parts must be drained at once (one thread each, as the runtime runs
    subtasks, or in turn on one thread); a part never drained holds the others
    back once its queue is full, unless it is closed (its records are dropped).

    A checkpoint taken while a part replays cuts that part alone
    (:meth:`SharedReplayPart.cut`): its queued records and those the demultiplexer
    packs so far are handed out, and where each stream stands is taken at the same
    moment, with the read stopped; the other parts read on.
    """

    def __init__(
        self,
        parts: Mapping[int, tuple[Sequence[RecordStream], KeyGroupFilter]],
        *,
        buffer_size: int,
        max_queued_bytes: int | None = None,
        **options: Any,
    ) -> None:
        if not parts:
            raise ConfigError("a shared replay needs at least one part")
        filters = [f for _, f in parts.values()]
        if not all(isinstance(f, KeyGroupFilter) for f in filters):
            raise ConfigError("a shared replay filters by key group only")
        max_p = filters[0].max_parallelism
        offset = filters[0].key_offset
        if any(f.max_parallelism != max_p or f.key_offset != offset for f in filters):
            raise ConfigError("parts of a shared replay need one max parallelism and key offset")
        self.parts_ids = tuple(sorted(parts))
        slot = {p: i for i, p in enumerate(self.parts_ids)}
        self._filters = [parts[p][1] for p in self.parts_ids]
        # Per slot, its streams by old channel: what a cut part's rest is given as.
        self._streams: list[dict[tuple[int, int], RecordStream]] = [
            {(s.old_upstream, s.old_downstream): s for s in parts[p][0]} for p in self.parts_ids
        ]
        owner = np.full(max_p, -1, np.int32)  # key group -> part slot
        for p, (_, f) in parts.items():
            if (owner[f.start : f.end + 1] >= 0).any():
                raise ConfigError(f"part {p}'s key groups overlap another part's")
            owner[f.start : f.end + 1] = slot[p]
        # Merge the parts' streams by old channel: {slot: new channel} per stream read.
        merged: dict[tuple[int, int], tuple[RecordStream, dict[int, int]]] = {}
        channels = 1
        for p, (streams, _) in parts.items():
            for s in streams:
                if s.channel is None:
                    raise ConfigError(f"{s.name} has no new channel")
                read = RecordStream(s.pieces, s.old_upstream, s.old_downstream, None, s.skips)
                first, takers = merged.setdefault((s.old_upstream, s.old_downstream), (read, {}))
                if first != read:
                    raise ConfigError(f"parts read {s.name} from different pieces")
                takers[slot[p]] = s.channel
                channels = max(channels, s.channel + 1)
        self.n_channels = channels
        # One table per new channel: records of one channel must go through one
        # demultiplexer, or two could cut each other's records in a shared buffer.
        by_channel = {
            c: np.where(owner >= 0, owner * channels + c, -1).astype(np.int32)
            for c in range(channels)
        }
        tables = [by_channel[next(iter(takers.values()))] for _, takers in merged.values()]
        for read, takers in merged.values():
            if len(set(takers.values())) > 1:
                raise ConfigError(f"parts replay {read.name} on different new channels")
        union = np.full(max_p, -1, np.int32)
        for t in tables:
            union = np.where(t >= 0, t, union)
        self._retriever = FilteringRetriever(
            [read for read, _ in merged.values()],
            max_parallelism=max_p,
            key_group_table=union,
            n_outputs=len(self.parts_ids) * channels,
            buffer_size=buffer_size,
            coalesce=True,
            stream_tables=tables,
            **options,
        )
        self.max_queued_bytes = (
            max(4 * buffer_size, 4 * MiB) if max_queued_bytes is None else max_queued_bytes
        )
        self._queues: list[collections.deque[ReplayBuffer]] = [
            collections.deque() for _ in self.parts_ids
        ]
        self._queued = [0] * len(self.parts_ids)
        self._open = [True] * len(self.parts_ids)
        self._reading = threading.Lock()  # one part reads for all at a time
        self._changed = threading.Condition()  # a queue shrank or grew, or reading ended
        self._done = False
        self._error: BaseException | None = None
        self.parts = {p: SharedReplayPart(self, slot[p], p) for p in self.parts_ids}

    @property
    def blocks_read(self) -> int:
        """Read-ahead blocks read so far, for every part."""
        return self._retriever.blocks_read

    @property
    def routed(self) -> int:
        """Records handed to some part so far."""
        return self._retriever.routed

    @property
    def dropped(self) -> int:
        """Records no part keeps (their key group belongs to no part naming their stream)."""
        return self._retriever.dropped

    # -- used by the parts -------------------------------------------------------

    def _pop(self, slot: int) -> ReplayBuffer | None:
        with self._changed:
            q = self._queues[slot]
            if not q:
                return None
            buf = q.popleft()
            self._queued[slot] -= len(buf)
            self._changed.notify_all()
            return buf

    def _held_back(self, slot: int) -> bool:
        """Whether another open part's queue is full (reading now would grow it)."""
        return any(
            self._open[i] and self._queued[i] >= self.max_queued_bytes
            for i in range(len(self._queues))
            if i != slot
        )

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def _step(self, slot: int) -> bool:
        """Reads one block for every part if no one else is; whether it got anywhere."""
        if not self._reading.acquire(blocking=False):
            return False
        tried = False
        try:
            self._check()
            if self._done or self._held_back(slot):
                return False  # nothing changed: waking the others would only spin them
            tried = True
            r = self._retriever
            try:
                first = r.poll_next()
                if first is None:
                    if r.finished:
                        self._finish()
                        return True
                    return False
                bufs = [first]
                while r.ready:
                    nxt = r.poll_next()
                    assert nxt is not None
                    bufs.append(nxt)
            except BaseException as e:
                self._error = e
                with self._changed:
                    self._changed.notify_all()
                raise
            # Done only together with the last buffers: a part that saw the read done
            # before its last buffers were queued would close and lose them.
            self._queue(bufs, done=r.finished)
            return True
        finally:
            self._reading.release()
            if tried:  # a part waiting because this one was reading reads next
                with self._changed:
                    self._changed.notify_all()

    def _queue(self, bufs: Sequence[ReplayBuffer], done: bool = False) -> None:
        """Each buffer to the queue of the part its output belongs to (none if closed);
        with ``done``, the read ends in the same step, under the same lock."""
        with self._changed:
            for buf in bufs:
                s, channel = divmod(int(buf.channel_id), self.n_channels)
                if self._open[s]:
                    self._queues[s].append(replay_buffer(buf, channel, buf.data_type))
                    self._queued[s] += len(buf)
            if done:
                self._done = True
            self._changed.notify_all()

    def _cut(
        self, slot: int
    ) -> tuple[list[ReplayBuffer], list[tuple[RecordStream, tuple[Piece, ...]]]]:
        """With the read stopped: every buffer of ``slot`` queued or partly packed, and
        the rest of each of its streams from there (the other parts' packed records
        join their queues)."""
        with self._reading:
            self._check()
            r = self._retriever
            self._queue(r.cut())
            rest = [
                (self._streams[slot][(s.old_upstream, s.old_downstream)], pieces)
                for s, pieces in r.remainder()
                if (s.old_upstream, s.old_downstream) in self._streams[slot]
            ]
            with self._changed:
                out = list(self._queues[slot])
                self._queues[slot].clear()
                self._queued[slot] = 0
                self._changed.notify_all()
        return out, rest

    def _finish(self) -> None:
        with self._changed:
            self._done = True
            self._changed.notify_all()

    def _wait(self, slot: int, timeout: float | None) -> bool:
        with self._changed:
            if self._queues[slot] or self._done or self._error is not None:
                return True
            if self._held_back(slot) or self._reading.locked():
                return self._changed.wait(timeout)
        # Nothing queued and nobody reading: wait for the read-ahead.
        if not self._reading.acquire(timeout=-1 if timeout is None else timeout):
            return False
        try:
            return self._done or self._retriever.wait(timeout)
        finally:
            self._reading.release()

    def _close(self, slot: int) -> None:
        with self._changed:
            self._open[slot] = False
            self._queues[slot].clear()
            self._queued[slot] = 0
            self._changed.notify_all()
            last = not any(self._open)
        if last:
            with self._reading:
                self._retriever.close()


class SharedReplayPart:
    """One new subtask's share of a :class:`SharedReplay`: polls like a retriever.

    ``poll_next()`` never waits; it returns the next buffer (a ``ReplayBuffer`` with
    this subtask's new channel) or ``None``, and ``finished`` tells whether for good.
    """

    def __init__(self, shared: SharedReplay, slot: int, subtask: int) -> None:
        self._shared = shared
        self._slot = slot
        self.subtask = subtask
        self._closed = False
        self._rest: list[tuple[RecordStream, tuple[Piece, ...]]] | None = None

    @property
    def filter(self) -> KeyGroupFilter:
        """What this part keeps: its subtask's key groups (as a reference records it)."""
        return self._shared._filters[self._slot]

    @property
    def blocks_read(self) -> int:
        """Read-ahead blocks the shared read took so far, for every part."""
        return self._shared.blocks_read

    def cut(self) -> list[ReplayBuffer]:
        """Every buffer of this part read so far, partly packed ones too, taken with the
        read stopped; :meth:`remainder` then says where each of its streams stands at
        that moment, whatever the other parts read meanwhile."""
        if self._closed:
            raise ClosedError("shared replay part is closed")
        out, self._rest = self._shared._cut(self._slot)
        return out

    def remainder(
        self, held: Callable[[RecordStream], int] | None = None
    ) -> list[tuple[RecordStream, tuple[Piece, ...]]]:
        """Per stream of this part not replayed to its end at the last :meth:`cut`,
        ``(stream, pieces)`` from the first byte of the record it had begun (as
        :meth:`FilteringRetriever.remainder`; only whole records are handed out, so
        ``held`` must be None)."""
        if held is not None:
            raise ConfigError("a shared replay part hands out whole records only")
        if self._rest is None:
            raise ConfigError("cut a shared replay part before asking for its remainder")
        rest, self._rest = self._rest, None
        return rest

    def poll_next(self) -> ReplayBuffer | None:
        """The next buffer if one is ready, else ``None``."""
        if self._closed:
            raise ClosedError("shared replay part is closed")
        sh = self._shared
        while True:
            buf = sh._pop(self._slot)
            if buf is not None:
                return buf
            sh._check()
            if sh._done or not sh._step(self._slot):
                return sh._pop(self._slot)

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until ``poll_next()`` may make progress; False on timeout."""
        if self._closed:
            raise ClosedError("shared replay part is closed")
        return self._shared._wait(self._slot, timeout)

    @property
    def ready(self) -> bool:
        """Whether ``poll_next()`` has a buffer without reading anything."""
        return bool(self._shared._queues[self._slot])

    @property
    def finished(self) -> bool:
        """True once the shared read ended and this part's buffers are all handed out."""
        return self._shared._done and not self._shared._queues[self._slot]

    def __iter__(self) -> Iterator[ReplayBuffer]:
        return iter_replay(self)

    def close(self) -> None:
        """Stops taking this part's buffers; the last part closed ends the read."""
        if not self._closed:
            self._closed = True
            self._shared._close(self._slot)

    def __enter__(self) -> SharedReplayPart:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
