"""The three plots: checkpoint duration over time per policy, persisted
in-flight bytes, sink throughput."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any

from spillover.benchmark.spec import (
    SAMPLE_EVERY_S,
)
from spillover.config.policies import POLICIES

PLOTS = ("checkpoint-duration.png", "inflight-bytes.png", "throughput.png")


def plot(results: dict[str, Any], out_dir: str) -> list[str]:
    """Draws :data:`PLOTS` into ``out_dir`` from a report (also one read back from
    ``bench.json``): checkpoint duration and persisted in-flight bytes per checkpoint
    over time, one series per policy; sink throughput per policy and executor, and
    over time per run. Returns the paths written."""
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
    paths = []

    def checkpoint_plot(title: str, ylabel: str, value: Callable[[dict[str, Any]], float]) -> Any:
        fig = Figure(figsize=(9, 4.8), layout="constrained")
        ax = fig.add_subplot()
        ax.axvspan(0, warmup, color="0.92", label="warm-up (not measured)")
        for r in with_cps:
            cps = sorted(r["checkpoint_list"], key=lambda c: c["trigger_s"])
            done = [c for c in cps if c["status"] == "completed"]
            ax.plot(
                [c["trigger_s"] for c in done],
                [value(c) for c in done],
                "o-",
                ms=3,
                lw=1,
                color=colors[r["policy"]],
                label=r["policy"],
            )
            aborted = [c for c in cps if c["status"] != "completed"]
            if aborted:
                ax.plot(
                    [c["trigger_s"] for c in aborted],
                    [value(c) for c in aborted],
                    "x",
                    color=colors[r["policy"]],
                    label=f"{r['policy']}, aborted",
                )
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
    paths.append(_save(fig, out_dir, "checkpoint-duration.png"))
    fig = checkpoint_plot(
        "In-flight bytes persisted per checkpoint, all subtasks",
        "in-flight bytes (KiB)",
        lambda c: float(c["inflight_bytes"]) / 1024,
    )
    paths.append(_save(fig, out_dir, "inflight-bytes.png"))

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
        drawn = bars.bar(xs, ys, width, label=label, color=f"C{g}", alpha=0.85 if g == 0 else 0.5)
        bars.bar_label(drawn, fmt="{:,.0f}", fontsize=7)
    bars.set_xticks(range(len(names)), names)
    bars.set_ylabel("sink records/s")
    bars.set_title("Per policy, measured window", fontsize=10)
    bars.legend(fontsize=8, loc="lower right")
    bars.grid(True, axis="y", alpha=0.3)
    series.axvspan(0, warmup, color="0.92", label="warm-up")
    for g, (_, runs) in enumerate(groups):
        for r in runs.values():
            pairs = list(itertools.pairwise([[0.0, 0], *r["sink_series"]]))
            ts = [(a[0] + b[0]) / 2 for a, b in pairs]
            rates = [(b[1] - a[1]) / (b[0] - a[0]) if b[0] > a[0] else 0.0 for a, b in pairs]
            series.plot(
                ts,
                rates,
                "-" if g == 0 else "--",
                lw=1,
                color=colors[r["policy"]],
                label=r["policy"] if g == 0 else f"{r['policy']}, local",
            )
    series.set_xlim(0, end)
    series.set_ylim(bottom=0)
    series.set_xlabel("seconds since the run started")
    series.set_ylabel(f"sink records/s, over {SAMPLE_EVERY_S:g} s")
    series.set_title("Sink throughput over time", fontsize=10)
    fig.suptitle(f"Sink throughput ({setting})", fontsize=10)
    series.grid(True, alpha=0.3)
    series.legend(fontsize=8, ncol=2)
    paths.append(_save(fig, out_dir, "throughput.png"))
    return paths


def _save(fig: Any, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    return path
