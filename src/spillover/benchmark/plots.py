"""The three plots: checkpoint duration over time per policy, persisted
in-flight bytes, sink throughput."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any

from spillover.benchmark.results import _fmt_bytes
from spillover.benchmark.spec import (
    INPUT_OPERATORS,
    SAMPLE_EVERY_S,
)
from spillover.config.policies import POLICIES

PLOTS = ("checkpoint-duration.png", "inflight-bytes.png", "throughput.png")


def plot(results: dict[str, Any], out_dir: str) -> list[str]:
    """Draws :data:`PLOTS` into ``out_dir`` from a report (also one read back from
    ``bench.json``): checkpoint duration and persisted in-flight bytes per checkpoint
    over time, one series per policy (every round); sink throughput per policy and
    executor, and over time per run. Returns the paths written."""
    return [_save(fig, out_dir, name) for name, fig in figures(results).items()]


def figures(results: dict[str, Any]) -> dict[str, Any]:
    """The matplotlib figures of :data:`PLOTS`, by file name. The in-flight plot
    draws the max-inflight policy's bound and the throughput plot the sinks' cap as
    labelled horizontal lines."""
    from matplotlib.figure import Figure  # lazily: only the plots need matplotlib

    spec = results["spec"]
    ex = results.get("executor", spec["executor"])
    colors = {p: f"C{i}" for i, p in enumerate(POLICIES)}
    warmup, end = spec["warmup_s"], spec["warmup_s"] + spec["duration_s"]
    setting = (
        f"parallelism {spec['parallelism']}, checkpoint every {spec['interval_ms']} ms, "
        f"sink {spec['sink_rate']:g} records/s per subtask"
    )
    with_cps = [r for r in results["policies"].values() if r["policy"] != "none"]
    figs: dict[str, Any] = {}

    def checkpoint_plot(
        title: str,
        ylabel: str,
        value: Callable[[dict[str, Any]], float],
        bound: tuple[float, str] | None = None,
    ) -> Any:
        fig = Figure(figsize=(9, 4.8), layout="constrained")
        ax = fig.add_subplot()
        ax.axvspan(0, warmup, color="0.92", label="warm-up (not measured)")
        for p in with_cps:
            marked = False  # one legend entry for a policy's aborted checkpoints
            for k, r in enumerate(p.get("runs", [p])):
                cps = sorted(r["checkpoint_list"], key=lambda c: c["trigger_s"])
                done = [c for c in cps if c["status"] == "completed"]
                ax.plot(
                    [c["trigger_s"] for c in done],
                    [value(c) for c in done],
                    "o-",
                    ms=3,
                    lw=1,
                    alpha=1.0 if k == 0 else 0.5,
                    color=colors[p["policy"]],
                    label=_rounds_label(p) if k == 0 else None,
                )
                aborted = [c for c in cps if c["status"] != "completed"]
                if aborted:
                    ax.plot(
                        [c["trigger_s"] for c in aborted],
                        [value(c) for c in aborted],
                        "x",
                        color=colors[p["policy"]],
                        label=None if marked else f"{p['policy']}, aborted",
                    )
                    marked = True
        if bound is not None:
            ax.axhline(bound[0], color=colors["max-inflight"], ls="--", lw=1, label=bound[1])
        ax.set_xlim(0, end)
        ax.set_xlabel("checkpoint trigger, seconds since the run started")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title} ({ex} executor)\n{setting}", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
        return fig

    fig = checkpoint_plot(
        "Checkpoint duration, trigger to last acknowledgement",
        "duration (ms, log scale)",
        lambda c: max(float(c["duration_ms"]), 0.1),
    )
    fig.axes[0].set_yscale("log")
    figs["checkpoint-duration.png"] = fig
    bound = None
    if "max-inflight" in results["policies"]:
        # The bound holds per subtask, on the input state: the plot sums every subtask.
        inputs = INPUT_OPERATORS * spec["parallelism"]
        per = spec["max_inflight_bytes"]
        bound = (
            per * inputs / 1024,
            f"max-inflight bound: {_fmt_bytes(per)} × {inputs} subtasks with inputs",
        )
    figs["inflight-bytes.png"] = checkpoint_plot(
        "In-flight bytes persisted per checkpoint, all subtasks",
        "in-flight bytes (KiB)",
        lambda c: float(c["inflight_bytes"]) / 1024,
        bound,
    )

    fig = Figure(figsize=(12, 4.8), layout="constrained")
    bars, series = fig.subplots(1, 2, width_ratios=(1, 1.4))
    local = results.get("local", {})
    names = list(results["policies"])
    groups = [(ex, results["policies"])] + ([("local", local)] if local else [])
    width = 0.8 / len(groups)
    for g, (kind, runs) in enumerate(groups):
        xs = [i + (g - (len(groups) - 1) / 2) * width for i, p in enumerate(names) if p in runs]
        ys = [runs[p]["throughput_rps"] for p in names if p in runs]
        label = kind if g == 0 else "local (comparison)"
        spreads = [
            runs[p].get("spread", {}).get("throughput_rps") or [y, y]
            for p, y in zip([p for p in names if p in runs], ys, strict=True)
        ]
        yerr = [
            [y - lo for (lo, _), y in zip(spreads, ys, strict=True)],
            [hi - y for (_, hi), y in zip(spreads, ys, strict=True)],
        ]
        drawn = bars.bar(
            xs,
            ys,
            width,
            yerr=yerr,  # the spread over rounds, min to max
            capsize=3,
            label=label,
            color=f"C{g}",
            alpha=0.85 if g == 0 else 0.5,
        )
        bars.bar_label(drawn, fmt="{:,.0f}", fontsize=7)
    cap = spec["sink_rate"] * spec["parallelism"]
    cap_label = f"sinks' cap: {spec['sink_rate']:g} records/s × {spec['parallelism']}"
    bars.axhline(cap, color="0.3", ls="--", lw=1, label=cap_label)
    bars.set_xticks(range(len(names)), names)
    bars.set_ylabel("sink records/s")
    bars.set_title("Per policy, measured window", fontsize=10)
    bars.legend(fontsize=8, loc="lower right")
    bars.grid(True, axis="y", alpha=0.3)
    series.axvspan(0, warmup, color="0.92", label="warm-up")
    for g, (_, runs) in enumerate(groups):
        for p in runs.values():
            for k, r in enumerate(p.get("runs", [p])):
                pairs = list(itertools.pairwise([[0.0, 0], *r["sink_series"]]))
                ts = [(a[0] + b[0]) / 2 for a, b in pairs]
                rates = [(b[1] - a[1]) / (b[0] - a[0]) if b[0] > a[0] else 0.0 for a, b in pairs]
                label = p["policy"] if g == 0 else f"{p['policy']}, local"
                series.plot(
                    ts,
                    rates,
                    "-" if g == 0 else "--",
                    lw=1,
                    alpha=1.0 if k == 0 else 0.5,
                    color=colors[p["policy"]],
                    label=label if k == 0 else None,
                )
    series.axhline(cap, color="0.3", ls="--", lw=1, label=cap_label)
    series.set_xlim(0, end)
    series.set_ylim(bottom=0)
    series.set_xlabel("seconds since the run started")
    series.set_ylabel(f"sink records/s, over {SAMPLE_EVERY_S:g} s")
    series.set_title("Sink throughput over time", fontsize=10)
    fig.suptitle(f"Sink throughput ({setting})", fontsize=10)
    series.grid(True, alpha=0.3)
    series.legend(fontsize=8, ncol=2)
    figs["throughput.png"] = fig
    return figs


def _rounds_label(p: dict[str, Any]) -> str:
    n = int(p.get("rounds", 1))
    return p["policy"] if n < 2 else f"{p['policy']} ({n} rounds)"


def _save(fig: Any, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    return path
