"""The runtime's configuration: every key, the value formats, the sources and their
precedence, and the refusals (bad values, bad combinations, unknown keys)."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spillover.config import (
    KEYS,
    Alignment,
    CheckpointingConfig,
    CheckpointingMode,
    ClaimMode,
    Config,
    Executor,
    NetworkConfig,
    PipelineConfig,
    RestartStrategy,
    RuntimeMode,
    env_var,
    format_duration,
    format_memory_size,
    parse_duration,
    parse_memory_size,
)
from spillover.errors import ConfigError

CP = "execution.checkpointing."
DIR = {"state.checkpoints.dir": "/tmp/checkpoints"}
UNALIGNED = {CP + "unaligned.enabled": True}
MS = timedelta(milliseconds=1)
KB = 1024

# key -> (a non-default raw value, the typed value it gives, the field, keys it needs)
EXAMPLES: dict[str, tuple[Any, Any, Callable[[Config], Any], dict[str, Any]]] = {
    CP + "interval": ("2 s", 2000 * MS, lambda c: c.checkpointing.interval, DIR),
    CP + "timeout": ("1 min", 60_000 * MS, lambda c: c.checkpointing.timeout, {}),
    CP + "min-pause": ("250ms", 250 * MS, lambda c: c.checkpointing.min_pause, {}),
    CP + "max-concurrent-checkpoints": (
        "3",
        3,
        lambda c: c.checkpointing.max_concurrent_checkpoints,
        {},
    ),
    CP + "mode": (
        "exactly_once",
        CheckpointingMode.EXACTLY_ONCE,
        lambda c: c.checkpointing.mode,
        {},
    ),
    CP + "tolerable-failed-checkpoints": (
        5,
        5,
        lambda c: c.checkpointing.tolerable_failed_checkpoints,
        {},
    ),
    CP + "unaligned.enabled": ("TRUE", True, lambda c: c.checkpointing.unaligned, {}),
    CP + "aligned-checkpoint-timeout": (
        "30 s",
        30_000 * MS,
        lambda c: c.checkpointing.aligned_checkpoint_timeout,
        UNALIGNED,
    ),
    CP + "unaligned.max-inflight-bytes": (
        "64 MiB",
        64 << 20,
        lambda c: c.checkpointing.max_inflight_bytes,
        {},
    ),
    CP + "unaligned.compression": ("LZ4", "lz4", lambda c: c.checkpointing.compression, {}),
    CP + "unaligned.max-subtasks-per-channel-state-file": (
        "1",
        1,
        lambda c: c.checkpointing.max_subtasks_per_channel_state_file,
        {},
    ),
    CP + "unaligned.staging-memory": (
        "16 MiB",
        16 << 20,
        lambda c: c.checkpointing.staging_memory,
        {},
    ),
    "state.checkpoints.dir": ("s3://b/cp", "s3://b/cp", lambda c: c.state.checkpoints_dir, {}),
    "state.checkpoints.num-retained": (3, 3, lambda c: c.state.num_retained, {}),
    "state.checkpoints.fsync-metadata": ("false", False, lambda c: c.state.fsync_metadata, {}),
    "state.savepoints.dir": ("/sp", "/sp", lambda c: c.state.savepoints_dir, {}),
    "taskmanager.memory.segment-size": ("64kb", 64 * KB, lambda c: c.network.segment_size, {}),
    "taskmanager.memory.min-segment-size": (
        "1 kb",
        KB,
        lambda c: c.network.min_segment_size,
        {},
    ),
    "execution.buffer-timeout.interval": (
        "20 ms",
        20 * MS,
        lambda c: c.network.buffer_timeout,
        {},
    ),
    "heartbeat.interval": ("2 s", 2000 * MS, lambda c: c.network.heartbeat_interval, {}),
    "heartbeat.timeout": ("20 s", 20000 * MS, lambda c: c.network.heartbeat_timeout, {}),
    "taskmanager.network.memory.buffer-debloat.enabled": (
        "false",
        False,
        lambda c: c.network.debloat_enabled,
        {},
    ),
    "taskmanager.network.memory.buffer-debloat.target": (
        "300 ms",
        timedelta(milliseconds=300),
        lambda c: c.network.debloat_target,
        {},
    ),
    "taskmanager.network.memory.buffer-debloat.period": (
        "50 ms",
        timedelta(milliseconds=50),
        lambda c: c.network.debloat_period,
        {},
    ),
    "taskmanager.network.memory.buffer-debloat.threshold-percentages": (
        10,
        10,
        lambda c: c.network.debloat_threshold_percentages,
        {},
    ),
    "taskmanager.network.memory.buffer-debloat.initial-size": (
        "64 kb",
        64 * KB,
        lambda c: c.network.debloat_initial_size,
        {},
    ),
    "taskmanager.network.memory.buffers-per-channel": (
        4,
        4,
        lambda c: c.network.buffers_per_channel,
        {},
    ),
    "taskmanager.network.memory.floating-buffers-per-gate": (
        0,
        0,
        lambda c: c.network.floating_buffers_per_gate,
        {},
    ),
    "taskmanager.network.memory.buffers-per-partition": (
        32,
        32,
        lambda c: c.network.buffers_per_partition,
        {},
    ),
    "io.tmp.dirs": ("/var/tmp/spill", "/var/tmp/spill", lambda c: c.network.tmp_dir, {}),
    "parallelism.default": (4, 4, lambda c: c.pipeline.parallelism, {}),
    "pipeline.max-parallelism": (256, 256, lambda c: c.pipeline.max_parallelism, {}),
    "pipeline.name": ("wordcount", "wordcount", lambda c: c.pipeline.name, {}),
    "restart-strategy.type": (
        "failure-rate",
        RestartStrategy.FAILURE_RATE,
        lambda c: c.restart.strategy,
        {},
    ),
    "restart-strategy.fixed-delay.attempts": (
        10,
        10,
        lambda c: c.restart.fixed_delay_attempts,
        {},
    ),
    "restart-strategy.fixed-delay.delay": (
        "2 min",
        120_000 * MS,
        lambda c: c.restart.fixed_delay_delay,
        {},
    ),
    "restart-strategy.failure-rate.max-failures-per-interval": (
        3,
        3,
        lambda c: c.restart.failure_rate_max_failures_per_interval,
        {},
    ),
    "restart-strategy.failure-rate.failure-rate-interval": (
        "5 min",
        300_000 * MS,
        lambda c: c.restart.failure_rate_interval,
        {},
    ),
    "restart-strategy.failure-rate.delay": (
        "10 s",
        10_000 * MS,
        lambda c: c.restart.failure_rate_delay,
        {},
    ),
    "spillover.executor": ("SPARK", Executor.SPARK, lambda c: c.deployment.executor, {}),
    "spillover.spark.master": (
        "spark://head:7077",
        "spark://head:7077",
        lambda c: c.deployment.spark_master,
        {},
    ),
    "rest.bind-address": ("0.0.0.0", "0.0.0.0", lambda c: c.deployment.rest_bind_address, {}),
    "rest.port": ("8081", 8081, lambda c: c.deployment.rest_port, {}),
    "taskmanager.numberOfTaskSlots": ("4", 4, lambda c: c.deployment.task_slots, {}),
    "spillover.restart-in-place.enabled": (
        "false",
        False,
        lambda c: c.deployment.restart_in_place,
        {},
    ),
    "spillover.cpu-pinning.enabled": ("false", False, lambda c: c.deployment.cpu_pinning, {}),
    "execution.state-recovery.path": (
        "/ckpt/job/chk-7",
        "/ckpt/job/chk-7",
        lambda c: c.recovery.path,
        {},
    ),
    "execution.state-recovery.claim-mode": (
        "CLAIM",
        ClaimMode.CLAIM,
        lambda c: c.recovery.claim_mode,
        {},
    ),
    "execution.state-recovery.ignore-unclaimed-state": (
        "true",
        True,
        lambda c: c.recovery.ignore_unclaimed_state,
        {},
    ),
    CP + "recover-without-channel-state.checkpoint-id": (
        "7",
        7,
        lambda c: c.recovery.without_channel_state_checkpoint,
        {},
    ),
    CP + "unaligned.forward-rescale.forced": (
        "true",
        True,
        lambda c: c.recovery.force_forward_rescale,
        {},
    ),
    "execution.job-recovery.enabled": (
        "false",
        False,
        lambda c: c.recovery.job_recovery,
        {},
    ),
    "execution.job-recovery.lease-timeout": (
        "2 min",
        timedelta(minutes=2),
        lambda c: c.recovery.lease_timeout,
        {},
    ),
    "execution.runtime-mode": (
        "batch",
        RuntimeMode.BATCH,
        lambda c: c.execution.runtime_mode,
        {},
    ),
    "execution.batch.shuffle-dir": (
        "/data/shuffle",
        "/data/shuffle",
        lambda c: c.execution.shuffle_dir,
        {},
    ),
    "execution.batch.job-recovery.enabled": (
        "false",
        False,
        lambda c: c.execution.batch_job_recovery,
        {},
    ),
    "execution.batch.shuffle-compression": (
        "lz4",
        "lz4",
        lambda c: c.execution.shuffle_compression,
        {},
    ),
}


def message(exc: pytest.ExceptionInfo[ConfigError]) -> str:
    return str(exc.value)


# Keys whose one accepted value is the default (the mode: AT_LEAST_ONCE is refused).
ONLY_THE_DEFAULT = {CP + "mode"}


def test_the_examples_cover_every_key() -> None:
    assert set(EXAMPLES) == set(KEYS)


@pytest.mark.parametrize("key", KEYS)
def test_every_key_parses_and_round_trips(key: str) -> None:
    raw, typed, get, needs = EXAMPLES[key]
    config = Config.from_dict({key: raw, **needs})
    assert get(config) == typed
    if key not in ONLY_THE_DEFAULT:
        assert get(config) != get(Config.from_dict(needs))  # not the default by chance
    assert key in config.to_dict()
    assert Config.from_dict(config.to_dict()) == config
    assert config.with_options({key: None}) == Config.from_dict(needs)


def test_defaults() -> None:
    c = Config()
    assert c == Config.from_dict({}) == Config.load(env={})
    cp = c.checkpointing
    assert (cp.interval, cp.enabled, cp.interval_s) == (None, False, None)
    assert cp.timeout == timedelta(minutes=10) and cp.timeout_s == 600.0
    assert cp.min_pause == timedelta(0) and cp.max_concurrent_checkpoints == 1
    assert cp.mode is CheckpointingMode.EXACTLY_ONCE and cp.tolerable_failed_checkpoints == 0
    assert not cp.unaligned and cp.alignment is Alignment.ALIGNED
    assert cp.max_inflight_bytes is None and cp.compression == "none" and cp.codec.label is None
    assert c.state.checkpoints_dir is None and c.state.num_retained == 1
    net = c.network
    assert net == NetworkConfig(256 * KB, 2, 8, 16, debloat_target=timedelta(milliseconds=500))
    assert net.debloat_enabled and net.debloat_period == timedelta(milliseconds=200)
    assert c.pipeline.parallelism == 1 and c.max_parallelism == 128
    assert c.restart_strategy is RestartStrategy.NONE
    assert c.deployment.executor is Executor.LOCAL
    assert "execution.checkpointing.interval" not in c.to_dict()


# --- formats ------------------------------------------------------------------------------

DURATION_UNITS = {
    "d": 86_400_000_000,
    "days": 86_400_000_000,
    "h": 3_600_000_000,
    "hour": 3_600_000_000,
    "min": 60_000_000,
    "m": 60_000_000,
    "minutes": 60_000_000,
    "s": 1_000_000,
    "sec": 1_000_000,
    "seconds": 1_000_000,
    "ms": 1000,
    "millis": 1000,
    "": 1000,
    "µs": 1,
    "us": 1,
    "micros": 1,
}
MEMORY_UNITS = {
    "": 1,
    "b": 1,
    "bytes": 1,
    "k": KB,
    "kb": KB,
    "KiB": KB,
    "m": KB**2,
    "mb": KB**2,
    "MiB": KB**2,
    "g": KB**3,
    "gb": KB**3,
    "t": KB**4,
    "tb": KB**4,
}


@given(st.integers(0, 10**15))
def test_duration_format_parse_identity(micros: int) -> None:
    value = timedelta(microseconds=micros)
    text = format_duration(value)
    assert parse_duration(text) == value
    assert format_duration(parse_duration(text)) == text


@given(
    st.integers(0, 10**6),
    st.sampled_from(sorted(DURATION_UNITS)),
    st.sampled_from(["", " ", "  "]),
    st.booleans(),
)
def test_duration_spellings(amount: int, unit: str, space: str, upper: bool) -> None:
    text = f"{amount}{space}{unit.upper() if upper else unit}"
    assert parse_duration(text) == timedelta(microseconds=amount * DURATION_UNITS[unit])


def test_duration_bare_integers_are_milliseconds() -> None:
    assert parse_duration(1500) == parse_duration("1500") == timedelta(seconds=1.5)
    assert parse_duration("2000 ns") == timedelta(microseconds=2)
    assert format_duration(timedelta(hours=2)) == "2 h"
    assert format_duration(timedelta(seconds=90)) == "90 s"


@pytest.mark.parametrize("bad", ["1.5 s", "-1 s", "10 parsecs", "s", "", "1 ns", True, 1.0])
def test_bad_durations(bad: Any) -> None:
    with pytest.raises(ConfigError):
        parse_duration(bad)


@given(st.integers(0, 2**62))
def test_memory_size_format_parse_identity(size: int) -> None:
    text = format_memory_size(size)
    assert parse_memory_size(text) == size
    assert format_memory_size(parse_memory_size(text)) == text


@given(
    st.integers(0, 10**6),
    st.sampled_from(sorted(MEMORY_UNITS)),
    st.sampled_from(["", " "]),
    st.booleans(),
)
def test_memory_size_spellings(amount: int, unit: str, space: str, upper: bool) -> None:
    text = f"{amount}{space}{unit.upper() if upper else unit}"
    assert parse_memory_size(text) == amount * MEMORY_UNITS[unit]


def test_memory_size_examples() -> None:
    assert parse_memory_size("32kb") == parse_memory_size("32 KiB") == 32 * KB
    assert parse_memory_size("4m") == parse_memory_size("1 mb") * 4 == 4 * KB**2
    assert parse_memory_size(100) == parse_memory_size("100") == 100
    assert format_memory_size(32 * KB) == "32 kb" and format_memory_size(1000) == "1000 b"


@pytest.mark.parametrize("bad", ["1.5 mb", "-1", "10 kilos", "mb", "", "9999999 tb", True, 1.0])
def test_bad_memory_sizes(bad: Any) -> None:
    with pytest.raises(ConfigError):
        parse_memory_size(bad)


# --- refusals -----------------------------------------------------------------------------

BAD_VALUES: list[tuple[str, Any]] = [
    (CP + "interval", "5 ms"),
    (CP + "interval", "often"),
    (CP + "interval", 1.5),
    (CP + "timeout", "1 ms"),
    (CP + "min-pause", "-1 s"),
    (CP + "max-concurrent-checkpoints", 0),
    (CP + "max-concurrent-checkpoints", True),
    (CP + "max-concurrent-checkpoints", "two"),
    (CP + "mode", "EXACTLY_TWICE"),
    (CP + "tolerable-failed-checkpoints", -1),
    (CP + "unaligned.enabled", "yes"),
    (CP + "unaligned.enabled", 1),
    (CP + "aligned-checkpoint-timeout", "1 parsec"),
    (CP + "unaligned.max-inflight-bytes", "lots"),
    (CP + "unaligned.compression", "zstd"),
    (CP + "unaligned.max-subtasks-per-channel-state-file", 0),
    (CP + "unaligned.max-subtasks-per-channel-state-file", "five"),
    (CP + "unaligned.staging-memory", "plenty"),
    ("state.checkpoints.dir", ""),
    ("state.checkpoints.dir", 42),
    ("state.checkpoints.num-retained", 0),
    ("state.checkpoints.fsync-metadata", "sometimes"),
    ("state.savepoints.dir", ""),
    ("taskmanager.memory.segment-size", "2 kb"),
    ("taskmanager.memory.segment-size", "48 kb"),
    ("taskmanager.memory.segment-size", "32 mb"),
    ("taskmanager.memory.min-segment-size", "8 b"),
    ("execution.buffer-timeout.interval", "0 ms"),
    ("execution.buffer-timeout.interval", "soon"),
    ("heartbeat.interval", "5 ms"),
    ("heartbeat.timeout", "50 ms"),
    ("taskmanager.network.memory.buffer-debloat.enabled", "sometimes"),
    ("taskmanager.network.memory.buffer-debloat.target", "0 ms"),
    ("taskmanager.network.memory.buffer-debloat.period", "soon"),
    ("taskmanager.network.memory.buffer-debloat.threshold-percentages", 101),
    ("taskmanager.network.memory.buffer-debloat.initial-size", "8 b"),
    ("taskmanager.network.memory.buffers-per-channel", 0),
    ("taskmanager.network.memory.floating-buffers-per-gate", -1),
    ("taskmanager.network.memory.buffers-per-partition", 0),
    ("io.tmp.dirs", ""),
    ("io.tmp.dirs", 3),
    ("parallelism.default", 0),
    ("parallelism.default", 40_000),
    ("pipeline.max-parallelism", 32_769),
    ("pipeline.max-parallelism", -1),
    ("pipeline.name", 7),
    ("restart-strategy.type", "exponential-delay"),
    ("restart-strategy.type", "sometimes"),
    ("restart-strategy.fixed-delay.attempts", -1),
    ("restart-strategy.fixed-delay.attempts", 2**31),
    ("restart-strategy.fixed-delay.delay", "soon"),
    ("restart-strategy.failure-rate.max-failures-per-interval", 0),
    ("restart-strategy.failure-rate.failure-rate-interval", 0),
    ("restart-strategy.failure-rate.delay", [1]),
    ("spillover.executor", "yarn"),
    ("spillover.spark.master", "head:7077"),
    ("rest.bind-address", 8081),
    ("rest.port", 70000),
    ("taskmanager.numberOfTaskSlots", 0),
    ("spillover.restart-in-place.enabled", "sometimes"),
    ("spillover.cpu-pinning.enabled", "maybe"),
    ("execution.state-recovery.path", 7),
    ("execution.state-recovery.ignore-unclaimed-state", "perhaps"),
    ("execution.state-recovery.claim-mode", "LEGACY"),
    (CP + "recover-without-channel-state.checkpoint-id", -2),
    (CP + "unaligned.forward-rescale.forced", "yes please"),
    ("execution.job-recovery.enabled", "sometimes"),
    ("execution.job-recovery.lease-timeout", "10 ms"),
    ("execution.runtime-mode", "bulk"),
    ("execution.batch.shuffle-dir", " "),
    ("execution.batch.job-recovery.enabled", "maybe"),
    ("execution.batch.shuffle-compression", "zstd"),
]


def test_bad_values_cover_every_key() -> None:
    assert {key for key, _ in BAD_VALUES} == set(KEYS)


@pytest.mark.parametrize(("key", "value"), BAD_VALUES)
def test_bad_value_names_the_key_the_value_and_the_form(key: str, value: Any) -> None:
    with pytest.raises(ConfigError) as exc:
        Config.from_dict({key: value})
    text = message(exc)
    assert key in text and "expected" in text
    assert repr(value) in text or str(value) in text


def test_code_built_sections_are_checked_too() -> None:
    with pytest.raises(ConfigError, match=r"execution\.checkpointing\.interval"):
        CheckpointingConfig(interval=timedelta(milliseconds=5))
    with pytest.raises(ConfigError, match=r"max-concurrent-checkpoints"):
        CheckpointingConfig(max_concurrent_checkpoints=True)
    with pytest.raises(ConfigError, match=r"execution\.checkpointing\.mode"):
        CheckpointingConfig(mode="EXACTLY_ONCE")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"parallelism\.default"):
        PipelineConfig(parallelism=0)
    with pytest.raises(ConfigError, match=r"state\.checkpoints\.dir"):
        Config(checkpointing=CheckpointingConfig(interval=timedelta(seconds=1)))


BAD_COMBINATIONS: list[tuple[dict[str, Any], list[str]]] = [
    (
        {**UNALIGNED, CP + "mode": "AT_LEAST_ONCE"},
        [CP + "unaligned.enabled", CP + "mode"],
    ),
    (
        {**UNALIGNED, CP + "max-concurrent-checkpoints": 2},
        [CP + "unaligned.enabled", CP + "max-concurrent-checkpoints"],
    ),
    (
        {CP + "aligned-checkpoint-timeout": "1 s"},
        [CP + "aligned-checkpoint-timeout", CP + "unaligned.enabled"],
    ),
    ({CP + "interval": "10 s"}, [CP + "interval", "state.checkpoints.dir"]),
    (
        {"parallelism.default": 200, "pipeline.max-parallelism": 128},
        ["parallelism.default", "pipeline.max-parallelism"],
    ),
    (
        {CP + "unaligned.max-inflight-bytes": "16 kb"},
        [CP + "unaligned.max-inflight-bytes", "taskmanager.memory.segment-size"],
    ),
    (
        {"taskmanager.memory.min-segment-size": "1 mb"},
        ["taskmanager.memory.min-segment-size", "taskmanager.memory.segment-size"],
    ),
]


@pytest.mark.parametrize(("options", "keys"), BAD_COMBINATIONS)
def test_bad_combination_names_both_keys(options: dict[str, Any], keys: list[str]) -> None:
    with pytest.raises(ConfigError) as exc:
        Config.from_dict(options)
    assert all(key in message(exc) for key in keys)
    assert exc.value.hint


def test_good_combinations() -> None:
    c = Config.from_dict({**UNALIGNED, **DIR, CP + "interval": "1 s"})
    assert c.checkpointing.alignment is Alignment.UNALIGNED
    assert c.restart_strategy is RestartStrategy.FIXED_DELAY
    c = c.with_options({CP + "aligned-checkpoint-timeout": "50 ms"})
    assert c.checkpointing.alignment is Alignment.ALIGNED_WITH_TIMEOUT
    assert c.checkpointing.aligned_checkpoint_timeout_s == 0.05
    assert Config.from_dict({CP + "unaligned.max-inflight-bytes": "256 kb"})  # the segment size
    assert Config.from_dict(
        {CP + "unaligned.max-inflight-bytes": "32 kb", "taskmanager.memory.segment-size": "32 kb"}
    )
    assert Config.from_dict({"parallelism.default": 100}).max_parallelism == 256
    assert Config.from_dict({"parallelism.default": 30_000}).max_parallelism == 32_768


@pytest.mark.parametrize(
    ("typo", "key"),
    [
        ("execution.checkpointing.intervall", CP + "interval"),
        ("execution.checkpointing.max_concurrent_checkpoints", CP + "max-concurrent-checkpoints"),
        ("state.checkpoint.dir", "state.checkpoints.dir"),
        ("taskmanager.memory.segmentsize", "taskmanager.memory.segment-size"),
    ],
)
def test_unknown_key_suggests_the_nearest(typo: str, key: str) -> None:
    with pytest.raises(ConfigError) as exc:
        Config.from_dict({typo: 1})
    assert typo in message(exc) and f"did you mean {key}?" in message(exc)


def test_unknown_key_far_from_any() -> None:
    with pytest.raises(ConfigError, match=r"docs/configuration\.md"):
        Config.from_dict({"zzz": 1})


def test_flink_alternative_names_are_accepted_once() -> None:
    c = Config.from_dict(
        {
            "execution.checkpointing.unaligned": True,
            "execution.checkpointing.alignment-timeout": "1 s",
            "execution.checkpointing.dir": "/cp",
            "execution.checkpointing.num-retained": 2,
        }
    )
    assert c.checkpointing.unaligned and c.state.checkpoints_dir == "/cp"
    assert c.checkpointing.aligned_checkpoint_timeout_s == 1.0 and c.state.num_retained == 2
    with pytest.raises(ConfigError, match="given twice"):
        Config.from_dict({"execution.checkpointing.dir": "/a", "state.checkpoints.dir": "/b"})


# --- sources ------------------------------------------------------------------------------

NESTED_YAML = """
execution:
  checkpointing:
    interval: 10 s
    unaligned:
      enabled: true
      compression: lz4
state:
  checkpoints:
    dir: /data/cp
parallelism:
  default: 4
"""
FLAT_YAML = """
execution.checkpointing.interval: 10 s
execution.checkpointing.unaligned.enabled: true
execution.checkpointing.unaligned.compression: lz4
state.checkpoints.dir: /data/cp
parallelism.default: 4
"""
MIXED_YAML = """
execution.checkpointing:
  interval: 10 s
  unaligned.enabled: true
  unaligned:
    compression: lz4
state.checkpoints.dir: /data/cp
parallelism: {default: 4}
"""
NESTED_TOML = """
[execution.checkpointing]
interval = "10 s"
unaligned = { enabled = true, compression = "lz4" }

[state.checkpoints]
dir = "/data/cp"

[parallelism]
default = 4
"""
FLAT_TOML = """
"execution.checkpointing.interval" = "10 s"
"execution.checkpointing.unaligned.enabled" = true
"execution.checkpointing.unaligned.compression" = "lz4"
"state.checkpoints.dir" = "/data/cp"
"parallelism.default" = 4
"""
FILE_EXPECTED = {
    CP + "interval": "10 s",
    CP + "unaligned.enabled": True,
    CP + "unaligned.compression": "lz4",
    "state.checkpoints.dir": "/data/cp",
    "parallelism.default": 4,
}


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("nested.yaml", NESTED_YAML),
        ("flat.yml", FLAT_YAML),
        ("mixed.YAML", MIXED_YAML),
        ("nested.toml", NESTED_TOML),
        ("flat.toml", FLAT_TOML),
    ],
)
def test_files(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    assert Config.from_file(path) == Config.from_dict(FILE_EXPECTED)
    assert Config.from_file(str(path)).checkpointing.codec.label == "lz4"


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("a.json", "{}", "file type"),
        ("a.yaml", "- a list", "mapping"),
        ("a.yaml", "a: [unclosed", "bad YAML"),
        ("a.toml", "a = ", "bad TOML"),
        ("a.yaml", "parallelism.default: 2\nparallelism: {default: 3}", "twice"),
        ("a.yaml", "execution:\n  checkpointing:\n    intervall: 1 s", "did you mean"),
        ("a.yaml", "parallelism.default: x", r"a\.yaml"),
        ("a.yaml", "execution.checkpointing.dir: /a\nstate: {checkpoints: {dir: /b}}", "twice"),
    ],
)
def test_bad_files(tmp_path: Path, name: str, text: str, match: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        Config.from_file(path)


def test_empty_yaml_file_is_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing set\n")
    assert Config.from_file(path) == Config()


def test_no_key_is_a_section_of_another() -> None:
    # A nested file maps to dotted keys without ambiguity.
    for key in KEYS:
        assert not any(other.startswith(key + ".") for other in KEYS)


@pytest.mark.parametrize("key", KEYS)
def test_env_mapping_of_every_key(key: str) -> None:
    raw, _, _, needs = EXAMPLES[key]
    options = {key: raw, **needs}
    environ = {env_var(k): str(v) for k, v in options.items()}
    assert Config.from_env(environ) == Config.from_dict(options)


def test_env_names() -> None:
    assert env_var(CP + "interval") == "SPILLOVER_EXECUTION_CHECKPOINTING_INTERVAL"
    assert env_var(CP + "unaligned.max-inflight-bytes") == (
        "SPILLOVER_EXECUTION_CHECKPOINTING_UNALIGNED_MAX_INFLIGHT_BYTES"
    )
    assert env_var("restart-strategy.type") == "SPILLOVER_RESTART_STRATEGY_TYPE"
    assert env_var("spillover.executor") == "SPILLOVER_EXECUTOR"
    names = [env_var(k) for k in KEYS]
    assert len(set(names)) == len(names)
    tools = {"SPILLOVER_CFLAGS", "SPILLOVER_DEBUG", "SPILLOVER_ONLY", "SPILLOVER_PURE_CRC"}
    assert not tools & set(names)
    assert not [n for n in names if n.startswith(("SPILLOVER_DEMO_", "SPILLOVER_BENCH_"))]


def test_env_leaves_other_variables_alone_and_skips_empty_ones() -> None:
    environ = {
        "SPILLOVER_DEBUG": "1",
        "SPILLOVER_DEMO_DIR": "/tmp",
        "SPILLOVER_BENCH_BYTES": "x",
        "PARALLELISM_DEFAULT": "9",
        "SPILLOVER_PARALLELISM_DEFAULT": "3",
        "SPILLOVER_PIPELINE_NAME": "",
    }
    assert Config.from_env(environ) == Config.from_dict({"parallelism.default": 3})


def test_env_refuses_unknown_names_in_the_key_namespaces() -> None:
    with pytest.raises(ConfigError) as exc:
        Config.from_env({"SPILLOVER_EXECUTION_CHECKPOINTING_INTERVL": "1 s"})
    assert "did you mean SPILLOVER_EXECUTION_CHECKPOINTING_INTERVAL?" in message(exc)


def test_env_bad_value_names_variable_and_key() -> None:
    with pytest.raises(ConfigError) as exc:
        Config.from_env({"SPILLOVER_STATE_CHECKPOINTS_NUM_RETAINED": "none"})
    assert "SPILLOVER_STATE_CHECKPOINTS_NUM_RETAINED" in message(exc)
    assert "state.checkpoints.num-retained" in message(exc)
    with pytest.raises(ConfigError, match="twice"):
        Config.from_env(
            {"SPILLOVER_STATE_CHECKPOINTS_DIR": "/a", "SPILLOVER_EXECUTION_CHECKPOINTING_DIR": "/b"}
        )


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=60)
@given(
    st.none() | st.integers(1, 100),
    st.none() | st.integers(1, 100),
    st.none() | st.integers(1, 100),
)
def test_precedence(tmp_path: Path, file: int | None, env: int | None, over: int | None) -> None:
    path = tmp_path / "conf.yaml"
    path.write_text("" if file is None else f"parallelism.default: {file}\n")
    environ = {} if env is None else {"SPILLOVER_PARALLELISM_DEFAULT": str(env)}
    overrides = {} if over is None else {"parallelism.default": over}
    config = Config.load(path, env=environ, overrides=overrides)
    expected = next((v for v in (over, env, file) if v is not None), 1)
    assert config.pipeline.parallelism == expected


def test_load_checks_the_merged_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "conf.toml"
    path.write_text('"execution.checkpointing.interval" = "1 s"\n')
    with pytest.raises(ConfigError, match=r"state\.checkpoints\.dir"):
        Config.load(path, env={})
    monkeypatch.setenv("SPILLOVER_STATE_CHECKPOINTS_DIR", "/from/env")
    config = Config.load(path, overrides={CP + "unaligned.enabled": "true"})
    assert config.state.checkpoints_dir == "/from/env" and config.checkpointing.unaligned
    assert Config.load(path, overrides={CP + "interval": None}).checkpointing.enabled is False


def test_at_least_once_is_refused_not_ignored() -> None:
    """No barrier handler here tracks barriers without aligning: the mode would be a
    setting that does nothing, so it is one clear error instead."""
    with pytest.raises(ConfigError, match=r"mode AT_LEAST_ONCE is not supported") as e:
        Config.from_dict({**DIR, CP + "interval": "1 s", CP + "mode": "AT_LEAST_ONCE"})
    assert e.value.hint and "EXACTLY_ONCE" in e.value.hint


def test_with_options_copies_and_checks() -> None:
    base = Config.from_dict({**DIR, CP + "interval": "1 s", "parallelism.default": 2})
    changed = base.with_options({"parallelism.default": 8, CP + "interval": None})
    assert base.pipeline.parallelism == 2 and base.checkpointing.enabled
    assert changed.pipeline.parallelism == 8 and not changed.checkpointing.enabled
    assert changed.state.checkpoints_dir == DIR["state.checkpoints.dir"]
    with pytest.raises(ConfigError):
        base.with_options({CP + "mode": "AT_LEAST_ONCE", **UNALIGNED})


# --- whole configs ------------------------------------------------------------------------


@st.composite
def valid_options(draw: st.DrawFn) -> dict[str, Any]:
    def maybe(key: str, strategy: st.SearchStrategy[Any]) -> None:
        if draw(st.booleans()):
            options[key] = draw(strategy)

    durations = st.integers(10, 10**9).map(lambda ms: format_duration(ms * MS))
    options: dict[str, Any] = {}
    maybe(CP + "interval", durations | st.integers(10, 10**6))
    if CP + "interval" in options or draw(st.booleans()):
        options["state.checkpoints.dir"] = draw(st.sampled_from(["/cp", "s3://b/p", "file:///x"]))
    unaligned = draw(st.booleans())
    options[CP + "unaligned.enabled"] = unaligned
    if unaligned:
        maybe(CP + "aligned-checkpoint-timeout", durations)
    else:
        maybe(CP + "mode", st.sampled_from(["EXACTLY_ONCE", "exactly_once"]))
        maybe(CP + "max-concurrent-checkpoints", st.integers(1, 10))
    maybe(CP + "timeout", durations)
    maybe(CP + "min-pause", st.integers(0, 10**5).map(lambda ms: timedelta(milliseconds=ms)))
    maybe(CP + "unaligned.compression", st.sampled_from(["none", "lz4"]))
    maybe(CP + "unaligned.max-inflight-bytes", st.integers(16 << 20, 2**40).map(format_memory_size))
    maybe("taskmanager.memory.segment-size", st.integers(12, 24).map(lambda p: 1 << p))
    parallelism = draw(st.integers(1, 1000))
    options["parallelism.default"] = parallelism
    maybe("pipeline.max-parallelism", st.integers(parallelism, 32768))
    maybe("pipeline.name", st.text(max_size=10))
    maybe("restart-strategy.type", st.sampled_from(["none", "fixed-delay", "failure-rate"]))
    maybe("restart-strategy.fixed-delay.attempts", st.integers(0, 2**31 - 1))
    maybe("spillover.executor", st.sampled_from(["local", "spark"]))
    maybe("spillover.spark.master", st.sampled_from(["local[4]", "spark://h:7077", "yarn"]))
    maybe("rest.port", st.integers(0, 65535))
    maybe("taskmanager.numberOfTaskSlots", st.integers(1, 8))
    return options


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(valid_options())
def test_whole_config_round_trips_through_dict_yaml_and_pickle(
    tmp_path: Path, options: dict[str, Any]
) -> None:
    config = Config.from_dict(options)
    plain = config.to_dict()
    assert Config.from_dict(plain) == config
    assert Config.from_dict(plain).to_dict() == plain
    yaml = pytest.importorskip("yaml")
    path = tmp_path / "dump.yaml"
    # Escaped: PyYAML writes a raw NEL (U+0085) with allow_unicode, which reads
    # back as a line break (YAML 1.1), so such a dump is not the same config.
    path.write_text(yaml.safe_dump(plain))
    assert Config.from_file(path) == config
    assert pickle.loads(pickle.dumps(config)) == config
    assert hash(config) == hash(Config.from_dict(plain))


# --- restore ------------------------------------------------------------------------------


def test_restore_critical_and_restore() -> None:
    taken = Config.from_dict({"parallelism.default": 4, CP + "unaligned.compression": "lz4"})
    saved = taken.restore_critical()
    assert saved == {"max-parallelism": 128, "format-version": 1, "codec": "lz4"}
    # A restore at a parallelism whose derived max parallelism differs keeps the saved one.
    later = Config.from_dict({"parallelism.default": 100})
    assert later.max_parallelism == 256
    restored = later.with_restored(saved)
    assert restored.max_parallelism == 128 and restored.pipeline.parallelism == 100
    assert Config.from_dict({"pipeline.max-parallelism": 128}).with_restored(saved)


@pytest.mark.parametrize(
    ("options", "saved", "match"),
    [
        ({"pipeline.max-parallelism": 256}, {}, r"pipeline\.max-parallelism"),
        ({"parallelism.default": 200}, {}, r"parallelism\.default"),
        ({}, {"format-version": 2}, "format version"),
        ({}, {"max-parallelism": "128"}, "max-parallelism"),
    ],
)
def test_restore_refusals(options: dict[str, Any], saved: dict[str, Any], match: str) -> None:
    metadata = {"max-parallelism": 128, "format-version": 1, "codec": "none", **saved}
    with pytest.raises(ConfigError, match=match):
        Config.from_dict(options).with_restored(metadata)


def test_docs_list_every_key() -> None:
    docs = (Path(__file__).parents[3] / "docs" / "configuration.md").read_text()
    assert [k for k in KEYS if f"| `{k}` |" not in docs] == []


def test_docs_yaml_and_toml_examples_agree(tmp_path: Path) -> None:
    docs = (Path(__file__).parents[3] / "docs" / "configuration.md").read_text()
    runtime = docs[docs.index("## Runtime configuration") :]
    configs = []
    for lang in ("yaml", "toml"):
        path = tmp_path / f"example.{lang}"
        path.write_text(runtime.split(f"```{lang}\n", 1)[1].split("```", 1)[0])
        configs.append(Config.from_file(path))
    assert configs[0] == configs[1]
    assert configs[0].checkpointing.alignment is Alignment.UNALIGNED
    assert configs[0].checkpointing.interval_s == 10.0


def test_flinks_forced_unaligned_key_is_refused_with_why() -> None:
    """Every job takes unaligned checkpoints (loops too): the key would do nothing."""
    with pytest.raises(ConfigError, match=r"unaligned\.forced is not needed") as e:
        Config.from_dict({CP + "unaligned.forced": "true"})
    assert "loops included" in str(e.value)


def test_a_heartbeat_interval_not_below_its_timeout_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"heartbeat\.interval is not below heartbeat\.timeout"):
        Config.from_dict({"heartbeat.interval": "1 min"})
