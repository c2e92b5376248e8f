"""Recovery under backpressure, and a live rescale, on the job of ``spillover bench``
(FLIP-76's own goal: a backpressured job restarts and catches up fast).

A recovery round runs the bench job (sinks paced, unaligned checkpoints every
``spec.interval_ms``, restart strategy fixed-delay with no delay), lets it run until
``spec.warmup_s`` passed and :data:`MIN_CHECKPOINTS` checkpoints completed, measures
the sinks' steady rate over :data:`STEADY_S`, then fails the keyed count's subtask 0
once, on its next buffer (:class:`ArmedFailure`, an operator failure). The job
restarts from its latest checkpoint. Timed from the failure: the first record a sink
of the restarted attempt took, and the start of the first :data:`WINDOW_S` window
(not before that record) in which the sinks take :data:`RECOVERED_SHARE` of the
steady rate again; and the in-flight bytes the restore replayed (the task metrics'
``replayed_bytes``). The timeline of the restart comes with it: the failure
detected, the new attempt's subtasks running, the first sink opened.

A rescale round lets the same job warm up the same way at ``spec.parallelism``, asks
``Executor.rescale_live`` for another parallelism and times, from the request, the
first record a sink at the new parallelism took (and the runtime's own figure, the
first record any operator processed there).

Both time what the sinks see through :class:`SinkStamps`, an inner operator of the
paced sink that writes, per batch, its wall-clock time and size to a file per
attempt and subtask: the same clock on the local executor and on Spark's worker
processes (one machine), and nothing per record.
"""

from __future__ import annotations

import glob
import os
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import Field, asdict, dataclass, field
from typing import IO, Any, ClassVar

from spillover.benchmark.spec import BenchSpec, build_job
from spillover.deploy import create_executor
from spillover.errors import SpilloverError
from spillover.runtime.api import Batch, Operator, OperatorContext
from spillover.runtime.failures import FailureInjector, FailureSpec

POLICY = "unaligned"  # the job's checkpoints
MIN_CHECKPOINTS = 2  # completed before the failure or the rescale
STEADY_S = 2.0  # the steady rate is measured over this long before the failure
STEADY_BATCHES = 4  # ... or longer, to take in at least this many sink batches
WINDOW_S = 0.5  # throughput is back once a window this long reaches RECOVERED_SHARE
RECOVERED_SHARE = 0.9
FAILING_VERTEX = "count"  # the keyed count's subtask 0 fails
TARGET_RATIO = 0.5  # issue 34: both recovery times at most this share of Flink's
_FLUSH_S = 0.05  # SinkStamps writes its lines at least this often


class SinkStamps(Operator):
    """Writes ``<wall time> <records>`` per batch to ``<directory>/sink-<attempt>-p
    <parallelism>-<subtask>-<id>``, and ``<wall time> open`` when opened; lines are
    flushed every :data:`_FLUSH_S` and on close, so a failed attempt loses at most
    the last few."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def open(self, ctx: OperatorContext) -> None:
        super().open(ctx)
        name = f"sink-{ctx.attempt}-p{ctx.parallelism}-{ctx.subtask_index}-{uuid.uuid4().hex[:8]}"
        self._file: IO[str] | None = open(os.path.join(self.directory, name), "w")  # noqa: SIM115
        self._lines = [f"{time.time():.6f} open\n"]
        self._flushed = 0.0

    def process(self, batch: Batch, input_index: int = 0) -> None:
        now = time.time()
        self._lines.append(f"{now:.6f} {len(batch)}\n")
        if now - self._flushed >= _FLUSH_S:
            self._flush(now)

    def _flush(self, now: float) -> None:
        if self._file is not None and self._lines:
            self._file.writelines(self._lines)
            self._file.flush()
            self._lines = []
        self._flushed = now

    def close(self) -> None:
        self._flush(time.time())
        if self._file is not None:
            self._file.close()
            self._file = None


@dataclass(frozen=True)
class SinkBatch:
    """One batch a sink took: wall-clock time, records, and where."""

    t: float
    records: int
    attempt: int
    parallelism: int


def read_stamps(directory: str) -> tuple[list[SinkBatch], list[SinkBatch]]:
    """The batches every sink wrote to ``directory``, and their opens (``records``
    0), each sorted by time."""
    batches, opens = [], []
    for path in glob.glob(os.path.join(directory, "sink-*")):
        _, attempt, par, _, _ = os.path.basename(path).split("-")
        with open(path) as f:
            for line in f:
                t, what = line.split()
                if what == "open":
                    opens.append(SinkBatch(float(t), 0, int(attempt), int(par[1:])))
                else:
                    batches.append(SinkBatch(float(t), int(what), int(attempt), int(par[1:])))
    return sorted(batches, key=lambda b: b.t), sorted(opens, key=lambda b: b.t)


class ArmedFailure(FailureInjector):
    """Fails subtask 0 of :data:`FAILING_VERTEX` on its next buffer once the file
    ``<directory>/arm`` exists, once (an operator failure), and writes the time it
    fired to ``<directory>/failed``. A file, so that Spark's worker processes see
    it too."""

    def __init__(self, directory: str) -> None:
        super().__init__([FailureSpec("operator", FAILING_VERTEX, 0)])
        self.directory = directory

    def ready(
        self, point: str, attempt: int, vertex_uid: str, subtask: int, checkpoint: int | None
    ) -> bool:
        return (
            point == "operator"
            and vertex_uid == FAILING_VERTEX
            and subtask == 0
            and not attempt
            and os.path.exists(os.path.join(self.directory, "arm"))
        )

    def firing(self, spec: FailureSpec, attempt: int) -> None:
        with open(os.path.join(self.directory, "failed"), "w") as f:
            f.write(f"{time.time():.6f}\n")


def window_start(batches: Sequence[SinkBatch], rate: float, window_s: float) -> float | None:
    """The time of the first batch from which the batches of the next ``window_s``
    seconds hold at least ``rate * window_s`` records (None if no window does, or the
    series ends before a window does)."""
    need = rate * window_s
    j, inside = 0, 0
    for i, b in enumerate(batches):
        if j < i:
            j, inside = i, 0
        while j < len(batches) and batches[j].t < b.t + window_s:
            inside += batches[j].records
            j += 1
        if j >= len(batches):
            return None  # the window is not over yet when the series ends
        if inside >= need:
            return b.t
        inside -= b.records
    return None


class _RoundResult:
    """What a recovery round and a live rescale report alike: their fields as a dict,
    and one line that is the failures when the round failed, else :meth:`_summary`."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]
    kind: ClassVar[str]
    executor: str
    status: str
    failures: list[str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        if self.status == "failed":
            return f"{self.executor} {self.kind}: FAILED: {'; '.join(self.failures)}"
        return self._summary()

    def _summary(self) -> str:
        raise NotImplementedError


@dataclass
class RecoveryResult(_RoundResult):
    """One recovery round: times in ms from the failure (the moment the operator
    raised), the restored checkpoint's in-flight bytes, and the restart's timeline."""

    executor: str
    status: str  # ok | failed (see failures)
    steady_rps: float = 0.0  # the sinks' rate before the failure
    restored_checkpoint: int | None = None
    detected_ms: float | None = None  # the job master learnt of the failure
    running_ms: float | None = None  # the new attempt's subtasks run (restart_s)
    sink_opened_ms: float | None = None  # the first sink of the new attempt opened
    first_record_ms: float | None = None  # ... took its first record
    ninety_percent_ms: float | None = None  # throughput at 90 % of steady from here
    replayed_bytes: int = 0  # task metrics' replayed_bytes, every subtask
    restored_inflight_bytes: int = 0  # persisted in the restored checkpoint
    failures: list[str] = field(default_factory=list)

    kind: ClassVar[str] = "recovery"

    def _summary(self) -> str:
        return (
            f"{self.executor} recovery from checkpoint {self.restored_checkpoint}: detected "
            f"{_fmt(self.detected_ms)}, running {_fmt(self.running_ms)}, sink opened "
            f"{_fmt(self.sink_opened_ms)}, first record {_fmt(self.first_record_ms)}, 90 % "
            f"{_fmt(self.ninety_percent_ms)} ms after the failure; replayed "
            f"{self.replayed_bytes:,} B (restored checkpoint's in-flight "
            f"{self.restored_inflight_bytes:,} B); steady {self.steady_rps:,.0f} records/s"
        )


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _recovery_config(spec: BenchSpec, checkpoint_dir: str) -> Any:
    """The bench's unaligned configuration, restarting at once (Flink's run alike)."""
    return spec.config(POLICY, checkpoint_dir).with_options(
        {
            "restart-strategy.type": "fixed-delay",
            "restart-strategy.fixed-delay.attempts": 1,
            "restart-strategy.fixed-delay.delay": "0 ms",
        }
    )


def _warm(ex: Any, spec: BenchSpec, done: threading.Event) -> bool:
    """Waits until the job ran ``spec.warmup_s`` and completed :data:`MIN_CHECKPOINTS`
    checkpoints; False if ``done`` was set first."""
    while not done.is_set():
        since = ex.running_since()
        warm = since is not None and time.monotonic() - since >= spec.warmup_s
        if warm and max(ex.completed_ids(), default=0) >= MIN_CHECKPOINTS:
            return True
        done.wait(0.01)
    return False


def _run_driven(
    ex: Any, driver: Callable[[], None], done: threading.Event, timeout_s: float, name: str
) -> Any:
    """Runs the job on ``ex`` with ``driver`` on a thread of its own, until the job ends
    or ``done`` is set; ``done`` is set and the driver joined before returning."""
    thread = threading.Thread(target=driver, name=name, daemon=True)
    thread.start()
    try:
        return ex.run(timeout=timeout_s, stop_when=lambda _: done.is_set())
    finally:
        done.set()
        thread.join()


def recover_once(
    spec: BenchSpec, executor: str = "local", *, after_s: float = 5.0, timeout_s: float = 300.0
) -> RecoveryResult:
    """One recovery round on ``executor``; see the module's docstring. The job runs
    ``after_s`` seconds after the failure, then stops."""
    base = tempfile.mkdtemp("-spillover-recovery", dir=spec.checkpoint_dir)
    stamps = os.path.join(base, "stamps")
    os.makedirs(stamps)
    out = RecoveryResult(executor, "failed")
    try:
        env = build_job(spec, f"recovery-{executor}-{uuid.uuid4().hex[:8]}", SinkStamps(stamps))
        ex = create_executor(
            executor,
            env,
            _recovery_config(spec, os.path.join(base, "checkpoints")),
            master=spec.master if executor == "spark" else None,
            failures=ArmedFailure(stamps),
        )
        ex.prepare()
        done = threading.Event()
        seen: dict[str, float] = {}

        def driver() -> None:
            if not _warm(ex, spec, done) or done.wait(STEADY_S):
                return
            first_run = ex.running_since()
            open(os.path.join(stamps, "arm"), "w").close()
            failed = os.path.join(stamps, "failed")
            while not os.path.exists(failed):
                if done.wait(0.001):
                    return
            running = ex.running_since()
            while running is None or running == first_run:  # until the new attempt runs
                if done.wait(0.001):
                    return
                running = ex.running_since()
            seen["running_mono"] = running
            seen["offset"] = time.time() - time.monotonic()
            done.wait(after_s)
            done.set()

        result = _run_driven(ex, driver, done, timeout_s, "bench-recovery")
        out.failures = list(result.failures)
        _summarise_recovery(out, result, stamps, seen)
        return out
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _summarise_recovery(
    out: RecoveryResult, result: Any, stamps: str, seen: dict[str, float]
) -> None:
    failed_path = os.path.join(stamps, "failed")
    if not os.path.exists(failed_path) or len(result.restored_from) != 1:
        out.failures.append(
            f"expected one failure and one restore, got restores from {result.restored_from}"
        )
        return
    with open(failed_path) as f:
        tf = float(f.read())
    batches, opens = read_stamps(stamps)
    # The sinks' rate before the failure, over the last STEADY_S, or further back
    # to take in at least STEADY_BATCHES batches: a backpressured sink takes its
    # records in bursts, seconds apart on a loaded machine.
    earlier = sorted(b.t for b in batches if b.attempt == 0 and b.t < tf)
    start = min([tf - STEADY_S, *earlier[-STEADY_BATCHES:][:1]])
    # (a batch holds what the sink took since the one before: the first at the
    # window's start counts only as its start)
    before = [b for b in batches if b.attempt == 0 and start < b.t < tf]
    after = [b for b in batches if b.attempt > 0]
    if not after:
        out.failures.append("no sink record after the restore")
        return
    out.steady_rps = round(sum(b.records for b in before) / (tf - start), 1)
    out.restored_checkpoint = result.restored_from[0]
    out.first_record_ms = round((after[0].t - tf) * 1000, 1)
    ninety = window_start(after, RECOVERED_SHARE * out.steady_rps, WINDOW_S)
    out.ninety_percent_ms = None if ninety is None else round((ninety - tf) * 1000, 1)
    later_opens = [o for o in opens if o.attempt > 0]
    if later_opens:
        out.sink_opened_ms = round((later_opens[0].t - tf) * 1000, 1)
    if "running_mono" in seen:
        running = seen["running_mono"] + seen["offset"]
        out.running_ms = round((running - tf) * 1000, 1)
        if result.restart_s:  # restart_s: from the detection to the subtasks running
            out.detected_ms = round((running - result.restart_s[0] - tf) * 1000, 1)
    out.replayed_bytes = int(result.replayed_bytes)
    restored = [c for c in result.checkpoints if c["checkpoint_id"] == out.restored_checkpoint]
    if restored:
        out.restored_inflight_bytes = int(restored[0]["inflight_bytes"])
    out.status = "ok" if result.status in ("stopped", "finished") else "failed"


@dataclass
class RescaleResult(_RoundResult):
    """One live rescale: times in ms from the request."""

    executor: str
    status: str  # ok | failed (see failures)
    from_parallelism: int = 0
    to_parallelism: int = 0
    savepoint_ms: float | None = None  # the stop's savepoint completed
    running_ms: float | None = None  # the job's subtasks run at the new parallelism
    sink_opened_ms: float | None = None  # the first sink at the new parallelism opened
    first_sink_record_ms: float | None = None  # ... took its first record
    first_record_ms: float | None = None  # the runtime's figure: any operator's record
    replayed_bytes: int = 0
    failures: list[str] = field(default_factory=list)

    kind: ClassVar[str] = "rescale"

    def _summary(self) -> str:
        return (
            f"{self.executor} live rescale {self.from_parallelism}->{self.to_parallelism}: "
            f"savepoint {_fmt(self.savepoint_ms)}, running {_fmt(self.running_ms)}, "
            f"sink opened {_fmt(self.sink_opened_ms)}, first sink record "
            f"{_fmt(self.first_sink_record_ms)} ms after the request (first record of any "
            f"operator {_fmt(self.first_record_ms)} ms); replayed {self.replayed_bytes:,} B"
        )


def rescale_once(
    spec: BenchSpec, executor: str = "local", to: int = 3, *, timeout_s: float = 300.0
) -> RescaleResult:
    """One live rescale from ``spec.parallelism`` to ``to`` on ``executor``; see the
    module's docstring. The job stops one second after the first sink record at
    ``to``."""
    base = tempfile.mkdtemp("-spillover-rescale", dir=spec.checkpoint_dir)
    stamps = os.path.join(base, "stamps")
    os.makedirs(stamps)
    out = RescaleResult(executor, "failed", spec.parallelism, to)
    try:
        env = build_job(spec, f"rescale-{executor}-{uuid.uuid4().hex[:8]}", SinkStamps(stamps))
        ex = create_executor(
            executor,
            env,
            spec.config(POLICY, os.path.join(base, "checkpoints")),
            master=spec.master if executor == "spark" else None,
        )
        ex.prepare()
        done = threading.Event()
        asked: dict[str, Any] = {}

        def driver() -> None:
            if not _warm(ex, spec, done):
                return
            asked["wall"] = time.time()
            try:
                request = ex.rescale_live(to)
            except SpilloverError as e:  # refused: the round fails, the job stops
                asked["error"] = f"{type(e).__name__}: {e}"
                done.set()
                return
            asked["status"] = request.wait(timeout_s)
            asked["running_wall"] = (ex.running_since() or 0.0) + time.time() - time.monotonic()
            pattern = os.path.join(stamps, f"sink-*-p{to}-*")
            while not done.is_set():  # until a sink at ``to`` took a record
                if any(os.path.getsize(p) > 20 for p in glob.glob(pattern)):
                    break
                done.wait(0.01)
            done.wait(1.0)
            done.set()

        result = _run_driven(ex, driver, done, timeout_s, "bench-rescale")
        out.failures = list(result.failures)
        if "error" in asked:
            out.failures.append(f"the rescale was refused: {asked['error']}")
            return out
        status = asked.get("status")
        if status is None or status.status != "COMPLETED":
            out.failures.append(f"the rescale did not complete: {status}")
            return out
        out.first_record_ms = status.first_record_ms
        batches, opens = read_stamps(stamps)
        at_new = [b for b in batches if b.parallelism == to]
        opened = [o for o in opens if o.parallelism == to]
        if not at_new:
            out.failures.append(f"no sink record at parallelism {to}")
            return out
        out.first_sink_record_ms = round((at_new[0].t - asked["wall"]) * 1000, 1)
        if opened:
            out.sink_opened_ms = round((opened[0].t - asked["wall"]) * 1000, 1)
        out.running_ms = round((asked["running_wall"] - asked["wall"]) * 1000, 1)
        saved = [c for c in result.checkpoints if c["checkpoint_id"] == status.savepoint_id]
        if saved:
            done_ms = saved[0]["trigger_ms"] + saved[0]["duration_ms"]
            out.savepoint_ms = round(done_ms - asked["wall"] * 1000, 1)
        out.replayed_bytes = int(result.replayed_bytes)
        out.status = "ok"
        return out
    finally:
        shutil.rmtree(base, ignore_errors=True)


def summarise(rows: Sequence[dict[str, Any]], metrics: Sequence[str]) -> dict[str, Any]:
    """Per ``variant`` of ``rows`` (dicts with ``variant`` and ``status``): the rounds,
    and the median, min and max of each of ``metrics`` over the rounds that went ok."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["variant"], []).append(r)
    out: dict[str, Any] = {}
    for name, rs in groups.items():
        ok = [r for r in rs if r["status"] == "ok"]
        row: dict[str, Any] = {"rounds": len(ok), "failed": len(rs) - len(ok)}
        for m in metrics:
            xs = [float(r[m]) for r in ok if r.get(m) is not None]
            row[m] = (
                {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else None
            )
        out[name] = row
    return out


def to_markdown(summary: dict[str, Any], metrics: Sequence[tuple[str, str]]) -> str:
    """One row per variant: ``metrics`` are ``(key, header)``; medians with the range."""

    def cell(stat: dict[str, float] | None) -> str:
        if stat is None:
            return "–"
        med, lo, hi = (stat[k] for k in ("median", "min", "max"))
        return f"{med:,.0f} ({lo:,.0f}–{hi:,.0f})"

    rows = [
        "| variant | rounds | " + " | ".join(h for _, h in metrics) + " |",
        "|---|---:|" + "---:|" * len(metrics),
    ]
    for name, r in summary.items():
        failed = f" (+{r['failed']} failed)" if r["failed"] else ""
        rows.append(
            f"| {name} | {r['rounds']}{failed} | "
            + " | ".join(cell(r[k]) for k, _ in metrics)
            + " |"
        )
    return "\n".join(rows) + "\n"
