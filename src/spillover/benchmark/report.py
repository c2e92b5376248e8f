"""The results as markdown, CSV and JSON files."""

from __future__ import annotations

import csv
import json
import os
from typing import Any

from spillover.benchmark.plots import (
    plot,
)
from spillover.benchmark.results import _fmt_bytes, _ms, runs
from spillover.benchmark.spec import (
    PACED_SHARE,
)


def _with_spread(text: str, lo_hi: list[float] | None, fmt: Any, rounds: int) -> str:
    """``text (min–max)`` when there are several rounds and they differ."""
    if rounds < 2 or lo_hi is None:
        return text
    lo, hi = (fmt(v) for v in lo_hi)
    return f"{text} ({lo}–{hi})"


def to_markdown(results: dict[str, Any]) -> str:
    """A table with one row per policy and executor (the median over rounds, the
    spread of the rounds in brackets), the ratios and their targets, then the
    executor's throughput against the local executor's when compared."""
    rounds = int(results["spec"].get("repeat", 1))
    per = f" (min–max of {rounds} rounds)" if rounds > 1 else ""
    rows = [
        f"| executor | policy | checkpoints | aborted | duration median{per} "
        f"| duration p90{per} | duration max (ms) | to the last ack median / p90 (ms) "
        "| start delay median / p90 (ms) | alignment median / p90 (ms) "
        f"| in-flight median{per} / max | sink records/s{per} |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    tagged = [(r, "") for r in results["policies"].values()]
    tagged += [(r, " (comparison)") for r in results.get("local", {}).values()]
    for r, tag in tagged:
        name = r["policy"]
        acked = r.get("checkpoint_acked_ms", {})
        d, s, a, i = (
            r["checkpoint_duration_ms"],
            r["start_delay_ms"],
            r["alignment_ms"],
            r["inflight_bytes"],
        )
        spread = r.get("spread", {})
        n = int(r.get("rounds", 1))

        def ms(metric: str, stat: str, v: float | None, n: int = n, spread: Any = spread) -> str:
            return _with_spread(_ms(v), spread.get(f"{metric}.{stat}"), _ms, n)

        if name == "none":
            cells = ["–"] * 9
        else:
            inflight = (
                "–"
                if i["median"] is None
                else _with_spread(
                    _fmt_bytes(i["median"]), spread.get("inflight_bytes.median"), _fmt_bytes, n
                )
                + f" / {_fmt_bytes(i['max'])}"
            )
            cells = [
                str(r["checkpoints"]),
                str(r["aborted"]) + (f" (+{r['cut_off']} cut off)" if r["cut_off"] else ""),
                ms("checkpoint_duration_ms", "median", d["median"]),
                ms("checkpoint_duration_ms", "p90", d["p90"]),
                _ms(d["max"]),
                ms("checkpoint_acked_ms", "median", acked.get("median"))
                + " / "
                + ms("checkpoint_acked_ms", "p90", acked.get("p90")),
                f"{_ms(s['median'])} / {_ms(s['p90'])}",
                f"{_ms(a['median'])} / {_ms(a['p90'])}",
                inflight,
            ]
        label = f"{name} (failed)" if r["status"] == "failed" else name
        rps = _with_spread(
            f"{r['throughput_rps']:,.0f}", spread.get("throughput_rps"), "{:,.0f}".format, n
        )
        rows.append(f"| {r['executor']}{tag} | {label} | " + " | ".join(cells) + f" | {rps} |")
    c = results["comparison"]
    lines = [*rows, ""]
    if c["aligned_to_unaligned_median_duration"] is not None:
        met = "met" if c["duration_target_met"] else "not met"
        lines.append(
            f"- aligned / unaligned median checkpoint duration: "
            f"{c['aligned_to_unaligned_median_duration']:,.1f}× "
            f"(target ≥ {c['duration_target']:g}×: {met})"
        )
    if c["unaligned_to_none_throughput"] is not None:
        met = "met" if c["throughput_target_met"] else "not met"
        lines.append(
            f"- unaligned / no-checkpoint sink throughput: "
            f"{c['unaligned_to_none_throughput']:.3f}× "
            f"(target ≥ {c['throughput_target']:g}×: {met})"
        )
    vs = c.get("executor_vs_local") or {}
    if vs:
        ex = results.get("executor", results["spec"]["executor"])
        target = f"cost ≤ {c['executor_cost_target']:.0%}"
        lines += [
            "",
            f"| policy | {ex} records/s | local (comparison) records/s | {ex} / local | {target} |",
            "|---|---:|---:|---:|---|",
        ]
        for policy, v in vs.items():
            ratio = "–" if v["ratio"] is None else f"{v['ratio']:.3f}×"
            if v["target_met"] is None:
                verdict = "–"
            elif v.get("paced"):
                verdict = f"paced: {'keeps up' if v['target_met'] else 'falls behind'}"
            else:
                verdict = "met" if v["target_met"] else "not met"
            if v["cost"] is not None:
                verdict += f" ({v['cost']:+.1%})"
            lines.append(
                f"| {policy} | {v['throughput_rps'] or 0:,.0f} "
                f"| {v['local_throughput_rps'] or 0:,.0f} | {ratio} | {verdict} |"
            )
        paced = [p for p, v in vs.items() if v.get("paced")]
        if paced:
            spec = results["spec"]
            lines += [
                "",
                f"- Paced ({', '.join(paced)}): the sinks take at most "
                f"{c['sink_pace_rps']:,.0f} records/s ({spec['sink_rate']:g} per subtask × "
                f"{spec['parallelism']}) and a run reached {PACED_SHARE:.0%} of that, so both "
                f"executors were held to it: the ratio says whether {ex} keeps the pace, not "
                "what it costs. For a cost, give --sink-rate above what the job reaches.",
            ]
    return "\n".join(lines).rstrip() + "\n"


RUN_COLUMNS = (
    "executor",
    "policy",
    "round",
    "status",
    "window_s",
    "sink_records",
    "throughput_rps",
    "vs_local",
    "checkpoints",
    "aborted",
    "cut_off",
    *(f"duration_ms_{k}" for k in ("median", "p90", "max")),
    *(f"acked_ms_{k}" for k in ("median", "p90", "max")),
    *(f"start_delay_ms_{k}" for k in ("median", "p90", "max")),
    *(f"alignment_ms_{k}" for k in ("median", "p90", "max")),
    "inflight_bytes_median",
    "inflight_bytes_max",
    "source_backpressured_share",
)
CHECKPOINT_COLUMNS = (
    "executor",
    "policy",
    "round",
    "checkpoint_id",
    "trigger_s",
    "in_window",
    "status",
    "duration_ms",
    "acked_ms",
    "start_delay_ms",
    "alignment_ms",
    "inflight_bytes",
    "state_bytes",
    "reason",
)


def _run_row(r: dict[str, Any], local: dict[str, Any] | None) -> dict[str, Any]:
    """One run's row; ``local``: the local comparison's run of the same round."""
    row = {k: r[k] for k in RUN_COLUMNS if k in r}
    there = local["throughput_rps"] if local is not None else 0
    row["vs_local"] = round(r["throughput_rps"] / there, 3) if there else ""
    for metric, prefix in (
        ("checkpoint_duration_ms", "duration_ms"),
        ("checkpoint_acked_ms", "acked_ms"),
        ("start_delay_ms", "start_delay_ms"),
        ("alignment_ms", "alignment_ms"),
        ("inflight_bytes", "inflight_bytes"),
    ):
        for k, v in r.get(metric, {}).items():
            row[f"{prefix}_{k}"] = "" if v is None else v
    return row


def write_results(results: dict[str, Any], out_dir: str, plots: bool = True) -> list[str]:
    """Writes the report into ``out_dir`` (created): ``bench.json``, ``bench.md``,
    ``bench.csv`` (one row per run, every round), ``checkpoints.csv`` (one row per
    checkpoint of every run) and,
    with ``plots``, the PNGs of :func:`plot`. Returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, n) for n in ("bench.json", "bench.md")]
    with open(paths[0], "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
    with open(paths[1], "w") as f:
        f.write(to_markdown(results))
    path = os.path.join(out_dir, "bench.csv")
    local = {
        (r["policy"], r.get("round", 1)): r
        for p in results.get("local", {}).values()
        for r in p.get("runs", [p])
    }
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, RUN_COLUMNS)
        w.writeheader()
        for p in results["policies"].values():
            for r in p.get("runs", [p]):
                w.writerow(_run_row(r, local.get((r["policy"], r.get("round", 1)))))
        for p in results.get("local", {}).values():
            for r in p.get("runs", [p]):
                w.writerow(_run_row(r, None))
    paths.append(path)
    path = os.path.join(out_dir, "checkpoints.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, CHECKPOINT_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in runs(results):
            for c in r["checkpoint_list"]:
                w.writerow(
                    {
                        **c,
                        "executor": r["executor"],
                        "policy": r["policy"],
                        "round": r.get("round", 1),
                    }
                )
    paths.append(path)
    if plots:
        paths += plot(results, out_dir)
    return paths
