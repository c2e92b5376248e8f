"""Stop-with-savepoint under backpressure: how long a stop takes, aligned against
unaligned, on the job of ``spillover bench``, next to the machine's own limit for
writing the savepoint's bytes.

One round runs the bench job (periodic checkpoints of the ``unaligned`` policy, so
that a periodic checkpoint never holds the stop up for long), lets it run until
``spec.warmup_s`` passed and a checkpoint of id :data:`MIN_CHECKPOINTS` or later
completed (the channels are full by then), asks ``Executor.stop_with_savepoint`` from another
thread and times, from the request: the savepoint checkpoint's completion (its
summary's ``trigger_ms + duration_ms``) and ``run`` returning with the savepoint
exported. ``pure=True`` runs the round with the engine's pure-Python twin
(``SPILLOVER_PURE=1``, local executor only: the variable is read at every open).
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from spillover.benchmark.spec import BenchSpec, build_job
from spillover.deploy import create_executor
from spillover.errors import ConfigError

STOP_KINDS = ("aligned", "unaligned")
PERIODIC_POLICY = "unaligned"  # the job's periodic checkpoints during the warm-up
MIN_CHECKPOINTS = 2  # completed before the stop is asked
UNALIGNED_STOP_TARGET_MS = 100.0  # docs/benchmarks.md: request -> savepoint complete
_CHK = re.compile(r"chk-(\d+)/?$")


@dataclass
class StopResult:
    """One stop: times from the request (ms), what the savepoint holds, and the
    machine's time to write (and fsync) the same files."""

    executor: str
    kind: str  # aligned | unaligned
    pure: bool
    status: str  # the job's: stopped, or failed (see failures)
    waited_s: float = 0.0  # from the start of run to the request
    checkpoints_before: int = 0  # the newest checkpoint id completed before the request
    trigger_ms: float | None = None  # request -> the savepoint checkpoint triggered
    complete_ms: float | None = None  # request -> the savepoint checkpoint completed
    returned_ms: float | None = None  # request -> run returned, savepoint exported
    inflight_bytes: int = 0  # persisted by the savepoint checkpoint, all subtasks
    state_bytes: int = 0
    savepoint_files: int = 0
    savepoint_bytes: int = 0  # on disk: the savepoint directory, referenced checkpoints too
    raw_write_ms: float | None = None  # the same file sizes, written, not synced
    raw_write_fsync_ms: float | None = None  # ... written and fsynced, directory too
    source_backpressured_share: float = 0.0
    failures: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def variant(self) -> str:
        return f"{self.executor}{' pure' if self.pure else ''} {self.kind}"

    def line(self) -> str:
        if self.status == "failed":
            return f"{self.variant}: FAILED: {'; '.join(self.failures)}"
        return (
            f"{self.variant}: savepoint complete {_fmt(self.complete_ms)} ms, run returned "
            f"{_fmt(self.returned_ms)} ms after the request; in-flight {self.inflight_bytes:,} B, "
            f"savepoint {self.savepoint_bytes:,} B in {self.savepoint_files} files (raw write "
            f"{_fmt(self.raw_write_ms)} ms, with fsync {_fmt(self.raw_write_fsync_ms)} ms)"
        )


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:,.1f}"


@contextmanager
def _pure_engine(on: bool) -> Iterator[None]:
    """``SPILLOVER_PURE=1`` while the block runs, when ``on``; restored after."""
    before = os.environ.get("SPILLOVER_PURE")
    if on:
        os.environ["SPILLOVER_PURE"] = "1"
    try:
        yield
    finally:
        if on:
            if before is None:
                os.environ.pop("SPILLOVER_PURE", None)
            else:
                os.environ["SPILLOVER_PURE"] = before


def stop_once(
    spec: BenchSpec,
    kind: str,
    executor: str = "local",
    *,
    pure: bool = False,
    timeout_s: float = 300.0,
) -> StopResult:
    """Runs the bench job on ``executor`` and stops it with a ``kind`` savepoint once
    it is warm and backpressured; see the module's docstring."""
    if kind not in STOP_KINDS:
        raise ConfigError(f"unknown stop {kind!r}", hint=f"choose from {', '.join(STOP_KINDS)}")
    if pure and executor != "local":
        raise ConfigError(
            "the pure-Python engine runs on the local executor only",
            detail="SPILLOVER_PURE is read in this process",
        )
    base = tempfile.mkdtemp("-spillover-stop", dir=spec.checkpoint_dir)
    out = StopResult(executor, kind, pure, "failed")
    try:
        env = build_job(spec, f"stop-{executor}-{kind}-{uuid.uuid4().hex[:8]}")
        ex = create_executor(
            executor,
            env,
            spec.config(PERIODIC_POLICY, os.path.join(base, "checkpoints")),
            master=spec.master if executor == "spark" else None,
        )
        ex.prepare()
        asked: dict[str, float] = {}
        done = threading.Event()

        def stopper() -> None:
            while not done.is_set():
                waited = time.monotonic() - started
                # Retention keeps the newest completed ids only: ids count every trigger.
                newest = max(ex.completed_ids(), default=0)
                if waited >= spec.warmup_s and newest >= MIN_CHECKPOINTS:
                    asked["checkpoints"] = newest
                    asked["waited"] = waited
                    asked["wall"] = time.time()
                    asked["mono"] = time.monotonic()
                    ex.stop_with_savepoint(
                        savepoint_dir=os.path.join(base, "savepoints"),
                        unaligned=kind == "unaligned",
                    )
                    return
                done.wait(0.01)

        thread = threading.Thread(target=stopper, name="bench-stopper", daemon=True)
        with _pure_engine(pure):
            started = time.monotonic()
            thread.start()
            try:
                result = ex.run(timeout=timeout_s)
            finally:
                returned = time.monotonic()
                done.set()
                thread.join()
        out.status = result.status
        out.failures = list(result.failures)
        if "mono" not in asked:
            out.status = "failed"
            out.failures.append("the job ended before the stop was asked")
            return out
        if result.savepoint is None:
            out.status = "failed"
            out.failures.append("no savepoint")
            return out
        out.waited_s = round(asked["waited"], 3)
        out.checkpoints_before = int(asked["checkpoints"])
        out.returned_ms = round((returned - asked["mono"]) * 1000, 1)
        m = _CHK.search(result.savepoint)
        cid = int(m[1]) if m else None
        saved = [c for c in result.checkpoints if c["checkpoint_id"] == cid]
        if saved:
            c = saved[0]
            req_ms = int(asked["wall"] * 1000)  # truncated to whole ms, as trigger_ms is
            out.trigger_ms = round(c["trigger_ms"] - req_ms, 1)
            out.complete_ms = round(c["trigger_ms"] + c["duration_ms"] - req_ms, 1)
            out.inflight_bytes = int(c["inflight_bytes"])
            out.state_bytes = int(c["state_bytes"])
        # The savepoint directory holds the stop's chk-<id> and the older ones it references.
        sizes = _file_sizes(os.path.dirname(result.savepoint.rstrip("/")))
        out.savepoint_files, out.savepoint_bytes = len(sizes), sum(sizes)
        out.raw_write_ms, out.raw_write_fsync_ms = raw_write(sizes, base)
        sources = [t for k, t in result.tasks.items() if k.startswith("source#")]
        if sources:
            out.source_backpressured_share = round(
                statistics.fmean(t.get("backpressured_share", 0.0) for t in sources), 3
            )
        return out
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _file_sizes(path: str) -> list[int]:
    """The sizes of every file under a local directory (none for a URI)."""
    local = path.removeprefix("file://")
    if "://" in local:
        return []
    return [os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(local) for f in files]


def raw_write(sizes: Sequence[int], where: str) -> tuple[float, float]:
    """Milliseconds to write files of ``sizes`` into a new directory under ``where``:
    without a sync, then again with each file and the directory fsynced (the
    machine's limit for a savepoint of these files, the second a durable one)."""
    times = []
    for sync in (False, True):
        d = tempfile.mkdtemp("-raw", dir=where)
        data = memoryview(os.urandom(max(sizes, default=0)))
        t = time.perf_counter()
        for i, n in enumerate(sizes):
            fd = os.open(os.path.join(d, f"f{i}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                written = 0
                while written < n:
                    written += os.write(fd, data[written:n])
                if sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        if sync:
            dfd = os.open(d, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        times.append(round((time.perf_counter() - t) * 1000, 2))
        shutil.rmtree(d, ignore_errors=True)
    return times[0], times[1]


def variants(
    executors: Sequence[str], kinds: Sequence[str] = STOP_KINDS, pure: bool = True
) -> list[tuple[str, str, bool]]:
    """``(executor, kind, pure)`` of one alternation: every kind on every executor,
    then, with ``pure``, every kind with the pure-Python engine on local."""
    out = [(e, k, False) for e in executors for k in kinds]
    return out + ([("local", k, True) for k in kinds] if pure else [])


def summarise(results: Sequence[StopResult]) -> dict[str, dict[str, Any]]:
    """Per variant: median, min and max of each time, and the savepoint's bytes."""
    groups: dict[str, list[StopResult]] = {}
    for r in results:
        groups.setdefault(r.variant, []).append(r)
    out = {}
    for name, rs in groups.items():
        ok = [r for r in rs if r.status != "failed"]
        row: dict[str, Any] = {"stops": len(ok), "failed": len(rs) - len(ok)}
        for metric in (
            "trigger_ms",
            "complete_ms",
            "returned_ms",
            "inflight_bytes",
            "savepoint_bytes",
            "raw_write_ms",
            "raw_write_fsync_ms",
        ):
            xs = [float(v) for r in ok if (v := getattr(r, metric)) is not None]
            row[metric] = (
                {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else None
            )
        if rs[0].kind == "unaligned" and not rs[0].pure and row["complete_ms"] is not None:
            row["target_ms"] = UNALIGNED_STOP_TARGET_MS
            row["target_met"] = row["complete_ms"]["median"] < UNALIGNED_STOP_TARGET_MS
        out[name] = row
    return out


def to_markdown(summary: dict[str, dict[str, Any]]) -> str:
    """One row per variant: medians with the range of the rounds."""

    def cell(stat: dict[str, float] | None, scale: float = 1.0, digits: int = 0) -> str:
        if stat is None:
            return "–"
        # + 0.0: no "-0" for a trigger a fraction of a ms before the request (ms clock)
        med, lo, hi = (round(stat[k] / scale, digits) + 0.0 for k in ("median", "min", "max"))
        return f"{med:,.{digits}f} ({lo:,.{digits}f}–{hi:,.{digits}f})"

    rows = [
        "| variant | stops | request → trigger (ms) | request → savepoint complete (ms) "
        "| request → run returned (ms) | in-flight (KiB) | savepoint on disk (KiB) "
        "| raw write (ms) | raw write + fsync (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in summary.items():
        failed = f" (+{r['failed']} failed)" if r["failed"] else ""
        rows.append(
            f"| {name} | {r['stops']}{failed} "
            f"| {cell(r['trigger_ms'])} | {cell(r['complete_ms'])} | {cell(r['returned_ms'])} "
            f"| {cell(r['inflight_bytes'], 1024)} | {cell(r['savepoint_bytes'], 1024)} "
            f"| {cell(r['raw_write_ms'], digits=1)} | {cell(r['raw_write_fsync_ms'], digits=1)} |"
        )
    return "\n".join(rows) + "\n"
