"""A job's stop-with-savepoint (FLIP-147) as its master holds it: asked by an
operator, or carried over from a master that died before the stop ended (the job
event log's ``StopRequested``); recorded in the log once; given up when its
savepoint attempts fail beyond the tolerated, and the job goes on."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

from spillover.errors import ConfigError
from spillover.runtime.checkpointing.savepoint_request import SavepointRequest
from spillover.runtime.jobevents import StopRequested
from spillover.runtime.network.events import BarrierKind


class StopLog(Protocol):
    """Where a stop is recorded for a later master (the job event log)."""

    def command_received(self, command: str, detail: str) -> None: ...

    def stop_requested(self, drain: bool, unaligned: bool, savepoint_dir: str) -> None: ...

    def stop_abandoned(self, reason: str) -> None: ...


@dataclass(frozen=True)
class StopAsked:
    """One stop: drained (the sources end, the final checkpoint is the savepoint) or
    not (the tasks suspend at an aligned or ``unaligned`` savepoint); ``request``
    is answered with the savepoint's path under ``savepoint_dir``."""

    drain: bool
    unaligned: bool
    savepoint_dir: str
    request: SavepointRequest

    @property
    def kind(self) -> BarrierKind:
        return BarrierKind.UNALIGNED if self.unaligned else BarrierKind.ALIGNED

    def describe(self) -> str:
        return f"drain={self.drain} unaligned={self.unaligned} dir={self.savepoint_dir}"


class Stop:
    """The stop under way, if any; safe from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._asked: StopAsked | None = None
        self._logged = False

    @property
    def asked(self) -> StopAsked | None:
        return self._asked

    def accept(self, drain: bool, unaligned: bool, savepoint_dir: str) -> SavepointRequest:
        """A new stop; refused (ConfigError) while one is under way."""
        kind = BarrierKind.UNALIGNED if unaligned else BarrierKind.ALIGNED
        asked = StopAsked(drain, unaligned, savepoint_dir, SavepointRequest(kind))
        with self._lock:
            if self._asked is not None:
                raise ConfigError("the job is stopping already", hint="wait for that stop")
            self._asked, self._logged = asked, False
        return asked.request

    def resume(self, stop: StopRequested) -> None:
        """The stop a dead master accepted and did not end (already in the log); one
        asked of this master meanwhile wins."""
        kind = BarrierKind.UNALIGNED if stop.unaligned else BarrierKind.ALIGNED
        asked = StopAsked(stop.drain, stop.unaligned, stop.savepoint_dir, SavepointRequest(kind))
        with self._lock:
            if self._asked is None:
                self._asked, self._logged = asked, True

    def record(self, log: StopLog | None) -> None:
        """Records the stop in ``log``, once (a master resuming the run carries it out)."""
        with self._lock:
            asked, logged, self._logged = self._asked, self._logged, True
        if log is None or asked is None or logged:
            return
        log.command_received("stop", asked.describe())
        log.stop_requested(asked.drain, asked.unaligned, asked.savepoint_dir)

    def give_up(self, reason: str, log: StopLog | None) -> None:
        """The savepoint failed beyond the tolerated: the job goes on, and a master
        resuming the run runs it on."""
        with self._lock:
            asked, self._asked = self._asked, None
        if asked is None:
            return
        if log is not None:
            log.stop_abandoned(reason)
        asked.request.failed(reason)

    def ended(self, status: str) -> None:
        """The run ended: a stop not answered with a savepoint fails."""
        asked = self._asked
        if asked is not None:
            asked.request.failed(f"the job ended {status} without a savepoint")
