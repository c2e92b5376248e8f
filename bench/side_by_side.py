#!/usr/bin/env python3
"""Issue 34's figures side by side with Flink 2.3: alternating rounds, one table.

Each round runs, as subprocesses of the existing runners (the commands are
printed, kept in ``<out>/commands.txt`` and every raw result in ``<out>``):

- ``flink``: ``bench/flink/run.py`` unpaced (``none``, ``unaligned`` every 1 s) at
  Flink's default segment size (32 KiB) and at spillover's default (read from its
  configuration, ``NetworkConfig.segment_size``),
  then paced ``unaligned`` (5,000 records/s per sink subtask);
- ``spark``: ``spillover bench --executor spark`` unpaced (``none,unaligned``) and
  paced ``unaligned``;
- ``spark1w``: the same unpaced without checkpoints, with ``--slots`` at the
  parallelism: every subtask in one worker process, its channels in memory, as
  Flink's local MiniCluster runs the job in one TaskManager;
- ``local``: ``spillover bench --executor local`` unpaced (``none,unaligned``);
- ``bare``: the bare network loop (``bench/bench_runtime.py -k bare``);
- ``floor``: the job's own work on one thread, no runtime around it
  (``bench/bench_hotpath.py --floor``), as the records/s two cores could reach.

Odd rounds run Flink first, even rounds spillover first, so that drift on the
machine touches both alike. The table gives per figure the median over rounds,
every round's value and issue 34's target with met / not met. A ratio is taken
within each round (paired), then its median over rounds.

    PYTHONPATH=src .venv/bin/python bench/side_by_side.py --rounds 5 --out side-by-side
    PYTHONPATH=src .venv/bin/python bench/side_by_side.py --smoke     # seconds, CI-sized

See docs/benchmarks.md, "Issue 34, side by side (`bench/side_by_side.py`)".
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from spillover.benchmark.spec import BenchSpec
from spillover.config import NetworkConfig
from spillover.config.units import KiB, MiB

HERE = Path(__file__).resolve().parent
PARTS = ("flink", "spark", "spark1w", "local", "bare", "floor")
# --slots of the one-worker run: the bench job's parallelism, every subtask in one worker
ONE_WORKER_SLOTS = BenchSpec.parallelism
UNPACED_FLINK = 1_000_000_000  # sink records/s per subtask: the sink takes what comes
UNPACED_SPILLOVER = 100_000_000


def _size_flag(size: int) -> str:
    """A segment size as both runners' ``--segment-size`` takes it (``512kb``, ``1mb``)."""
    return f"{size // MiB}mb" if size % MiB == 0 else f"{size // KiB}kb"


def _size_label(size: int) -> str:
    return f"{size // MiB} MiB" if size % MiB == 0 else f"{size // KiB} KiB"


# spillover's default segment size, as its configuration has it; Flink runs at it too.
SEGMENT = NetworkConfig.segment_size
# Flink's segment sizes: its default, and spillover's default; the prefix of their figures.
FLINK_FLAVOURS = {
    "32kb": ("32kb", "flink_"),
    _size_flag(SEGMENT): (_size_flag(SEGMENT), "flinkseg_"),
}


@dataclass(frozen=True)
class Run:
    """One command of a round: its figures come from ``out`` (a file or a folder),
    named ``<prefix><policy>`` (throughput) or ``<prefix>paced_median`` / ``_p90``."""

    part: str
    name: str
    argv: tuple[str, ...]
    out: Path
    prefix: str = ""
    paced: bool = False
    env: tuple[tuple[str, str], ...] = ()

    def command(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env)
        return (env + " " if env else "") + shlex.join(self.argv)


@dataclass(frozen=True)
class Target:
    """Issue 34's bound on one figure: ``figure >= bound`` (``at_least``) or ``<=``."""

    bound: float
    at_least: bool

    def met(self, value: float) -> bool:
        return value >= self.bound if self.at_least else value <= self.bound

    def __str__(self) -> str:
        return f"{'≥' if self.at_least else '≤'} {self.bound:g}"


@dataclass(frozen=True)
class Figure:
    """One row of the table: ``key`` names it in a round's figures; ``unit`` formats it."""

    key: str
    label: str
    unit: str  # rps | ms | ratio | ns
    target: Target | None = None


@dataclass(frozen=True)
class Row:
    """A figure over the rounds: each round's value (None: not measured), the median."""

    figure: Figure
    values: tuple[float | None, ...]

    @property
    def median(self) -> float | None:
        got = [v for v in self.values if v is not None]
        return float(statistics.median(got)) if got else None

    @property
    def verdict(self) -> str:
        """``met`` / ``not met`` on the median; ``–`` without a target or a value."""
        t, m = self.figure.target, self.median
        if t is None or m is None:
            return "–"
        return "met" if t.met(m) else "not met"


# Issue 34's targets 1 and 2; the rows without a target give the context.
FIGURES = (
    Figure("flink_none", "Flink 2.3 unpaced, no checkpoints (32 KiB), records/s", "rps"),
    Figure("flink_unaligned", "Flink 2.3 unpaced, unaligned every 1 s (32 KiB)", "rps"),
    Figure("flinkseg_none", f"Flink 2.3 unpaced, no checkpoints ({_size_label(SEGMENT)})", "rps"),
    Figure(
        "flinkseg_unaligned",
        f"Flink 2.3 unpaced, unaligned every 1 s ({_size_label(SEGMENT)})",
        "rps",
    ),
    Figure("spark_none", "spillover on Spark unpaced, no checkpoints", "rps"),
    Figure("spark_unaligned", "spillover on Spark unpaced, unaligned every 1 s", "rps"),
    Figure(
        "spark1w_none",
        "spillover on Spark unpaced, no checkpoints, one worker (as Flink's one TaskManager)",
        "rps",
    ),
    Figure("local_none", "spillover local unpaced, no checkpoints", "rps"),
    Figure("local_unaligned", "spillover local unpaced, unaligned every 1 s", "rps"),
    Figure("bare", "bare network loop, records/s", "rps"),
    Figure("floor_ns", "work floor: the job's CPU ns per generated record, one thread", "ns"),
    Figure("floor", "work floor: two cores doing the job's work only, sink records/s", "rps"),
    Figure("spark_vs_flink", "Spark / Flink unpaced (Flink at 32 KiB)", "ratio", Target(3.0, True)),
    Figure(
        "spark_vs_flinkseg",
        f"Spark / Flink unpaced (both at {_size_label(SEGMENT)})",
        "ratio",
        Target(3.0, True),
    ),
    Figure(
        "spark1w_vs_flink",
        "Spark, one worker / Flink unpaced (Flink at 32 KiB)",
        "ratio",
        Target(3.0, True),
    ),
    Figure(
        "spark1w_vs_flinkseg",
        f"Spark, one worker / Flink unpaced (both at {_size_label(SEGMENT)})",
        "ratio",
        Target(3.0, True),
    ),
    Figure("spark_vs_bare", "Spark job / bare loop", "ratio", Target(0.3, True)),
    Figure("local_vs_bare", "local job / bare loop", "ratio", Target(0.3, True)),
    Figure(
        "floor_vs_bare",
        "work floor / (0.3 × bare loop): < 1, 0.3× bare is beyond two cores",
        "ratio",
        Target(1.0, True),
    ),
    Figure("spark_vs_floor", "Spark job / work floor", "ratio"),
    Figure("local_vs_floor", "local job / work floor", "ratio"),
    Figure("spark_ckpt_cost", "Spark unaligned / none", "ratio", Target(0.95, True)),
    Figure("local_ckpt_cost", "local unaligned / none", "ratio", Target(0.95, True)),
    Figure("flink_ckpt_cost", "Flink unaligned / none (32 KiB)", "ratio"),
    # Flink's checkpoint duration is its REST end_to_end_duration: trigger to the last
    # acknowledgement. spillover's is given both ways: to the last acknowledgement (the
    # same measure) and to completion (its metadata durable, the completion logged).
    Figure(
        "flink_paced_median",
        "Flink 2.3 paced unaligned checkpoint median (trigger to last ack), ms",
        "ms",
    ),
    Figure("flink_paced_p90", "Flink 2.3 paced unaligned checkpoint p90 (to last ack), ms", "ms"),
    Figure(
        "spark_paced_acked_median",
        "Spark paced unaligned checkpoint median (trigger to last ack), ms",
        "ms",
        Target(5, False),
    ),
    Figure(
        "spark_paced_acked_p90",
        "Spark paced unaligned checkpoint p90 (to last ack), ms",
        "ms",
        Target(10, False),
    ),
    Figure(
        "spark_paced_acked_vs_flink",
        "Spark / Flink paced checkpoint median (both to last ack)",
        "ratio",
        Target(0.25, False),
    ),
    Figure(
        "spark_paced_median",
        "Spark paced unaligned checkpoint median (trigger to completion, metadata durable), ms",
        "ms",
        Target(5, False),
    ),
    Figure(
        "spark_paced_p90",
        "Spark paced unaligned checkpoint p90 (to completion), ms",
        "ms",
        Target(10, False),
    ),
    Figure(
        "spark_paced_vs_flink",
        "Spark to completion / Flink to last ack, paced checkpoint median",
        "ratio",
        Target(0.25, False),
    ),
)

# Ratios of one round's figures: key -> (numerator, denominator, scale of the denominator).
RATIOS: dict[str, tuple[str, str, float]] = {
    "spark_vs_flink": ("spark_none", "flink_none", 1.0),
    "spark_vs_flinkseg": ("spark_none", "flinkseg_none", 1.0),
    "spark1w_vs_flink": ("spark1w_none", "flink_none", 1.0),
    "spark1w_vs_flinkseg": ("spark1w_none", "flinkseg_none", 1.0),
    "spark_vs_bare": ("spark_none", "bare", 1.0),
    "local_vs_bare": ("local_none", "bare", 1.0),
    "floor_vs_bare": ("floor", "bare", 0.3),
    "spark_vs_floor": ("spark_none", "floor", 1.0),
    "local_vs_floor": ("local_none", "floor", 1.0),
    "spark_ckpt_cost": ("spark_unaligned", "spark_none", 1.0),
    "local_ckpt_cost": ("local_unaligned", "local_none", 1.0),
    "flink_ckpt_cost": ("flink_unaligned", "flink_none", 1.0),
    "spark_paced_vs_flink": ("spark_paced_median", "flink_paced_median", 1.0),
    "spark_paced_acked_vs_flink": ("spark_paced_acked_median", "flink_paced_median", 1.0),
}


def with_ratios(measured: dict[str, float]) -> dict[str, float]:
    """One round's figures with the ratios of :data:`RATIOS` that both sides allow."""
    out = dict(measured)
    for key, (num, den, scale) in RATIOS.items():
        a, b = measured.get(num), measured.get(den)
        if a is not None and b:
            out[key] = a / (b * scale)
    return out


def table(rounds: Sequence[dict[str, float]]) -> list[Row]:
    """Every figure of :data:`FIGURES` over ``rounds`` (each round's measured figures,
    ratios added here); figures no round measured are left out."""
    full = [with_ratios(r) for r in rounds]
    rows = [Row(f, tuple(r.get(f.key) for r in full)) for f in FIGURES]
    return [r for r in rows if any(v is not None for v in r.values)]


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "–"
    if unit == "rps":
        return f"{value / 1e6:.2f} M"
    if unit == "ratio":
        return f"{value:.2f}"
    return f"{value:.1f}"


def render(rows: Sequence[Row]) -> str:
    """The table as Markdown: figure, median, rounds, target, verdict."""
    lines = [
        "| figure | median | rounds | target | |",
        "|---|---:|---:|---:|---|",
    ]
    for r in rows:
        u = r.figure.unit
        each = ", ".join(fmt(v, u) for v in r.values)
        target = "–" if r.figure.target is None else str(r.figure.target)
        lines.append(f"| {r.figure.label} | {fmt(r.median, u)} | {each} | {target} | {r.verdict} |")
    return "\n".join(lines)


# ---- the runs of one round, and their figures ----


def plan(parts: Sequence[str], n: int, a: argparse.Namespace, out: Path) -> list[Run]:
    """The runs of round ``n`` in order: Flink first in odd rounds, last in even ones."""
    py, d, w = sys.executable, str(a.duration), str(a.warmup)
    flink: list[Run] = []
    if "flink" in parts:
        run_py = str(HERE / "flink" / "run.py")
        common = ("--duration", d, "--warmup", w)
        for tag, (size, prefix) in FLINK_FLAVOURS.items():
            name, file = f"flink-unpaced-{tag}-{n}", out / f"flink-unpaced-{tag}-{n}.json"
            argv = (py, run_py, "--policies", "none,unaligned", *common)
            argv += ("--sink-rate", str(UNPACED_FLINK), "--segment-size", size)
            flink.append(Run("flink", name, (*argv, "--out", str(file)), file, prefix))
        name, file = f"flink-paced-{n}", out / f"flink-paced-{n}.json"
        argv = (py, run_py, "--policies", "unaligned", *common, "--out", str(file))
        flink.append(Run("flink", name, argv, file, "flink_", paced=True))
    ours: list[Run] = []
    bench = (py, "-m", "spillover.cli", "bench", "--repeat", "1", "--duration", d, "--warmup", w)
    unpaced = ("--policies", "none,unaligned", "--sink-rate", str(UNPACED_SPILLOVER))
    if "spark" in parts:
        spark = (*bench, "--executor", "spark", "--compare-local", "off")
        name = f"spark-unpaced-{n}"
        argv = (*spark, *unpaced, "--out", str(out / name))
        ours.append(Run("spark", name, argv, out / name, "spark_"))
        name = f"spark-paced-{n}"
        argv = (*spark, "--policies", "unaligned", "--out", str(out / name))
        ours.append(Run("spark", name, argv, out / name, "spark_", paced=True))
    if "spark1w" in parts:
        name = f"spark1w-unpaced-{n}"
        argv = (*bench, "--executor", "spark", "--compare-local", "off", "--policies", "none")
        argv += ("--sink-rate", str(UNPACED_SPILLOVER), "--slots", str(ONE_WORKER_SLOTS))
        ours.append(Run("spark1w", name, (*argv, "--out", str(out / name)), out / name, "spark1w_"))
    if "local" in parts:
        name = f"local-unpaced-{n}"
        argv = (*bench, "--executor", "local", *unpaced, "--out", str(out / name))
        ours.append(Run("local", name, argv, out / name, "local_"))
    if "bare" in parts:
        name = f"bare-{n}"
        argv = (py, "-m", "pytest", str(HERE / "bench_runtime.py"), "-k", "bare")
        argv += ("--benchmark-only", "-q", "-p", "no:cacheprovider")
        argv += (f"--benchmark-json={out / name}.json",)
        env = (("SPILLOVER_BENCH_RUNTIME_RECORDS", str(a.bare_records)),)
        ours.append(Run("bare", name, argv, out / f"{name}.json", env=env))
    if "floor" in parts:
        name = f"floor-{n}"
        argv = (py, str(HERE / "bench_hotpath.py"), "--floor", "--batches", str(a.floor_batches))
        argv += ("--json", str(out / f"{name}.json"))
        ours.append(Run("floor", name, argv, out / f"{name}.json"))
    return flink + ours if n % 2 else ours + flink


def figures(run: Run) -> dict[str, float]:
    """The figures one run's raw result holds (``{}`` when it holds none)."""
    if run.part == "flink":
        doc = json.loads(run.out.read_text())
        got: dict[str, float] = {}
        for r in doc.get("runs", []):
            if run.paced:
                _put(got, run.prefix + "paced_median", r.get("checkpoint_ms_median"))
                _put(got, run.prefix + "paced_p90", r.get("checkpoint_ms_p90"))
            else:
                _put(got, run.prefix + r["policy"], r.get("sink_records_per_s"))
        return got
    if run.part in ("spark", "spark1w", "local"):
        doc = json.loads((run.out / "bench.json").read_text())
        got = {}
        for policy, r in doc.get("policies", {}).items():
            if r.get("status") == "failed":
                continue
            if run.paced:
                ckpt = r.get("checkpoint_duration_ms", {})
                _put(got, run.prefix + "paced_median", ckpt.get("median"))
                _put(got, run.prefix + "paced_p90", ckpt.get("p90"))
                acked = r.get("checkpoint_acked_ms", {})
                _put(got, run.prefix + "paced_acked_median", acked.get("median"))
                _put(got, run.prefix + "paced_acked_p90", acked.get("p90"))
            else:
                _put(got, run.prefix + policy, r.get("throughput_rps"))
        return got
    if run.part == "bare":
        doc = json.loads(run.out.read_text())
        got = {}
        for b in doc.get("benchmarks", []):
            _put(got, "bare", b.get("extra_info", {}).get("records_per_s"))
        return got
    if run.part == "floor":
        doc = json.loads(run.out.read_text())
        return {"floor": doc["two_core_sink_records_per_s"], "floor_ns": doc["ns_per_record"]}
    raise ValueError(f"unknown part {run.part!r}")


def _put(into: dict[str, float], key: str, value: Any) -> None:
    if value is not None:
        into[key] = float(value)


def flink_available() -> str | None:
    """Why Flink cannot run without a download (None: it can): ``bench/flink/run.py``
    needs java and javac, and fetches its JARs into its cache the first time."""
    spec = importlib.util.spec_from_file_location("flink_run", HERE / "flink" / "run.py")
    assert spec is not None and spec.loader is not None
    flink_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(flink_run)
    if not (shutil.which("java") and shutil.which("javac")):
        return "java/javac not on PATH"
    jars = flink_run.default_cache() / f"jars-{flink_run.FLINK_VERSION}" / ".complete"
    if not jars.is_file():
        return f"Flink's JARs not in {jars.parent} yet (the first run downloads 330 MB)"
    return None


def run_all(
    runs_of: Callable[[int], list[Run]],
    rounds: int,
    out: Path,
    execute: Callable[[Run, Path], bool],
) -> tuple[list[dict[str, float]], list[str]]:
    """Every round's runs in order; each round's figures, and what failed."""
    measured: list[dict[str, float]] = []
    failed: list[str] = []
    for n in range(1, rounds + 1):
        got: dict[str, float] = {}
        for run in runs_of(n):
            ok = execute(run, out)
            try:
                found = figures(run) if ok else {}
            except (OSError, ValueError, KeyError) as e:
                found, ok = {}, False
                print(f"[side-by-side] {run.name}: no figures ({e})", file=sys.stderr)
            if not ok or not found:
                failed.append(run.name)
            got.update(found)
        measured.append(got)
    return measured, failed


def execute(run: Run, out: Path) -> bool:
    """Runs one command, its output into ``<out>/<name>.log``; True when it exited 0."""
    print(
        f"[side-by-side] {time.strftime('%H:%M:%S')} {run.command()}", file=sys.stderr, flush=True
    )
    with open(out / "commands.txt", "a") as f:
        f.write(run.command() + "\n")
    env = {**os.environ, **dict(run.env)}
    with open(out / f"{run.name}.log", "w") as log:
        rc = subprocess.run(run.argv, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        print(f"[side-by-side] {run.name}: exit {rc}, see {out / run.name}.log", file=sys.stderr)
    return rc == 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    ap.add_argument("--duration", type=float, default=10.0, help="measured s per run (default 10)")
    ap.add_argument("--warmup", type=float, default=5.0, help="warm-up s per run (default 5)")
    ap.add_argument(
        "--only",
        default=",".join(PARTS),
        help=f"parts to run, from {','.join(PARTS)} (default all)",
    )
    ap.add_argument("--out", default="side-by-side", help="raw results (default side-by-side/)")
    ap.add_argument("--bare-records", type=int, default=2_000_000, help="bare loop's records")
    ap.add_argument(
        "--floor-batches", type=int, default=400, help="work floor's 1,024-record batches"
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="one tiny round (1 s runs, small loops; Flink left out unless it runs without "
        "a download): checks the harness, measures nothing",
    )
    a = ap.parse_args(argv)
    parts = [p.strip() for p in a.only.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        ap.error(f"--only: unknown parts {bad}; choose from {', '.join(PARTS)}")
    if a.smoke:
        a.rounds, a.duration, a.warmup = 1, 1.0, 0.5
        a.bare_records, a.floor_batches = 100_000, 20
        if "flink" in parts and (why := flink_available()) is not None:
            print(f"[side-by-side] smoke: Flink left out: {why}", file=sys.stderr)
            parts.remove("flink")
    if a.rounds < 1 or a.duration <= 0 or a.warmup < 0:
        ap.error("--rounds must be >= 1, --duration > 0 and --warmup >= 0")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    measured, failed = run_all(lambda n: plan(parts, n, a, out), a.rounds, out, execute)
    rows = table(measured)
    summary = {
        "started": started,
        "ended": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_average_start": load,
        "load_average_end": os.getloadavg(),
        "args": vars(a),
        "rounds": measured,
        "rows": [
            {**asdict(r.figure), "values": r.values, "median": r.median, "verdict": r.verdict}
            for r in rows
        ],
        "failed": failed,
    }
    (out / "side-by-side.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    text = render(rows)
    (out / "side-by-side.md").write_text(text + "\n")
    print(text)
    print(
        f"\n{a.rounds} round(s), {started} to {summary['ended']}, load average "
        f"{load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; raw results in {out}/",
    )
    if failed:
        print(f"failed or without figures: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
