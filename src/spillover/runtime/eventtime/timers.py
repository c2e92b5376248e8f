"""Event-time timers of one keyed operator, kept as a ``"timers"`` keyed state."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from spillover.errors import ConfigError
from spillover.runtime.api import KeyedStateBackend, StateDescriptor
from spillover.runtime.network.events import MIN_WATERMARK
from spillover.runtime.state.heap import HeapTimerState

Keys = npt.NDArray[np.int64]


class KeyedTimerService:
    """The :class:`~spillover.runtime.api.TimerService` of a keyed operator.

    Its timers are the keyed state ``name`` of the subtask's backend, created on the
    first registration (or by a restore), so an operator that never registers a
    timer adds nothing to its checkpoints. The watermark is not state: a restored
    operator starts at ``MIN_WATERMARK`` and its restored timers fire once the
    watermark passes them again.
    """

    def __init__(self, backend: KeyedStateBackend, name: str) -> None:
        self._backend = backend
        self._name = name
        self._state: HeapTimerState | None = None
        self._watermark = MIN_WATERMARK

    @property
    def current_watermark(self) -> int:
        return self._watermark

    def _timers(self, create: bool) -> HeapTimerState | None:
        if self._state is None and (create or self._name in self._backend.state_names()):
            state = self._backend.state(StateDescriptor(self._name, "timers", np.int64))
            if not isinstance(state, HeapTimerState):
                raise ConfigError(f"state {self._name!r} is not a timer state")
            self._state = state
        return self._state

    def register(self, keys: Keys, times: npt.NDArray[np.int64]) -> None:
        state = self._timers(True)
        assert state is not None
        state.put(keys, times)

    def delete(self, keys: Keys, times: npt.NDArray[np.int64]) -> None:
        state = self._timers(False)
        if state is not None:
            state.delete(keys, times)

    def pending(self) -> int:
        """Timers registered and not fired yet."""
        state = self._timers(False)
        return 0 if state is None else len(state)

    def advance(self, watermark: int, fire: Callable[[Keys, npt.NDArray[np.int64]], None]) -> None:
        """Moves to ``watermark`` and hands ``fire`` every timer at or before it, in
        timestamp order; timers ``fire`` registers at or before it fire too."""
        if watermark <= self._watermark:
            return
        self._watermark = watermark
        state = self._timers(False)
        if state is None:
            return
        while True:
            keys, times = state.pop_until(watermark)
            if not keys.size:
                return
            fire(keys, times)
