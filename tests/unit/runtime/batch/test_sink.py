"""ParquetSink in a batch job: a task that runs again (its end never logged) first
removes what an earlier run of it published, so its output is there once; output of
the run's other tasks stays, and another run's output is still refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from spillover.errors import ConfigError
from spillover.runtime.api import Batch, OperatorContext, Output
from spillover.runtime.checkpointing.finishing import FINAL_WITHOUT_CHECKPOINTS as FINAL_ID
from spillover.runtime.connectors import ParquetSink

KV = np.dtype([("key", "<i8"), ("value", "<i8")])


class _Nowhere(Output):
    def emit(self, batch: Batch) -> None:
        raise AssertionError("a sink emits nothing")

    def emit_watermark(self, timestamp_ms: int) -> None:
        pass


def _run(out: Path, subtask: int, keys: list[int], run: str, attempt: int = 0, p: int = 2) -> None:
    """One run of a batch sink task: open, write, commit at the end (no checkpoints)."""
    sink = ParquetSink(str(out))
    sink.open(
        OperatorContext(
            uid="sink",
            name="sink",
            subtask_index=subtask,
            parallelism=p,
            max_parallelism=128,
            attempt=attempt,
            output=_Nowhere(),
            batch_run=run,
        )
    )
    rows = np.zeros(len(keys), KV)
    rows["key"] = keys
    sink.process(rows)
    snap = sink.snapshot(FINAL_ID)
    if snap.finalize is not None:
        snap.finalize("")
    sink.notify_checkpoint_complete(FINAL_ID)
    sink.close()


def _keys(out: Path) -> list[int]:
    return sorted(pq.read_table(out)["key"].to_pylist())


def test_a_sink_task_that_runs_again_replaces_what_it_published(tmp_path: Path) -> None:
    run = "0123456789abcdef"
    _run(tmp_path, 0, [1, 2], run)
    _run(tmp_path, 1, [3], run)
    _run(tmp_path, 0, [1, 2], run, attempt=1)  # published, but its end was not logged
    assert _keys(tmp_path) == [1, 2, 3]


def test_a_rescaled_sink_replaces_every_old_subtask_it_owns(tmp_path: Path) -> None:
    run = "0123456789abcdef"
    for i, keys in enumerate([[1], [2], [3]]):
        _run(tmp_path, i, keys, run, p=3)
    _run(tmp_path, 0, [1, 3], run, p=2)  # owns old subtasks 0 and 2
    _run(tmp_path, 1, [2], run, p=2)
    assert _keys(tmp_path) == [1, 2, 3]


def test_another_runs_output_is_still_refused(tmp_path: Path) -> None:
    _run(tmp_path, 0, [1], "aaaaaaaaaaaaaaaa")
    with pytest.raises(ConfigError, match="committed output of another run"):
        _run(tmp_path, 0, [1], "bbbbbbbbbbbbbbbb")
