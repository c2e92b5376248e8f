"""Throughput of a keyed streaming job on the local executor, next to the network's limit.

Run: ``PYTHONPATH=src .venv/bin/python -m pytest bench/bench_runtime.py --benchmark-only -q``

Job: ``GeneratorSource`` (100-byte payloads, 10,000 uniform keys, unthrottled,
bounded) → ``key_by("key")`` → keyed sum → counting sink, parallelism 2, on
``LocalExecutor``; once with checkpointing off and once with aligned checkpoints
every second (each round right after a run with checkpointing off, so that their
ratio is taken pair by pair on a shared machine). The bare loop moves the same
bytes (the key_by writer's 32 KiB buffers of the same records) through the same
partitions, gates and credits, 2 producer threads × 2 consumer threads, with no
operators, no serialization and no state: the network's own limit for this job
shape.

``SPILLOVER_BENCH_RUNTIME_RECORDS`` (default 2,000,000, all subtasks together)
sets the records per run; ``SPILLOVER_BENCH_ROUNDS`` (default 3) the timed
rounds. Rates use the median round.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
import uuid
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from spillover.config import Config
from spillover.deploy.local import LocalExecutor
from spillover.keygroups import compute_default_max_parallelism
from spillover.runtime.api import Batch, EdgeKind, Operator, OperatorContext
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.graph import StreamEnvironment
from spillover.runtime.jobmaster import JobResult
from spillover.runtime.network.buffers import BufferPool
from spillover.runtime.network.gate import InputGate
from spillover.runtime.network.local import connect
from spillover.runtime.network.partition import ResultPartition
from spillover.runtime.network.writers import PartitionWriter
from spillover.runtime.operators import KeyedSum
from spillover.storage.handle import DataType

PARALLELISM = 2
PAYLOAD = 100
KEYS = 10_000
RECORD_DTYPE = GeneratorSource.dtype(PAYLOAD)
FRAMED = 4 + RECORD_DTYPE.itemsize  # bytes of one record on the wire
RECORDS = int(float(os.environ.get("SPILLOVER_BENCH_RUNTIME_RECORDS", "2000000")))
ROUNDS = int(os.environ.get("SPILLOVER_BENCH_ROUNDS", "3"))
ALIGNED_TARGET = 0.90  # aligned checkpoints every second cost at most 10 % of throughput
SAMPLE_RECORDS = 65_536  # per producer: the bare loop cycles through their buffers

COUNT_DTYPE = np.dtype([("records", "<i8")])


class BatchCountingSum(KeyedSum):
    """``KeyedSum("key", "seq")`` whose output is one row per batch: its record count."""

    def __init__(self) -> None:
        super().__init__("key", "seq", out="none")
        self.out_dtype = COUNT_DTYPE

    def process(self, batch: Batch, input_index: int = 0) -> None:
        super().process(batch, input_index)
        out = np.empty(1, COUNT_DTYPE)
        out["records"] = len(batch)
        self.ctx.output.emit(out)


class CountingSink(Operator):
    """Adds up the counts it receives; ``totals[(run, subtask)]`` holds them at the end."""

    totals: ClassVar[dict[tuple[str, int], int]] = {}

    def __init__(self, run: str) -> None:
        self.run = run
        self.records = 0

    def process(self, batch: Batch, input_index: int = 0) -> None:
        self.records += int(batch["records"].sum())

    def finish(self) -> None:
        CountingSink.totals[(self.run, self.ctx.subtask_index)] = self.records


def _job(records_per_partition: int, run: str) -> StreamEnvironment:
    env = StreamEnvironment("runtime-bench", parallelism=PARALLELISM)
    source = GeneratorSource(
        partitions=PARALLELISM,
        records_per_partition=records_per_partition,
        rate_per_subtask=None,
        payload_bytes=PAYLOAD,
        keys=KEYS,
    )
    (
        env.from_source(source, uid="source")
        .key_by("key")
        .process(BatchCountingSum(), uid="keyed-sum")
        .sink(CountingSink(run), uid="count")
    )
    return env


def _record(benchmark: Any, role: str, records: int, nbytes: int, rates: dict[str, float]) -> None:
    """Adds records/s and MB/s (10^6 bytes/s on the wire) over the median round."""
    median = benchmark.stats.stats.median
    rates[role] = records / median
    benchmark.extra_info.update(
        role=role,
        records=records,
        bytes=nbytes,
        records_per_s=round(records / median),
        mb_per_s=round(nbytes / median / 1e6, 1),
    )


def _executor(settings: dict[str, Any], checkpoints: Path | None) -> tuple[LocalExecutor, str]:
    """A fresh executor of the job and its run id (checkpoints in a directory of its own)."""
    run = uuid.uuid4().hex
    cfg = dict(settings)
    if checkpoints is not None:
        cfg["state.checkpoints.dir"] = str(checkpoints / run)
    return LocalExecutor(_job(RECORDS // PARALLELISM, run), Config.from_dict(cfg)), run


def _checked(run: str, result: JobResult) -> JobResult:
    """``result``, once it is known that the job finished and every record was summed."""
    assert result.status == "finished", result.failures
    counted = sum(CountingSink.totals.pop((run, i), 0) for i in range(PARALLELISM))
    assert counted == RECORDS // PARALLELISM * PARALLELISM
    return result


def _run_job(
    benchmark: Any,
    settings: dict[str, Any],
    checkpoints: Path | None = None,
    paired_off: list[float] | None = None,
) -> list[JobResult]:
    """Times ``LocalExecutor.run`` of the job over the rounds; checks every record arrived.

    With ``checkpoints``, each round writes its checkpoints to a directory of its own
    there. With ``paired_off``, a run with checkpointing off precedes every round,
    outside the benchmark's timing, and its seconds are appended there: a ratio of
    pairs taken back to back holds on a machine whose speed drifts between tests.
    """
    runs: list[tuple[str, JobResult]] = []
    cpu_share: list[float] = []

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        if paired_off is not None:
            executor, run = _executor({}, None)
            t = time.perf_counter()
            _checked(run, executor.run(timeout=600))
            paired_off.append(time.perf_counter() - t)
        return _executor(settings, checkpoints), {}

    def go(executor: LocalExecutor, run: str) -> None:
        cpu, wall = time.process_time(), time.perf_counter()
        runs.append((run, executor.run(timeout=600)))
        cpu_share.append((time.process_time() - cpu) / (time.perf_counter() - wall))

    benchmark.pedantic(go, setup=setup, rounds=ROUNDS, iterations=1)
    results = [_checked(run, result) for run, result in runs]
    _task_info(benchmark, results, cpu_share)
    return results


def _task_info(benchmark: Any, results: list[JobResult], cpu_share: list[float]) -> None:
    """Where the time went, as medians over the rounds: the process's CPU time per wall
    second (all threads; 1.0 = one core), and per vertex the share of its wall time
    spent busy (processing or, for sources, generating and emitting) and the share
    spent waiting for credit."""
    info = benchmark.extra_info
    info["cpu_cores_used"] = round(statistics.median(cpu_share), 2)
    for vertex in ("source", "keyed-sum"):
        ms = [m for r in results for name, m in r.tasks.items() if name.startswith(vertex + "#")]
        busy = statistics.median(m["busy_seconds"] / m["wall_seconds"] for m in ms)
        info[f"{vertex.replace('-', '_')}_busy_share"] = round(busy, 2)
        if vertex == "source":
            bp = statistics.median(m["backpressured_share"] for m in ms)
            info["source_backpressured_share"] = round(bp, 2)


@pytest.fixture(scope="module")
def rates() -> dict[str, float]:
    """Records/s measured so far in this module, by role, for the ratios."""
    return {}


def _producer_buffers(producer: int, max_parallelism: int) -> list[tuple[int, np.ndarray]]:
    """The full buffers (whole records) the key_by writer of source subtask ``producer`` emits
    for its first records, as ``(subpartition, buffer)`` in emission order."""
    batches: list[Batch] = []

    class Collect:
        def emit(self, batch: Batch) -> None:
            batches.append(batch)

    source = GeneratorSource(
        partitions=PARALLELISM,
        records_per_partition=SAMPLE_RECORDS // PARALLELISM,
        payload_bytes=PAYLOAD,
        keys=KEYS,
    )
    source.open(
        OperatorContext("source", "source", producer, PARALLELISM, max_parallelism, 0, Collect())
    )
    while source.on_timer():
        pass
    out: list[tuple[int, np.ndarray]] = []
    writer = PartitionWriter(
        EdgeKind.KEY_BY,
        RECORD_DTYPE,
        PARALLELISM,
        producer,
        Config().network.segment_size,
        max_parallelism,
        "key",
        send=lambda sub, buf: out.append((sub, buf)),
        send_all=None,
    )
    for batch in batches:
        writer.emit(batch)
    return out


@pytest.mark.benchmark(group="runtime")
def test_bare_network_loop(benchmark: Any, rates: dict[str, float]) -> None:
    """2 producers × 2 consumers over LocalChannels: emit pre-built buffers, poll, release."""
    net = Config().network
    max_p = compute_default_max_parallelism(PARALLELISM)
    samples = [_producer_buffers(u, max_p) for u in range(PARALLELISM)]
    # Full buffers of whole records: as many as fit in a segment.
    full = net.segment_size // FRAMED * FRAMED
    per_producer = RECORDS // PARALLELISM * FRAMED // full
    assert all(len(b) == full for s in samples for _, b in s)
    sent = per_producer * PARALLELISM * full
    received: list[int] = []

    def produce(part: ResultPartition, pool: BufferPool, sample: list[Any]) -> None:
        k = len(sample)
        for i in range(per_producer):
            sub, buf = sample[i % k]
            part.emit(sub, pool.wrap(buf, DataType.DATA))
        part.finish()

    def consume(gate: InputGate) -> None:
        nbytes = 0
        while not gate.finished:
            item = gate.poll(0.1)
            if item is None:
                continue
            _, buf = item
            if buf.data_type == DataType.DATA:
                nbytes += len(buf)
            buf.release()
        received.append(nbytes)

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        gates = [
            InputGate(
                PARALLELISM,
                floating_buffers=net.floating_buffers_per_gate,
                name=f"sum#{d}",
                buffers_per_channel=net.buffers_per_channel,
            )
            for d in range(PARALLELISM)
        ]
        threads = []
        for u in range(PARALLELISM):
            pool = BufferPool(net.segment_size, net.buffers_per_partition, f"source#{u}")
            part = ResultPartition(PARALLELISM, pool, name=f"source#{u}->sum")
            for d, gate in enumerate(gates):
                connect(part, d, gate, u)
            threads.append(threading.Thread(target=produce, args=(part, pool, samples[u])))
        threads += [threading.Thread(target=consume, args=(g,)) for g in gates]
        received.clear()
        return (threads,), {}

    def go(threads: list[threading.Thread]) -> None:
        cpu, wall = time.process_time(), time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        cpu_share.append((time.process_time() - cpu) / (time.perf_counter() - wall))

    cpu_share: list[float] = []
    # A round takes a fraction of a second: more rounds and a warm-up, at little cost.
    benchmark.pedantic(go, setup=setup, rounds=max(ROUNDS, 5), iterations=1, warmup_rounds=1)
    assert sum(received) == sent
    _record(benchmark, "bare", sent // FRAMED, sent, rates)
    benchmark.extra_info["buffers"] = per_producer * PARALLELISM
    benchmark.extra_info["cpu_cores_used"] = round(statistics.median(cpu_share), 2)


@pytest.mark.benchmark(group="runtime")
def test_job_checkpointing_off(benchmark: Any, rates: dict[str, float]) -> None:
    """The job with checkpointing off."""
    _run_job(benchmark, {})
    records = RECORDS // PARALLELISM * PARALLELISM
    _record(benchmark, "off", records, records * FRAMED, rates)
    if "bare" in rates:
        benchmark.extra_info["ratio_to_bare"] = round(rates["off"] / rates["bare"], 3)


@pytest.mark.benchmark(group="runtime")
def test_job_aligned_checkpoints(benchmark: Any, tmp_path: Path, rates: dict[str, float]) -> None:
    """The job with aligned checkpoints every second, each round paired with a run with
    checkpointing off; records the checkpoints' count and duration."""
    paired_off: list[float] = []
    results = _run_job(benchmark, {"execution.checkpointing.interval": "1 s"}, tmp_path, paired_off)
    records = RECORDS // PARALLELISM * PARALLELISM
    _record(benchmark, "aligned", records, records * FRAMED, rates)
    done = [c for r in results for c in r.completed_checkpoints()]
    periodic = [c for c in done if not c["final"]]
    info = benchmark.extra_info
    info["checkpoints_completed_per_round"] = [len(r.completed_checkpoints()) for r in results]
    info["periodic_checkpoints_per_round"] = [
        sum(not c["final"] for c in r.completed_checkpoints()) for r in results
    ]
    info["checkpoints_aborted"] = sum(
        c["status"] != "completed" for r in results for c in r.checkpoints
    )
    if done:
        info["checkpoint_median_ms"] = round(statistics.median(c["duration_ms"] for c in done), 1)
        info["alignment_median_ms"] = round(statistics.median(c["alignment_ms"] for c in done), 1)
    if periodic:
        info["periodic_checkpoint_median_ms"] = round(
            statistics.median(c["duration_ms"] for c in periodic), 1
        )
    # The judged ratio: each aligned round against the off run just before it.
    aligned_s = benchmark.stats.stats.data
    ratio = statistics.median(o / a for o, a in zip(paired_off, aligned_s, strict=True))
    info["paired_off_records_per_s"] = round(records / statistics.median(paired_off))
    info["ratio_to_off"] = round(ratio, 3)
    info["target_met"] = ratio >= ALIGNED_TARGET
    if "off" in rates:
        info["ratio_to_off_test"] = round(rates["aligned"] / rates["off"], 3)
