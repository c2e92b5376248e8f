"""Reading a bench report: its runs, and how its figures print."""

from __future__ import annotations

from typing import Any


def policies(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every policy's figures over its rounds: the bench executor's, then the local
    comparison's."""
    return [*results["policies"].values(), *results.get("local", {}).values()]


def runs(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every single run of a report, each with its ``round``: the bench executor's,
    then the local comparison's, policy by policy."""
    return [r for p in policies(results) for r in p.get("runs", [p])]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:,.0f}" if v >= 10 else f"{v:.1f}"
