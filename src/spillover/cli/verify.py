"""``spillover verify``: a topology or a user's job with induced failures, checked exactly."""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
from typing import Any

from spillover.cli.options import (
    EXIT_CHECK_FAILED,
    EXIT_OK,
    EXIT_RUN_FAILED,
    check_folder,
    env_flag,
    env_option,
)
from spillover.cli.sparklog import spark_logs
from spillover.config.policies import CHECKPOINT_POLICIES
from spillover.errors import ConfigError
from spillover.verify import VerifySpec, verify, write_json
from spillover.verify.topologies import TOPOLOGIES


def cmd_verify(args: argparse.Namespace) -> int:
    """Runs a built-in topology or the user's job with induced failures; exit 0 only
    when exact (and, with ``--strict``, when the run proved all it was asked to)."""

    if args.job and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: modules next to the user
    state_uid, _, state = (args.state or "").partition(":")
    spec = VerifySpec(
        topology=args.topology,
        parallelism=args.parallelism,
        records=args.records,
        failures=(0 if args.kill_driver else 5) if args.failures is None else args.failures,
        kill_driver=args.kill_driver,
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
        stop=_stop(args.stop_with_savepoint, args.drain),
        runtime_mode=args.runtime_mode,
    )
    if args.workdir:  # before any run: a folder it cannot write is bad usage
        check_folder("--workdir (env SPILLOVER_VERIFY_WORKDIR)", args.workdir, create=False)
    log = None
    try:
        with spark_logs("verify", _spark_log(args)) as log:
            report = verify(spec, workdir=args.workdir or None)
    finally:  # a run that failed is when Spark's lines are wanted most
        if log is not None:
            print(f"Spark's log lines: {log} (--verbose: here)", file=sys.stderr)
    print(report.text())
    if args.json:
        write_json(report, args.json)
    if report.errors:  # a run did not finish: nothing to check
        return EXIT_RUN_FAILED
    if not report.exact:
        return EXIT_CHECK_FAILED
    return EXIT_CHECK_FAILED if args.strict and report.shortfalls() else EXIT_OK


def _spark_log(args: argparse.Namespace) -> str | None:
    """Where Spark's log lines go: ``spark.log`` in ``--workdir`` (kept), else in the
    temporary folder (the work directory is removed); None for the terminal."""
    if args.verbose or args.executor != "spark":
        return None
    if args.workdir:
        return os.path.join(args.workdir, "spark.log")
    return os.path.join(tempfile.gettempdir(), f"spillover-verify-spark-{os.getpid()}.log")


def _stop(savepoint: str | None, drain: bool) -> str | None:
    """``VerifySpec.stop`` of ``--stop-with-savepoint [aligned|unaligned]`` and ``--drain``."""
    if drain:
        if savepoint == "unaligned":
            raise ConfigError(
                "--drain takes an aligned savepoint",
                detail="a drain processes everything in flight before its savepoint",
                hint="drop --drain, or give --stop-with-savepoint without 'unaligned'",
            )
        return "drain"
    if savepoint is None:
        return None
    return "unaligned-savepoint" if savepoint == "unaligned" else "savepoint"


@functools.cache
def add_parser(sub: Any) -> None:
    """Adds the command to the ``spillover`` parser."""
    p = sub.add_parser(
        "verify",
        help="run a built-in topology or your job with induced failures and check exactly-once",
        description="Runs the topology, or the job of --job, once without failures and once "
        "with --failures induced failures (in operators, snapshots, restores and before "
        "commits), then compares the committed output and the final keyed state. Exit code "
        "0 only when nothing was lost, duplicated or reordered; 1 when something was; 2 "
        "for bad flags; 3 when a run could not finish. See 'Testing your own jobs' "
        "in docs/runtime.md for the contract of --job.",
    )
    env_option(
        p,
        "--job",
        env="SPILLOVER_VERIFY_JOB",
        type=str,
        default=None,
        help="your job instead of a topology: module:function or file.py:function, "
        "function(out_dir, name, parallelism) -> StreamEnvironment",
    )
    env_option(
        p,
        "--order",
        env="SPILLOVER_VERIFY_ORDER",
        default="per-key",
        choices=["per-key", "none"],
        help="check that seqs increase per (partition, key) in the committed output",
    )
    env_option(
        p,
        "--order-by",
        env="SPILLOVER_VERIFY_ORDER_BY",
        type=str,
        default=None,
        help="the output column ordering a key's records (default: commit order; "
        "topologies: total)",
    )
    env_option(
        p,
        "--state",
        env="SPILLOVER_VERIFY_STATE",
        type=str,
        default=None,
        help="UID or UID:STATE: the keyed operator (and state) whose final state must equal "
        "the failure-free run's",
    )
    env_option(
        p,
        "--workdir",
        env="SPILLOVER_VERIFY_WORKDIR",
        type=str,
        default=None,
        help="keep outputs and checkpoints here (default: a temporary directory, removed); "
        "with a Spark cluster, a directory every machine sees",
    )
    env_option(
        p,
        "--executor",
        env="SPILLOVER_VERIFY_EXECUTOR",
        default="local",
        choices=["local", "processes", "spark"],
        help="where the run with failures goes: local (threads here), processes (worker "
        "processes here) or spark (a barrier stage per attempt); the failure-free "
        "reference always runs locally",
    )
    env_option(
        p,
        "--runtime-mode",
        env="SPILLOVER_VERIFY_RUNTIME_MODE",
        default="streaming",
        choices=["streaming", "batch"],
        help="execution.runtime-mode of both runs: batch runs the job stage by stage "
        "through blocking result files, without checkpoints (no --policy, --interval-ms, "
        "savepoints or --rescale-to); its failures re-run a region, and with "
        "--kill-driver each start re-runs only the tasks its event log does not name "
        "finished (docs/recovery.md, 'Batch jobs')",
    )
    env_option(
        p,
        "--master",
        env="SPILLOVER_VERIFY_MASTER",
        type=str,
        default=None,
        help="Spark master URL for --executor spark (default: the embedded local master); "
        "on a cluster, give output and checkpoints storage every machine reaches",
    )
    env_flag(
        p,
        "--strict",
        env="SPILLOVER_VERIFY_STRICT",
        help="also fail when fewer failures happened than asked, or a rescale restored no "
        "in-flight data",
    )
    env_option(
        p,
        "--topology",
        env="SPILLOVER_VERIFY_TOPOLOGY",
        default="pipeline",
        choices=list(TOPOLOGIES),
        help="the job shape (without --job); finishing: a short branch whose operator "
        "emits in finish() beside a long one",
    )
    env_option(
        p,
        "--parallelism",
        env="SPILLOVER_VERIFY_PARALLELISM",
        type=int,
        default=2,
        help="parallelism of every operator",
    )
    env_option(
        p,
        "--policy",
        env="SPILLOVER_VERIFY_POLICY",
        default="aligned",
        choices=list(CHECKPOINT_POLICIES),
        help="checkpoint barrier policy",
    )
    env_option(
        p,
        "--aligned-timeout-ms",
        env="SPILLOVER_VERIFY_ALIGNED_TIMEOUT_MS",
        type=int,
        default=5,
        help="timeout policy: switch to unaligned after this long",
    )
    env_option(
        p,
        "--max-inflight-bytes",
        env="SPILLOVER_VERIFY_MAX_INFLIGHT_BYTES",
        type=int,
        default=256 * 1024,
        help="max-inflight policy: bound on persisted input bytes per subtask",
    )
    env_option(
        p,
        "--failures",
        env="SPILLOVER_VERIFY_FAILURES",
        type=int,
        default=None,
        help="failures to induce (default 5; 0 with --kill-driver)",
    )
    env_option(
        p,
        "--kill-driver",
        env="SPILLOVER_VERIFY_KILL_DRIVER",
        type=int,
        default=0,
        help="instead of failing tasks, run the job in a child driver process, SIGKILL "
        "it this many times at random points (start-up, restore, checkpoints, commits) "
        "and start it again each time: each start must resume the run exactly",
    )
    env_option(
        p,
        "--records",
        env="SPILLOVER_VERIFY_RECORDS",
        type=int,
        default=200_000,
        help="records per source",
    )
    env_option(
        p,
        "--rate",
        env="SPILLOVER_VERIFY_RATE",
        type=float,
        default=50_000.0,
        help="records/s per source subtask (0: unthrottled)",
    )
    env_option(
        p,
        "--interval-ms",
        env="SPILLOVER_VERIFY_INTERVAL_MS",
        type=int,
        default=100,
        help="checkpoint interval",
    )
    env_option(
        p,
        "--rescale-to",
        env="SPILLOVER_VERIFY_RESCALE_TO",
        type=int,
        default=None,
        help="stop the run with failures part way and restore it at this parallelism",
    )
    env_option(
        p,
        "--stop-with-savepoint",
        env="SPILLOVER_VERIFY_STOP_WITH_SAVEPOINT",
        nargs="?",
        const="aligned",
        default=None,
        choices=["aligned", "unaligned"],
        help="instead of crashing it, stop the run with failures part way with a "
        "savepoint (aligned as Flink's, or unaligned: what is in flight goes into it), "
        "restore that (at --rescale-to if given) and run it to the end",
    )
    env_flag(
        p,
        "--drain",
        env="SPILLOVER_VERIFY_DRAIN",
        help="stop with drain: every operator finishes and the job ends for good; checks "
        "that everything the sources emitted was committed once",
    )
    env_flag(
        p,
        "--verbose",
        env="SPILLOVER_VERIFY_VERBOSE",
        help="Spark's and the JVM's log lines to the terminal, as they come; without it "
        "they go to spark.log in --workdir, or a file in the temporary folder (named "
        "once on stderr)",
    )
    env_option(
        p,
        "--seed",
        env="SPILLOVER_VERIFY_SEED",
        type=int,
        default=1,
        help="seed of the data and of the failure script",
    )
    env_option(
        p,
        "--json",
        env="SPILLOVER_VERIFY_JSON",
        type=str,
        default=None,
        help="also write the report as JSON here",
    )
    p.set_defaults(func=cmd_verify)
