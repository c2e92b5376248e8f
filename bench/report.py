"""Markdown summary of a storage benchmark run, checked against the tracker's targets.

    python bench/report.py BENCH.json [--check]

``BENCH.json`` comes from ``pytest bench --benchmark-only --benchmark-json BENCH.json``.
Rates are payload bytes over the median round time, in GB/s (10^9 bytes per second);
ratios compare benchmarks of the same group, so of the same run and the same data.
``--check`` exits with 1 when a target fails or has no measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROLE_ORDER = {"raw": 0, "codec": 1, "reference": 2, "engine": 3}


@dataclass
class Result:
    group: str
    name: str
    role: str
    op: str
    codec: str
    buffer_bytes: int
    median: float
    rate: float | None  # payload bytes per second
    info: dict[str, Any]

    @property
    def size(self) -> str:
        return f"{self.buffer_bytes // 1024} KiB"


def load(path: Path) -> tuple[dict[str, Any], list[Result], int]:
    """The run's metadata, its storage results, and how many other benchmarks it holds."""
    data = json.loads(path.read_text())
    results, others = [], 0
    for b in data["benchmarks"]:
        info = b.get("extra_info", {})
        if "op" not in info:
            others += 1
            continue
        median = b["stats"]["median"]
        rate = info["bytes"] / median if info.get("op") != "retrieve-rss" else None
        results.append(
            Result(
                b["group"] or "",
                b["name"],
                info.get("role", ""),
                info["op"],
                info.get("codec", "none"),
                int(info.get("buffer_bytes", 0)),
                median,
                rate,
                info,
            )
        )
    order = {g: i for i, g in reversed(list(enumerate(r.group for r in results)))}
    results.sort(key=lambda r: (order[r.group], ROLE_ORDER.get(r.role, 9), r.name))
    return data, results, others


def _baseline(results: list[Result], of: Result, role: str) -> Result | None:
    return next((r for r in results if r.group == of.group and r.role == role), None)


def _ratio(results: list[Result], r: Result, role: str) -> float | None:
    base = _baseline(results, r, role)
    if base is None or base.rate is None or r.rate is None or base is r:
        return None
    return r.rate / base.rate


def _fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{suffix}"


def throughput_table(results: list[Result]) -> list[str]:
    lines = [
        "| group | benchmark | role | GB/s | × raw or codec | × reference |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in results:
        if r.rate is None:
            continue
        first = "raw" if _baseline(results, r, "raw") else "codec"
        vs_first = _ratio(results, r, first) if r.role in ("reference", "engine") else None
        vs_ref = _ratio(results, r, "reference") if r.role == "engine" else None
        lines.append(
            f"| {r.group} | {r.name} | {r.role} | {r.rate / 1e9:.2f} "
            f"| {_fmt(vs_first, '.2f', '×')} | {_fmt(vs_ref, '.2f', '×')} |"
        )
    return lines


def rss_table(results: list[Result]) -> list[str]:
    lines = [
        "| buffers | file | read-ahead window | RSS before | peak growth | growth / window |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    mib = 1024 * 1024
    for r in results:
        if r.op != "retrieve-rss":
            continue
        i = r.info
        lines.append(
            f"| {r.size} | {i['bytes'] / mib:.0f} MiB | {i['read_ahead_bytes'] / mib:.1f} MiB "
            f"| {i['rss_baseline_bytes'] / mib:.1f} MiB | {i['rss_growth_bytes'] / mib:.1f} MiB "
            f"| {i['growth_per_window']:.2f}× |"
        )
    return lines


@dataclass
class Target:
    title: str
    select: Callable[[Result], bool]
    measure: Callable[[list[Result], Result], float | None]
    passes: Callable[[float], bool]
    required: str
    unit: str = "×"


TARGETS = [
    Target(
        "uncompressed append vs raw write",
        lambda r: r.op == "append" and r.codec == "none" and r.role == "engine",
        lambda rs, r: _ratio(rs, r, "raw"),
        lambda x: x >= 0.85,
        "≥ 0.85×",
    ),
    Target(
        "retrieval vs raw read",
        lambda r: r.op == "retrieve" and r.role == "engine",
        lambda rs, r: _ratio(rs, r, "raw"),
        lambda x: x >= 0.85,
        "≥ 0.85×",
    ),
    Target(
        "uncompressed 4 KiB buffers vs pure-Python reference",
        lambda r: (
            r.op in ("append", "retrieve")
            and r.codec == "none"
            and r.role == "engine"
            and r.buffer_bytes == 4096
        ),
        lambda rs, r: _ratio(rs, r, "reference"),
        lambda x: x >= 5,
        "≥ 5×",
    ),
    Target(
        "lz4 append vs lz4.block.compress alone",
        lambda r: r.op == "append" and r.codec == "lz4" and r.role == "engine",
        lambda rs, r: _ratio(rs, r, "codec"),
        lambda x: x >= 0.85,
        "≥ 0.85×",
    ),
    Target(
        "retrieval peak RSS growth / read-ahead window",
        lambda r: r.op == "retrieve-rss",
        lambda rs, r: r.info.get("growth_per_window"),
        lambda x: x < 2,
        "< 2×",
    ),
]


def target_rows(results: list[Result]) -> Iterable[tuple[str, str, str, str, bool]]:
    """(target, measurement, value, required, passed) for every target and measurement."""
    for t in TARGETS:
        chosen = [r for r in results if t.select(r)]
        if not chosen:
            yield t.title, "no measurement", "–", t.required, False
        for r in chosen:
            x = t.measure(results, r)
            ok = x is not None and t.passes(x)
            yield t.title, r.name, _fmt(x, ".2f", t.unit), t.required, ok


def report(path: Path) -> tuple[str, bool]:
    """The markdown text, and whether every target passed."""
    data, results, others = load(path)
    commit = data.get("commit_info", {})
    cpu = data.get("machine_info", {}).get("cpu", {}).get("brand_raw", "unknown CPU")
    caches = sorted({str(r.info["cache"]) for r in results if "cache" in r.info})
    sizes = sorted({int(r.info["bytes"]) for r in results if r.rate is not None})
    lines = [
        f"Run of {data.get('datetime', '?')} at commit {commit.get('id', '?')[:10]}"
        f"{' (dirty)' if commit.get('dirty') else ''}, {cpu}, "
        f"{data.get('machine_info', {}).get('python_version', '?')}; "
        f"{', '.join(f'{s / 2**20:.0f} MiB' for s in sizes) or '?'} per measurement; "
        f"reads {', '.join(caches) or '?'}.",
        "",
        "### Throughput (median round)",
        "",
        *throughput_table(results),
        "",
        "### Retrieval memory",
        "",
        *rss_table(results),
        "",
        "### Targets",
        "",
        "| target | measurement | value | required | result |",
        "|---|---|---:|---|---|",
    ]
    all_ok = True
    for title, what, value, required, ok in target_rows(results):
        all_ok &= ok
        lines.append(f"| {title} | {what} | {value} | {required} | {'pass' if ok else 'FAIL'} |")
    if others:
        lines += ["", f"({others} benchmarks of other suites are not summarised here.)"]
    return "\n".join(lines) + "\n", all_ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", type=Path, help="pytest-benchmark JSON (--benchmark-json)")
    parser.add_argument("--check", action="store_true", help="exit 1 unless every target passes")
    args = parser.parse_args(argv)
    text, ok = report(args.json)
    sys.stdout.write(text)
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
