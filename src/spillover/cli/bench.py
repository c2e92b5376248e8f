"""``spillover bench``: checkpoints under backpressure, one run per policy."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from typing import Any

from spillover.benchmark import (
    BenchSpec,
    BenchSpecError,
    ProgressBar,
    run,
    to_markdown,
    write_results,
)
from spillover.benchmark import runs as bench_runs
from spillover.cli.options import (
    EXIT_OK,
    EXIT_RUN_FAILED,
    check_folder,
    define_option,
    defines,
    env_flag,
    env_option,
)
from spillover.cli.sparklog import spark_logs
from spillover.config import NetworkConfig, parse_duration, parse_memory_size
from spillover.errors import ConfigError


def _bench_flags() -> tuple[tuple[str, str, str | None, str], ...]:
    """(flag, env, default, help) of ``spillover bench``; the defaults are BenchSpec's.

    Values stay strings until :func:`_bench_spec` checks them, so a bad value from the
    command line or the environment gets the same clear error.
    """

    d = BenchSpec()
    flags = (
        (
            "--executor",
            str(d.executor),
            "where subtasks run: local (threads here), processes (worker processes here) or spark",
        ),
        (
            "--master",
            None,
            "Spark master URL, e.g. spark://host:7077 (spark executor only; default the "
            "embedded local master)",
        ),
        (
            "--compare-local",
            "auto",
            "policies run again on the local executor, for the executor's throughput cost: "
            "a comma-separated list, all, off, or auto (none,unaligned with spark or "
            "processes, off with local)",
        ),
        ("--policies", ",".join(d.policies), "comma-separated policies, one run each"),
        ("--parallelism", str(d.parallelism), "parallelism of every operator"),
        (
            "--repeat",
            str(d.repeat),
            "rounds: every run this many times, round 1 of every policy first; the table "
            "gives the median over rounds and the spread (min-max)",
        ),
        ("--duration", f"{d.duration_s:g}", "measured seconds per run"),
        ("--warmup", f"{d.warmup_s:g}", "seconds before measuring, per run"),
        ("--interval-ms", str(d.interval_ms), "checkpoint interval"),
        (
            "--sink-rate",
            f"{d.sink_rate:g}",
            "backpressure: records/s each sink subtask takes (lower is stronger)",
        ),
        ("--keys", str(d.keys), "distinct int64 keys"),
        ("--payload-bytes", str(d.payload_bytes), "record size: payload bytes per record"),
        (
            "--segment-size",
            str(d.segment_size),
            "network buffer size (taskmanager.memory.segment-size), a power of two",
        ),
        (
            "--slots",
            str(d.slots),
            "subtasks of each operator one worker hosts (taskmanager.numberOfTaskSlots); "
            "the parallelism puts every subtask in one worker, as Flink's local "
            "MiniCluster does",
        ),
        (
            "--aligned-timeout-ms",
            str(d.aligned_timeout_ms),
            "timeout policy: switch to unaligned after this long",
        ),
        (
            "--max-inflight-bytes",
            str(d.max_inflight_bytes),
            "max-inflight policy: in-flight bytes one subtask persists per checkpoint",
        ),
        (
            "--checkpoint-dir",
            None,
            "checkpoint storage: a path or a pyarrow URI (s3://bucket/prefix); a temporary "
            "directory by default",
        ),
        (
            "--out",
            "results",
            "results folder: bench.json, bench.md, bench.csv, checkpoints.csv, PNG plots",
        ),
        ("--json", None, "also write the JSON report here"),
        ("--markdown", None, "also write the markdown table here"),
    )
    return tuple(
        (flag, "SPILLOVER_BENCH_CLI_" + flag[2:].upper().replace("-", "_"), default, text)
        for flag, default, text in flags
    )


def _seconds(text: str) -> float:
    """A number of seconds (``30``, ``2.5``) or a duration with a unit (``1 min``)."""

    try:
        seconds = float(text)
    except ValueError:
        pass
    else:  # inf would announce "about inf min" and never end; nan compares false
        if not math.isfinite(seconds):
            raise ValueError("expected a finite number of seconds")
        return seconds
    try:  # bare numbers never get here: parse_duration would read them as ms
        return parse_duration(text).total_seconds()
    except ValueError:
        raise ValueError("expected seconds (30, 2.5) or a duration with a unit (1 min)") from None


_SEGMENT_SIZE_RULE = "a power of two from 4 kb to 16 mb"


def _segment_size_ok(size: int) -> bool:
    """Whether ``taskmanager.memory.segment-size`` takes ``size`` (its own check)."""
    try:
        NetworkConfig.check_segment_size(size)
    except ConfigError:
        return False
    return True


def _named(flag: str) -> str:
    """``--flag (env SPILLOVER_BENCH_CLI_FLAG)``."""
    env = next(e for f, e, _, _ in _bench_flags() if f == flag)
    return f"{flag} (env {env})"


def _check_outputs(args: argparse.Namespace) -> None:
    """Creates the ``--out`` folder and the folders of ``--json`` and ``--markdown``
    and checks each takes a file: a ConfigError now, not after minutes of runs."""

    folders = [("--out", args.out or "results")]
    for flag in ("--json", "--markdown"):
        path = getattr(args, flag[2:])
        if path and os.path.isdir(path):
            raise ConfigError(f"bad {_named(flag)}", detail=f"{path!r} is a directory")
        if path:
            folders.append((flag, os.path.dirname(path) or "."))
    for flag, folder in folders:
        check_folder(_named(flag), folder)


def _bench_spec(args: argparse.Namespace) -> BenchSpec:
    """The :class:`~spillover.benchmark.BenchSpec` of the flags; a bad one raises a
    ConfigError naming the flag and its environment variable."""

    def raw(flag: str) -> Any:
        return getattr(args, flag.lstrip("-").replace("-", "_"))

    def value(flag: str, convert: Any, ok: Any = None, rule: str = "") -> Any:
        text = raw(flag)
        try:
            v = convert(text)
        except ValueError as e:  # ConfigError is one too (parse_memory_size)
            detail = e.detail if isinstance(e, ConfigError) and e.detail else str(e)
            raise ConfigError(f"bad {_named(flag)}", detail=f"{text!r}: {detail}") from None
        if ok is not None and not ok(v):
            raise ConfigError(f"bad {_named(flag)}", detail=f"{text!r} is not {rule}")
        return v

    def names(flag: str) -> list[str]:
        return [p.strip().lower() for p in str(raw(flag)).split(",") if p.strip()]

    policies = names("--policies")
    compare = str(args.compare_local).strip().lower()
    compare_local = (
        None
        if compare == "auto"
        else []
        if compare in ("off", "")
        else policies
        if compare == "all"
        else names("--compare-local")
    )
    try:
        return BenchSpec(
            executor=str(args.executor).strip().lower(),
            master=(args.master or "").strip() or None,
            compare_local=compare_local,
            policies=policies,
            parallelism=value("--parallelism", int, lambda v: v >= 1, ">= 1"),
            duration_s=value("--duration", _seconds, lambda v: v > 0, "> 0 s"),
            warmup_s=value("--warmup", _seconds, lambda v: v >= 0, ">= 0 s"),
            interval_ms=value("--interval-ms", int, lambda v: v >= 10, ">= 10 ms"),
            sink_rate=value("--sink-rate", float, lambda v: 0 < v < math.inf, "finite and > 0"),
            keys=value("--keys", int, lambda v: v >= 1, ">= 1"),
            repeat=value("--repeat", int, lambda v: v >= 1, ">= 1"),
            payload_bytes=value("--payload-bytes", parse_memory_size, lambda v: v >= 1, ">= 1"),
            segment_size=value(
                "--segment-size", parse_memory_size, _segment_size_ok, _SEGMENT_SIZE_RULE
            ),
            slots=value("--slots", int, lambda v: v >= 1, ">= 1"),
            aligned_timeout_ms=value("--aligned-timeout-ms", int, lambda v: v > 0, "> 0"),
            max_inflight_bytes=value("--max-inflight-bytes", parse_memory_size),
            checkpoint_dir=args.checkpoint_dir or None,
            options=defines(args.define),
        )
    except BenchSpecError as e:  # BenchSpec's own check, in the words of the command line
        envs = {f: env for f, env, _, _ in _bench_flags()}
        flag = "--" + e.field.replace("_", "-")
        if flag not in envs:
            raise

        def twin(m: re.Match[str]) -> str:  # "--executor spark": and its variable
            env = envs.get(m[1])
            return m[0] if env is None else f"{m[0]} (or {env}={m[2]})"

        raise ConfigError(
            e.message.replace(e.field, _named(flag), 1),
            detail=e.detail,
            hint=re.sub(r"(--[a-z-]+) ([\w.:/-]+)", twin, e.hint) if e.hint else None,
        ) from None


def _about(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def cmd_bench(args: argparse.Namespace) -> int:
    """Runs the backpressured job once per policy (and again on the local executor for
    the comparison), ``--repeat`` rounds of them; prints a line each, then the table;
    writes the results folder. Exit 3 when a run failed."""

    spec = _bench_spec(args)
    runs = spec.runs()
    total = len(runs) * spec.repeat
    _check_outputs(args)
    out = args.out or "results"
    spark = "spark" in (kind for kind, _ in runs)
    log = None if args.verbose or not spark else os.path.join(out, "spark.log")
    rounds = f"{spec.repeat} rounds of " if spec.repeat > 1 else ""
    print(
        f"{rounds}{len(runs)} runs of {spec.run_s:g} s ({spec.warmup_s:g} s warm-up) on the "
        f"{spec.executor} executor"
        + (f" ({spec.master})" if spec.master else "")
        + (f", {len(spec.compare_local or ())} again on local" if spec.compare_local else "")
        + f": about {_about(total * spec.run_s)}; parallelism {spec.parallelism}, "
        f"sink {spec.sink_rate:g} records/s per subtask, {spec.payload_bytes} B payloads"
        + (f"; Spark's log lines in {log} (--verbose: here)" if log else ""),
        flush=True,
    )
    bar = ProgressBar(total, spec.run_s, spec.warmup_s, rounds=spec.repeat)
    with spark_logs("bench", log):
        results = run(spec, progress=lambda line: print(line, flush=True), bar=bar)
    table = to_markdown(results)
    print()
    print(table, end="")
    try:
        written = write_results(results, out)
    except ImportError as e:  # matplotlib missing: everything but the plots
        print(f"spillover bench: no plots ({e}); pip install matplotlib", file=sys.stderr)
        written = write_results(results, out, plots=False)
    if log is not None and os.path.exists(log):
        written.append(log)
    print(f"\nresults in {out}/: {', '.join(os.path.basename(p) for p in written)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    failed = [r for r in bench_runs(results) if r["status"] == "failed"]
    if failed:
        print(
            f"spillover bench: error: {len(failed)} of {len(bench_runs(results))} runs failed "
            "(see their lines above)",
            file=sys.stderr,
        )
        return EXIT_RUN_FAILED
    return EXIT_OK


def add_parser(sub: Any) -> None:
    """Adds the command to the ``spillover`` parser."""
    p = sub.add_parser(
        "bench",
        help="checkpoints under backpressure: one run per barrier policy",
        description="Runs a backpressured job (unthrottled source, key_by, keyed count, "
        "rebalance, a paced sink) once per policy, and again on the local executor for the "
        "comparison, and reports checkpoint duration, start delay, alignment time, "
        "persisted in-flight bytes and sink throughput over the measured window. Writes "
        "JSON, CSV, markdown and PNG plots to --out. See docs/benchmarks.md.",
    )
    for flag, env, default, help_text in _bench_flags():
        env_option(p, flag, env=env, default=default, help=help_text)
    env_flag(
        p,
        "--verbose",
        env="SPILLOVER_BENCH_CLI_VERBOSE",
        help="Spark's and the JVM's log lines to the terminal, as they come; without it "
        "they go to <out>/spark.log (spark executor)",
    )
    define_option(
        p,
        "a configuration option for every run (repeatable), e.g. -D "
        "taskmanager.network.memory.floating-buffers-per-gate=2; recorded in bench.json. "
        "Keys the flags above set are refused",
    )
    p.set_defaults(func=cmd_bench)
