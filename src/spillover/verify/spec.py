"""What a verification runs: :class:`VerifySpec`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from spillover.config import Config
from spillover.config.policies import policy_options
from spillover.errors import ConfigError
from spillover.storage.location import Location
from spillover.verify.loops import build_iteration
from spillover.verify.topologies import (
    POLICIES,
    JobFactory,
    build,
    checked_job,
    load_job,
)

RUNTIME_MODES = ("streaming", "batch", "automatic")
# The built-ins that take ``event_time`` (``finishing`` has it always).
EVENT_TIME_TOPOLOGIES = ("pipeline", "union", "multi-input", "finishing")


@dataclass
class VerifySpec:
    topology: str = "pipeline"
    parallelism: int = 2
    records: int = 200_000  # per source
    rate_per_subtask: float | None = 50_000.0
    failures: int = 5
    seed: int = 1
    interval_ms: int = 100
    policy: str = "aligned"  # aligned | unaligned | timeout | max-inflight
    aligned_timeout_ms: int = 5
    max_inflight_bytes: int = 256 * 1024
    # The sink takes this share of what the sources offer: below 1, real backpressure.
    sink_share: float = 0.8
    # Restore at this parallelism: the run with failures stops part way, after a
    # checkpoint holding in-flight data, and is restored at ``rescale_to``.
    rescale_to: int | None = None
    # The user's job (a factory or "module:function"); None: the built-in ``topology``.
    # Of the fields above, a user's job uses parallelism, rescale_to, policy and its
    # settings, failures, seed, interval_ms, and records (per source) to place failures.
    job: JobFactory | str | None = None
    # "per-key": per (partition, key), or per partition without a key column, the
    # committed seqs increase; None: order is not checked.
    order: str | None = "per-key"
    # The column that orders a key's records; None: commit order (then the job must
    # bring each key's records to the sink without a rebalance). Built-ins: "total".
    order_by: str | None = None
    # The uid of a keyed operator whose final state must equal the failure-free run's,
    # and optionally the one state of it to compare (default: every state it holds).
    # Built-ins: "running-total" and "total".
    state_uid: str | None = None
    state: str | None = None
    # Where the runs with failures go: "local" (threads here), "processes" (worker
    # processes here) or "spark" (a barrier stage per attempt on ``master``, default
    # the embedded local master). The
    # failure-free reference run always uses the local executor.
    executor: str = "local"
    master: str | None = None
    # Stop-with-savepoint instead of a crash: "savepoint" (aligned, as Flink),
    # "unaligned-savepoint" (what is in flight goes into it) or "drain"; the run with
    # failures is stopped part way, then restored from its savepoint (at
    # ``rescale_to`` if given) and run to the end.
    stop: str | None = None
    # Where checkpoints go (a path or pyarrow URI such as s3://...): each run uses
    # <checkpoint_dir>/<run name>. None: under the work directory.
    checkpoint_dir: str | None = None
    # Kill the driver instead of tasks: the job runs in child driver processes, this
    # many of them SIGKILLed at random points (verify/driver.py), each started
    # again with the same command; no task failures are induced then.
    kill_driver: int = 0
    # state.checkpoints.num-retained of the runs (more keeps restored checkpoints to
    # read afterwards).
    num_retained: int = 1
    # execution.runtime-mode of every run: "streaming", "batch" (stage by stage,
    # blocking results; failures are task failures, a killed driver's successor
    # reuses what finished) or "automatic".
    runtime_mode: str = "streaming"
    # Give the built-in topologies pipeline, union and multi-input event time: their
    # records carry timestamps, watermarks follow them, and the first source's
    # records are also counted in event-time windows, checked like ``finishing``'s.
    event_time: bool = False
    # More configuration of every run, in Flink's option names (say
    # "execution.checkpointing.unaligned.max-subtasks-per-channel-state-file"); they
    # go over what the fields above set.
    options: dict[str, Any] = field(default_factory=dict)
    # Each induced failure fires only while the latest completed checkpoint holds
    # in-flight data, and while one waits the throttled sinks take no input between
    # checkpoints (verify/inflight.py): every restore replays in-flight data however
    # slow the machine. Local executor, an unaligned policy, crashes only.
    failures_after_inflight: bool = False

    def check(self) -> None:
        """Raises a :class:`ConfigError` naming the first count out of range (with its
        ``spillover verify`` flag); :func:`~spillover.verify.verify` calls it before
        it writes anything."""
        least = (
            ("parallelism", self.parallelism, 1),
            ("records", self.records, 1),
            ("failures", self.failures, 0),
            ("interval_ms", self.interval_ms, 1),
            ("rescale_to", self.rescale_to, 1),
        )
        for name, value, low in least:
            if value is not None and value < low:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{name} ({flag}) must be at least {low}", detail=f"got {value}")
        if self.runtime_mode not in RUNTIME_MODES:
            raise ConfigError(
                f"unknown runtime mode {self.runtime_mode!r}",
                hint=f"choose one of {', '.join(RUNTIME_MODES)}",
            )
        if self.event_time and (self.job is not None or self.topology not in EVENT_TIME_TOPOLOGIES):
            raise ConfigError(
                f"{self.describe()} has no event-time variant",
                hint="event time is for the built-in " + ", ".join(EVENT_TIME_TOPOLOGIES),
            )
        if self.batch:
            self._check_batch()
        if self.failures_after_inflight:
            self._check_after_inflight()
        if self.rate_per_subtask is not None and self.rate_per_subtask <= 0:
            raise ConfigError(
                "rate_per_subtask (--rate) must be positive",
                detail=f"got {self.rate_per_subtask:g}",
                hint="--rate 0 (rate_per_subtask=None) runs unthrottled",
            )

    def _check_after_inflight(self) -> None:
        """Waiting for in-flight data needs checkpoints that hold some (not aligned
        ones), a sink held in this process, and failures that crash the run."""
        why = None
        if self.policy == "aligned" or self.batch:
            why = f"the {self.policy} policy persists no in-flight data"
        elif self.executor != "local":
            why = f"the {self.executor} executor runs the sinks in other processes"
        elif self.stop is not None or self.rescale_to is not None or self.kill_driver:
            why = "a stop, a rescale or a killed driver ends the run its own way"
        elif not self.rate_per_subtask or self.sink_share >= 1:
            why = "only a throttled sink (a rate and a sink share below 1) is held"
        if why is not None:
            raise ConfigError(
                "failures_after_inflight cannot apply here: " + why,
                hint="use it with the local executor, an unaligned policy and plain failures",
            )

    def _check_batch(self) -> None:
        """A batch run takes no checkpoints and no savepoints: a stop, a rescale from a
        checkpoint, or a checkpoint setting other than the default would mean nothing
        in it, so each is refused rather than ignored."""
        if self.stop is not None or self.rescale_to is not None:
            raise ConfigError(
                "a batch run cannot be stopped with a savepoint or rescaled from a checkpoint",
                detail="--stop-with-savepoint, --drain and --rescale-to are streaming's",
                hint="drop them, or give --runtime-mode streaming",
            )
        defaults = {f.name: f.default for f in fields(self)}
        for name in ("policy", "interval_ms", "aligned_timeout_ms", "max_inflight_bytes"):
            if getattr(self, name) != defaults[name]:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(
                    f"a batch run takes no checkpoints, so {name} ({flag}) means nothing in it",
                    detail=f"got {getattr(self, name)!r}",
                    hint=f"drop {flag}, or give --runtime-mode streaming",
                )

    @property
    def batch(self) -> bool:
        """Whether the runs are batch runs (``automatic``: the built-ins are bounded)."""
        return self.runtime_mode != "streaming"

    def describe(self) -> str:
        """``topology <name>`` or ``job <module:function>``."""
        if self.job is None:
            return f"topology {self.topology}"
        if isinstance(self.job, str):
            return f"job {self.job}"
        fn = self.job
        qual = getattr(fn, "__qualname__", type(fn).__qualname__)
        return f"job {getattr(fn, '__module__', '?')}:{qual}"

    def factory(self) -> JobFactory:
        """The job to run: the user's, or the built-in topology."""
        if self.job is None and self.topology == "iteration":
            return lambda out_dir, name, parallelism: build_iteration(
                self, out_dir, name, parallelism
            )
        if self.job is None:
            return lambda out_dir, name, parallelism: build(self, out_dir, name, parallelism)
        return checked_job(
            load_job(self.job) if isinstance(self.job, str) else self.job, self.describe()
        )

    def checks(self) -> tuple[str | None, str | None, str | None]:
        """``(order_by, state_uid, state)`` in effect: the built-ins fill in their own."""
        if self.job is None:
            return (
                self.order_by or "total",
                self.state_uid or "running-total",
                self.state or ("total" if self.state_uid is None else None),
            )
        return self.order_by, self.state_uid, self.state

    def checkpoint_options(self) -> dict[str, Any]:
        """The config keys of the policy (``config/policies.py``)."""
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {POLICIES}")
        return policy_options(
            self.policy,
            aligned_timeout_ms=self.aligned_timeout_ms,
            max_inflight_bytes=self.max_inflight_bytes,
        )


def _checkpoints(spec: VerifySpec, workdir: str, name: str) -> str:
    if spec.checkpoint_dir is None:
        return os.path.join(workdir, name, "checkpoints")
    return Location.parse(spec.checkpoint_dir).child(name).uri


def config_for(spec: VerifySpec, ckpt: str) -> Config:
    """The runtime configuration of ``spec``'s runs, checkpoints under ``ckpt``."""
    return Config.from_dict(
        {
            "execution.checkpointing.interval": f"{spec.interval_ms} ms",
            "state.checkpoints.dir": ckpt,
            "restart-strategy.type": "fixed-delay",
            "restart-strategy.fixed-delay.attempts": spec.failures + 1,
            "restart-strategy.fixed-delay.delay": "10 ms",
            "state.checkpoints.num-retained": spec.num_retained,
            "execution.runtime-mode": spec.runtime_mode,
            **spec.checkpoint_options(),
            **spec.options,
        }
    )
