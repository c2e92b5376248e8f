"""Event time on whole jobs: tumbling window counts equal a numpy reference computed
from the generated records, after induced failures (aligned and unaligned
checkpoints), after a restore at another parallelism (timers and window state
rescaled by key group), across a stop-with-savepoint without drain, and with a
drain (every window fires); an idle source subtask holds no window back."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spillover.config import Config
from spillover.deploy.local import LocalExecutor
from spillover.runtime.checkpointing.metadata import CheckpointStorage
from spillover.runtime.connectors.collecting import CollectingSink
from spillover.runtime.connectors.generator import GeneratedEventTime, GeneratorSource
from spillover.runtime.eventtime import WatermarkStrategy
from spillover.runtime.failures import FailureInjector, FailureSpec
from spillover.runtime.graph import StreamEnvironment
from support.operators import LingeringGenerator, Paced

PARTITIONS, RECORDS, KEYS = 4, 3000, 64
WINDOW_MS, DISORDER_MS = 1000, 80
EVENT_TIME = GeneratedEventTime(step_ms=10, max_disorder_ms=DISORDER_MS)
WATERMARKS = WatermarkStrategy.bounded_out_of_orderness("ts", DISORDER_MS)
OUT = np.dtype([("key", "<i8"), ("window_end", "<i8"), ("count", "<i8")])


def _source(rate: float | None = None, cls: type[GeneratorSource] = GeneratorSource) -> Any:
    return cls(
        partitions=PARTITIONS,
        records_per_partition=RECORDS,
        payload_bytes=8,
        keys=KEYS,
        batch_size=256,
        rate_per_subtask=rate,
        event_time=EVENT_TIME,
    )


def _job(name: str, parallelism: int = 2, rate: float | None = None) -> StreamEnvironment:
    """Source -> rebalance -> a paced stage (backpressure, in-flight data) -> key_by
    -> window count -> exactly-once sink: watermarks cross two exchanges."""
    env = StreamEnvironment(name, parallelism=parallelism, max_parallelism=128)
    src = env.from_source(_source(rate), uid="src", watermarks=WATERMARKS)
    paced = src.rebalance().process(Paced(4000, src.dtype), uid="paced")
    windows = paced.key_by("key").window_count(WINDOW_MS, timestamp_field="ts", uid="windows")
    windows.sink(CollectingSink(name), uid="sink")
    return env


def _reference(emitted: dict[int, int] | None = None) -> dict[tuple[int, int], int]:
    """Window counts of the records of every partition (or the first ``emitted[p]``)."""
    gen = _source()
    parts, seqs = [], []
    for p in range(PARTITIONS):
        n = RECORDS if emitted is None else emitted.get(p, 0)
        parts.append(np.full(n, p))
        seqs.append(np.arange(n))
    part, seq = np.concatenate(parts), np.concatenate(seqs)
    keys = gen.keys_of(part, seq)
    ends = (gen.timestamps_of(part, seq) // WINDOW_MS + 1) * WINDOW_MS
    pairs, counts = np.unique(np.stack([keys, ends]), axis=1, return_counts=True)
    return {(int(k), int(e)): int(c) for (k, e), c in zip(pairs.T, counts, strict=True)}


def _windows(name: str) -> dict[tuple[int, int], int]:
    rows = CollectingSink.records(name, OUT)
    got: dict[tuple[int, int], int] = {}
    for k, e, c in zip(
        rows["key"].tolist(), rows["window_end"].tolist(), rows["count"].tolist(), strict=True
    ):
        assert (k, e) not in got, f"window ({k}, {e}) emitted twice"
        got[(k, e)] = c
    return got


def _config(tmp: Path, unaligned: bool, **extra: Any) -> Config:
    return Config.from_dict(
        {
            "execution.checkpointing.interval": "100 ms",
            "execution.checkpointing.unaligned.enabled": unaligned,
            "state.checkpoints.dir": str(tmp / "ckpt"),
            # The restored checkpoints stay to be read afterwards.
            "state.checkpoints.num-retained": 1000,
            "restart-strategy.fixed-delay.attempts": 3,
            "restart-strategy.fixed-delay.delay": "0 ms",
            **extra,
        }
    )


def test_windows_equal_the_reference_without_failures() -> None:
    name = "event-time-plain"
    CollectingSink.clear(name)
    result = LocalExecutor(_job(name), Config()).run(timeout=120)
    assert result.status == "finished", result
    assert _windows(name) == _reference()
    assert sum(m.get("late_records_dropped", 0) for m in result.tasks.values()) == 0


@pytest.mark.parametrize("unaligned", [False, True], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("rescale_to", [None, 3], ids=["same", "to-3"])
def test_windows_are_exact_after_a_failure(
    unaligned: bool, rescale_to: int | None, tmp_path: Path
) -> None:
    """The windows task fails part way; the restore (at the same parallelism, or at
    3: window state and timers rescaled by key group) gives the failure-free result."""
    name = f"event-time-{unaligned}-{rescale_to}"
    CollectingSink.clear(name)
    failures = FailureInjector([FailureSpec("operator", "windows", 0, after_records=4500)])
    rescale = None if rescale_to is None else (lambda *_: _job(name, rescale_to))
    ex = LocalExecutor(_job(name), _config(tmp_path, unaligned), failures=failures, rescale=rescale)
    result = ex.run(timeout=180)
    assert result.status == "finished", result
    assert len(failures.fired) == 1 and result.restored_from, result
    if unaligned:
        restored = CheckpointStorage(str(tmp_path / "ckpt"), name).read_metadata(
            result.restored_from[0]
        )
        assert _inflight_bytes(restored) > 0, "the restored checkpoint held in-flight data"
    assert _windows(name) == _reference()


def _inflight_bytes(meta: dict[str, Any]) -> int:
    total = 0
    for entry in meta["tasks"].values():
        for st in entry["subtasks"].values():
            cs = st.get("channel_state") or {}
            total += int(cs.get("bytes", 0))
    return total


def _stop_once(ex: LocalExecutor, drain: bool, when: Any) -> threading.Thread:
    def stop() -> None:
        while not when():
            threading.Event().wait(0.01)
        ex.stop_with_savepoint(drain=drain)

    thread = threading.Thread(target=stop, daemon=True)
    thread.start()
    return thread


def _timer_rows(meta: dict[str, Any]) -> int:
    rows = 0
    for st in meta["tasks"]["windows"]["subtasks"].values():
        for handle in (st.get("keyed") or {}).values():
            rows += sum(e["rows"] for e in handle["states"] if e["kind"] == "timers")
    return rows


def _emitted(meta: dict[str, Any]) -> dict[int, int]:
    """Per partition, how many records the sources had emitted at this checkpoint."""
    out: dict[int, int] = {}
    for st in meta["tasks"]["src"]["subtasks"].values():
        for p, n in st["operators"]["src"]["next_seq"].items():
            out[int(p)] = int(n)
    return out


@pytest.mark.parametrize("unaligned", [False, True], ids=["aligned", "unaligned"])
def test_a_stop_without_drain_keeps_timers_in_the_savepoint(
    unaligned: bool, tmp_path: Path
) -> None:
    """No MAX_WATERMARK without drain: pending windows stay in the savepoint (their
    timers with them) and fire after the restore, as if never stopped."""
    name = f"event-time-stop-{unaligned}"
    CollectingSink.clear(name)
    cfg = _config(tmp_path, unaligned)
    ex = LocalExecutor(_job(name, rate=2000), cfg)
    stopper = _stop_once(ex, False, lambda: len(ex.completed_ids()) >= 2)
    result = ex.run(timeout=120)
    stopper.join()
    assert result.status == "stopped" and result.savepoint is not None, result
    first = _windows(name)
    assert len(first) < len(_reference()), "stopped while windows were open"
    chk = int(result.savepoint.rsplit("chk-", 1)[1])
    meta = CheckpointStorage(str(tmp_path / "ckpt"), name).read_metadata(chk)
    assert _timer_rows(meta) > 0, "pending timers are in the savepoint"
    resumed = LocalExecutor(_job(name, rate=2000), cfg, restore_checkpoint=result.savepoint)
    assert resumed.run(timeout=120).status == "finished"
    assert _windows(name) == _reference()


def test_a_stop_with_drain_fires_every_window(tmp_path: Path) -> None:
    name = "event-time-drain"
    CollectingSink.clear(name)
    ex = LocalExecutor(_job(name, rate=2000), _config(tmp_path, False))
    stopper = _stop_once(ex, True, lambda: len(ex.completed_ids()) >= 2)
    result = ex.run(timeout=120)
    stopper.join()
    assert result.status == "finished" and result.savepoint is not None, result
    chk = int(result.savepoint.rsplit("chk-", 1)[1])
    meta = CheckpointStorage(str(tmp_path / "ckpt"), name).read_metadata(chk)
    emitted = _emitted(meta)
    assert sum(emitted.values()) < PARTITIONS * RECORDS, "drained while the sources ran"
    # MAX_WATERMARK fired every window of what the sources had emitted, open ones too.
    assert _windows(name) == _reference(emitted)
    assert _timer_rows(meta) == 0


def test_an_idle_source_subtask_holds_no_window_back(tmp_path: Path) -> None:
    """Three source subtasks, two partitions: the third owns none and stays up, idle.
    Every window fires although it never sends a watermark."""
    name = "event-time-idle"
    CollectingSink.clear(name)
    env = StreamEnvironment(name, parallelism=3, max_parallelism=128)
    source = _source(cls=LingeringGenerator)
    source.partitions = 2
    env.from_source(source, uid="src", watermarks=WATERMARKS).key_by("key").window_count(
        WINDOW_MS, timestamp_field="ts", uid="windows"
    ).sink(CollectingSink(name), uid="sink")
    expected = _reference({0: RECORDS, 1: RECORDS})
    ex = LocalExecutor(env, _config(tmp_path, False))
    # The two subtasks with partitions run out (MAX_WATERMARK); the third never sends
    # a watermark, so the windows fire only if its idleness lets them. The job stays
    # up with it: it is stopped (without drain) once every window came.
    stopper = _stop_once(ex, False, lambda: len(_windows(name)) >= len(expected))
    result = ex.run(timeout=120)
    stopper.join()
    assert result.status == "stopped", result
    assert _windows(name) == expected
