"""Built-in operators: map, filter, flat_map, keyed aggregations, keyed user logic
and two-input operators.

User functions take a whole batch and return a whole batch (or a mask), so no
operator touches single records in Python. What a function returns is checked
against the declared dtype on every batch (a constant-time check) and a
mismatch raises :class:`~spillover.errors.BatchTypeError`.

Union needs no operator: the job builder wires every stream of a union to the
one input (input index 0) of the next operator, whose ``process`` sees their
batches interleaved in arrival order. Keyed state is snapshotted by the keyed
state backend, so keyed operators return no operator state of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from spillover.errors import BatchTypeError, ConfigError
from spillover.runtime.api import (
    Batch,
    KeyedState,
    KeyedStateBackend,
    Operator,
    OperatorContext,
    StateDescriptor,
)
from spillover.runtime.state.heap import HeapSumState

__all__ = [
    "CoMap",
    "FilterOperator",
    "FlatMapOperator",
    "KeyedCount",
    "KeyedProcess",
    "KeyedSum",
    "MapOperator",
    "TwoInputOperator",
    "check_batch",
]

BatchFn = Callable[[Batch], Batch]


def check_batch(out: object, dtype: np.dtype[Any], what: str) -> Batch:
    """Returns ``out`` if it is a 1-D structured array of ``dtype``, else raises."""
    if not isinstance(out, np.ndarray):
        raise BatchTypeError(
            f"{what} must return a numpy structured array",
            detail=f"got {type(out).__name__}",
            hint="build the result with np.empty(n, dtype=out_dtype) and fill its fields",
        )
    if out.ndim != 1 or out.dtype != dtype:
        raise BatchTypeError(
            f"{what} returned a batch of the wrong dtype or shape",
            detail=f"expected 1-D {dtype}, got {out.ndim}-D {out.dtype}",
            hint="declare the function's output with out_dtype=",
        )
    return out


def _group_sums(
    keys: npt.NDArray[np.int64], values: npt.NDArray[Any]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[Any]]:
    """Distinct keys (sorted) and the sum of ``values`` of each, exactly (no float detour)."""
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
    return sorted_keys[starts], np.add.reduceat(values[order], starts)


def _keyed_backend(ctx: OperatorContext, who: str) -> KeyedStateBackend:
    if ctx.keyed is None:
        raise ConfigError(
            f"{who} needs keyed state, but its subtask has none",
            hint="put key_by(field) before a keyed operator",
        )
    return ctx.keyed


class MapOperator(Operator):
    """``fn(batch) -> batch`` of ``out_dtype`` with one output record per input record."""

    def __init__(self, fn: BatchFn, out_dtype: npt.DTypeLike) -> None:
        self.fn = fn
        self.out_dtype = np.dtype(out_dtype)

    def process(self, batch: Batch, input_index: int = 0) -> None:
        out = check_batch(self.fn(batch), self.out_dtype, "the map function")
        if len(out) != len(batch):
            raise BatchTypeError(
                "the map function changed the number of records",
                detail=f"{len(batch)} in, {len(out)} out",
                hint="use flat_map to emit a different number of records",
            )
        if len(out):
            self.ctx.output.emit(out)


class FilterOperator(Operator):
    """Keeps the records where ``fn(batch)`` (a boolean mask, one per record) is True.

    ``out_dtype`` is the input's dtype; the job builder sets it.
    """

    def __init__(self, fn: Callable[[Batch], npt.NDArray[np.bool_]], dtype: Any = None) -> None:
        self.fn = fn
        self.out_dtype = None if dtype is None else np.dtype(dtype)

    def process(self, batch: Batch, input_index: int = 0) -> None:
        mask = self.fn(batch)
        if not (
            isinstance(mask, np.ndarray) and mask.dtype == np.bool_ and mask.shape == batch.shape
        ):
            got = f"{mask.shape} {mask.dtype}" if isinstance(mask, np.ndarray) else type(mask)
            raise BatchTypeError(
                "the filter function must return one boolean per record",
                detail=f"expected bool array of shape {batch.shape}, got {got}",
            )
        if mask.all():
            if len(batch):
                self.ctx.output.emit(batch)
        elif mask.any():
            self.ctx.output.emit(batch[mask])


class FlatMapOperator(Operator):
    """``fn(batch) -> batch`` of ``out_dtype`` of any length (or None for nothing)."""

    def __init__(self, fn: Callable[[Batch], Batch | None], out_dtype: npt.DTypeLike) -> None:
        self.fn = fn
        self.out_dtype = np.dtype(out_dtype)

    def process(self, batch: Batch, input_index: int = 0) -> None:
        out = self.fn(batch)
        if out is not None and len(check_batch(out, self.out_dtype, "the flat_map function")):
            self.ctx.output.emit(out)


class _KeyedAggregate(Operator):
    """Adds a per-record value into a ``"sum"`` state per key and emits, per batch,
    one ``(key, running total)`` row for every key the batch touched."""

    _state_suffix = "sum"

    def __init__(self, key_field: str, out_field: str, sum_dtype: npt.DTypeLike, out: str) -> None:
        if out not in ("updates", "none"):
            raise ConfigError(f"out must be 'updates' or 'none', got {out!r}")
        self.key_field = key_field
        self.out_field = out_field
        self.sum_dtype = np.dtype(sum_dtype)
        self.emit_updates = out == "updates"
        self.out_dtype = np.dtype([(key_field, "<i8"), (out_field, self.sum_dtype)])

    def open(self, ctx: OperatorContext) -> None:
        super().open(ctx)
        backend = _keyed_backend(ctx, type(self).__name__)
        # Prefixed by the uid so operators chained in one subtask never share state.
        name = f"{ctx.uid}.{self._state_suffix}"
        self.state = backend.state(StateDescriptor(name, "sum", self.sum_dtype))
        # Put-and-get in one pass where the backend offers it (the heap's sum state,
        # whose ``add`` counts with ``values`` None; another backend's state is only
        # asked for what every keyed state offers: ``put`` and ``get``).
        heap = self.state if isinstance(self.state, HeapSumState) else None
        self._add = None if heap is None else heap.add
        # int64 sums on the heap: the sums and the output rows in one native pass (the
        # output's two field assignments would each let the GIL go and wait for it).
        self._add_rows = (
            heap.add_rows
            if heap is not None and self.sum_dtype == np.int64 and self.emit_updates
            else None
        )

    def _values(self, batch: Batch) -> npt.NDArray[Any] | None:
        """What each record adds (None: 1 each, which ``add`` counts without an array)."""
        raise NotImplementedError

    def process(self, batch: Batch, input_index: int = 0) -> None:
        if not len(batch):
            return
        keys = np.asarray(batch[self.key_field], dtype=np.int64)
        values = self._values(batch)
        if self._add_rows is not None:
            rows = self._add_rows(keys, values)
            if len(rows):
                self.ctx.output.emit(rows.view(self.out_dtype).reshape(len(rows)))
            return
        if self._add is not None:
            uniq, totals = self._add(keys, values)
            if not self.emit_updates:
                return
        else:
            if values is None:
                values = np.ones(len(batch), dtype=self.sum_dtype)
            if not self.emit_updates:
                self.state.put(keys, values)
                return
            uniq, sums = _group_sums(keys, values)
            self.state.put(uniq, sums)
            totals, _ = self.state.get(uniq)
        out = np.empty(len(uniq), dtype=self.out_dtype)
        out[self.key_field] = uniq
        out[self.out_field] = totals
        self.ctx.output.emit(out)


class KeyedSum(_KeyedAggregate):
    """Running sum of ``value_field`` per key (``"sum"`` keyed state).

    Emits ``[(key_field, int64), (value_field, sum_dtype)]`` rows, one per key a
    batch updated, with the key's new total (``out="updates"``), or nothing
    (``out="none"``, e.g. to measure state cost alone).
    """

    def __init__(
        self,
        key_field: str,
        value_field: str,
        out: str = "updates",
        sum_dtype: npt.DTypeLike = np.int64,
    ) -> None:
        super().__init__(key_field, value_field, sum_dtype, out)
        self.value_field = value_field

    def _values(self, batch: Batch) -> npt.NDArray[Any]:
        return np.asarray(batch[self.value_field], dtype=self.sum_dtype)


class KeyedCount(_KeyedAggregate):
    """Running count of records per key; emits ``[(key_field, int64), ("count", int64)]``."""

    _state_suffix = "count"

    def __init__(self, key_field: str, out: str = "updates") -> None:
        super().__init__(key_field, "count", np.int64, out)

    def _values(self, batch: Batch) -> None:
        return None


class KeyedProcess(Operator):
    """User logic over keyed state: ``fn(batch, states) -> batch | None``.

    ``states`` maps each descriptor's name to its :class:`KeyedState` (vectorised
    ``get/put/items/clear`` over int64 key arrays). Whatever ``fn`` returns is
    emitted; it must be of ``out_dtype``.
    """

    def __init__(
        self,
        fn: Callable[[Batch, dict[str, KeyedState]], Batch | None],
        states: Sequence[StateDescriptor],
        out_dtype: npt.DTypeLike,
    ) -> None:
        names = [d.name for d in states]
        if len(set(names)) != len(names):
            raise ConfigError(f"state names must be unique, got {names}")
        self.fn = fn
        self.descriptors = list(states)
        self.out_dtype = np.dtype(out_dtype)

    def open(self, ctx: OperatorContext) -> None:
        super().open(ctx)
        backend = _keyed_backend(ctx, "KeyedProcess")
        self.states = {d.name: backend.state(d) for d in self.descriptors}

    def process(self, batch: Batch, input_index: int = 0) -> None:
        out = self.fn(batch, self.states)
        if out is not None and len(check_batch(out, self.out_dtype, "the process function")):
            self.ctx.output.emit(out)


class TwoInputOperator(Operator):
    """Base of operators with two inputs of possibly different dtypes
    (``a.connect(b)``): batches of input 0 go to ``process1``, of input 1 to ``process2``."""

    def process(self, batch: Batch, input_index: int = 0) -> None:
        if input_index == 0:
            self.process1(batch)
        elif input_index == 1:
            self.process2(batch)
        else:
            raise ValueError(f"a two-input operator has inputs 0 and 1, not {input_index}")

    def process1(self, batch: Batch) -> None:
        raise NotImplementedError

    def process2(self, batch: Batch) -> None:
        raise NotImplementedError


class CoMap(TwoInputOperator):
    """``fn1`` maps batches of input 0, ``fn2`` those of input 1, both to ``out_dtype``."""

    def __init__(self, fn1: BatchFn, fn2: BatchFn, out_dtype: npt.DTypeLike) -> None:
        self.fn1, self.fn2 = fn1, fn2
        self.out_dtype = np.dtype(out_dtype)

    def _emit(self, out: object, what: str) -> None:
        batch = check_batch(out, self.out_dtype, what)
        if len(batch):
            self.ctx.output.emit(batch)

    def process1(self, batch: Batch) -> None:
        self._emit(self.fn1(batch), "the first co-map function")

    def process2(self, batch: Batch) -> None:
        self._emit(self.fn2(batch), "the second co-map function")
