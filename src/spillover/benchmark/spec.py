"""What ``spillover bench`` runs: :class:`BenchSpec`, checked as a whole before
any run, and the job it builds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from spillover.config import Config, NetworkConfig, canonical_key
from spillover.config.policies import POLICIES, policy_options
from spillover.deploy import EXECUTORS
from spillover.errors import ConfigError
from spillover.runtime.api import Operator
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.connectors.throttled import ThrottledSink
from spillover.runtime.graph import StreamEnvironment
from spillover.runtime.operators import KeyedCount

DEFAULT_EXECUTOR = "spark"
# With --executor spark, the policies repeated on the local executor unless told
# otherwise: the no-checkpoint baseline and the main policy, to keep the run short.
COMPARE_AUTO = ("none", "unaligned")
# Targets of docs/benchmarks.md.
DURATION_RATIO_TARGET = 50.0  # aligned median duration / unaligned median duration
THROUGHPUT_RATIO_TARGET = 0.95  # unaligned sink throughput / sink throughput without checkpoints
EXECUTOR_COST_TARGET = 0.10  # at most this share of the local executor's sink throughput lost
# A run whose sinks took this share of their pace (sink_rate x parallelism) was held back
# by them: compared at that pace, executors show whether they keep it, not what they cost.
PACED_SHARE = 0.95
SAMPLE_EVERY_S = 1.0  # the sink's records_in is read this often (the throughput plot)
# Operators of build_job that take input (count, sink): each of their subtasks persists
# input state, and --max-inflight-bytes bounds each one's.
INPUT_OPERATORS = 2
_STOPPED = "job attempt ended"  # the coordinator's reason for checkpoints cut off by the stop
_PLACEHOLDER_DIR = "/nonexistent/spillover-bench"  # only to check configs before any run


@dataclass
class BenchSpec:
    """What to run; checked when built (a bad value raises :class:`ConfigError`).

    ``compare_local``: the policies to run again on the local executor, each right
    after its run on ``executor``; None picks :data:`COMPARE_AUTO` (those of them in
    ``policies``) with the spark and processes executors and none with the local one.
    """

    policies: Sequence[str] = POLICIES
    parallelism: int = 2
    # Three rounds of every run at these fit in about five minutes on Spark.
    duration_s: float = 8.0
    warmup_s: float = 3.0
    interval_ms: int = 1000
    sink_rate: float = 5000.0  # records/s per sink subtask: lower is stronger backpressure
    keys: int = 10_000
    payload_bytes: int = 100
    segment_size: int = NetworkConfig.segment_size  # taskmanager.memory.segment-size
    # taskmanager.numberOfTaskSlots: subtasks of each operator one worker hosts (1: a
    # worker per subtask index; the parallelism: every subtask in one worker, as
    # Flink's local MiniCluster runs them in one TaskManager)
    slots: int = 1
    aligned_timeout_ms: int = 100
    max_inflight_bytes: int = 1024 * 1024
    checkpoint_dir: str | None = None  # None: a temporary directory, removed afterwards
    executor: str = DEFAULT_EXECUTOR
    master: str | None = None  # the Spark master; None: the embedded local one
    compare_local: Sequence[str] | None = None
    # Rounds: every run of runs() once per round, round 1 of every run first, so that
    # drift on the machine (load, thermals, page cache) touches every policy alike.
    repeat: int = 3
    # More configuration keys for every run (``spillover bench -D key=value``), as
    # strings or typed values; a key the bench sets itself is refused (its flag sets it).
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.policies = tuple(self.policies)
        problems = _names_problems(self.policies, POLICIES)
        if problems or not self.policies:
            raise BenchSpecError(
                "bad policies",
                field="policies",
                detail=f"{list(self.policies)}: {problems or 'none given'}",
                hint=f"one or more of {', '.join(POLICIES)}, each once",
            )
        if self.executor not in EXECUTORS:
            raise BenchSpecError(
                "bad executor",
                field="executor",
                detail=repr(self.executor),
                hint=f"choose one of {', '.join(EXECUTORS)}",
            )
        if self.master is not None and self.executor != "spark":
            raise BenchSpecError(
                "master needs the spark executor",
                field="master",
                detail=f"{self.master!r} with executor {self.executor!r}",
                hint="add --executor spark",
            )
        if (
            self.master is not None
            and not self.master.startswith("local")
            and self.checkpoint_dir is None
            and set(self.policies) != {"none"}
        ):
            raise ConfigError(
                f"master {self.master!r} runs subtasks on other machines: they need "
                "checkpoint storage they all reach",
                hint="give --checkpoint-dir a shared URI (s3://..., hdfs://...)",
            )
        if self.compare_local is None:
            auto = COMPARE_AUTO if self.executor != "local" else ()
            self.compare_local = tuple(p for p in self.policies if p in auto)
        self.compare_local = tuple(self.compare_local)
        problems = _names_problems(self.compare_local, self.policies, "not run")
        if problems:
            raise BenchSpecError(
                "bad compare_local",
                field="compare_local",
                detail=f"{list(self.compare_local)} against policies {list(self.policies)}: "
                + problems,
                hint="compare only policies that run, each once",
            )
        if self.repeat < 1:
            raise BenchSpecError(
                "bad repeat", field="repeat", detail=f"{self.repeat!r} is not >= 1"
            )
        _check(self.parallelism >= 1, "parallelism", self.parallelism, ">= 1")
        _check(self.duration_s > 0, "duration_s", self.duration_s, "> 0")
        _check(self.warmup_s >= 0, "warmup_s", self.warmup_s, ">= 0")
        _check(self.sink_rate > 0, "sink_rate", self.sink_rate, "> 0")
        _check(self.keys >= 1, "keys", self.keys, ">= 1")
        _check(self.slots >= 1, "slots", self.slots, ">= 1")
        _check(self.payload_bytes >= 1, "payload_bytes", self.payload_bytes, ">= 1")
        _check(self.aligned_timeout_ms > 0, "aligned_timeout_ms", self.aligned_timeout_ms, "> 0")
        self.options = {str(k).strip(): v for k, v in self.options.items()}
        # Every policy's keys, not only those run: a key another policy sets would
        # turn this run into that policy under this one's name.
        owned = {k for p in POLICIES for k in self._own_options(p, _PLACEHOLDER_DIR)}
        taken = sorted(k for k in self.options if canonical_key(k) in owned)
        if taken:
            raise BenchSpecError(
                "bad -D option",
                field="options",
                detail=f"the bench sets {', '.join(taken)} itself",
                hint="its own flags set those: --parallelism, --segment-size, --slots, "
                "--interval-ms, --checkpoint-dir, --policies, --aligned-timeout-ms, "
                "--max-inflight-bytes; restart-strategy.type is none (a failure ends a run)",
            )
        for policy in self.policies:  # every config key checked before the first run
            self.config(policy, self.checkpoint_dir or _PLACEHOLDER_DIR)

    def runs(self) -> list[tuple[str, str]]:
        """``(executor, policy)`` of every run of one round, in order."""
        out = []
        for policy in self.policies:
            out.append((self.executor, policy))
            if policy in (self.compare_local or ()):
                out.append(("local", policy))
        return out

    @property
    def run_s(self) -> float:
        """Seconds of one run, warm-up included."""
        return self.warmup_s + self.duration_s

    def config(self, policy: str, checkpoint_dir: str) -> Config:
        """The runtime configuration of one policy's run: :attr:`options` and the
        bench's own keys."""
        return Config.from_dict({**self.options, **self._own_options(policy, checkpoint_dir)})

    def _own_options(self, policy: str, checkpoint_dir: str) -> dict[str, Any]:
        """The keys the bench sets for one policy's run (its flags)."""
        options: dict[str, Any] = {
            "parallelism.default": self.parallelism,
            "restart-strategy.type": "none",  # a failure ends the run: it is not measured
            "taskmanager.memory.segment-size": self.segment_size,
            "taskmanager.numberOfTaskSlots": self.slots,
        }
        if policy != "none":
            options["execution.checkpointing.interval"] = f"{self.interval_ms} ms"
            options["state.checkpoints.dir"] = checkpoint_dir
        options.update(
            policy_options(
                policy,
                aligned_timeout_ms=self.aligned_timeout_ms,
                max_inflight_bytes=self.max_inflight_bytes,
            )
        )
        return options

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["policies"] = list(self.policies)
        d["compare_local"] = list(self.compare_local or ())
        d["options"] = {k: str(v) for k, v in self.options.items()}
        return d


class BenchSpecError(ConfigError):
    """A bad :class:`BenchSpec` field. ``field`` names it, and the message calls it by
    that name, so that the command line can name the flag that set it instead."""

    def __init__(self, message: str, *, field: str = "", **kw: Any) -> None:
        super().__init__(message, **kw)
        self.field = field


def _names_problems(names: Sequence[str], allowed: Sequence[str], unknown: str = "unknown") -> str:
    """What is wrong with a list of names, each to be one of ``allowed`` at most once;
    empty when nothing is."""
    bad = [n for n in names if n not in allowed]
    twice = sorted({n for n in names if names.count(n) > 1} - set(bad))
    problems = [f"{', '.join(bad)} {unknown}"] if bad else []
    return "; ".join(problems + ([f"{', '.join(twice)} named twice"] if twice else []))


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ConfigError(f"bad {name}", detail=f"{value!r} is not {rule}")


def build_job(spec: BenchSpec, name: str, sink_inner: Operator | None = None) -> StreamEnvironment:
    """The benchmark's job; its sink operator has the uid ``sink``, and passes every
    batch on to ``sink_inner`` (the recovery benchmark's timestamps) when given."""
    p = spec.parallelism
    env = StreamEnvironment(name, parallelism=p)
    source = GeneratorSource(
        partitions=2 * p,
        records_per_partition=None,
        rate_per_subtask=None,
        payload_bytes=spec.payload_bytes,
        keys=spec.keys,
    )
    (
        env.from_source(source, uid="source")
        .key_by("key")
        .process(KeyedCount("key", out="updates"), uid="count")
        .rebalance()
        .sink(ThrottledSink(spec.sink_rate, sink_inner), uid="sink")
    )
    return env
