"""bench/side_by_side.py keeps working: per-round figures become paired ratios, medians
and issue 34's verdicts; the runners' raw results are read; rounds alternate; and the
work floor (bench/bench_hotpath.py) runs every stage of the job."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from spillover.config import NetworkConfig
from spillover.config.units import parse_memory_size

BENCH = Path(__file__).resolve().parents[3] / "bench"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


sbs = _load("side_by_side")


def _rows(rounds: list[dict[str, float]]) -> dict[str, object]:
    return {r.figure.key: r for r in sbs.table(rounds)}


def test_ratios_are_paired_per_round_then_their_median() -> None:
    rounds = [
        {"spark_none": 6e6, "flink_none": 2e6},  # 3.0
        {"spark_none": 4e6, "flink_none": 4e6},  # 1.0
        {"spark_none": 9e6, "flink_none": 2e6},  # 4.5
    ]
    row = _rows(rounds)["spark_vs_flink"]
    assert row.values == pytest.approx((3.0, 1.0, 4.5))  # type: ignore[attr-defined]
    assert row.median == pytest.approx(3.0)  # type: ignore[attr-defined]
    assert row.verdict == "met"  # type: ignore[attr-defined]
    # The medians of the figures themselves: 6 M and 2 M.
    assert _rows(rounds)["spark_none"].median == pytest.approx(6e6)  # type: ignore[attr-defined]


def test_verdicts_follow_each_target_direction() -> None:
    rows = _rows(
        [
            {
                "spark_paced_median": 6.0,
                "spark_paced_p90": 9.0,
                "flink_paced_median": 20.0,
                "spark_none": 1e6,
                "spark_unaligned": 0.96e6,
                "local_none": 1e6,
                "local_unaligned": 0.9e6,
                "bare": 10e6,
                "floor": 2e6,
            }
        ]
    )
    verdicts = {k: r.verdict for k, r in rows.items()}  # type: ignore[attr-defined]
    assert verdicts["spark_paced_median"] == "not met"  # 6 > 5 ms
    assert verdicts["spark_paced_p90"] == "met"  # 9 <= 10 ms
    assert verdicts["spark_paced_vs_flink"] == "not met"  # 0.3 > 0.25
    assert verdicts["spark_ckpt_cost"] == "met"  # 0.96 >= 0.95
    assert verdicts["local_ckpt_cost"] == "not met"
    assert verdicts["spark_vs_bare"] == "not met"  # 0.1 < 0.3
    # Two cores' own work (2 M) is below 0.3 x the bare loop (3 M): the floor row says so.
    assert rows["floor_vs_bare"].median == pytest.approx(2 / 3)  # type: ignore[attr-defined]
    assert verdicts["floor_vs_bare"] == "not met"
    assert verdicts["spark_vs_floor"] == "–"  # context, no target
    assert verdicts["bare"] == "–"


def test_a_missing_figure_leaves_its_round_out_and_unmeasured_rows_away() -> None:
    rows = _rows([{"spark_none": 3e6, "flink_none": 1e6}, {"spark_none": 3e6}])
    row = rows["spark_vs_flink"]
    assert row.values == (pytest.approx(3.0), None)  # type: ignore[attr-defined]
    assert row.median == pytest.approx(3.0)  # type: ignore[attr-defined]
    assert "spark_paced_median" not in rows
    assert "flinkseg_none" not in rows
    no_data = sbs.Row(sbs.FIGURES[-1], (None, None))
    assert no_data.median is None and no_data.verdict == "–"


def test_render_gives_every_round_and_the_verdict() -> None:
    text = sbs.render(sbs.table([{"spark_paced_median": 4.2}, {"spark_paced_median": 5.4}]))
    line = next(
        x for x in text.splitlines() if x.startswith("| Spark paced unaligned checkpoint median")
    )
    assert "| 4.8 | 4.2, 5.4 | ≤ 5 | met |" in line


def _args(**kw: object) -> argparse.Namespace:
    base = {"duration": 8.0, "warmup": 4.0, "bare_records": 1000, "floor_batches": 4}
    return argparse.Namespace(**{**base, **kw})


def test_rounds_alternate_flink_first_then_last(tmp_path: Path) -> None:
    parts = ("flink", "spark", "spark1w", "local", "bare", "floor")
    first = [r.name for r in sbs.plan(parts, 1, _args(), tmp_path)]
    second = [r.name for r in sbs.plan(parts, 2, _args(), tmp_path)]
    seg = sbs._size_flag(NetworkConfig.segment_size)  # spillover's default, e.g. 512kb
    assert first[:3] == ["flink-unpaced-32kb-1", f"flink-unpaced-{seg}-1", "flink-paced-1"]
    assert second[-3:] == ["flink-unpaced-32kb-2", f"flink-unpaced-{seg}-2", "flink-paced-2"]
    assert first[3:] == [n[:-1] + "1" for n in second[:-3]]
    only = [r.part for r in sbs.plan(("local", "bare"), 1, _args(), tmp_path)]
    assert only == ["local", "bare"]
    spark = {r.name: r.command() for r in sbs.plan(("spark",), 1, _args(), tmp_path)}
    assert "--policies none,unaligned --sink-rate 100000000" in spark["spark-unpaced-1"]
    assert "--compare-local off --policies unaligned" in spark["spark-paced-1"]
    one = {r.name: r.command() for r in sbs.plan(("spark1w",), 1, _args(), tmp_path)}
    assert "--policies none --sink-rate 100000000 --slots 2" in one["spark1w-unpaced-1"]
    flink = {r.name: r.command() for r in sbs.plan(("flink",), 1, _args(), tmp_path)}
    assert "--segment-size 32kb" in flink["flink-unpaced-32kb-1"]
    assert f"--segment-size {seg}" in flink[f"flink-unpaced-{seg}-1"]
    assert parse_memory_size(seg) == NetworkConfig.segment_size


def _write_raw(run: object, tmp: Path) -> None:
    """What each runner writes, reduced to the fields the harness reads."""
    name, out = run.name, run.out  # type: ignore[attr-defined]
    if name.startswith("flink-paced"):
        doc = {
            "runs": [{"policy": "unaligned", "checkpoint_ms_median": 20, "checkpoint_ms_p90": 30}]
        }
        out.write_text(json.dumps(doc))
    elif name.startswith("flink-unpaced"):
        runs = [
            {"policy": "none", "sink_records_per_s": 2e6},
            {"policy": "unaligned", "sink_records_per_s": 1.9e6},
        ]
        out.write_text(json.dumps({"runs": runs}))
    elif name.startswith(("spark", "local")):  # spark1w too
        out.mkdir()
        if "-paced" in name:
            policies = {
                "unaligned": {
                    "status": "stopped",
                    "throughput_rps": 1e4,
                    "checkpoint_duration_ms": {"median": 8.0, "p90": 12.0},
                    "checkpoint_acked_ms": {"median": 4.5, "p90": 9.0},
                }
            }
        else:
            policies = {
                "none": {"status": "stopped", "throughput_rps": 5e6},
                "unaligned": {"status": "failed", "throughput_rps": 0.0},
            }
        (out / "bench.json").write_text(json.dumps({"policies": policies}))
    elif name.startswith("bare"):
        doc = {"benchmarks": [{"extra_info": {"records_per_s": 20e6}}]}
        out.write_text(json.dumps(doc))
    elif name.startswith("floor"):
        out.write_text(json.dumps({"two_core_sink_records_per_s": 9e6, "ns_per_record": 200.0}))


def test_raw_results_become_figures_and_failures_are_named(tmp_path: Path) -> None:
    parts = ("flink", "spark", "spark1w", "local", "bare", "floor")

    def execute(run: object, out: Path) -> bool:
        if run.name == "bare-2":  # type: ignore[attr-defined]
            return False
        _write_raw(run, out)
        return True

    measured, failed = sbs.run_all(
        lambda n: sbs.plan(parts, n, _args(), tmp_path), 2, tmp_path, execute
    )
    assert measured[0] == {
        "flink_none": 2e6,
        "flink_unaligned": 1.9e6,
        "flinkseg_none": 2e6,
        "flinkseg_unaligned": 1.9e6,
        "flink_paced_median": 20.0,
        "flink_paced_p90": 30.0,
        "spark_none": 5e6,  # the failed unaligned run gives no figure
        "spark_paced_median": 8.0,
        "spark_paced_p90": 12.0,
        "spark_paced_acked_median": 4.5,  # to the last ack, as Flink's figure is taken
        "spark_paced_acked_p90": 9.0,
        "spark1w_none": 5e6,  # one worker: the same job's figure under its own name
        "local_none": 5e6,
        "bare": 20e6,
        "floor": 9e6,
        "floor_ns": 200.0,
    }
    assert "bare" not in measured[1]
    assert failed == ["bare-2"]
    rows = _rows(measured)
    assert rows["spark_vs_flink"].median == pytest.approx(2.5)  # type: ignore[attr-defined]
    assert rows["spark1w_vs_flink"].median == pytest.approx(2.5)  # type: ignore[attr-defined]
    assert rows["spark_paced_vs_flink"].verdict == "not met"  # type: ignore[attr-defined]
    # Like for like (both to the last acknowledgement): 4.5 / 20 is within 0.25.
    acked = rows["spark_paced_acked_vs_flink"]
    assert acked.median == pytest.approx(0.225)  # type: ignore[attr-defined]
    assert acked.verdict == "met"  # type: ignore[attr-defined]
    assert rows["spark_paced_acked_median"].verdict == "met"  # type: ignore[attr-defined]


@pytest.mark.parametrize("staged", [False, True])
def test_the_work_floor_runs_every_stage_of_the_job(staged: bool) -> None:
    hotpath = _load("bench_hotpath")
    measure = hotpath.work_floor_staged if staged else hotpath.work_floor
    floor = measure(batches=4, passes=1)  # raises unless the sinks took every row made
    assert list(floor.stage_ns) == ["generate", "route", "receive", "keyed", "emit", "sink"]
    assert floor.records == 4 * 1024 and floor.staged is staged
    assert 0 < floor.sink_records <= floor.records  # one row per key a batch touched
    assert all(ns >= 0 for ns in floor.stage_ns.values())
    assert floor.sink_records_per_s(2) == pytest.approx(
        2 * floor.records_per_s(1) * floor.sink_records / floor.records
    )
