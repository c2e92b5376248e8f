"""``spillover chaos``: scenarios that combine every feature with every fault, drawn
at random for a given time (or one replayed by its id), each checked exactly;
a failing one is shrunk to a smaller one that still fails."""

from __future__ import annotations

import argparse
import functools
import random
from typing import Any

from rich.console import Console
from rich.table import Table

from spillover.chaos import (
    FEATURES,
    VOCABULARY,
    ChaosReport,
    Ran,
    explore,
    regression_test,
    replay_command,
    run_one,
    scenario_for,
    shrink,
)
from spillover.chaos.runner import VACUOUS_TRIES, IsolatedRunner
from spillover.chaos.scenario import EXECUTORS, Scenario
from spillover.cli.options import EXIT_CHECK_FAILED, EXIT_OK, check_folder, env_option
from spillover.errors import ConfigError


def cmd_chaos(args: argparse.Namespace) -> int:
    """Runs scenarios (or replays one); exit 0 only when every scenario was exact."""
    if args.minutes <= 0:
        raise ConfigError("--minutes must be positive", detail=f"got {args.minutes:g}")
    if args.replays < 1:
        raise ConfigError("--replays must be at least 1", detail=f"got {args.replays}")
    if args.workdir:
        check_folder("--workdir (env SPILLOVER_CHAOS_WORKDIR)", args.workdir, create=False)
    timeout = args.scenario_timeout or (180.0 if args.executor == "local" else 900.0)
    if timeout <= 0:
        raise ConfigError("--scenario-timeout must be positive", detail=f"got {timeout:g}")
    with IsolatedRunner(timeout) as runner:
        return _chaos(args, runner)


def _chaos(args: argparse.Namespace, runner: IsolatedRunner) -> int:
    console = Console(stderr=True)
    out = Console(highlight=False)
    if args.replay:
        s = scenario_for(args.replay, args.executor)
        seed = s.seed
        out.print(f"replaying {s.describe()}")
        report = ChaosReport(seed, args.executor)
        for _ in range(args.replays):
            report.ran.append(run_one(s, runner, args.workdir or None))
            _line(out, report.ran[-1])
        failed = sum(not r.outcome.exact for r in report.ran)
        out.print(f"{failed} of {len(report.ran)} replays failed")
    else:
        seed = random.randrange(1, 2**31) if args.seed is None else args.seed
        out.print(f"spillover chaos: seed {seed}, {args.minutes:g} minutes on {args.executor}")
        with console.status("starting") as status:

            def progress(ran: Ran, elapsed: float) -> None:
                _line(out, ran)
                done = len(report_box)
                report_box.append(ran.outcome.exact)
                status.update(
                    f"[{elapsed:4.0f}/{args.minutes * 60:.0f} s] {done + 1} scenarios, "
                    f"{done + 1 - sum(report_box)} failed; last {ran.scenario.id}"
                )

            report_box: list[bool] = []
            report = explore(
                args.minutes * 60,
                seed=seed,
                executor=args.executor,
                runner=runner,
                workdir=args.workdir or None,
                on_ran=progress,
            )
        out.print(_coverage_table(report))
        for ran in report.failed[: args.shrink]:
            _shrink(out, ran.scenario, args)
            report.shrunk.append(
                shrink(
                    ran.scenario,
                    kind=ran.outcome.kind,
                    runner=runner,
                    workdir=args.workdir or None,
                    replays=args.replays,
                    budget_s=args.shrink_minutes * 60,
                    on_try=lambda s, failed: out.print(
                        f"  shrink: {s.id} {'still fails so' if failed else 'does not'}"
                    ),
                )
            )
            found = report.shrunk[-1]
            out.print(
                f"  smallest scenario failing so ({found.kind}): {found.smallest.describe()}\n"
                f"  it failed so in {found.failed_replays} of {found.replays} replays; "
                f"replay it with: {replay_command(found.smallest)}\n"
                "  as a regression test:\n"
                + "\n".join("    " + line for line in regression_test(found.smallest).splitlines())
            )
        verdict = "every scenario exact" if report.all_exact else f"{len(report.failed)} NOT EXACT"
        out.print(f"{len(report.ran)} scenarios in {report.seconds:.0f} s, seed {seed}: {verdict}")
    if args.json:
        report.write_json(args.json)
    return EXIT_OK if report.all_exact else EXIT_CHECK_FAILED


def _line(out: Console, ran: Ran) -> None:
    o = ran.outcome
    verdict = "[green]exact[/]" if o.exact else "[bold red]NOT EXACT[/]"
    out.print(
        f"{ran.scenario.describe()}\n  -> {verdict} in {o.seconds:.1f} s"
        + (f": {o.summary}" if o.summary else "")
        + (f"; {o.storage_faults} storage faults" if o.storage_faults else "")
        + (f"; run {o.tries} of {VACUOUS_TRIES}, those before vacuous" if o.tries > 1 else "")
        + (f"; {o.error}" if o.error else ""),
        markup=True,
    )
    if not o.exact:
        out.print(f"  replay it with: {replay_command(ran.scenario)}", markup=False)


def _shrink(out: Console, s: Scenario, args: argparse.Namespace) -> None:
    out.print(f"shrinking {s.id} (at most {args.shrink_minutes:g} minutes)")


def _coverage_table(report: ChaosReport) -> Table:
    """Per feature this executor draws: scenarios that used it, how many of those
    were exact, and the features it was combined with (scenarios with both)."""
    t = Table(title="features combined and survived")
    t.add_column("feature")
    t.add_column("scenarios", justify="right")
    t.add_column("exact", justify="right")
    t.add_column("combined with (scenarios)")
    survived, pairs = report.survived(), report.pairs()
    for name, n in report.coverage().items():
        if report.executor not in FEATURES[name].executors:
            continue
        together = {
            other: pairs.get(f"{name}+{other}", 0) + pairs.get(f"{other}+{name}", 0)
            for other in VOCABULARY
            if other != name
        }
        t.add_row(
            name,
            str(n),
            str(survived[name]),
            ", ".join(f"{other} {k}" for other, k in together.items() if k) or "-",
        )
    return t


@functools.cache
def add_parser(sub: Any) -> None:
    """Adds the command to the ``spillover`` parser."""
    p = sub.add_parser(
        "chaos",
        help="combine every feature with every fault in random whole-job scenarios, each "
        "checked exactly; replay and shrink one that fails",
        description="Draws scenarios from the seed (a job, its settings and a script of "
        "failures, rescales, stops, aborted savepoints, storage faults and driver kills) "
        "and runs each with a failure-free twin, compared exactly. A failing scenario is "
        "printed with its replay command and shrunk to a smaller one that still fails. "
        "Exit code 0 only when every scenario was exact; 1 when one was not; 2 for bad "
        "flags. See docs/chaos.md.",
    )
    env_option(
        p,
        "--minutes",
        env="SPILLOVER_CHAOS_MINUTES",
        type=float,
        default=5.0,
        help="how long to draw and run scenarios (the last one may end later)",
    )
    env_option(
        p,
        "--seed",
        env="SPILLOVER_CHAOS_SEED",
        type=int,
        default=None,
        help="seed of every draw (default: one drawn at random, printed)",
    )
    env_option(
        p,
        "--executor",
        env="SPILLOVER_CHAOS_EXECUTOR",
        default="local",
        choices=list(EXECUTORS),
        help="where the runs with faults go; the failure-free twins always run locally",
    )
    env_option(
        p,
        "--replay",
        env="SPILLOVER_CHAOS_REPLAY",
        type=str,
        default=None,
        help="run the scenario of this id again (as chaos prints it) instead of drawing",
    )
    env_option(
        p,
        "--replays",
        env="SPILLOVER_CHAOS_REPLAYS",
        type=int,
        default=3,
        help="how often --replay, and the end of shrinking, run a scenario (timing can "
        "differ, so how often it fails is reported)",
    )
    env_option(
        p,
        "--shrink",
        env="SPILLOVER_CHAOS_SHRINK",
        type=int,
        default=1,
        help="shrink at most this many failing scenarios (0: none)",
    )
    env_option(
        p,
        "--shrink-minutes",
        env="SPILLOVER_CHAOS_SHRINK_MINUTES",
        type=float,
        default=10.0,
        help="time bound of one shrink",
    )
    env_option(
        p,
        "--scenario-timeout",
        env="SPILLOVER_CHAOS_SCENARIO_TIMEOUT",
        type=float,
        default=None,
        help="seconds a scenario may take before it counts as a hang and its process is "
        "killed (default 180 on local, 900 on spark)",
    )
    env_option(
        p,
        "--workdir",
        env="SPILLOVER_CHAOS_WORKDIR",
        type=str,
        default=None,
        help="where each scenario's folder goes (removed after it); default the temporary folder",
    )
    env_option(
        p,
        "--json",
        env="SPILLOVER_CHAOS_JSON",
        type=str,
        default=None,
        help="also write the report as JSON here: seed, scenarios (id, topology, "
        "features, actions, exact, seconds), coverage, all_exact",
    )
    p.set_defaults(func=cmd_chaos)
