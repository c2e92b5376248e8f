"""Stream old channels' in-flight records back to one new subtask, filtered.

After a rescale, a new subtask replays the in-flight records of the old
channels the mapping gives it, keeping only its own. Each old channel is a
:class:`~spillover.rescale.streams.RecordStream`: the downstream's input piece,
then the upstream's output piece, one byte stream in which a record may be cut
anywhere, between the pieces too. :class:`FilteringRetriever` reads the pieces
lazily, one open state file at a time, routes whole records by key group (or by
a custom partitioner) with the native demultiplexers (per old channel, so cut
records are joined again), and hands out full network buffers per new channel.
``build.py`` makes one from an edge mapping or from a typed filter. See
``docs/rescaling.md``, section "Filtering retriever".

One module for one pipeline (open pieces in order, join cut records, filter,
pack): its stages share the per-channel reassembly state and are only correct
together.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from spillover._native import _records
from spillover.errors import (
    ClosedError,
    ConfigError,
    CorruptRecordError,
    RescaleError,
)
from spillover.keygroups import KeyGroupRange, check_max_parallelism
from spillover.records import (
    DEFAULT_BUFFER_SIZE,
    MAX_RECORD_SIZE,
    FieldKey,
    Key,
    KeyGroupDemux,
    PartitionerDemux,
)
from spillover.rescale.filters import (
    Filter,
)
from spillover.rescale.pieces import Piece, missing_frames
from spillover.rescale.streams import (
    DEFAULT_KEY,
    OnEvent,
    RecordStream,
    ReplayBuffer,
    frames_in,
    iter_replay,
    replay_buffer,
)
from spillover.storage import (
    DataType,
    FrameArrays,
    GateStateHandle,
    RetrievedBuffer,
    Retriever,
    StorageOptions,
    open_retriever,
)

__all__ = ["FilteringRetriever"]

# One file of the read plan: ``(handle, {channel: stream index}, frames to read or
# None, phase, channel -> stream table)``; the table is what ``route_frames`` takes.
_PlanEntry = tuple[GateStateHandle, dict[int, int], int | None, int, npt.NDArray[np.int32]]


@dataclass(frozen=True, slots=True)
class _TableRoute:
    """A route of streams given their own key-group table (``stream_tables``)."""

    index: int


Route = int | None | _TableRoute
"""Where a stream's records go: its new channel, the common table (None) or its own table."""


def _table(
    key_group_table: npt.ArrayLike | KeyGroupRange, max_parallelism: int, n_outputs: int
) -> npt.NDArray[np.int32]:
    if isinstance(key_group_table, KeyGroupRange):
        r = key_group_table
        if len(r) and r.end >= max_parallelism:
            raise ConfigError(f"{r!r} exceeds max parallelism {max_parallelism}")
        table = np.full(max_parallelism, -1, dtype=np.int32)
        table[r.start : r.end + 1] = 0
        return table
    arr = np.asarray(key_group_table)
    if arr.shape != (max_parallelism,) or arr.dtype.kind not in "iu":
        raise ConfigError(
            f"key_group_table needs one integer per key group ({max_parallelism}), "
            f"got shape {arr.shape} of {arr.dtype}"
        )
    if ((arr < -1) | (arr >= n_outputs)).any():
        raise ConfigError(f"key_group_table entries must be -1 or in 0..{n_outputs - 1}")
    return arr.astype(np.int32)


class FilteringRetriever:
    """Replays old channels' records that belong to one new subtask, as full network buffers.

    Streams are read one after the other, each piece with its own
    :func:`~spillover.open_retriever` opened only when the stream reaches it
    (frames of other channels in the same file are skipped; a piece the handle
    shows empty is not opened). Each data buffer goes through a native
    :class:`~spillover.records.KeyGroupDemux` with the stream as the demux
    channel, so a record cut between buffers, pieces or files comes out
    whole. Records whose key group ``key_group_table`` maps to an output are
    packed into ``buffer_size`` buffers framed like the input; the others are
    dropped. The table is an int32 array of ``max_parallelism`` entries (an
    output index, or -1), or a :class:`KeyGroupRange` (kept on output 0).

    Order is kept per old channel (and so per key within it), not across old
    channels: a new channel receives its old channels' records stream by
    stream. Every output buffer is full except the last one of each new
    channel, handed out when its last stream ends, and those ahead of an
    event. A stream that ends inside a record raises
    :class:`~spillover.errors.CorruptRecordError` naming it and its pieces:
    the checkpoint lost data, which is never skipped silently.

    With ``pass_through`` (the mapping takes every record whole), buffers go
    out as they were stored, zero-copy and unparsed, on the stream's channel.

    Event buffers in channel state describe the old channel (Flink itself
    persists data buffers only). ``on_event="refuse"`` (default) raises
    :class:`~spillover.errors.RescaleError` at the first one.
    ``"forward"`` replays it in place: it must sit on a record boundary; the
    records before it are flushed first, then it goes out on the stream's
    channel (or on every output the table routes to).

    ``keeps`` is the :class:`~spillover.rescale.filters.Filter` the retriever was
    built from (``build.filter_retriever``), which a reference to its rest records.

    ``stream_tables`` (filtering by key group, streams without a channel) gives each
    stream its own table, one int32 output or -1 per key group, instead of the
    common ``key_group_table``: streams with equal tables share a demultiplexer.
    A :class:`~spillover.rescale.shared.SharedReplay` reads once for several new
    subtasks this way, each output being one new subtask's new channel.

    Memory stays bounded: one open retriever's read-ahead, one partly filled
    buffer per output, one partial record per stream and the buffers one
    input buffer produced. ``poll_next()`` never waits for data (opening the
    next state file reads its header and trailer) and, filtering, takes at most
    one read-ahead block per call (``blocks_read`` counts them).
    """

    def __init__(
        self,
        streams: Iterable[RecordStream],
        *,
        max_parallelism: int | None = None,
        key_group_table: npt.ArrayLike | KeyGroupRange | None = None,
        key: Key = DEFAULT_KEY,
        n_outputs: int = 1,
        buffer_size: int = DEFAULT_BUFFER_SIZE,
        pass_through: bool = False,
        on_event: OnEvent = "refuse",
        max_record_size: int = MAX_RECORD_SIZE,
        filesystem: Any = None,
        partitioner: Callable[[npt.NDArray[np.int64], int], npt.ArrayLike] | None = None,
        partition: int | None = None,
        n_partitions: int | None = None,
        coalesce: bool = False,
        keeps: Filter | None = None,
        stream_tables: Sequence[npt.ArrayLike] | None = None,
        **retriever_options: Any,
    ) -> None:
        self.streams = tuple(streams)
        if not all(isinstance(s, RecordStream) for s in self.streams):
            raise ConfigError("streams must be RecordStream objects")
        ids = [(s.old_upstream, s.old_downstream) for s in self.streams]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ConfigError(f"old channel {dup[0]} -> {dup[1]} is given twice")
        if on_event not in ("refuse", "forward"):
            raise ConfigError(f"on_event must be 'refuse' or 'forward', got {on_event!r}")
        if not 1 <= n_outputs < 1 << 31:
            raise ConfigError(f"n_outputs must be at least 1, got {n_outputs}")
        for s in self.streams:
            if s.channel is not None and s.channel >= n_outputs:
                raise ConfigError(
                    f"{s.name} goes to channel {s.channel}, not in 0..{n_outputs - 1}"
                )
        try:
            StorageOptions(**retriever_options)
        except TypeError as e:
            raise ConfigError("unknown retriever option", detail=str(e)) from e
        if pass_through and not coalesce and any(st.skips for st in self.streams):
            raise ConfigError("pieces with skip need coalesce=True or filtering")
        self.n_outputs = n_outputs
        # pass_through with coalesce: records are reassembled per stream and repacked
        # into buffer_size buffers without reading keys (the filtering path, keep all).
        self._keep_all = pass_through and coalesce
        self.pass_through = pass_through and not coalesce
        self.on_event: OnEvent = on_event
        self._filesystem = filesystem
        self._options = retriever_options
        self._demux_args: dict[str, Any] = {}
        self._table = np.zeros(0, dtype=np.int32)
        self._partitioner = partitioner
        self._partition = (partition or 0, n_partitions or 1)
        if pass_through:
            if key_group_table is not None:
                raise ConfigError("pass_through takes records whole; drop key_group_table")
            if coalesce:
                self._table = np.zeros(1, dtype=np.int32)
                self._demux_args = {
                    "max_parallelism": 1,
                    "key": FieldKey(0, "int32"),
                    "buffer_size": buffer_size,
                    "max_record_size": max_record_size,
                }
        elif partitioner is not None:
            if partition is None or n_partitions is None or not 0 <= partition < n_partitions:
                raise ConfigError("a partitioner filter needs partition in 0..n_partitions-1")
            if any(s.channel is None for s in self.streams):
                raise ConfigError("a partitioner filter needs every stream's channel")
            if not isinstance(key, FieldKey):
                raise ConfigError("a partitioner filter reads an int FieldKey")
            self._demux_args = {
                "key": key,
                "buffer_size": buffer_size,
                "max_record_size": max_record_size,
            }
        else:
            if max_parallelism is None or key_group_table is None:
                raise ConfigError("filtering needs max_parallelism and key_group_table")
            check_max_parallelism(max_parallelism)
            self._table = _table(key_group_table, max_parallelism, n_outputs)
            routed = {s.channel is None for s in self.streams}
            if len(routed) > 1:
                # Two demultiplexers writing one channel could cut each other's records.
                raise ConfigError("give every stream a channel, or none (the table then routes)")
            self._demux_args = {
                "max_parallelism": max_parallelism,
                "key": key,
                "buffer_size": buffer_size,
                "max_record_size": max_record_size,
            }
            KeyGroupDemux(kg_to_output=self._table, n_outputs=n_outputs, **self._demux_args)
        # A route is what a stream's records go through: its channel (None: the table
        # picks), or with stream_tables the index of its table among the distinct ones.
        self._routes: list[Route] = [s.channel for s in self.streams]
        self._route_tables: list[npt.NDArray[np.int32]] = []
        if stream_tables is not None:
            if (
                pass_through
                or partitioner is not None
                or max_parallelism is None
                or len(stream_tables) != len(self.streams)
                or any(s.channel is not None for s in self.streams)
            ):
                raise ConfigError(
                    "stream_tables needs key-group filtering, one table per stream "
                    "and no stream channel"
                )
            assert max_parallelism is not None
            distinct: dict[bytes, int] = {}
            for i, t in enumerate(stream_tables):
                table = _table(t, max_parallelism, n_outputs)
                k = distinct.setdefault(table.tobytes(), len(distinct))
                if k == len(self._route_tables):
                    self._route_tables.append(table)
                self._routes[i] = _TableRoute(k)
            outs = [set(np.unique(t[t >= 0]).tolist()) for t in self._route_tables]
            if sum(map(len, outs)) != len(set().union(*outs)):
                # Two demultiplexers writing one output could cut each other's records.
                raise ConfigError("stream tables that differ must route to different outputs")
        self._stream_keys: list[object] = [self._key(st) for st in self.streams]
        self._single_route = len(set(self._routes)) <= 1
        # Per route, each stream's slot if the route is its own, else -1; the last entry
        # (-1) is where a frame of no stream (slot -1) looks up: a block's slots for one
        # route's demultiplexer in one indexing.
        self._route_slots = {
            r: np.array(
                [i if route == r else -1 for i, route in enumerate(self._routes)] + [-1], np.int32
            )
            for r in set(self._routes)
        }
        # Outputs a stream's records can reach: where a forwarded event goes.
        self._table_outputs = sorted({int(o) for o in np.unique(self._table) if o >= 0})
        for t in self._route_tables:
            self._table_outputs = sorted(
                {*self._table_outputs, *(int(o) for o in np.unique(t) if o >= 0)}
            )
        # A route is a stream's channel (None: the table picks); its demux is
        # created at its first data and finished after its last stream.
        self._last_of_route = {r: i for i, r in enumerate(self._routes)}
        self._demuxes: dict[Route, KeyGroupDemux | PartitionerDemux] = {}
        self._counts = [0, 0]  # routed, dropped by retired demuxes
        self._ready: collections.deque[ReplayBuffer] = collections.deque()
        self._stream = 0
        self._piece = 0
        self._retriever: Retriever | None = None
        self._piece_channel = 0
        self._left: int | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._plan: list[_PlanEntry] | None = None
        self._plan_skips: dict[tuple[int, int], int] = {}  # (plan entry, channel) -> bytes
        self._skip: dict[int, int] = {}
        self._file = 0
        self._file_left: int | None = None
        self._files_ended = False
        # Bytes fed to the demux per stream and piece (after its skip): where a
        # checkpoint taken meanwhile cuts each stream (remainder).
        self._fed = [[0] * len(st.pieces) for st in self.streams]
        self._keeps = keeps
        # Read-ahead blocks taken so far (filtering mode): ``poll_next`` takes at most
        # one per call, so a caller can bound its work per step.
        self.blocks_read = 0

    # -- consumer side -------------------------------------------------------

    def poll_next(self) -> ReplayBuffer | None:
        """The next buffer if one is ready, else ``None`` (``finished`` tells whether for good)."""
        self._check_usable()
        if not self.pass_through:
            try:
                return self._poll_files()
            except BaseException as e:
                self._fail(e)
                raise
        try:
            while not self._ready:
                if self._stream >= len(self.streams):
                    return None
                r = self._retriever
                if r is None:
                    self._open_piece()
                    continue
                buf = r.poll_next()
                if buf is None:
                    if not r.finished:
                        return None
                    self._end_piece()
                elif buf.channel_id == self._piece_channel:
                    self._take(buf)
            return self._ready.popleft()
        except BaseException as e:
            self._fail(e)
            raise

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until ``poll_next()`` can make progress; False on timeout."""
        self._check_usable()
        if self._ready or self._retriever is None:
            return True
        try:
            return self._retriever.wait(timeout)
        except BaseException as e:
            self._fail(e)
            raise

    @property
    def ready(self) -> bool:
        """Whether ``poll_next()`` has a buffer without reading anything."""
        return bool(self._ready)

    @property
    def finished(self) -> bool:
        """True once every stream is read and every buffer handed out."""
        return not self._ready and self._stream >= len(self.streams)

    def __iter__(self) -> Iterator[ReplayBuffer]:
        return iter_replay(self)

    @property
    def routed(self) -> int:
        """Records handed to an output so far (0 in pass-through mode)."""
        return self._counts[0] + sum(d.routed for d in self._demuxes.values())

    @property
    def dropped(self) -> int:
        """Records dropped so far: their key group belongs to another subtask."""
        return self._counts[1] + sum(d.dropped for d in self._demuxes.values())

    @property
    def filter(self) -> Filter:
        """What this retriever keeps, as a channel-state reference records it
        (docs/format.md): the filter it was built from (``keeps``)."""
        if self._keeps is None:
            raise ConfigError("a retriever built without a filter cannot be referenced")
        return self._keeps

    def cut(self) -> list[ReplayBuffer]:
        """Every buffer ready and every whole record kept so far, partly filled buffers
        too. Once the caller has processed them, :meth:`remainder` says where each
        stream stands; reading goes on afterwards as before."""
        self._check_usable()
        if self.pass_through:
            raise ConfigError("a pass-through retriever cannot be cut; use coalesce=True")
        out = list(self._ready)
        self._ready.clear()
        for route, demux in self._demuxes.items():
            self._emit(route, demux.flush())
            out += self._ready
            self._ready.clear()
        return out

    def remainder(
        self, held: Callable[[RecordStream], int] | None = None
    ) -> list[tuple[RecordStream, tuple[Piece, ...]]]:
        """Per stream not replayed to its end, ``(stream, pieces)``: its pieces from the
        first byte of the record it has begun (after :meth:`cut`, everything before it
        was handed out or dropped). ``held(stream)``: bytes of it the consumer holds in
        a record it has begun and not finished (0 for this retriever's whole records)."""
        out = []
        for stream, fed, route in zip(self.streams, self._fed, self._routes, strict=True):
            demux = self._demuxes.get(route)
            pos = sum(fed) - (demux.pending().get(self._key(stream), 0) if demux else 0)
            pos -= held(stream) if held is not None else 0
            skips = stream.skips or (0,) * len(stream.pieces)
            rest: list[Piece] = []
            for (handle, channel), skip in zip(stream.pieces, skips, strict=True):
                avail = handle.channels.get(channel, (0, 0))[1] - skip
                if rest or pos < avail:
                    rest.append(Piece(handle, channel, skip + max(pos, 0)))
                pos -= max(avail, 0)
            if rest:
                out.append((stream, tuple(rest)))
        return out

    def close(self) -> None:
        """Stops reading and releases the open state file and the buffers held."""
        if self._closed:
            return
        self._closed = True
        self._close_retriever()
        self._demuxes.clear()
        self._ready.clear()

    def __enter__(self) -> FilteringRetriever:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading, filtering mode: each state file once --------------------------

    def _file_plan(self) -> list[_PlanEntry]:
        """The files to read, in phases: every stream's first piece (the old downstream's
        input part), then every stream's second piece (the old upstream's output part).
        A stream's pieces stay in order, and each file is read once per phase."""
        plan: list[_PlanEntry] = []
        phases = max((len(s.pieces) for s in self.streams), default=0)
        for phase in range(phases):
            # Keyed by section, not file: gates of several subtasks may share a file.
            files: dict[tuple[str, int], list[Any]] = {}
            for i, stream in enumerate(self.streams):
                if phase >= len(stream.pieces):
                    continue
                handle, channel = stream.pieces[phase]
                entry = files.setdefault(handle.key, [handle, {}, 0, phase])
                entry[1][channel] = i
                if stream.skips and stream.skips[phase]:
                    self._plan_skips[(len(plan) + list(files).index(handle.key), channel)] = (
                        stream.skips[phase]
                    )
                n = frames_in(handle, channel)
                entry[2] = None if n is None or entry[2] is None else entry[2] + n
            plan += [(e[0], e[1], e[2], e[3], _stream_table(e[1])) for e in files.values()]
        return plan

    def _poll_files(self) -> ReplayBuffer | None:
        if self._plan is None:
            self._plan, self._file = self._file_plan(), 0
            self._left = None  # counted per file here, not per piece
        while not self._ready:
            if self._file >= len(self._plan):
                if not self._files_ended:
                    self._files_ended = True
                    self._stream = 0
                    while self._stream < len(self.streams):
                        self._end_stream()  # checks each stream ended on a record boundary
                    continue  # the demuxes' last buffers
                return None
            r = self._retriever
            handle, channels, left, phase, table = self._plan[self._file]
            if r is None:
                if left == 0:
                    self._file += 1
                    continue
                self._retriever = open_retriever(
                    handle,
                    filesystem=self._filesystem,
                    channels=channels if left is not None else None,
                    **self._options,
                )
                self._file_left = left
                self._skip = {
                    c: self._plan_skips.get((self._file, c), 0)
                    for c in channels
                    if self._plan_skips.get((self._file, c), 0)
                }
                continue
            frames = r.poll_frames()
            if frames is None:
                if not r.finished:
                    return None
                if self._file_left:
                    raise missing_frames(handle.uri, self._file_left, channels)
                self._close_retriever()
                self._file += 1
                continue
            self._take_frames(frames, table, phase)
            self.blocks_read += 1
            if self._file_left is not None and self._file_left <= 0:
                # the rest of the file holds other channels only
                self._close_retriever()
                self._file += 1
            if not self._ready:
                break  # one block per call: a caller's step stays bounded
        if not self._files_ended:
            self._stream = 0  # not finished while files remain
        if not self._ready:
            return None
        return self._ready.popleft()

    def _take_frames(self, frames: FrameArrays, table: npt.NDArray[np.int32], phase: int) -> None:
        """One read-ahead block's frames: each frame of a wanted channel goes to its
        stream, in order; with the native key, one demux call per route and block.
        Which stream each frame feeds and what each stream is fed is one native call
        (``route_frames``): the bookkeeping of a block, under the GIL, stays short."""
        ids = frames.channel_ids
        for channel, skip in self._skip.items():  # only channels some stream reads
            if skip <= 0:
                continue
            for i in np.flatnonzero(ids == channel).tolist():
                cut = min(skip, int(frames.lengths[i]))
                frames.offsets[i] += cut
                frames.lengths[i] -= cut
                skip -= cut
                if skip == 0:
                    break
            self._skip[channel] = skip
        slots, wanted, fed, present, events = _records.route_frames(
            ids, frames.lengths, frames.data_types, table, len(self.streams)
        )
        if self._file_left is not None:
            self._file_left -= wanted
        if not wanted:
            return
        for i in np.flatnonzero(fed).tolist():
            self._fed[i][phase] += int(fed[i])
        self._piece = phase
        if self._single_route:
            routes = {self._routes[0]}
        else:
            routes = {self._routes[i] for i in np.flatnonzero(present).tolist()}
        if events or self._partitioner is not None:
            view = frames.data
            for i in np.flatnonzero(slots >= 0).tolist():
                o = int(frames.offsets[i])
                self._stream = int(slots[i])
                self._take_frame(
                    view[o : o + int(frames.lengths[i])],
                    bool(frames.data_types[i]),
                    int(frames.file_offsets[i]),
                )
            return
        for route in routes:
            mine = slots
            if len(routes) > 1:
                mine = self._route_slots[route][slots]
            demux = self._demux(route)
            assert isinstance(demux, KeyGroupDemux)  # partitioner demuxes go frame by frame
            try:
                pairs = demux.push_frames(
                    frames.data, frames.offsets, frames.lengths, mine, self._stream_keys
                )
            except CorruptRecordError as e:
                first = self.streams[int(mine[mine >= 0][0])]
                raise CorruptRecordError(
                    e.message,
                    path=first.pieces[min(phase, len(first.pieces) - 1)][0].uri,
                    offset=int(frames.file_offsets[0]),
                    detail=f"{e.detail or 'bad records'}; in a block of {first.describe()}",
                    hint=e.hint,
                ) from e
            self._emit(route, pairs)

    # -- reading -------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise ClosedError("filtering retriever is closed")
        if self._error is not None:
            raise self._error

    def _fail(self, error: BaseException) -> None:
        # The demux state is lost after an error, so the failure is sticky.
        self._error = error
        self._close_retriever()

    def _close_retriever(self) -> None:
        if self._retriever is not None:
            self._retriever.close()
            self._retriever = None

    def _open_piece(self) -> None:
        stream = self.streams[self._stream]
        if self._piece >= len(stream.pieces):
            self._end_stream()
            return
        handle, channel = stream.pieces[self._piece]
        left = frames_in(handle, channel)
        if left == 0:
            self._piece += 1
            return
        self._retriever = open_retriever(handle, filesystem=self._filesystem, **self._options)
        self._piece_channel, self._left = channel, left

    def _end_piece(self) -> None:
        self._close_retriever()
        self._piece += 1

    def _end_stream(self) -> None:
        index, stream = self._stream, self.streams[self._stream]
        route = self._routes[index]
        demux = self._demuxes.get(route)
        if demux is not None:
            pending = demux.pending().get(self._key(stream), 0)
            if pending:
                raise CorruptRecordError(
                    f"{stream.name} ends in the middle of a record",
                    path=stream.pieces[-1][0].uri,
                    detail=f"{pending} bytes of its last record never end; "
                    f"read {stream.describe()}",
                    hint="a buffer of this channel was lost when the checkpoint was taken",
                )
            if self._last_of_route[route] == index:
                self._emit(route, demux.finish())
                self._counts[0] += demux.routed
                self._counts[1] += demux.dropped
                del self._demuxes[route]
        self._stream, self._piece = index + 1, 0

    @staticmethod
    def _key(stream: RecordStream) -> tuple[int, int]:
        return stream.old_upstream, stream.old_downstream

    def _demux(self, route: Route) -> KeyGroupDemux | PartitionerDemux:
        demux = self._demuxes.get(route)
        if demux is None and self._partitioner is not None:
            keep, n = self._partition
            keep_only = np.full(n, -1, np.int64)
            keep_only[keep] = 0
            demux = self._demuxes[route] = PartitionerDemux(
                self._partitioner, keep_only, 1, **self._demux_args
            )
        if demux is None:
            table, n = self._table, self.n_outputs
            if isinstance(route, _TableRoute):
                table = self._route_tables[route.index]
            elif route is not None:
                table, n = np.where(table >= 0, 0, -1).astype(np.int32), 1
            if self._keep_all:
                channel = route if isinstance(route, int) else 0
                table, n = np.zeros(1, np.int32), max(n, 1 + channel)
            demux = KeyGroupDemux(kg_to_output=table, n_outputs=n, **self._demux_args)
            if self._keep_all:
                demux.keep_all()
            self._demuxes[route] = demux
        return demux

    def _emit(self, route: Route, buffers: list[tuple[int, npt.NDArray[np.uint8]]]) -> None:
        fixed = route if isinstance(route, int) else None
        for out, buf in buffers:
            self._ready.append(replay_buffer(buf, out if fixed is None else fixed, DataType.DATA))

    def _take(self, buf: RetrievedBuffer) -> None:
        self._take_frame(buf, buf.is_event, buf.offset)
        if self._left is not None:
            self._left -= 1
            if self._left == 0:  # the rest of the file holds other channels only
                self._end_piece()

    def _take_frame(self, buf: Any, is_event: bool, offset: int) -> None:
        stream = self.streams[self._stream]
        if is_event:
            self._event(stream, buf, offset)
        elif self.pass_through:
            self._ready.append(replay_buffer(buf, stream.channel or 0, DataType.DATA))
        else:
            route = self._routes[self._stream]
            try:
                pairs = self._demux(route).push(buf, self._key(stream))
            except CorruptRecordError as e:
                raise CorruptRecordError(
                    e.message,
                    path=stream.pieces[self._piece][0].uri,
                    offset=offset,
                    detail=f"{e.detail or 'bad records'}; in {stream.describe()}",
                    hint=e.hint,
                ) from e
            self._emit(route, pairs)

    def _event(self, stream: RecordStream, buf: Any, offset: int) -> None:
        uri = stream.pieces[self._piece][0].uri
        if self.on_event == "refuse":
            raise RescaleError(
                "channel state holds an event, which a rescaled channel cannot replay",
                path=uri,
                offset=offset,
                detail=f"in {stream.describe()}",
                hint="events describe the old channel; pass on_event='forward' to replay "
                "them in place if the consumer expects that",
            )
        route = self._routes[self._stream]
        demux = self._demuxes.get(route)
        if demux is not None:
            if demux.pending().get(self._key(stream), 0):
                raise CorruptRecordError(
                    "an event sits inside a record",
                    path=uri,
                    offset=offset,
                    detail=f"in {stream.describe()}",
                )
            self._emit(route, demux.flush())
        if self.pass_through or stream.channel is not None:
            channels = [stream.channel or 0]
        elif isinstance(route, _TableRoute):
            t = self._route_tables[route.index]
            channels = sorted({int(o) for o in np.unique(t) if o >= 0})
        else:
            channels = self._table_outputs
        self._ready.extend(replay_buffer(buf, c, DataType.EVENT) for c in channels)


def _stream_table(channels: dict[int, int]) -> npt.NDArray[np.int32]:
    """``channels`` (channel -> stream index) as a table indexed by channel, -1 where
    no stream reads it."""
    if min(channels, default=0) < 0:  # numpy would wrap it to the table's end
        raise ConfigError(f"a stream reads channel {min(channels)}")
    table = np.full(max(channels, default=-1) + 1, -1, np.int32)
    for channel, index in channels.items():
        table[channel] = index
    return table
