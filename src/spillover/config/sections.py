"""The sections of the configuration tree, one frozen dataclass each, with
Flink's and Spark's option names as their fields' keys."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import timedelta

from spillover.config.options import (
    _Bool,
    _check_fields,
    _Choice,
    _Duration,
    _enum_choice,
    _Int,
    _key,
    _MemorySize,
    _seconds,
    _SparkMaster,
    _Text,
)
from spillover.config.units import (
    KiB,
    MiB,
    format_duration,
    format_memory_size,
)
from spillover.errors import ConfigError
from spillover.keygroups import UPPER_BOUND_MAX_PARALLELISM, compute_default_max_parallelism
from spillover.storage.handle import Codec


class CheckpointingMode(enum.Enum):
    """``execution.checkpointing.mode``."""

    EXACTLY_ONCE = "EXACTLY_ONCE"
    AT_LEAST_ONCE = "AT_LEAST_ONCE"


class Alignment(enum.Enum):
    """How a subtask handles barriers, derived from the unaligned options."""

    ALIGNED = "aligned"
    UNALIGNED = "unaligned"
    ALIGNED_WITH_TIMEOUT = "aligned-with-timeout"  # starts aligned, switches to unaligned


class RestartStrategy(enum.Enum):
    """``restart-strategy.type``."""

    NONE = "none"
    FIXED_DELAY = "fixed-delay"
    FAILURE_RATE = "failure-rate"


class RuntimeMode(enum.Enum):
    """``execution.runtime-mode``: how a job's operators exchange data (Flink's values)."""

    STREAMING = "streaming"  # pipelined exchanges, checkpoints
    BATCH = "batch"  # blocking exchanges, stage by stage; bounded sources only
    AUTOMATIC = "automatic"  # batch when every source is bounded


class ClaimMode(enum.Enum):
    """``execution.state-recovery.claim-mode`` (Flink's): who owns the restored
    checkpoint or savepoint."""

    NO_CLAIM = "NO_CLAIM"  # never deleted; the first checkpoint after it copies what it needs
    CLAIM = "CLAIM"  # the job's own from now on: retention may delete it


class Executor(enum.Enum):
    """``spillover.executor``: where subtasks run."""

    LOCAL = "local"
    PROCESSES = "processes"  # worker processes on this machine, wired as on Spark
    SPARK = "spark"


# --- the sections -------------------------------------------------------------------------

_CP = "execution.checkpointing."
_UNALIGNED = _CP + "unaligned.enabled"
_ALIGNED_TIMEOUT = _CP + "aligned-checkpoint-timeout"


@dataclass(frozen=True)
class CheckpointingConfig:
    """``execution.checkpointing.*``: when and how checkpoints are taken.

    ``interval`` None turns periodic checkpoints off. The unaligned options only
    act when ``unaligned`` is True.
    """

    interval: timedelta | None = field(
        default=None, metadata=_key(_CP + "interval", _Duration(timedelta(milliseconds=10)))
    )
    timeout: timedelta = field(
        default=timedelta(minutes=10),
        metadata=_key(_CP + "timeout", _Duration(timedelta(milliseconds=10))),
    )
    min_pause: timedelta = field(
        default=timedelta(0), metadata=_key(_CP + "min-pause", _Duration())
    )
    max_concurrent_checkpoints: int = field(
        default=1, metadata=_key(_CP + "max-concurrent-checkpoints", _Int(1))
    )
    mode: CheckpointingMode = field(
        default=CheckpointingMode.EXACTLY_ONCE,
        metadata=_key(_CP + "mode", _enum_choice(CheckpointingMode)),
    )
    tolerable_failed_checkpoints: int = field(
        default=0, metadata=_key(_CP + "tolerable-failed-checkpoints", _Int(0))
    )
    unaligned: bool = field(default=False, metadata=_key(_UNALIGNED, _Bool()))
    aligned_checkpoint_timeout: timedelta = field(
        default=timedelta(0), metadata=_key(_ALIGNED_TIMEOUT, _Duration())
    )
    max_inflight_bytes: int | None = field(
        default=None, metadata=_key(_CP + "unaligned.max-inflight-bytes", _MemorySize())
    )
    compression: str = field(
        default="none",
        metadata=_key(_CP + "unaligned.compression", _Choice({"none": "none", "lz4": "lz4"})),
    )
    max_subtasks_per_channel_state_file: int = field(
        default=5,
        metadata=_key(_CP + "unaligned.max-subtasks-per-channel-state-file", _Int(1)),
    )
    staging_memory: int = field(
        default=64 * MiB,
        metadata=_key(_CP + "unaligned.staging-memory", _MemorySize(0)),
    )

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.unaligned and self.mode is not CheckpointingMode.EXACTLY_ONCE:
            raise ConfigError(
                f"{_UNALIGNED} requires {_CP}mode EXACTLY_ONCE",
                detail=f"the mode is {self.mode.value}",
                hint=f"set {_CP}mode to EXACTLY_ONCE or turn unaligned checkpoints off",
            )
        if self.mode is CheckpointingMode.AT_LEAST_ONCE:
            # Refused rather than accepted and ignored: every barrier handler here
            # aligns (or persists) exactly once; there is no non-blocking tracker.
            raise ConfigError(
                f"{_CP}mode AT_LEAST_ONCE is not supported",
                detail="checkpoints are exactly-once: barriers are aligned or in-flight "
                "data is persisted",
                hint=f"remove {_CP}mode or set it to EXACTLY_ONCE (unaligned checkpoints "
                "avoid waiting for alignment under backpressure)",
            )
        if self.unaligned and self.max_concurrent_checkpoints != 1:
            raise ConfigError(
                f"{_UNALIGNED} requires {_CP}max-concurrent-checkpoints 1",
                detail=f"it is {self.max_concurrent_checkpoints}",
                hint=f"set {_CP}max-concurrent-checkpoints to 1 or turn unaligned checkpoints off",
            )
        if self.aligned_checkpoint_timeout and not self.unaligned:
            raise ConfigError(
                f"{_ALIGNED_TIMEOUT} requires {_UNALIGNED} true",
                detail=f"the timeout is {format_duration(self.aligned_checkpoint_timeout)} "
                "with unaligned checkpoints off",
                hint=f"set {_UNALIGNED} to true to switch to unaligned checkpoints after the "
                "timeout, or leave the timeout at 0",
            )

    @property
    def enabled(self) -> bool:
        """Whether periodic checkpoints are taken (an interval is set)."""
        return self.interval is not None

    @property
    def alignment(self) -> Alignment:
        """How barriers are handled, from ``unaligned`` and ``aligned_checkpoint_timeout``."""
        if not self.unaligned:
            return Alignment.ALIGNED
        if self.aligned_checkpoint_timeout:
            return Alignment.ALIGNED_WITH_TIMEOUT
        return Alignment.UNALIGNED

    @property
    def interval_s(self) -> float | None:
        return None if self.interval is None else _seconds(self.interval)

    @property
    def timeout_s(self) -> float:
        return _seconds(self.timeout)

    @property
    def min_pause_s(self) -> float:
        return _seconds(self.min_pause)

    @property
    def aligned_checkpoint_timeout_s(self) -> float:
        return _seconds(self.aligned_checkpoint_timeout)

    @property
    def codec(self) -> Codec:
        """The codec for persisted in-flight buffers."""
        return Codec.parse(self.compression)


@dataclass(frozen=True)
class StateConfig:
    """``state.checkpoints.*``: where checkpoints go and how many are kept."""

    checkpoints_dir: str | None = field(
        default=None,
        metadata=_key("state.checkpoints.dir", _Text("a non-empty path or URI", path=True)),
    )
    num_retained: int = field(default=1, metadata=_key("state.checkpoints.num-retained", _Int(1)))
    # Checkpoint metadata and the job event log beside it (what a restarted master
    # reads to decide where to resume) are fsynced, so they survive the machine's
    # loss, not only the process's (docs/recovery.md); false trades that for speed.
    fsync_metadata: bool = field(
        default=True, metadata=_key("state.checkpoints.fsync-metadata", _Bool())
    )
    # Where stop-with-savepoint writes its savepoint when the call names no directory
    # (default: ``savepoints`` beside the job's checkpoints).
    savepoints_dir: str | None = field(
        default=None,
        metadata=_key("state.savepoints.dir", _Text("a non-empty path or URI", path=True)),
    )

    def __post_init__(self) -> None:
        _check_fields(self)


_TM = "taskmanager.network.memory."
_DEBLOAT = _TM + "buffer-debloat."


@dataclass(frozen=True)
class NetworkConfig:
    """Network buffers and credits: ``taskmanager.memory.segment-size`` and
    ``taskmanager.network.memory.*``."""

    # 256 KiB, not Flink's 32: the runtime pays per buffer in the interpreter, and
    # debloating (on) cuts buffers smaller while consumers lag. Not larger: what is in
    # flight when a slow consumer starts, and each TCP channel's receiving pool, grow
    # with it (docs/runtime.md, "Buffer size and debloating").
    segment_size: int = field(
        default=256 * KiB,
        metadata=_key("taskmanager.memory.segment-size", _MemorySize(4 * KiB, 16 * MiB, True)),
    )
    buffers_per_channel: int = field(default=2, metadata=_key(_TM + "buffers-per-channel", _Int(1)))
    floating_buffers_per_gate: int = field(
        default=8, metadata=_key(_TM + "floating-buffers-per-gate", _Int(0))
    )
    buffers_per_partition: int = field(
        default=16, metadata=_key(_TM + "buffers-per-partition", _Int(1))
    )
    # Where a loop's feedback spills when its head has no credit (runtime/iteration);
    # None: the system's temporary directory.
    tmp_dir: str | None = field(
        default=None, metadata=_key("io.tmp.dirs", _Text("a non-empty local path", path=True))
    )
    # Buffer debloating (FLIP-183's keys): buffers cut smaller while consumers take
    # less, so the in-flight data stays about ``debloat_target`` of what they take.
    # On, and half Flink's target: a backpressured edge holds the target at its gate
    # and about as much again in its producer's partition.
    debloat_enabled: bool = field(default=True, metadata=_key(_DEBLOAT + "enabled", _Bool()))
    debloat_target: timedelta = field(
        default=timedelta(milliseconds=500),
        metadata=_key(_DEBLOAT + "target", _Duration(timedelta(milliseconds=1))),
    )
    debloat_period: timedelta = field(
        default=timedelta(milliseconds=200),
        metadata=_key(_DEBLOAT + "period", _Duration(timedelta(milliseconds=1))),
    )
    debloat_threshold_percentages: int = field(
        default=25, metadata=_key(_DEBLOAT + "threshold-percentages", _Int(0, 100))
    )
    # Where producers cut buffers until their consumer's first measurement (then up
    # to the segment size, or down): 32 KiB, Flink's segment size. At the segment
    # size, a slow consumer's gate filled with full buffers in the job's first
    # moments and held them for tens of seconds (docs/runtime.md).
    debloat_initial_size: int = field(
        default=32 * KiB,
        metadata=_key(_DEBLOAT + "initial-size", _MemorySize(16, 16 * MiB)),
    )
    min_segment_size: int = field(
        default=256,
        metadata=_key("taskmanager.memory.min-segment-size", _MemorySize(16, 16 * MiB)),
    )
    # How often a task sends its partly filled buffers (Flink's
    # execution.buffer-timeout.interval, default 100 ms there): a buffer also goes
    # when full and before an event or barrier. 5 ms: the runtime's tests and
    # verify's short runs count on data in flight soon after a job starts.
    buffer_timeout: timedelta = field(
        default=timedelta(milliseconds=5),
        metadata=_key("execution.buffer-timeout.interval", _Duration(timedelta(milliseconds=1))),
    )

    # Heartbeats (Flink's keys): a TCP channel's producer sends one whenever it wrote
    # nothing for ``heartbeat_interval``; a consumer that heard nothing on a channel,
    # or a job master that heard nothing from a running worker, for
    # ``heartbeat_timeout`` fails the attempt (a hung peer or a dead network path).
    heartbeat_interval: timedelta = field(
        default=timedelta(seconds=10),
        metadata=_key("heartbeat.interval", _Duration(timedelta(milliseconds=10))),
    )
    heartbeat_timeout: timedelta = field(
        default=timedelta(seconds=50),
        metadata=_key("heartbeat.timeout", _Duration(timedelta(milliseconds=100))),
    )

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.heartbeat_interval >= self.heartbeat_timeout:
            raise ConfigError(
                "heartbeat.interval is not below heartbeat.timeout",
                detail=f"{format_duration(self.heartbeat_interval)} >= "
                f"{format_duration(self.heartbeat_timeout)}",
                hint="a peer must have time for a few heartbeats before it counts as hung",
            )
        if self.min_segment_size > self.segment_size:
            raise ConfigError(
                "taskmanager.memory.min-segment-size is above taskmanager.memory.segment-size",
                detail=f"{format_memory_size(self.min_segment_size)} > "
                f"{format_memory_size(self.segment_size)}",
                hint="lower the minimum or raise the segment size",
            )

    @staticmethod
    def check_segment_size(size: int) -> None:
        """Raises the :class:`ConfigError` ``taskmanager.memory.segment-size: <size>``
        would raise (a power of two in its range), whatever the other keys say."""
        NetworkConfig(segment_size=size, min_segment_size=min(size, 256))

    @property
    def heartbeat_interval_s(self) -> float:
        return _seconds(self.heartbeat_interval)

    @property
    def heartbeat_timeout_s(self) -> float:
        return _seconds(self.heartbeat_timeout)


@dataclass(frozen=True)
class PipelineConfig:
    """``parallelism.default`` and ``pipeline.*``.

    ``max_parallelism`` None derives it from the parallelism by Flink's rule;
    :attr:`effective_max_parallelism` is the value in force.
    """

    parallelism: int = field(
        default=1, metadata=_key("parallelism.default", _Int(1, UPPER_BOUND_MAX_PARALLELISM))
    )
    max_parallelism: int | None = field(
        default=None,
        metadata=_key("pipeline.max-parallelism", _Int(1, UPPER_BOUND_MAX_PARALLELISM)),
    )
    name: str | None = field(default=None, metadata=_key("pipeline.name", _Text()))

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.max_parallelism is not None and self.parallelism > self.max_parallelism:
            raise ConfigError(
                "parallelism.default exceeds pipeline.max-parallelism",
                detail=f"{self.parallelism} > {self.max_parallelism}",
                hint="raise pipeline.max-parallelism, or leave it unset to derive it",
            )

    @property
    def effective_max_parallelism(self) -> int:
        if self.max_parallelism is not None:
            return self.max_parallelism
        return compute_default_max_parallelism(self.parallelism)


_RS = "restart-strategy."


@dataclass(frozen=True)
class RestartConfig:
    """``restart-strategy.*``. ``strategy`` None means: fixed-delay when checkpointing
    is on, none otherwise (:attr:`Config.restart_strategy` is the one in force)."""

    strategy: RestartStrategy | None = field(
        default=None,
        metadata=_key(
            _RS + "type",
            _Choice(
                {
                    **{m.value: m for m in RestartStrategy},
                    "off": RestartStrategy.NONE,
                    "disable": RestartStrategy.NONE,
                    "fixeddelay": RestartStrategy.FIXED_DELAY,
                    "failurerate": RestartStrategy.FAILURE_RATE,
                },
                refused=dict.fromkeys(
                    ("exponential-delay", "exponentialdelay"), "is not supported by spillover"
                ),
            ),
        ),
    )
    fixed_delay_attempts: int = field(
        default=1, metadata=_key(_RS + "fixed-delay.attempts", _Int(0))
    )
    fixed_delay_delay: timedelta = field(
        default=timedelta(seconds=1), metadata=_key(_RS + "fixed-delay.delay", _Duration())
    )
    failure_rate_max_failures_per_interval: int = field(
        default=1, metadata=_key(_RS + "failure-rate.max-failures-per-interval", _Int(1))
    )
    failure_rate_interval: timedelta = field(
        default=timedelta(minutes=1),
        metadata=_key(
            _RS + "failure-rate.failure-rate-interval", _Duration(timedelta(milliseconds=1))
        ),
    )
    failure_rate_delay: timedelta = field(
        default=timedelta(seconds=1), metadata=_key(_RS + "failure-rate.delay", _Duration())
    )

    def __post_init__(self) -> None:
        _check_fields(self)

    @property
    def fixed_delay_delay_s(self) -> float:
        return _seconds(self.fixed_delay_delay)

    @property
    def failure_rate_interval_s(self) -> float:
        return _seconds(self.failure_rate_interval)

    @property
    def failure_rate_delay_s(self) -> float:
        return _seconds(self.failure_rate_delay)


@dataclass(frozen=True)
class DeploymentConfig:
    """``spillover.*``: spillover's own keys, where subtasks run and how."""

    executor: Executor = field(
        default=Executor.LOCAL, metadata=_key("spillover.executor", _enum_choice(Executor))
    )
    spark_master: str | None = field(
        default=None, metadata=_key("spillover.spark.master", _SparkMaster())
    )
    # Subtasks of each operator one worker process hosts (Flink's slots per
    # TaskManager): Spark tasks and worker processes a generation takes are the
    # job's largest parallelism divided by this, rounded up.
    task_slots: int = field(default=1, metadata=_key("taskmanager.numberOfTaskSlots", _Int(1)))
    # On Spark and worker processes: an operator failure with every worker alive
    # restarts in the running stage (its workers cancel their subtasks and build the
    # next attempt's), not in a new one (docs/spark.md, "Restart in place").
    restart_in_place: bool = field(
        default=True, metadata=_key("spillover.restart-in-place.enabled", _Bool())
    )
    # Where the job master serves its REST API, metrics and dashboard (Flink's keys);
    # port 0 takes a free port, which ``spillover list`` shows.
    rest_bind_address: str = field(
        default="127.0.0.1", metadata=_key("rest.bind-address", _Text("a host name or address"))
    )
    rest_port: int = field(default=0, metadata=_key("rest.port", _Int(0, 65535)))
    # The threads of each worker process on one CPU, round-robin over the CPUs it may
    # use (on the local executor, the task threads of the job): the interpreter lock
    # handed between threads of one core is a switch, not a cross-core wake-up.
    cpu_pinning: bool = field(default=True, metadata=_key("spillover.cpu-pinning.enabled", _Bool()))

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True)
class RecoveryConfig:
    """How a job restores: from which checkpoint, and what it may leave behind."""

    path: str | None = field(default=None, metadata=_key("execution.state-recovery.path", _Text()))
    ignore_unclaimed_state: bool = field(
        default=False, metadata=_key("execution.state-recovery.ignore-unclaimed-state", _Bool())
    )
    claim_mode: ClaimMode = field(
        default=ClaimMode.NO_CLAIM,
        metadata=_key(
            "execution.state-recovery.claim-mode",
            _enum_choice(ClaimMode, **{"no-claim": ClaimMode.NO_CLAIM, "claim": ClaimMode.CLAIM}),
        ),
    )
    without_channel_state_checkpoint: int = field(
        default=-1,
        metadata=_key(_CP + "recover-without-channel-state.checkpoint-id", _Int(-1, 2**62)),
    )
    force_forward_rescale: bool = field(
        default=False, metadata=_key(_CP + "unaligned.forward-rescale.forced", _Bool())
    )
    # A job with checkpoint storage keeps an event log there; running it again after
    # its driver died resumes it from the newest checkpoint the log names (false:
    # start a fresh run, which the log records).
    job_recovery: bool = field(
        default=True, metadata=_key("execution.job-recovery.enabled", _Bool())
    )
    # How long a dead master's lease keeps another off the job (one on this host whose
    # process is gone is taken over at once); renewed every third of it.
    lease_timeout: timedelta = field(
        default=timedelta(seconds=30),
        metadata=_key(
            "execution.job-recovery.lease-timeout", _Duration(timedelta(milliseconds=100))
        ),
    )

    def __post_init__(self) -> None:
        _check_fields(self)

    @property
    def lease_timeout_s(self) -> float:
        return _seconds(self.lease_timeout)


@dataclass(frozen=True)
class ExecutionConfig:
    """``execution.runtime-mode`` and the batch execution's keys (docs/recovery.md,
    "Batch jobs")."""

    runtime_mode: RuntimeMode = field(
        default=RuntimeMode.STREAMING,
        metadata=_key("execution.runtime-mode", _enum_choice(RuntimeMode)),
    )
    # Where blocking result partitions go; unset: beside the checkpoints
    # (state.checkpoints.dir), else io.tmp.dirs (then nothing survives the driver).
    shuffle_dir: str | None = field(
        default=None,
        metadata=_key("execution.batch.shuffle-dir", _Text("a non-empty path or URI", path=True)),
    )
    # A batch job with durable storage logs its finished tasks; running it again after
    # its driver died re-runs only what had not finished (false: start over).
    batch_job_recovery: bool = field(
        default=True, metadata=_key("execution.batch.job-recovery.enabled", _Bool())
    )
    # LZ4 per buffer of the result partitions (kept only where it shrinks a buffer).
    shuffle_compression: str = field(
        default="none",
        metadata=_key(
            "execution.batch.shuffle-compression", _Choice({"none": "none", "lz4": "lz4"})
        ),
    )

    def __post_init__(self) -> None:
        _check_fields(self)

    @property
    def shuffle_codec(self) -> Codec:
        return Codec.parse(self.shuffle_compression)
