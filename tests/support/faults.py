"""The fault-injecting filesystem of the storage-fault tests; it lives in
:mod:`spillover.chaos.faults`, which ``spillover chaos`` uses too."""

from __future__ import annotations

from spillover.chaos.faults import (
    Faults,
    FaultyHandler,
    Rule,
    enospc,
    fail,
    failing_renames,
    faulty_dir,
    hold,
)

__all__ = [
    "Faults",
    "FaultyHandler",
    "Rule",
    "enospc",
    "fail",
    "failing_renames",
    "faulty_dir",
    "hold",
]
