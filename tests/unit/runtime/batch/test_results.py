"""Blocking result partitions: what a producer writes through the engine, a consumer
reads back exactly, at the parallelism it was written for or (key_by) at another
one, by key group; a damaged file names its producer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spillover.keygroups import key_group_range_for_operator, key_groups
from spillover.records import FixedWidthSerializer, RecordReader
from spillover.runtime.api import EdgeKind
from spillover.runtime.batch.results import (
    BlockingSubpartition,
    InputResult,
    ResultHandle,
    ResultReader,
    ResultUnreadableError,
    ResultWriter,
)
from spillover.runtime.graph import JobEdge, JobGraph
from spillover.runtime.network import events as ev
from spillover.runtime.network.buffers import BufferPool
from spillover.runtime.network.gate import InputGate
from spillover.runtime.network.partition import ResultPartition
from spillover.runtime.network.writers import Outbox, PartitionWriter
from spillover.storage import DataType, open_storage

DTYPE = np.dtype([("key", "<i8"), ("value", "<i8")])
MAX_P = 128
SEGMENT = 4096


def _write(
    where: Path, records: np.ndarray[Any, Any], channels: int, kind: EdgeKind
) -> ResultHandle:
    storage = open_storage(str(where), subtask_index=0)
    writer = ResultWriter(storage, 0, channels)
    pool = BufferPool(SEGMENT, 4, "p")
    part = ResultPartition(channels, pool, name="p")
    for d in range(channels):
        part.connect(d, BlockingSubpartition(writer, d))
    box = Outbox(part, pool)
    pw = PartitionWriter(
        kind, DTYPE, channels, 0, SEGMENT, MAX_P, "key", send=box.send, send_all=box.send_all
    )
    for chunk in np.array_split(records, 7):
        pw.emit(chunk)
        box.drain_blocking()
    pw.flush()
    box.drain_blocking()
    part.broadcast_event(ev.EndOfData(True))  # events stay out of the file
    part.finish()
    assert writer.handle is not None
    return ResultHandle("p", 0, "c", 0, channels, writer.handle)


def _read(
    handle: ResultHandle, kind: EdgeKind, subtask: int, parallelism: int
) -> np.ndarray[Any, Any]:
    edge = JobEdge(0, 1, kind, 0, "key", DTYPE)
    graph = JobGraph("g", [], [edge], MAX_P)
    gate = InputGate(1, buffers_per_channel=2, floating_buffers=2, name="c")
    reader = ResultReader(
        graph, subtask, parallelism, gate, [InputResult(handle, edge, 0)], SEGMENT, "c"
    )
    reader.start()
    records, events, rr, ser = [], [], RecordReader(), FixedWidthSerializer(DTYPE)
    while not gate.finished:
        item = gate.poll(5.0)
        if item is None:
            continue
        ch, buf = item
        try:
            if buf.data_type == DataType.EVENT:
                event = ev.deserialize(buf.data)
                events.append(type(event).__name__)
                if isinstance(event, ev.EndOfPartition):
                    gate.channel_finished(ch)
            else:
                records += [ser.deserialize_batch(b) for b in rr.feed(buf)]
        finally:
            buf.release()
    reader.thread.join()
    assert reader.error is None
    assert events == ["EndOfData", "EndOfPartition"]
    return np.concatenate(records) if records else np.empty(0, DTYPE)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    keys=st.lists(st.integers(-(2**40), 2**40), min_size=0, max_size=600),
    written_for=st.integers(1, 4),
    read_at=st.integers(1, 5),
)
def test_a_key_by_result_is_read_by_key_group_at_any_parallelism(
    tmp_path_factory: pytest.TempPathFactory, keys: list[int], written_for: int, read_at: int
) -> None:
    records = np.zeros(len(keys), DTYPE)
    records["key"] = keys
    records["value"] = np.arange(len(keys))
    handle = _write(tmp_path_factory.mktemp("r"), records, written_for, EdgeKind.KEY_BY)
    seen = []
    groups = key_groups(records["key"], MAX_P)
    for d in range(read_at):
        got = _read(handle, EdgeKind.KEY_BY, d, read_at)
        r = key_group_range_for_operator(MAX_P, read_at, d)
        mine = records[(groups >= r.start) & (groups <= r.end)]
        # exactly its key groups, in the order they were written per key
        assert sorted(got["value"].tolist()) == sorted(mine["value"].tolist())
        for k in np.unique(got["key"]):
            assert (
                got["value"][got["key"] == k].tolist() == mine["value"][mine["key"] == k].tolist()
            )
        seen.append(got)
    assert sorted(np.concatenate(seen)["value"].tolist()) == list(range(len(keys)))


@pytest.mark.parametrize("kind", [EdgeKind.REBALANCE, EdgeKind.BROADCAST])
def test_rebalance_and_broadcast_results_are_shared_out_at_another_parallelism(
    tmp_path: Path, kind: EdgeKind
) -> None:
    records = np.zeros(3000, DTYPE)
    records["key"] = np.arange(3000)
    records["value"] = np.arange(3000)
    handle = _write(tmp_path, records, 3, kind)
    got = [_read(handle, kind, d, 2) for d in range(2)]
    if kind is EdgeKind.BROADCAST:
        assert all(sorted(g["value"].tolist()) == list(range(3000)) for g in got)
    else:
        assert sorted(np.concatenate(got)["value"].tolist()) == list(range(3000))


def test_a_missing_result_names_its_producer(tmp_path: Path) -> None:
    records = np.zeros(100, DTYPE)
    handle = _write(tmp_path, records, 1, EdgeKind.KEY_BY)
    Path(handle.gate.uri).unlink()
    edge = JobEdge(0, 1, EdgeKind.KEY_BY, 0, "key", DTYPE)
    gate = InputGate(1, buffers_per_channel=2, floating_buffers=2, name="c")
    reader = ResultReader(
        JobGraph("g", [], [edge], MAX_P), 0, 1, gate, [InputResult(handle, edge, 0)], SEGMENT, "c"
    )
    reader.start()
    reader.thread.join(10)
    assert isinstance(reader.error, ResultUnreadableError)
    assert reader.error.producer == ("p", 0)


def test_a_result_handle_round_trips_through_the_log(tmp_path: Path) -> None:
    handle = _write(tmp_path, np.zeros(10, DTYPE), 2, EdgeKind.KEY_BY)
    assert ResultHandle.from_dict(handle.to_dict()) == handle
