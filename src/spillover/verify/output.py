"""A run's committed output and final keyed state, read back from its Parquet
files and its last checkpoint."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spillover.errors import ConfigError
from spillover.keygroups import KeyGroupRange
from spillover.runtime.api import (
    StateDescriptor,
)
from spillover.runtime.failures import FailureInjector
from spillover.runtime.jobmaster import JobResult
from spillover.storage.location import Location
from spillover.verify.spec import (
    VerifySpec,
)


@dataclass
class RunOutput:
    result: JobResult
    rows: np.ndarray[Any, Any]  # committed rows, in commit order
    state: dict[Any, Any]
    fired: list[str] = field(default_factory=list)
    restored_inflight: int = 0  # in-flight bytes of the checkpoint a rescale restored
    out_dir: str | None = None  # where the run committed its output
    max_parallelism: int = 0
    # A run that failed for good: the latest checkpoint it was then restored from
    # and run to the end without faults (verify.run.finish_failed), and how that ended.
    finished_from: int | None = None
    finished_status: str | None = None


ID_COLUMNS = ("partition", "seq")
OPTIONAL_COLUMNS = ("key", "total", "subtask", "parallelism")
# ParquetSink's names: part-<subtask>-a<attempt>-c<last checkpoint>-<counter>-<writer>.parquet
_PART = re.compile(r"part-(\d+)-a(\d+)-c(\d+)-(\d+)(?:-[0-9a-f]+)?\.parquet$")


def _commit_order(name: str) -> tuple[int, int, int, str]:
    """Sorts committed files as they were committed: a subtask writes one file per
    checkpoint interval, named after the checkpoint before it, and a key moves to
    another subtask only at a restore, whose files continue from that checkpoint."""
    m = _PART.match(name)
    if m is None:
        return (sys.maxsize, 0, 0, name)
    subtask, _, checkpoint, counter = map(int, m.groups())
    return (checkpoint, counter, subtask, name)


def read_output(out_dir: str, extra: tuple[str, ...] = ()) -> np.ndarray[Any, Any]:
    """The committed rows under ``out_dir`` in commit order: ``partition``, ``seq``, the
    optional contract columns present, and ``extra`` columns (see :class:`JobFactory`)."""
    import pyarrow.parquet as pq

    files = [f for f in os.listdir(out_dir) if f.endswith(".parquet") and not f.startswith("_")]
    if not files:
        return np.empty(0, [(n, "<i8") for n in ID_COLUMNS])
    files.sort(key=_commit_order)
    t = pq.read_table([os.path.join(out_dir, f) for f in files])
    names = set(t.column_names)
    missing = [n for n in (*ID_COLUMNS, *extra) if n not in names]
    if missing:
        raise ConfigError(
            f"the committed output under {out_dir} has no column {', '.join(missing)}",
            detail=f"its columns: {', '.join(t.column_names)}",
            hint="see the output contract of spillover.verify.JobFactory",
        )
    if ("subtask" in names) != ("parallelism" in names):
        raise ConfigError(
            f"the committed output under {out_dir} has one of subtask and parallelism",
            hint="add both (stamp_subtask) or neither",
        )
    wanted = list(dict.fromkeys(n for n in (*ID_COLUMNS, *OPTIONAL_COLUMNS, *extra) if n in names))
    cols = {n: t.column(n).to_numpy() for n in wanted}
    ints = (*ID_COLUMNS, "key", "subtask", "parallelism")
    rows = np.empty(t.num_rows, [(n, "<i8" if n in ints else cols[n].dtype) for n in wanted])
    for n in wanted:
        rows[n] = cols[n]
    return rows


def _read_output(out_dir: str) -> np.ndarray[Any, Any]:
    return read_output(out_dir)


def final_state(
    result: JobResult,
    max_parallelism: int,
    uid: str,
    name: str | None = None,
    *,
    required: bool = True,
) -> dict[Any, Any]:
    """The keyed state of operator ``uid`` at the run's last checkpoint: ``{key: value}``
    of state ``name``, or ``{(state, key): value}`` of every state when ``name`` is None
    (a list state's value is the tuple of its entries). An operator or state that is
    not there raises :class:`ConfigError` when ``required``, else gives ``{}``."""
    from spillover.runtime.checkpointing.metadata import CheckpointStorage
    from spillover.runtime.state import HeapKeyedStateBackend

    if result.checkpoint_dir is None:
        return {}
    job = Location.parse(result.checkpoint_dir)
    latest = CheckpointStorage(job.parent.uri, job.name).latest()
    if latest is None:
        return {}
    meta = latest.metadata
    keyed = [entry.keyed for task in meta.tasks.values() for entry in task.subtasks.values()]
    handles = [k[uid] for k in keyed if k.get(uid) is not None]
    kinds = {e["name"]: (e["kind"], np.dtype(e["dtype"])) for h in handles for e in h["states"]}
    if (name is not None and name not in kinds) or not handles:
        if not required:
            return {}
        operators = ", ".join(sorted({u for k in keyed for u in k})) or "none"
        raise ConfigError(
            f"no keyed state {name or ''!s} of operator {uid!r} in the last checkpoint",
            detail=f"its states: {', '.join(sorted(kinds))}"
            if handles
            else f"keyed operators: {operators}",
        )
    backend = HeapKeyedStateBackend(max_parallelism, KeyGroupRange(0, max_parallelism - 1))
    backend.restore(handles)
    out: dict[Any, Any] = {}
    for state_name in [name] if name is not None else sorted(kinds):
        kind, dtype = kinds[state_name]
        keys, values = backend.state(StateDescriptor(state_name, kind, dtype)).items()
        order = np.argsort(keys, kind="stable")
        grouped: dict[int, list[Any]] = {}
        for key, value in zip(keys[order].tolist(), values[order].tolist(), strict=True):
            grouped.setdefault(key, []).append(value)
        for key, vs in grouped.items():
            out[key if name is not None else (state_name, key)] = (
                tuple(vs) if kind == "list" else vs[0]
            )
    return out


def _final_state(result: JobResult, max_parallelism: int) -> dict[Any, Any]:
    return final_state(result, max_parallelism, "running-total", "total", required=False)


def _state_of(spec: VerifySpec, result: JobResult, max_parallelism: int) -> dict[Any, Any]:
    _, uid, name = spec.checks()
    if uid is None:
        return {}
    return final_state(result, max_parallelism, uid, name, required=spec.job is not None)


def _read(spec: VerifySpec, out_dir: str) -> np.ndarray[Any, Any]:
    order_by = spec.checks()[0]
    return read_output(out_dir, (order_by,) if order_by and spec.order else ())


def _read_rows(directory: str, dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    """The committed rows of a ParquetSink directory, as ``dtype``."""
    import pyarrow.parquet as pq

    files = []
    if os.path.isdir(directory):
        files = sorted(f for f in os.listdir(directory) if f.endswith(".parquet"))
    rows = np.empty(0, dtype)
    if files:
        t = pq.read_table([os.path.join(directory, f) for f in files])
        rows = np.empty(t.num_rows, dtype)
        for name in dtype.names or ():
            rows[name] = t.column(name).to_numpy()
    return rows


def output_of(
    spec: VerifySpec,
    result: JobResult,
    out_dir: str,
    max_parallelism: int,
    failures: FailureInjector | None = None,
) -> RunOutput:
    """What a run of ``spec`` committed to ``out_dir`` and its final keyed state, for
    :func:`compare`."""
    return RunOutput(
        result,
        _read(spec, out_dir),
        _state_of(spec, result, max_parallelism),
        [s.describe() for s in failures.fired] if failures is not None else [],
        out_dir=out_dir,
        max_parallelism=max_parallelism,
    )


@dataclass(frozen=True)
class DrainedSources:
    """What a drained run's sources emitted before the drain ended them, read from
    its savepoint: per committed partition (the source's partition plus its
    topology's offset, :data:`~spillover.verify.topologies.SOURCE_PARTITION_OFFSETS`),
    the ``seq`` of the next record the source would have emitted. A drain must
    commit every record below it once, whatever the sink committed."""

    savepoint: str
    next_seq: Mapping[int, int]

    @property
    def records(self) -> int:
        """How many records the sources emitted in all."""
        return sum(self.next_seq.values())

    def emitted(self, rows: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.bool_]]:
        """Which of ``rows`` (``partition``, ``seq``) the sources had emitted."""
        parts = np.fromiter(self.next_seq, np.int64, len(self.next_seq))
        ends = np.fromiter(self.next_seq.values(), np.int64, len(self.next_seq))
        order = np.argsort(parts)
        parts, ends = parts[order], ends[order]
        if not len(parts):
            return np.zeros(len(rows), bool)
        p = rows["partition"].astype(np.int64)
        at = np.clip(np.searchsorted(parts, p), 0, len(parts) - 1)
        return np.asarray((parts[at] == p) & (rows["seq"].astype(np.int64) < ends[at]))


def drained_sources(savepoint: str, offsets: Mapping[str, int]) -> DrainedSources:
    """The positions of the sources named in ``offsets`` (``uid -> partition offset``)
    in ``savepoint``: each subtask's ``{"next_seq": {partition: seq}}`` operator state
    (a :class:`~spillover.runtime.connectors.generator.GeneratorSource`'s). A source
    whose state is missing raises :class:`ConfigError`: without it, what the drain
    had to commit is unknown."""
    from spillover.runtime.checkpointing.metadata import load_checkpoint

    meta = load_checkpoint(savepoint)
    next_seq: dict[int, int] = {}
    for op in meta.tasks.values():
        for sub in op.subtasks.values():
            for uid, state in sub.operators.items():
                if uid not in offsets:
                    continue
                if not isinstance(state, Mapping) or "next_seq" not in state:
                    raise ConfigError(
                        f"the savepoint holds no position of source {uid!r}",
                        detail=f"{savepoint}: its state is {type(state).__name__}",
                    )
                for part, seq in dict(state["next_seq"]).items():
                    next_seq[offsets[uid] + int(part)] = int(seq)
    return DrainedSources(savepoint, next_seq)
