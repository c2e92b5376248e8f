"""One unaligned checkpoint's in-flight data on one task, and how its
acknowledgement is put together.

When the first barrier of checkpoint n reaches a task (on the priority path, or
when an aligned-with-timeout checkpoint switches), the task forwards the barrier
at the head of every output queue and snapshots its operators at once.
The checkpoint then also holds:

- output state: the data buffers the forwarded barrier overtook in each output
  queue (``broadcast_event(priority=True)`` hands them back);
- input state: per input channel, the bytes of a record the task had begun
  reading, then every buffer the task processes from that channel until the
  channel's own barrier n arrives (a channel whose barrier already came adds
  nothing more).

Each record stream thus replays as "this task's input state for the channel,
then the upstream's output state for it", which is also how rescaling reads it.
Buffers go to the storer without a copy (``OnRelease`` returns them to their
pool once written); the writer thread does the I/O (``channel_state.py``).

The acknowledgement has two halves done side by side on the task's two snapshot
threads (``snapshot.py``): the operator part and the channel state's finished
files. Whichever ends last acknowledges, or declines what went wrong.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from spillover.rescale.pieces import Reference
from spillover.runtime.checkpointing.channel_state import ChannelState
from spillover.runtime.checkpointing.messages import Ack
from spillover.runtime.network import events as ev


@dataclass
class InFlightCheckpoint:
    """A task's unaligned checkpoint while its input state is still being persisted."""

    checkpoint_id: int
    writer: ChannelState
    pending: set[int]  # input channels whose barrier has not come yet
    trigger_ms: int
    started: float
    # Task input channel -> (input gate, channel) of the channel state's layout.
    gate_of: Sequence[tuple[int, int]] = ()
    max_inflight_bytes: int | None = None
    limited: bool = False  # the bound was reached: pending channels are blocked
    # The acknowledgement's two halves: the operator part (None if it failed:
    # operator_error says why) and the channel state's finished files (None if
    # closing them failed: channel_error).
    operator_part: Ack | None = None
    operator_error: str | None = None
    channel_state: dict[str, Any] | None = None
    channel_error: str | None = None
    close_ms: float = 0.0
    closed_here: bool = False  # finished on the task thread (QUICK_CLOSE_BYTES)
    forwarded: bool = False  # the barrier went ahead of the output
    # How long that took (ms): the barrier and the output state it overtook handed
    # to the channel state (the breakdown's forward part, bench/checkpoint_breakdown.py).
    forward_ms: float = 0.0
    inputs_done: float = 0.0  # when the last input's barrier came (monotonic)
    _halves_left: int = 2
    _halves_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # Recovered input state not yet replayed, referenced in old files (recovery/).
    references: list[Reference] = field(default_factory=list)
    recovering: bool = False  # taken while recovered input state was being replayed
    # Wall-clock times (time.time()) of the task taking the barrier and of the
    # barrier going out: the per-phase breakdown (bench/checkpoint_breakdown.py)
    # lines them up across tasks and processes.
    taken_at: float = 0.0
    forwarded_at: float = 0.0

    @property
    def done(self) -> bool:
        return not self.pending

    def half_done(self) -> bool:
        """One half of the acknowledgement is in; True for the second (which sends it)."""
        with self._halves_lock:
            self._halves_left -= 1
            return self._halves_left == 0

    def add_input(self, channel: int, buffer: Any) -> None:
        """Persists ``buffer`` (or the bytes of a begun record) as input state of the
        task's input ``channel``: the one way a task buffer becomes input state."""
        self.writer.add_input(*self.gate_of[channel], buffer)

    def over_limit(self) -> bool:
        return (
            self.max_inflight_bytes is not None
            and not self.limited
            and self.writer.input_bytes >= self.max_inflight_bytes
        )


def barrier_of(cid: int, found: list[Any] | None = None) -> Callable[[Any], bool]:
    """A matcher for ``InputGate.overtake``: checkpoint ``cid``'s barrier (appended to
    ``found`` when given)."""

    def match(buf: Any) -> bool:
        event = ev.deserialize(buf)
        if isinstance(event, ev.CheckpointBarrier) and event.checkpoint_id == cid:
            if found is not None:
                found.append(event)
            return True
        return False

    return match


class ChannelThreads(Protocol):
    """The task's snapshot threads, as the acknowledgement uses them."""

    def submit_channels(self, fn: Callable[..., Any], *args: Any) -> Any: ...
    def channels_idle(self) -> bool: ...


class AckGateway(Protocol):
    """Where a task's acknowledgements and declines go (its coordinator)."""

    def acknowledge(self, ack: Ack) -> None: ...
    def decline(self, checkpoint_id: int, reason: str) -> None: ...


class InflightAcks:
    """Finishes in-flight checkpoints: closes their channel state beside the operator
    part, acknowledges once both halves are in, declines whatever failed."""

    def __init__(self, threads: ChannelThreads, gateway: AckGateway) -> None:
        self.threads = threads
        self.gateway = gateway

    def complete(self, inf: InFlightCheckpoint) -> None:
        """Every channel's barrier came: its input state is complete."""
        inf.inputs_done = time.monotonic()
        # Small and local: finished here, without a hand-off (QUICK_CLOSE_BYTES), if no
        # earlier checkpoint's close or acknowledgement is still to go out.
        if not (self.threads.channels_idle() and self._close_channels(inf, quick=True)):
            self.threads.submit_channels(self._close_channels, inf)

    def abort(self, inf: InFlightCheckpoint) -> None:
        """Drops ``inf``'s files and declines it."""
        self.threads.submit_channels(inf.writer.discard)
        self.gateway.decline(inf.checkpoint_id, "unaligned checkpoint aborted")

    def operator_part_done(
        self, inf: InFlightCheckpoint, ack: Ack | None, error: str | None = None
    ) -> None:
        """On the snapshot thread: the operator half of ``inf`` is done (``ack``; the
        checkpoint is acknowledged once its channel state is finished too), or failed
        (``error``: declined now, not after the inputs' barriers)."""
        inf.operator_part, inf.operator_error = ack, error
        if error is not None:
            self.gateway.decline(inf.checkpoint_id, error)
        if inf.half_done():
            self._acknowledge(inf)

    def _close_channels(self, inf: InFlightCheckpoint, quick: bool = False) -> bool:
        """On the channel-state thread, beside the operator part: finishes the files
        (drops them when the operator part failed already). ``quick`` (the task
        thread): only if that cannot wait on storage; False, having done nothing, if
        it could."""
        t = time.monotonic()
        try:
            if inf.operator_error is None:
                state = inf.writer.close(quick)
                if state is None:
                    return False
                inf.channel_state = state
            elif quick:
                return False
            else:
                inf.writer.discard()
        except BaseException as e:
            inf.channel_error = f"persisting in-flight data failed: {e!r}"
            with contextlib.suppress(Exception):
                inf.writer.discard()  # its files, staged sections and held buffers
        inf.close_ms = (time.monotonic() - t) * 1000
        inf.closed_here = quick
        if inf.half_done():
            self._acknowledge(inf)
        return True

    def _acknowledge(self, inf: InFlightCheckpoint) -> None:
        """On whichever snapshot thread finished its half last: acknowledges, or
        declines whatever went wrong (an exception here would otherwise vanish in the
        pool and hang the checkpoint)."""
        try:
            self._acknowledge_parts(inf)
        except BaseException as e:
            with contextlib.suppress(Exception):
                inf.writer.discard()  # no half-written channel files left behind
            self.gateway.decline(
                inf.checkpoint_id,
                f"completing the unaligned checkpoint failed: {type(e).__name__}: {e}",
            )

    def _acknowledge_parts(self, inf: InFlightCheckpoint) -> None:
        ack, channel_state = inf.operator_part, inf.channel_state
        if inf.operator_error is not None:
            return  # declined when it failed; its channel files are dropped or swept
        if ack is None or channel_state is None:
            reason = inf.channel_error or "unaligned checkpoint failed"
            self.gateway.decline(inf.checkpoint_id, reason)
            return
        # Taken while recovered input state was still being replayed (a metric, so
        # tests and operators can tell such checkpoints apart).
        ack.metrics["recovering"] = 1.0 if inf.recovering else 0.0
        if inf.references:
            channel_state["references"] = [r.to_dict() for r in inf.references]
            pieces = [p for r in inf.references for p in r.pieces]
            ack.metrics["referenced_bytes"] = float(sum(max(0, p.nbytes - p.skip) for p in pieces))
        ack.channel_state = channel_state
        ack.metrics["inflight_bytes"] = float(channel_state["bytes"])
        ack.metrics["close_ms"] = inf.close_ms
        ack.metrics["closed_on_task_thread"] = 1.0 if inf.closed_here else 0.0
        ack.metrics["inputs_ms"] = (inf.inputs_done - inf.started) * 1000
        ack.metrics["persist_ms"] = (time.monotonic() - inf.started) * 1000
        self.gateway.acknowledge(ack)
