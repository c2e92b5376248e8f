"""Keyed state of one subtask, kept in memory as sorted numpy arrays, and its snapshots.

A :class:`HeapKeyedStateBackend` owns the key groups of one subtask and hands
out one state per :class:`~spillover.runtime.api.StateDescriptor` name:

* ``"value"`` (:class:`HeapValueState`): the last value written per key;
* ``"sum"`` (:class:`HeapSumState`): a running sum per key (int64 or float64);
* ``"list"`` (:class:`HeapListState`): every value appended per key, in order;
* ``"timers"`` (:class:`HeapTimerState`): event-time timers, a set of
  ``(key, timestamp)`` pairs taken in timestamp order.

Every operation takes arrays of keys and works in a few numpy calls. A state
keeps a large run sorted by key and a small run of recent insertions, merged
into the large one when it grows past about ``32 * sqrt(n)`` rows, so a batch
of new keys costs far less than a copy of the whole state.

``snapshot()`` copies the state and returns ``write(directory_uri)``, which
writes one Arrow IPC file per state, rows sorted by key group, and returns a
JSON-able handle; ``restore(handles)`` reads back the rows whose key groups the
backend owns, so state taken at one parallelism restores at another. The file
format is described in ``docs/state.md``. ``split_even`` and ``union``
redistribute list-shaped operator state the way Flink does.
"""

from __future__ import annotations

from spillover.runtime.state.backend import (
    HeapKeyedStateBackend,
)
from spillover.runtime.state.heap import (
    FORMAT_NAME,
    FORMAT_VERSION,
    HeapListState,
    HeapSumState,
    HeapTimerState,
    HeapValueState,
)
from spillover.runtime.state.redistribute import (
    split_even,
    union,
)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "HeapKeyedStateBackend",
    "HeapListState",
    "HeapSumState",
    "HeapTimerState",
    "HeapValueState",
    "split_even",
    "union",
]
