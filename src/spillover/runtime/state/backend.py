"""The heap keyed-state backend of one subtask: its states by name, snapshots
by key group, restores from any old subtasks' files (rescaling included)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from spillover.errors import (
    ConfigError,
    ForeignFileError,
    KeyGroupRangeError,
    RescaleError,
)
from spillover.keygroups import (
    KeyGroupRange,
    check_max_parallelism,
    key_group_range_for_operator,
    key_groups,
)
from spillover.runtime.api import KeyedState, StateDescriptor
from spillover.runtime.state.files import (
    _check_handle,
    _read_state_file,
    _write_snapshot,
    learn_layout,
)
from spillover.runtime.state.heap import (
    _STATE_CLASSES,
    Keys,
    Values,
    _check_dtype,
    _HeapState,
)
from spillover.runtime.state.ipcfile import Layout

# ---- the backend ----


class HeapKeyedStateBackend:
    """The keyed state of one subtask, which owns the key groups ``key_group_range``.

    ``name`` prefixes the snapshot files (give each keyed operator its own when
    several share a directory); ``merge_rows`` fixes how many rows a state's
    small run holds before it is merged (default: adaptive); ``fsync`` makes
    local snapshot files durable before ``write`` returns. Keys outside the range
    raise :class:`KeyGroupRangeError` unless ``check_key_groups`` is False.
    Not thread-safe: use it from the task's thread (``write`` of a snapshot may
    run on any thread).
    """

    def __init__(
        self,
        max_parallelism: int,
        key_group_range: KeyGroupRange,
        *,
        name: str = "keyed",
        merge_rows: int | None = None,
        fsync: bool = False,
        check_key_groups: bool = True,
    ) -> None:
        check_max_parallelism(max_parallelism)
        if len(key_group_range) and key_group_range.end >= max_parallelism:
            raise ConfigError(f"{key_group_range!r} exceeds max parallelism {max_parallelism}")
        if merge_rows is not None and merge_rows < 0:
            raise ConfigError(f"merge_rows must be >= 0, got {merge_rows}")
        self._max_p = max_parallelism
        self._range = key_group_range
        self._name = re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "keyed"
        self._merge_rows = merge_rows
        self._fsync = fsync
        self._check = check_key_groups and len(key_group_range) < max_parallelism
        # The range a native state operation checks keys against (None: no check).
        self._checked_range = key_group_range if self._check else None
        self._states: dict[str, _HeapState] = {}
        self._layouts: dict[str, Layout | None] = {}  # of each state's files (ipcfile.py)

    @classmethod
    def for_subtask(
        cls, max_parallelism: int, parallelism: int, subtask_index: int, **kwargs: Any
    ) -> HeapKeyedStateBackend:
        """The backend of subtask ``subtask_index`` of ``parallelism`` (Flink's ranges)."""
        rng = key_group_range_for_operator(max_parallelism, parallelism, subtask_index)
        return cls(max_parallelism, rng, **kwargs)

    @property
    def max_parallelism(self) -> int:
        return self._max_p

    @property
    def key_group_range(self) -> KeyGroupRange:
        return self._range

    def state_names(self) -> list[str]:
        """Names of the states declared or restored so far, in creation order."""
        return list(self._states)

    def state(self, descriptor: StateDescriptor) -> KeyedState:
        """The state named ``descriptor.name``, created on first use.

        Raises :class:`ConfigError` when the kind or dtype is not supported or differs
        from the state's (declared earlier or restored)."""
        dtype = np.dtype(descriptor.dtype)
        return self._state(descriptor.name, descriptor.kind, dtype)

    def _state(
        self, name: str, kind: str, dtype: np.dtype[Any], source: str | None = None
    ) -> _HeapState:
        existing = self._states.get(name)
        if existing is not None:
            if existing.kind != kind or existing.dtype != dtype:
                raise ConfigError(
                    f"state {name!r} is {existing.kind} state of {existing.dtype}, "
                    f"not {kind} state of {dtype}",
                    path=source,
                    hint="a state keeps its kind and dtype across restores; use a new name",
                )
            return existing
        _check_dtype(kind, dtype, name)
        layout = learn_layout(name, kind, dtype, self._max_p, self._range)
        state = _STATE_CLASSES[kind](self, name, dtype)
        self._states[name] = state
        self._layouts[name] = layout
        return state

    def _check_keys(self, keys: Keys) -> None:
        if not self._check or keys.size == 0:
            return
        kg = key_groups(keys, self._max_p)
        bad = (kg < self._range.start) | (kg > self._range.end)
        if bad.any():
            i = int(np.argmax(bad))
            raise KeyGroupRangeError(
                f"key {int(keys[i])} is in key group {int(kg[i])}, outside this subtask's "
                f"key groups {self._range.start}..{self._range.end}",
                detail=f"{int(bad.sum())} of {keys.size} keys are outside",
                hint="keyed state must be fed through a key_by edge on the same int64 key "
                "and max parallelism",
            )

    def state_bytes(self) -> int:
        """Approximate memory the states hold, in bytes (array buffers, spare capacity included)."""
        return sum(s.nbytes() for s in self._states.values())

    def snapshot(self) -> Callable[[str], dict[str, Any]]:
        """Copies every state now and returns ``write(directory_uri) -> handle``.

        ``write`` may run on another thread; it writes one Arrow IPC file per state
        under the directory (a local path or a ``pyarrow.fs`` URI) and returns the
        JSON-able handle described in ``docs/state.md``."""
        copies = [
            (s.name, s.kind, s.dtype, *s.items(), self._layouts[s.name])
            for s in self._states.values()
        ]
        max_p, rng, prefix, fsync = self._max_p, self._range, self._name, self._fsync

        def write(directory_uri: str) -> dict[str, Any]:
            return _write_snapshot(directory_uri, copies, max_p, rng, prefix, fsync)

        return write

    def restore(self, handles: list[dict[str, Any]]) -> None:
        """Loads the rows of ``handles`` whose key groups lie in this backend's range.

        Pass the handles of every old subtask (those whose ranges miss this one are
        skipped without being opened). Restored rows are added as ``put`` would add
        them. Refuses handles and files of another format version
        (:class:`UnsupportedVersionError`), of another max parallelism or with
        overlapping key-group ranges (:class:`RescaleError`)."""
        chosen: list[tuple[KeyGroupRange, dict[str, Any]]] = []
        for handle in handles:
            covered = _check_handle(handle, self._max_p)
            overlap = covered.intersection(self._range)
            if len(overlap):
                chosen.append((overlap, handle))
        chosen.sort(key=lambda c: c[0].start)
        for (a, _), (b, _) in itertools.pairwise(chosen):
            if b.start <= a.end:
                raise RescaleError(
                    f"two keyed-state handles both hold key groups {b.start}..{min(a.end, b.end)}",
                    hint="pass each old subtask's handle once",
                )
        loaded: dict[str, tuple[str, np.dtype[Any], str, list[Keys], list[Values]]] = {}
        for overlap, handle in chosen:
            for entry in handle["states"]:
                name, kind, dtype, keys, values = _read_state_file(entry, handle, overlap)
                uri = str(entry["uri"])
                if name not in loaded:
                    loaded[name] = (kind, dtype, uri, [], [])
                first_kind, first_dtype, first_uri, key_parts, value_parts = loaded[name]
                if (kind, dtype) != (first_kind, first_dtype):
                    raise ForeignFileError(
                        f"state {name!r} is {kind} state of {dtype} here but "
                        f"{first_kind} state of {first_dtype} in {first_uri}",
                        path=uri,
                    )
                key_parts.append(keys)
                value_parts.append(values)
        for name, (kind, dtype, uri, key_parts, value_parts) in loaded.items():
            state = self._state(name, kind, dtype, source=uri)
            state._load(np.concatenate(key_parts), np.concatenate(value_parts))
