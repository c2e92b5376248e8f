"""The soak: whole jobs again and again for minutes, checkpoints every 20 ms and
induced failures all the time, every run checked exactly (in the spirit of Flink's
UnalignedCheckpointStressITCase).

Each run is one :func:`~spillover.verify.verify` of a built-in topology drawn at
random, with 2 to 6 induced failures (operator, snapshot, restore and commit
points) placed among its records, and on some runs (the rescaling topologies) a
restore at another parallelism. Runs follow each other until the time is up; one
that is not exact ends the soak. The report counts what was survived and samples
this process's memory after every run: its resident set must not grow.

``python -m spillover.verify.soak --minutes 10 --policy unaligned`` (``make soak``
runs every policy on both executors).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

from spillover.errors import ConfigError
from spillover.verify.compare import Report
from spillover.verify.run import verify
from spillover.verify.spec import VerifySpec
from spillover.verify.topologies import POLICIES, RESCALE_TOPOLOGIES, TOPOLOGIES

__all__ = ["SoakReport", "soak"]

# The topologies a soak draws from: every built-in one.
SOAK_TOPOLOGIES = TOPOLOGIES
# RSS may end at most this much above where it was after the first quarter of the
# runs (caches, Spark's first stages and the allocator's arenas settle there).
RSS_GROWTH_LIMIT = 1.25


@dataclass
class SoakReport:
    """What a soak survived, and whether every run was exact."""

    policy: str
    executor: str
    seconds: float
    runs: int = 0
    exact: bool = True
    records: int = 0
    checkpoints_completed: int = 0
    failures_survived: int = 0
    restarts: int = 0
    rescales: int = 0
    inflight_replayed: int = 0
    rss_mib: list[float] = field(default_factory=list)  # after each run
    by_topology: dict[str, int] = field(default_factory=dict)
    failed_run: str | None = None  # the report of the run that was not exact

    @property
    def rss_growth(self) -> float:
        """Last RSS over the median RSS of the first quarter of the runs (1.0: flat)."""
        if len(self.rss_mib) < 4:
            return 1.0
        first = statistics.median(self.rss_mib[: max(1, len(self.rss_mib) // 4)])
        return self.rss_mib[-1] / first

    @property
    def ok(self) -> bool:
        return self.exact and self.runs > 0 and self.rss_growth <= RSS_GROWTH_LIMIT

    def text(self) -> str:
        rss = f"{self.rss_mib[0]:.0f} -> {self.rss_mib[-1]:.0f} MiB" if self.rss_mib else "-"
        lines = [
            f"soak {self.policy} on {self.executor}: {self.runs} runs in {self.seconds:.0f} s, "
            f"{'every run exact' if self.exact else 'NOT EXACT'}",
            f"  {self.records:,} records, {self.checkpoints_completed:,} checkpoints completed, "
            f"{self.failures_survived} induced failures survived, {self.restarts} restarts, "
            f"{self.rescales} rescaled restores, {self.inflight_replayed:,} in-flight bytes "
            "replayed",
            f"  RSS {rss} (growth {self.rss_growth:.2f}, limit {RSS_GROWTH_LIMIT})",
            "  runs per topology: "
            + ", ".join(f"{t} {n}" for t, n in sorted(self.by_topology.items())),
        ]
        if self.failed_run:
            lines.append(self.failed_run)
        return "\n".join(lines)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _spec(rng: random.Random, policy: str, executor: str, records: int) -> VerifySpec:
    topology = rng.choice(SOAK_TOPOLOGIES)
    rescale = topology in RESCALE_TOPOLOGIES and rng.random() < 0.5
    return VerifySpec(
        topology=topology,
        parallelism=2,
        records=records,
        rate_per_subtask=40_000.0,
        failures=rng.randint(2, 6),
        seed=rng.randrange(2**31),
        interval_ms=20,
        policy=policy,
        executor=executor,
        rescale_to=rng.choice((1, 3)) if rescale else None,
    )


def soak(
    seconds: float,
    *,
    policy: str = "unaligned",
    executor: str = "local",
    seed: int = 1,
    records: int = 20_000,
    workdir: str | None = None,
    progress: bool = False,
    min_runs: int = 1,
) -> SoakReport:
    """Runs verifications for ``seconds`` (the last one may end a little later), and
    at least ``min_runs`` of them however long they take."""
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}", hint=f"choose from {POLICIES}")
    if seconds <= 0 or records < 1000:
        raise ConfigError("a soak needs seconds > 0 and at least 1000 records per source")
    rng = random.Random(seed)
    report = SoakReport(policy, executor, 0.0)
    started = time.monotonic()
    while time.monotonic() - started < seconds or report.runs < min_runs:
        spec = _spec(rng, policy, executor, records)
        with tempfile.TemporaryDirectory(prefix="spillover-soak-", dir=workdir) as d:
            run: Report = verify(spec, d)
        gc.collect()
        report.runs += 1
        report.by_topology[spec.topology] = report.by_topology.get(spec.topology, 0) + 1
        report.records += run.records
        report.checkpoints_completed += run.checkpoints_completed
        report.failures_survived += len(run.failures_fired)
        report.restarts += max(0, run.attempts - 1)
        report.rescales += 1 if spec.rescale_to else 0
        report.inflight_replayed += run.inflight_replayed
        report.rss_mib.append(round(_rss_mib(), 1))
        if progress:
            print(
                f"[{time.monotonic() - started:5.0f} s] {spec.topology} seed {spec.seed} "
                f"failures {len(run.failures_fired)}/{spec.failures}"
                + (f" rescale -> {spec.rescale_to}" if spec.rescale_to else "")
                + f": {'exact' if run.exact else 'NOT EXACT'}, RSS {report.rss_mib[-1]} MiB",
                flush=True,
            )
        if not run.exact:
            report.exact = False
            report.failed_run = run.text()
            break
    report.seconds = time.monotonic() - started
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m spillover.verify.soak", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--policy", action="append", choices=POLICIES, help="repeatable; default all")
    p.add_argument("--executor", action="append", choices=("local", "processes", "spark"))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--records", type=int, default=20_000, help="per source, per run")
    p.add_argument("--json", help="write the reports here")
    args = p.parse_args(argv)
    reports = []
    try:
        for executor in args.executor or ["local"]:
            for policy in args.policy or list(POLICIES):
                r = soak(
                    args.minutes * 60,
                    policy=policy,
                    executor=executor,
                    seed=args.seed,
                    records=args.records,
                    progress=True,
                )
                print(r.text(), flush=True)
                reports.append(r)
                if not r.ok:
                    break
    except ConfigError as e:
        print(f"spillover soak: {e}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**asdict(r), "rss_growth": r.rss_growth} for r in reports], f, indent=1)
    return 0 if reports and all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
