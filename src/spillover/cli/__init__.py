"""The ``spillover`` command line.

Every option has an environment-variable twin (shown in ``--help``); the command
line wins over the environment.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from spillover.config.policies import CHECKPOINT_POLICIES
from spillover.errors import SpilloverError

if TYPE_CHECKING:
    from spillover.benchmark import BenchSpec


class _EnvDefault(argparse.Action):
    """An option whose default comes from an environment variable."""

    def __init__(self, env: str, default: Any = None, **kw: Any) -> None:
        if env in os.environ:
            default = kw.get("type", str)(os.environ[env])
            kw["required"] = False
        kw["help"] = f"{kw.get('help', '')} [env {env}; default {default}]"
        super().__init__(default=default, **kw)

    def __call__(self, parser: Any, ns: Any, values: Any, option: Any = None) -> None:
        setattr(ns, self.dest, values)


def _env_option(p: argparse.ArgumentParser, *names: str, env: str, **kw: Any) -> None:
    p.add_argument(*names, action=_EnvDefault, env=env, **kw)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def cmd_inspect(args: argparse.Namespace) -> int:
    import signal

    # `spillover inspect ... | head` ends quietly. Only while inspecting: a job's
    # driver must survive a write to a peer that died (EPIPE, not a signal).
    previous = signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        return _inspect(args)
    finally:
        signal.signal(signal.SIGPIPE, previous)


def _inspect(args: argparse.Namespace) -> int:
    from spillover.runtime.checkpointing.inspect import checkpoint_dirs, render, summarize
    from spillover.storage.inspection import inspect_state_file, state_files

    checkpoints = checkpoint_dirs(args.path)
    if checkpoints:
        summaries = [summarize(d, verify=not args.no_verify) for d in checkpoints]
        if args.json:
            json.dump(summaries if len(summaries) > 1 else summaries[0], sys.stdout, indent=2)
            print()
        else:
            print("\n".join(render(x) for x in summaries))
        return 1 if any(x["problems"] for x in summaries) else 0
    reports: list[dict[str, Any]] = []
    failed = 0
    files = state_files(args.path)
    if not files:
        print(f"no state files (*.spill) under {args.path}", file=sys.stderr)
        return 1
    for uri in files:
        try:
            reports.append(inspect_state_file(uri, verify=not args.no_verify))
        except SpilloverError as e:
            failed += 1
            reports.append({"uri": uri, "error": type(e).__name__, "message": str(e)})
    if args.json:
        json.dump(reports if len(reports) > 1 else reports[0], sys.stdout, indent=2)
        print()
        return 1 if failed else 0
    for r in reports:
        if "error" in r:
            print(f"{r['uri']}: {r['error']}: {r['message']}")
            continue
        print(f"{r['uri']}  ({_fmt_bytes(r['size'])})")
        print(
            f"  format v{r['format_version']}, checkpoint {r['checkpoint_id']}, "
            f"subtask {r['subtask_index']}, {r['gate_kind']} gate {r['gate_id']}, "
            f"codec {r['codec']}, file id {r['file_id']}"
        )
        ratio = r["raw_bytes"] / r["stored_bytes"] if r["stored_bytes"] else 1.0
        print(
            f"  {r['frame_count']} frames, {_fmt_bytes(r['raw_bytes'])} raw, "
            f"{_fmt_bytes(r['stored_bytes'])} stored ({ratio:.2f}x)"
        )
        if r["channels"]:
            cols = ("channel", 8), ("frames", 8), ("events", 7), ("raw", 12), ("stored", 12)
            print("  " + " ".join(f"{c:>{w}}" for c, w in cols) + f" {'lz4':>6}")
            for ch, c in r["channels"].items():
                print(
                    f"  {ch:>8} {c['frames']:>8} {c['events']:>7} "
                    f"{_fmt_bytes(c['raw_bytes']):>12} {_fmt_bytes(c['stored_bytes']):>12} "
                    f"{c['lz4_frames']:>6}"
                )
        verified = "every checksum verified" if r["checksums_verified"] else "checksums not checked"
        print(f"  ok: {verified}")
    return 1 if failed else 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Spills and restores a few hundred MB and compares with the raw disk."""
    import numpy as np

    import spillover
    from spillover.storage import baselines

    total = args.size_mb * 1024 * 1024
    size = args.buffer_size
    n = max(1, total // size)
    rng = np.random.default_rng(7)
    # Partly compressible buffers: small integers next to random bytes.
    pool = []
    for _ in range(64):
        b = rng.integers(0, 256, size, dtype=np.uint8)
        b[: size // 2] = rng.integers(0, 4, size // 2, dtype=np.uint8)
        pool.append(b.tobytes())
    buffers = [pool[i % len(pool)] for i in range(n)]
    nbytes = n * size
    root = args.dir or tempfile.mkdtemp(prefix="spillover-demo-")
    os.makedirs(root, exist_ok=True)
    print(
        f"spilling {_fmt_bytes(nbytes)} in {n} buffers of {_fmt_bytes(size)} "
        f"over 8 channels to {root}"
    )
    rows = []

    def fresh(path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)
        os.sync()

    raw_path = os.path.join(root, "raw.bin")
    fresh(raw_path)
    fd = os.open(raw_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    t = time.perf_counter()
    baselines.raw_write(fd, buffers, spillover.StorageOptions().batch_bytes)
    os.close(fd)
    raw_write = nbytes / (time.perf_counter() - t)
    rows.append(("raw sequential write (baseline)", raw_write, 1.0))
    for label, opts in (
        ("spill, blocking (zero-copy)", {"blocking": True}),
        ("spill, non-blocking (pooled)", {"blocking": False}),
        ("spill, blocking + lz4", {"blocking": True, "compression": "lz4"}),
    ):
        d = os.path.join(root, "spill")
        fresh(d)
        storage = spillover.open_storage(d, **opts)
        t = time.perf_counter()
        st = storage.create_storer(0)
        append = st.append
        for i, b in enumerate(buffers):
            append(i & 7, b)
        handle = st.close()
        rate = nbytes / (time.perf_counter() - t)
        rows.append((label, rate, rate / raw_write))
    # Restore the last (lz4) file, then an uncompressed one, against a raw read.
    fresh(os.path.join(root, "spill"))
    st = spillover.open_storage(os.path.join(root, "spill")).create_storer(0)
    for i, b in enumerate(buffers):
        st.append(i & 7, b)
    handle = st.close()
    fd = os.open(raw_path, os.O_RDONLY)
    t = time.perf_counter()
    baselines.raw_read(fd, 1 << 20)
    os.close(fd)
    raw_read = nbytes / (time.perf_counter() - t)
    rows.append(("raw sequential read (baseline)", raw_read, 1.0))
    t = time.perf_counter()
    count = 0
    with spillover.open_retriever(handle) as r:
        for buf in r:
            count += len(buf)
    rate = nbytes / (time.perf_counter() - t)
    assert count == nbytes
    rows.append(("restore, streaming", rate, rate / raw_read))
    print(f"\n{'':34} {'GB/s':>7} {'vs raw':>7}")
    for label, rate, ratio in rows:
        print(f"{label:34} {rate / 1e9:7.2f} {ratio:7.2f}")
    print("\n(reads come from the page cache; see docs/benchmarks.md for the full suite)")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Runs a built-in topology or the user's job with induced failures; exit 0 only
    when exact (and, with ``--strict``, when the run proved all it was asked to)."""
    from spillover.verify import VerifySpec, verify, write_json

    if args.job and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: modules next to the user
    state_uid, _, state = (args.state or "").partition(":")
    spec = VerifySpec(
        topology=args.topology,
        parallelism=args.parallelism,
        records=args.records,
        failures=args.failures,
        seed=args.seed,
        policy=args.policy,
        interval_ms=args.interval_ms,
        rate_per_subtask=args.rate or None,
        aligned_timeout_ms=args.aligned_timeout_ms,
        max_inflight_bytes=args.max_inflight_bytes,
        rescale_to=args.rescale_to,
        job=args.job or None,
        order=None if args.order == "none" else args.order,
        order_by=args.order_by or None,
        state_uid=state_uid or None,
        state=state or None,
        executor=args.executor,
        master=args.master or None,
    )
    report = verify(spec, workdir=args.workdir or None)
    print(report.text())
    if args.json:
        write_json(report, args.json)
    if not report.exact:
        return 1
    return 1 if args.strict and report.shortfalls() else 0


# ---- bench: checkpoints under backpressure, one run per policy ----


@functools.cache
def _bench_flags() -> tuple[tuple[str, str, str | None, str], ...]:
    """(flag, env, default, help) of ``spillover bench``; the defaults are BenchSpec's.

    Values stay strings until :func:`_bench_spec` checks them, so a bad value from the
    command line or the environment gets the same clear error.
    """
    from spillover.benchmark import BenchSpec

    d = BenchSpec()
    flags = (
        ("--executor", str(d.executor), "where subtasks run: local (threads here) or spark"),
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
            "a comma-separated list, all, off, or auto (none,unaligned with spark, off with "
            "local)",
        ),
        ("--policies", ",".join(d.policies), "comma-separated policies, one run each"),
        ("--parallelism", str(d.parallelism), "parallelism of every operator"),
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
    from spillover.config import parse_duration

    try:
        return float(text)
    except ValueError:
        pass
    try:  # bare numbers never get here: parse_duration would read them as ms
        return parse_duration(text).total_seconds()
    except ValueError:
        raise ValueError("expected seconds (30, 2.5) or a duration with a unit (1 min)") from None


def _bench_spec(args: argparse.Namespace) -> BenchSpec:
    """The :class:`~spillover.benchmark.BenchSpec` of the flags; a bad one raises a
    ConfigError naming the flag and its environment variable."""
    from spillover.benchmark import BenchSpec, BenchSpecError
    from spillover.config import parse_memory_size
    from spillover.errors import ConfigError

    def name(flag: str) -> str:
        env = next(e for f, e, _, _ in _bench_flags() if f == flag)
        return f"{flag} (env {env})"

    def raw(flag: str) -> Any:
        return getattr(args, flag.lstrip("-").replace("-", "_"))

    def value(flag: str, convert: Any, ok: Any = None, rule: str = "") -> Any:
        text = raw(flag)
        try:
            v = convert(text)
        except ValueError as e:  # ConfigError is one too (parse_memory_size)
            detail = e.detail if isinstance(e, ConfigError) and e.detail else str(e)
            raise ConfigError(f"bad {name(flag)}", detail=f"{text!r}: {detail}") from None
        if ok is not None and not ok(v):
            raise ConfigError(f"bad {name(flag)}", detail=f"{text!r} is not {rule}")
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
            sink_rate=value("--sink-rate", float, lambda v: v > 0, "> 0"),
            keys=value("--keys", int, lambda v: v >= 1, ">= 1"),
            payload_bytes=value("--payload-bytes", parse_memory_size, lambda v: v >= 1, ">= 1"),
            aligned_timeout_ms=value("--aligned-timeout-ms", int, lambda v: v > 0, "> 0"),
            max_inflight_bytes=value("--max-inflight-bytes", parse_memory_size),
            checkpoint_dir=args.checkpoint_dir or None,
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
            e.message.replace(e.field, name(flag), 1),
            detail=e.detail,
            hint=re.sub(r"(--[a-z-]+) ([\w.:/-]+)", twin, e.hint) if e.hint else None,
        ) from None


def _about(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def cmd_bench(args: argparse.Namespace) -> int:
    """Runs the backpressured job once per policy (and again on the local executor for
    the comparison); prints a line each, then the table; writes the results folder."""
    from spillover.benchmark import ProgressBar, run, to_markdown, write_results
    from spillover.benchmark import runs as bench_runs

    spec = _bench_spec(args)
    runs = spec.runs()
    out = args.out or "results"
    print(
        f"{len(runs)} runs of {spec.run_s:g} s ({spec.warmup_s:g} s warm-up) on the "
        f"{spec.executor} executor"
        + (f" ({spec.master})" if spec.master else "")
        + (f", {len(spec.compare_local or ())} again on local" if spec.compare_local else "")
        + f": about {_about(len(runs) * spec.run_s)}; parallelism {spec.parallelism}, "
        f"sink {spec.sink_rate:g} records/s per subtask, {spec.payload_bytes} B payloads",
        flush=True,
    )
    bar = ProgressBar(len(runs), spec.run_s, spec.warmup_s)
    results = run(spec, progress=lambda line: print(line, flush=True), bar=bar)
    table = to_markdown(results)
    print()
    print(table, end="")
    try:
        written = write_results(results, out)
    except ImportError as e:  # matplotlib missing: everything but the plots
        print(f"spillover: no plots ({e}); pip install matplotlib", file=sys.stderr)
        written = write_results(results, out, plots=False)
    print(f"\nresults in {out}/: {', '.join(os.path.basename(p) for p in written)}")
    for path in (args.json, args.markdown):
        if path and os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    return 1 if any(r["status"] == "failed" for r in bench_runs(results)) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spillover",
        description="Persist, restore and rescale the in-flight data of streaming dataflows.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="summarise and verify state files")
    p.add_argument("path", help="a state file, or a storage directory (local path or URI)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--no-verify", action="store_true", help="skip payload checksums")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("demo", help="spill and restore a few hundred MB; print throughput")
    _env_option(
        p,
        "--size-mb",
        env="SPILLOVER_DEMO_SIZE_MB",
        type=int,
        default=512,
        help="how much to spill",
    )
    _env_option(
        p,
        "--buffer-size",
        env="SPILLOVER_DEMO_BUFFER_SIZE",
        type=int,
        default=32768,
        help="bytes per buffer",
    )
    _env_option(
        p,
        "--dir",
        env="SPILLOVER_DEMO_DIR",
        type=str,
        default=None,
        help="where to spill (a temporary directory by default)",
    )
    p.add_argument("--keep", action="store_true", help="keep the files")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "verify",
        help="run a built-in topology or your job with induced failures and check exactly-once",
        description="Runs the topology, or the job of --job, once without failures and once "
        "with --failures induced failures (in operators, snapshots, restores and before "
        "commits), then compares the committed output and the final keyed state. Exit code "
        "0 only when nothing was lost, duplicated or reordered. See 'Testing your own jobs' "
        "in docs/runtime.md for the contract of --job.",
    )
    _env_option(
        p,
        "--job",
        env="SPILLOVER_VERIFY_JOB",
        type=str,
        default=None,
        help="your job instead of a topology: module:function or file.py:function, "
        "function(out_dir, name, parallelism) -> StreamEnvironment",
    )
    _env_option(
        p,
        "--order",
        env="SPILLOVER_VERIFY_ORDER",
        default="per-key",
        choices=["per-key", "none"],
        help="check that seqs increase per (partition, key) in the committed output",
    )
    _env_option(
        p,
        "--order-by",
        env="SPILLOVER_VERIFY_ORDER_BY",
        type=str,
        default=None,
        help="the output column ordering a key's records (default: commit order; "
        "topologies: total)",
    )
    _env_option(
        p,
        "--state",
        env="SPILLOVER_VERIFY_STATE",
        type=str,
        default=None,
        help="UID or UID:STATE: the keyed operator (and state) whose final state must equal "
        "the failure-free run's",
    )
    _env_option(
        p,
        "--workdir",
        env="SPILLOVER_VERIFY_WORKDIR",
        type=str,
        default=None,
        help="keep outputs and checkpoints here (default: a temporary directory, removed); "
        "with a Spark cluster, a directory every machine sees",
    )
    _env_option(
        p,
        "--executor",
        env="SPILLOVER_VERIFY_EXECUTOR",
        default="local",
        choices=["local", "spark"],
        help="where the run with failures goes: local (threads here) or spark (a barrier "
        "stage per attempt); the failure-free reference always runs locally",
    )
    _env_option(
        p,
        "--master",
        env="SPILLOVER_VERIFY_MASTER",
        type=str,
        default=None,
        help="Spark master URL for --executor spark (default: the embedded local master); "
        "on a cluster, give output and checkpoints storage every machine reaches",
    )
    _env_option(
        p,
        "--strict",
        env="SPILLOVER_VERIFY_STRICT",
        type=lambda v: str(v).strip().lower() in ("1", "true", "yes", "on"),
        nargs="?",
        const=True,
        default=False,
        help="also fail when fewer failures happened than asked, or a rescale restored no "
        "in-flight data",
    )
    _env_option(
        p,
        "--topology",
        env="SPILLOVER_VERIFY_TOPOLOGY",
        default="pipeline",
        choices=[
            "pipeline",
            "multi-input",
            "union",
            "rebalance-chain",
            "keyed-parallelisms",
            "broadcast",
            "stateless-between-keyed",
            "custom-partitioner",
        ],
        help="the job shape (without --job)",
    )
    _env_option(
        p,
        "--parallelism",
        env="SPILLOVER_VERIFY_PARALLELISM",
        type=int,
        default=2,
        help="parallelism of every operator",
    )
    _env_option(
        p,
        "--policy",
        env="SPILLOVER_VERIFY_POLICY",
        default="aligned",
        choices=list(CHECKPOINT_POLICIES),
        help="checkpoint barrier policy",
    )
    _env_option(
        p,
        "--aligned-timeout-ms",
        env="SPILLOVER_VERIFY_ALIGNED_TIMEOUT_MS",
        type=int,
        default=5,
        help="timeout policy: switch to unaligned after this long",
    )
    _env_option(
        p,
        "--max-inflight-bytes",
        env="SPILLOVER_VERIFY_MAX_INFLIGHT_BYTES",
        type=int,
        default=256 * 1024,
        help="max-inflight policy: bound on persisted input bytes per subtask",
    )
    _env_option(
        p,
        "--failures",
        env="SPILLOVER_VERIFY_FAILURES",
        type=int,
        default=5,
        help="failures to induce",
    )
    _env_option(
        p,
        "--records",
        env="SPILLOVER_VERIFY_RECORDS",
        type=int,
        default=200_000,
        help="records per source",
    )
    _env_option(
        p,
        "--rate",
        env="SPILLOVER_VERIFY_RATE",
        type=float,
        default=50_000.0,
        help="records/s per source subtask (0: unthrottled)",
    )
    _env_option(
        p,
        "--interval-ms",
        env="SPILLOVER_VERIFY_INTERVAL_MS",
        type=int,
        default=100,
        help="checkpoint interval",
    )
    _env_option(
        p,
        "--rescale-to",
        env="SPILLOVER_VERIFY_RESCALE_TO",
        type=int,
        default=None,
        help="stop the run with failures part way and restore it at this parallelism",
    )
    _env_option(
        p,
        "--seed",
        env="SPILLOVER_VERIFY_SEED",
        type=int,
        default=1,
        help="seed of the data and of the failure script",
    )
    _env_option(
        p,
        "--json",
        env="SPILLOVER_VERIFY_JSON",
        type=str,
        default=None,
        help="also write the report as JSON here",
    )
    p.set_defaults(func=cmd_verify)

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
        _env_option(p, flag, env=env, default=default, help=help_text)
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "size_mb", 1) <= 0 or getattr(args, "buffer_size", 1) <= 0:
        parser.error("--size-mb and --buffer-size must be positive")
    try:
        return int(args.func(args))
    except SpilloverError as e:
        print(f"spillover: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
