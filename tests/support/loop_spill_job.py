"""Runs the doubling loop (``loops.doubling_job``) in a process of its own and prints
what a test checks as JSON: how it ended, its output totals, the bytes its feedback
spilled and the process's peak RSS. ``python loop_spill_job.py RECORDS GENERATIONS``."""

from __future__ import annotations

import json
import resource
import sys
import tempfile

from loops import TINY_NETWORK, doubling_job

from spillover.config import Config
from spillover.deploy.local import LocalExecutor


def main() -> None:
    records, generations = int(sys.argv[1]), int(sys.argv[2])
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Config.from_dict({**TINY_NETWORK, "io.tmp.dirs": tmp})
        result = LocalExecutor(doubling_job("doubling", records, generations), cfg).run(timeout=600)
    tasks = result.tasks.values()
    print(
        json.dumps(
            {
                "status": result.status,
                "exits": sum(m.get("exits", 0) for m in tasks),
                "id_sum": sum(m.get("id_sum", 0) for m in tasks),
                "spilled": sum(m.get("feedback_spilled_bytes", 0) for m in tasks),
                "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            }
        )
    )


if __name__ == "__main__":
    main()
