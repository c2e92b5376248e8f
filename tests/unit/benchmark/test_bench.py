"""``spillover bench``: short runs, the results folder, progress, flags and their errors."""

from __future__ import annotations

import csv
import io
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import spillover.benchmark as bench
import spillover.benchmark.runner as bench_run
from spillover.benchmark import (
    PLOTS,
    RUN_COLUMNS,
    BenchSpec,
    PolicyResult,
    ProgressBar,
    run,
    to_markdown,
    trigger_offsets,
)
from spillover.cli import main
from spillover.errors import ConfigError
from spillover.runtime.jobmaster import JobResult

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_aligned_and_unaligned_short_run(tmp_path: Path) -> None:
    spec = BenchSpec(
        policies=["aligned", "unaligned"],
        duration_s=2.0,
        warmup_s=0.5,
        interval_ms=200,
        sink_rate=20_000,  # a shorter backlog, so aligned checkpoints complete in 2 s
        segment_size=32 * 1024,  # ... and buffers that hold it from the start
        checkpoint_dir=str(tmp_path),
        executor="local",
        repeat=1,
    )
    lines: list[str] = []
    results = json.loads(json.dumps(run(spec, progress=lines.append)))
    assert list(results["policies"]) == ["aligned", "unaligned"] and len(lines) == 2
    assert results["local"] == {}  # the local executor is not compared with itself unasked
    for name, r in results["policies"].items():
        assert r["status"] == "stopped", (name, r["failures"])
        assert r["executor"] == "local"
        # The sinks are paced: what they took cannot beat 2 subtasks x 20,000 records/s.
        assert 0 < r["throughput_rps"] <= 2 * 20_000 * 1.1, name
        assert r["checkpoints"] >= 1, name
        assert set(r["checkpoint_duration_ms"]) == {"median", "p90", "max"}
        assert all("trigger_s" in c for c in r["runs"][0]["checkpoint_list"])
        # Trigger to the last acknowledgement (Flink's end_to_end_duration) is the
        # duration without the metadata's completion: never longer, never negative.
        for c in r["runs"][0]["checkpoint_list"]:
            if c["status"] == "completed":
                assert 0 <= c["acked_ms"] <= c["duration_ms"], c
        assert r["checkpoint_acked_ms"]["median"] <= r["checkpoint_duration_ms"]["median"]
    assert results["policies"]["aligned"]["inflight_bytes"]["max"] == 0
    assert results["policies"]["unaligned"]["inflight_bytes"]["max"] > 0
    table = to_markdown(results)
    rows = [ln for ln in table.splitlines() if ln.startswith("| ")]
    assert [r.split("|")[2].strip() for r in rows[1:]] == ["aligned", "unaligned"]


class _ScriptedExecutor:
    """Runs nothing until ``stop_when`` holds; its subtasks start ``start_up`` seconds
    into the run (a stage start), then its sink takes 1,000 records/s."""

    def __init__(self, start_up: float = 0.0) -> None:
        self.start_up = start_up
        self.started: float | None = None
        self.calls: list[tuple[str, str]] = []

    def prepare(self) -> None:
        pass

    def running_since(self) -> float | None:
        return (
            self.started if self.started is not None and self.started <= time.monotonic() else None
        )

    def live_metric(self, uid: str, metric: str = "records_in") -> float:
        self.calls.append((uid, metric))
        since = self.running_since()
        return 0.0 if since is None else 1000 * (time.monotonic() - since)

    def run(
        self, timeout: float | None = None, *, stop_when: Callable[[list[Any]], bool]
    ) -> JobResult:
        t0 = time.monotonic()
        self.started = t0 + self.start_up
        deadline = t0 + (timeout or 60.0)
        while not stop_when([]) and time.monotonic() < deadline:
            time.sleep(0.01)
        return JobResult("scripted", "stopped", 1, time.monotonic() - t0)


@pytest.mark.parametrize("start_up", [0.0, 1.5])
def test_sink_throughput_comes_from_the_executors_live_metric(
    monkeypatch: pytest.MonkeyPatch, start_up: float
) -> None:
    """Measured from when the subtasks run: a slow stage start (a busy machine) is
    left out of the window instead of eating it."""
    made: list[tuple[str, str | None, _ScriptedExecutor]] = []

    def create(kind: str, job: Any, config: Any, *, master: str | None = None) -> Any:
        made.append((kind, master, _ScriptedExecutor(start_up)))
        return made[-1][2]

    monkeypatch.setattr(bench_run, "create_executor", create)
    spec = BenchSpec(policies=["none"], duration_s=1.0, warmup_s=0.3, executor="local", repeat=1)
    r = run(spec)["policies"]["none"]
    assert [m[:2] for m in made] == [("local", None)]
    assert set(made[0][2].calls) == {("sink", "records_in")}
    assert r["throughput_rps"] == pytest.approx(1000, rel=0.1)
    assert r["sink_records"] == pytest.approx(1000 * r["window_s"], rel=0.1)
    assert len(r["runs"][0]["sink_series"]) >= 2  # one sample a second, for the throughput plot


def test_cli_writes_the_results_folder_and_compares_with_local(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "results"
    monkeypatch.setenv("SPILLOVER_BENCH_CLI_OUT", str(out))  # the environment twin
    monkeypatch.setenv("SPILLOVER_BENCH_CLI_SINK_RATE", "20000")
    argv = ["bench", "--executor", "local", "--policies", "none,unaligned"]
    argv += ["--compare-local", "unaligned"]
    argv += ["--duration", "1.5", "--warmup", "0.5", "--interval-ms", "200", "--repeat", "1"]
    assert main(argv) == 0
    std = capsys.readouterr()
    # Not a terminal: one plain progress line per run, on stderr.
    assert std.err.splitlines() == [
        "[1/3] local none: 2 s (total 0/6 s)",
        "[2/3] local unaligned: 2 s (total 2/6 s)",
        "[3/3] local unaligned: 2 s (total 4/6 s)",
    ]
    assert "local unaligned:" in std.out and "(local comparison)" in std.out

    results = json.loads((out / "bench.json").read_text())
    assert results["spec"]["sink_rate"] == 20_000 and results["spec"]["compare_local"] == [
        "unaligned"
    ]
    assert list(results["policies"]) == ["none", "unaligned"]
    assert list(results["local"]) == ["unaligned"]
    vs = results["comparison"]["executor_vs_local"]
    assert list(vs) == ["unaligned"] and vs["unaligned"]["ratio"] > 0
    assert results["comparison"]["executor_cost_target"] == 0.10

    with open(out / "bench.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == RUN_COLUMNS
    assert [(r["executor"], r["policy"]) for r in rows] == [
        ("local", "none"),
        ("local", "unaligned"),
        ("local", "unaligned"),
    ]
    assert float(rows[1]["vs_local"]) == vs["unaligned"]["ratio"]
    with open(out / "checkpoints.csv", newline="") as f:
        cps = list(csv.DictReader(f))
    runs = bench.runs(results)
    assert len(cps) == sum(len(r["checkpoint_list"]) for r in runs) > 0
    assert {c["policy"] for c in cps} == {"unaligned"}  # "none" takes no checkpoints

    md = (out / "bench.md").read_text()
    assert "| local (comparison) | unaligned |" in md and "cost ≤ 10%" in md
    assert md in std.out  # the table printed is the table written
    for name in PLOTS:
        png = (out / name).read_bytes()
        assert png.startswith(PNG_MAGIC) and len(png) > 10_000, name


def _compared(sink_rate: float, spark_rps: float, local_rps: float) -> dict[str, Any]:
    """A report of ``none`` on spark and on local, sinks paced at ``sink_rate`` each."""
    spec = BenchSpec(policies=["none"], executor="spark", sink_rate=sink_rate)
    policies = {"none": PolicyResult("none", "spark", "stopped", 10.0, 0, spark_rps).to_dict()}
    local = {"none": PolicyResult("none", "local", "stopped", 10.0, 0, local_rps).to_dict()}
    return {
        "spec": spec.to_dict(),
        "executor": "spark",
        "policies": policies,
        "local": local,
        "comparison": bench.compare(policies, local, spec.sink_rate * spec.parallelism),
    }


def test_the_executor_verdict_says_what_paced_sinks_let_it_measure() -> None:
    # Sinks at 2 x 5,000 records/s held both runs back: the ratio is no cost.
    paced = _compared(5000, 9_700, 9_990)
    assert paced["comparison"]["executor_vs_local"]["none"]["paced"] is True
    md = to_markdown(paced)
    assert "| paced: keeps up (+2.9%) |" in md
    assert "10,000 records/s (5000 per subtask × 2)" in md and "whether spark keeps" in md
    assert "| paced: falls behind (+19.9%) |" in to_markdown(_compared(5000, 8_000, 9_990))
    # Sinks far above what the job reaches: a measured cost.
    unpaced = _compared(1e8, 300_000, 400_000)
    assert unpaced["comparison"]["executor_vs_local"]["none"]["paced"] is False
    md = to_markdown(unpaced)
    assert "| not met (+25.0%) |" in md and "Paced" not in md
    assert "| met (-10.0%) |" in to_markdown(_compared(1e8, 440_000, 400_000))


def test_progress_bar_redraws_one_line_on_a_terminal() -> None:
    stream = io.StringIO()
    bar = ProgressBar(runs=2, run_s=10, warmup_s=2, stream=stream, tty=True, width=10)
    bar.start("spark", "unaligned")
    bar.update(5)
    drawn = stream.getvalue()
    bar.clear()
    text = stream.getvalue()
    assert "\n" not in drawn.rstrip("\n")  # redrawn in place, never scrolls
    assert "[1/2] spark unaligned" in drawn
    assert "5/10 s measuring" in drawn and "total 5/20 s" in drawn
    assert text.endswith(("\x1b[2K", "\x1b[?25h"))  # removed for the lines that follow


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--duration", "0"], "--duration (env SPILLOVER_BENCH_CLI_DURATION)"),
        (["--executor", "yarn"], "--executor (env SPILLOVER_BENCH_CLI_EXECUTOR)"),
        (
            ["--executor", "local", "--master", "local[2]"],
            "--master (env SPILLOVER_BENCH_CLI_MASTER) needs the spark",
        ),
        (["--policies", "aligned,sideways"], "--policies (env SPILLOVER_BENCH_CLI_POLICIES)"),
        (
            ["--max-inflight-bytes", "plenty"],
            "--max-inflight-bytes (env SPILLOVER_BENCH_CLI_MAX_INFLIGHT_BYTES)",
        ),
        (["--payload-bytes", "0"], "--payload-bytes (env SPILLOVER_BENCH_CLI_PAYLOAD_BYTES)"),
        (["--segment-size", "48kb"], "--segment-size (env SPILLOVER_BENCH_CLI_SEGMENT_SIZE)"),
        (["--segment-size", "32mb"], "--segment-size (env SPILLOVER_BENCH_CLI_SEGMENT_SIZE)"),
        (["--slots", "0"], "--slots (env SPILLOVER_BENCH_CLI_SLOTS)"),
        (["-D", "taskmanager.network.memory.floating-buffers-per-gate"], "-D takes key=value"),
        (["-D", "taskmanager.network.memory.floating-buffers=2"], "'taskmanager.network"),
        (["-D", "taskmanager.network.memory.floating-buffers-per-gate=-1"], "floating-buffers"),
        # Keys the bench's flags set, under their own name or an alias: a -D would run
        # another policy or size under this one's name.
        (["-D", "execution.checkpointing.unaligned=true"], "--policies"),
        (["-D", "taskmanager.memory.segment-size=32kb"], "segment-size itself"),
        (
            ["--policies", "none", "--compare-local", "aligned"],
            "--compare-local (env SPILLOVER_BENCH_CLI_COMPARE_LOCAL)",
        ),
    ],
)
def test_bad_flags_fail_before_running_and_name_the_flag(
    argv: list[str], names: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--out", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spillover bench: error: ") and names in err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_a_bad_environment_value_names_its_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPILLOVER_BENCH_CLI_PARALLELISM", "two")
    assert main(["bench"]) == 2
    assert "bad --parallelism (env SPILLOVER_BENCH_CLI_PARALLELISM): 'two'" in (
        capsys.readouterr().err
    )


def test_a_bad_combination_names_both_flags_and_their_variables(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """BenchSpec's own check, worded by the command line: the flag at fault and the fix."""
    assert main(["bench", "--executor", "local", "--master", "local[2]"]) == 2
    err = capsys.readouterr().err
    assert "--master (env SPILLOVER_BENCH_CLI_MASTER) needs the spark executor" in err
    assert "add --executor spark (or SPILLOVER_BENCH_CLI_EXECUTOR=spark)" in err


def test_help_shows_every_environment_twin(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for env in ("EXECUTOR", "MASTER", "COMPARE_LOCAL", "PARALLELISM", "PAYLOAD_BYTES"):
        assert f"SPILLOVER_BENCH_CLI_{env}" in text
    for env in ("SINK_RATE", "INTERVAL_MS", "DURATION", "CHECKPOINT_DIR", "OUT"):
        assert f"SPILLOVER_BENCH_CLI_{env}" in text
    assert f"default {BenchSpec().duration_s:g}]" in text  # the defaults are BenchSpec's


def test_spark_compares_the_baseline_and_unaligned_with_local_by_default() -> None:
    spec = BenchSpec(executor="spark")
    assert spec.compare_local == ("none", "unaligned")
    assert spec.runs()[:3] == [("spark", "none"), ("local", "none"), ("spark", "aligned")]
    assert BenchSpec(executor="spark", policies=["aligned"]).compare_local == ()
    # Local against itself only when asked.
    assert BenchSpec(executor="local").compare_local == ()


def test_a_cluster_master_needs_shared_checkpoint_storage() -> None:
    with pytest.raises(ConfigError, match="checkpoint storage"):
        BenchSpec(executor="spark", master="spark://head:7077")
    BenchSpec(executor="spark", master="spark://head:7077", checkpoint_dir="s3://b/ckpt")
    BenchSpec(executor="spark", master="local[2]")  # one machine: a temporary dir will do
    with pytest.raises(ConfigError, match="spark executor"):
        BenchSpec(executor="local", master="local[2]")


def test_the_default_runs_on_the_embedded_spark_master_against_local(tmp_path: Path) -> None:
    """The README's main job: every policy on Spark, the baseline and unaligned again on
    the local executor, with Spark's throughput cost per policy."""
    spec = BenchSpec(
        policies=["none", "unaligned"],
        duration_s=2.0,
        warmup_s=1.0,
        interval_ms=200,
        sink_rate=20_000,
        checkpoint_dir=str(tmp_path),
        repeat=1,
    )
    assert spec.executor == "spark"
    results = run(spec)
    for policy in ("none", "unaligned"):
        r = results["policies"][policy]
        assert r["executor"] == "spark" and r["status"] == "stopped", r["failures"]
        assert r["throughput_rps"] > 0  # the sinks' counts reach the driver from the workers
        assert results["local"][policy]["throughput_rps"] > 0
        assert results["comparison"]["executor_vs_local"][policy]["ratio"] > 0
    assert results["policies"]["unaligned"]["checkpoints"] >= 1


def test_trigger_offsets_rebuilt_from_the_schedule() -> None:
    cps = [
        {"checkpoint_id": 2, "duration_ms": 300.0},
        {"checkpoint_id": 1, "duration_ms": 2500.0},  # longer than the interval
        {"checkpoint_id": 3, "duration_ms": 10.0},
    ]
    offsets, exact = trigger_offsets(cps, 1.0, 0.0)
    assert not exact and offsets == [3.5, 1.0, 4.5]
    exact_offsets, exact = trigger_offsets([{"checkpoint_id": 1, "trigger_ms": 12_500}], 1.0, 10.0)
    assert exact and exact_offsets == [2.5]


def test_spec_checks_policies() -> None:
    with pytest.raises(ConfigError, match="aligned named twice"):
        BenchSpec(policies=["aligned", "aligned"])
    with pytest.raises(ConfigError, match="sideways unknown"):
        BenchSpec(policies=["aligned", "sideways"])
    with pytest.raises(ConfigError, match="none given"):
        BenchSpec(policies=[])
    with pytest.raises(ConfigError, match="aligned not run"):
        BenchSpec(policies=["none"], compare_local=["aligned"])


def test_rounds_alternate_and_the_report_keeps_every_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Round 1 of every policy before round 2 of any, so drift on the machine touches
    every policy alike; the report gives the median over rounds with their spread, and
    its CSV files every run with its round."""
    order: list[str] = []

    def create(kind: str, job: Any, config: Any, *, master: str | None = None) -> Any:
        order.append(job.name.split("-")[2])  # bench-<executor>-<policy>-<id>
        return _ScriptedExecutor()

    monkeypatch.setattr(bench_run, "create_executor", create)
    spec = BenchSpec(
        policies=["none", "aligned"], duration_s=0.4, warmup_s=0.1, executor="local", repeat=2
    )
    lines: list[str] = []
    results = run(spec, progress=lines.append)
    assert order == ["none", "aligned", "none", "aligned"]
    assert [ln.split(":")[0] for ln in lines] == [
        "round 1/2",
        "round 1/2",
        "round 2/2",
        "round 2/2",
    ]
    r = results["policies"]["none"]
    assert r["rounds"] == 2 and [x["round"] for x in r["runs"]] == [1, 2]
    lo, hi = r["spread"]["throughput_rps"]
    assert lo <= r["throughput_rps"] <= hi
    assert "(min–max of 2 rounds)" in to_markdown(results)

    bench.write_results(results, str(tmp_path), plots=False)
    with open(tmp_path / "bench.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["policy"], r["round"]) for r in rows] == [
        ("none", "1"),
        ("none", "2"),
        ("aligned", "1"),
        ("aligned", "2"),
    ]


def _run(policy: str, round_: int, rps: float, durations: list[float]) -> dict[str, Any]:
    cps = [
        {
            "checkpoint_id": i + 1,
            "trigger_s": float(i + 1),
            "status": "completed",
            "duration_ms": d,
            "inflight_bytes": 1000 * (i + 1),
        }
        for i, d in enumerate(durations)
    ]
    r = PolicyResult(
        policy,
        "local",
        "stopped",
        10.0,
        int(rps * 10),
        rps,
        checkpoints=len(cps),
        checkpoint_duration_ms=bench_run._stats(durations),
        start_delay_ms=bench_run._stats(durations),
        alignment_ms=bench_run._stats(durations),
        inflight_bytes=bench_run._stats([c["inflight_bytes"] for c in cps], p90=False),
        checkpoint_list=cps,
        sink_series=[[1.0, rps], [2.0, 2 * rps]],
    )
    return {**r.to_dict(), "round": round_}


def test_a_policy_over_rounds_is_the_median_of_its_runs_with_their_spread() -> None:
    rounds = [
        _run("unaligned", 1, 9000, [10, 20, 30]),
        _run("unaligned", 2, 9500, [40, 50, 60]),
        _run("unaligned", 3, 8000, [5, 6, 7]),
    ]
    a = bench_run.aggregate(rounds)
    assert a["throughput_rps"] == 9000 and a["spread"]["throughput_rps"] == [8000, 9500]
    assert a["checkpoint_duration_ms"]["median"] == 20  # the median of 20, 50, 6
    assert a["spread"]["checkpoint_duration_ms.median"] == [6, 50]
    assert a["checkpoint_duration_ms"]["max"] == 60 and a["checkpoints"] == 9
    failed = {**_run("unaligned", 4, 1.0, []), "status": "failed", "failures": ["boom"]}
    b = bench_run.aggregate([*rounds, failed])
    assert b["status"] == "failed" and b["failures"] == ["round 4: boom"]
    assert b["throughput_rps"] == a["throughput_rps"]  # a failed round is not measured


def test_a_figure_only_later_rounds_have_is_aggregated_from_them() -> None:
    # A result without the figure (written before it existed) first, then two with it.
    old = _run("unaligned", 1, 9000, [10, 20, 30])
    old.pop("checkpoint_acked_ms")
    new = [_run("unaligned", n, 9000, [10, 20, 30]) for n in (2, 3)]
    for r, acked in zip(new, ([4.0, 8.0], [6.0, 12.0]), strict=True):
        r["checkpoint_acked_ms"] = bench_run._stats(acked)
    a = bench_run.aggregate([old, *new])
    assert a["checkpoint_acked_ms"]["median"] == 7.5  # the median of the runs' 6 and 9
    assert a["checkpoint_acked_ms"]["max"] == 12.0


def test_the_plots_draw_the_inflight_bound_and_the_sinks_cap() -> None:
    from spillover.benchmark.plots import figures

    spec = BenchSpec(
        policies=["none", "max-inflight"],
        executor="local",
        parallelism=3,
        sink_rate=2000,
        max_inflight_bytes=512 * 1024,
    )
    policies = {
        p: bench_run.aggregate([_run(p, 1, 5000, [1, 2]), _run(p, 2, 5500, [3, 4])])
        for p in spec.policies
    }
    results = {
        "spec": spec.to_dict(),
        "executor": "local",
        "policies": policies,
        "local": {},
        "comparison": bench.compare(policies, {}, spec.sink_rate * spec.parallelism),
    }

    def lines(name: str, figs: dict[str, Any]) -> dict[str, list[float]]:
        return {
            str(ln.get_label()): list(ln.get_ydata())
            for ax in figs[name].axes
            for ln in ax.get_lines()
        }

    figs = figures(results)
    bound = lines("inflight-bytes.png", figs)
    # KiB: 512 KiB per subtask, count's and sink's 3 subtasks each.
    assert set(bound["max-inflight bound: 512.0 KiB × 6 subtasks with inputs"]) == {512 * 6}
    assert set(lines("throughput.png", figs)["sinks' cap: 2000 records/s × 3"]) == {6000}
    # Without the max-inflight policy there is no bound to draw.
    results["policies"] = {"none": policies["none"]}
    assert not any("bound" in k for k in lines("inflight-bytes.png", figures(results)))


def test_d_options_reach_every_run_and_the_report(monkeypatch: pytest.MonkeyPatch) -> None:
    """``-D key=value``: each run's configuration has it, as Flink's ``-D`` sets a
    job's; bench.json records it, so a result says what it was measured with."""
    configs: list[tuple[str, Any]] = []

    def create(kind: str, job: Any, config: Any, *, master: str | None = None) -> Any:
        configs.append((kind, config))
        return _ScriptedExecutor()

    monkeypatch.setattr(bench_run, "create_executor", create)
    key = "taskmanager.network.memory.floating-buffers-per-gate"
    spec = BenchSpec(
        policies=["none", "unaligned"],
        executor="processes",
        compare_local=["unaligned"],
        duration_s=0.3,
        warmup_s=0.0,
        repeat=1,
        options={key: "3", "execution.checkpointing.tolerable-failed-checkpoints": 7},
    )
    results = run(spec)
    assert [k for k, _ in configs] == ["processes", "processes", "local"]
    for _, config in configs:
        assert config.network.floating_buffers_per_gate == 3
        assert config.checkpointing.tolerable_failed_checkpoints == 7
    assert configs[2][1].checkpointing.unaligned  # the bench's own keys stay its own
    assert results["spec"]["options"] == {
        key: "3",
        "execution.checkpointing.tolerable-failed-checkpoints": "7",
    }
    assert BenchSpec(policies=["none"]).to_dict()["options"] == {}


def test_slots_put_that_many_subtasks_of_each_operator_in_one_worker() -> None:
    """``--slots``: the job's workers host that many subtasks each (2 at parallelism 2:
    one worker, every channel in memory, as Flink's local MiniCluster runs the job),
    and the report's spec says so."""
    spec = BenchSpec(policies=["none", "unaligned"], executor="processes", slots=2, repeat=1)
    for policy in spec.policies:
        assert spec.config(policy, "/tmp/unused").deployment.task_slots == 2
    assert spec.to_dict()["slots"] == 2
    assert BenchSpec(policies=["none"]).config("none", "/tmp/unused").deployment.task_slots == 1
    with pytest.raises(ConfigError, match="slots"):
        BenchSpec(slots=0)
