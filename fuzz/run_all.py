"""Runs every fuzz target for a number of inputs each and prints how many each ran.

    .venv/bin/python fuzz/run_all.py [--runs N] [--jobs J] [--target NAME ...] [-- flags]

By default about a million inputs in all (``BUDGET``: fewer for the targets that
read and write files, more for the pure parsers), two targets at a time; ``--runs``
gives every target the same number instead. Each target starts from its seed corpus
(``fuzz/corpus/<target>``) and its regressions (``fuzz/regressions/<target>``) and
runs in its own process; what it learns goes to a temporary directory, never into the
repository. A target that
finds a failure stops there: the input (``crash-*``, ``timeout-*``, ``oom-*``) and
the log are kept in the temporary directory this prints, to be copied into
``fuzz/regressions/<target>/``. Exits non-zero when a target failed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

FUZZ_DIR = Path(__file__).resolve().parent
# Inputs per target: 1,000,000 in all.
BUDGET = {
    "native_reader": 100_000,
    "reference_reader": 150_000,
    "handle": 250_000,
    "metadata": 150_000,
    "event_log": 100_000,
    "lease": 250_000,
}
TARGETS = list(BUDGET)
_EXECUTED = re.compile(r"stat::number_of_executed_units: (\d+)")


def seed_dirs(target: str) -> list[str]:
    dirs = [FUZZ_DIR / "corpus" / target, FUZZ_DIR / "regressions" / target]
    return [str(d) for d in dirs if d.is_dir() and any(inputs_in(d))]


def inputs_in(directory: Path) -> list[Path]:
    """The inputs in a corpus or regressions directory (``.gitkeep`` and such aside)."""
    return [p for p in directory.iterdir() if not p.name.startswith(".")]


def run_target(target: str, runs: int, work: Path, extra: list[str]) -> tuple[bool, int, float]:
    """Runs one target; ``(passed, inputs run, seconds)``."""
    corpus, artifacts = work / target / "corpus", work / target / "artifacts"
    corpus.mkdir(parents=True)
    artifacts.mkdir()
    log = work / target / "fuzz.log"
    cmd = [
        sys.executable,
        str(FUZZ_DIR / f"fuzz_{target}.py"),
        f"-runs={runs}",
        f"-artifact_prefix={artifacts}/",
        "-print_final_stats=1",
        *extra,
        str(corpus),
        *seed_dirs(target),
    ]
    env = {**os.environ, "SPILLOVER_FUZZ_SCRATCH": str(work / "scratch")}
    start = time.monotonic()
    with open(log, "wb") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    seconds = time.monotonic() - start
    text = log.read_text(errors="replace")
    found = _EXECUTED.findall(text)
    executed = int(found[-1]) if found else 0
    found_inputs = sorted(p.name for p in artifacts.iterdir())
    passed = rc == 0 and not found_inputs
    if not passed:
        print(f"{target}: FAILED (exit {rc}); log {log}", flush=True)
        for name in found_inputs:
            print(f"  failing input: {artifacts / name}", flush=True)
        tail = text.splitlines()[-40:]
        print("\n".join("  | " + line for line in tail), flush=True)
    return passed, executed, seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, help="inputs per target (default: BUDGET)")
    parser.add_argument("--jobs", type=int, default=2, help="targets run at once")
    parser.add_argument("--target", action="append", choices=TARGETS, help="only these")
    parser.add_argument("libfuzzer", nargs="*", help="further libFuzzer flags (after --)")
    args = parser.parse_args()
    targets = args.target or TARGETS
    runs = {t: args.runs or BUDGET[t] for t in targets}
    work = Path(tempfile.mkdtemp(prefix="spillover-fuzz-run-"))
    print(
        f"fuzzing {len(targets)} targets, {sum(runs.values())} inputs, "
        f"{args.jobs} at a time; work in {work}",
        flush=True,
    )

    def one(target: str) -> tuple[str, bool, int]:
        passed, executed, seconds = run_target(target, runs[target], work, args.libfuzzer)
        rate = executed / seconds if seconds else 0.0
        status = "ok" if passed and executed >= runs[target] else "FAILED"
        print(
            f"{target:>18}: {executed:>9} inputs in {seconds:7.1f} s ({rate:6.0f}/s)  {status}",
            flush=True,
        )
        return target, status == "ok", executed

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(one, targets))
    total = sum(executed for _, _, executed in results)
    failed = [target for target, ok, _ in results if not ok]
    print(f"{'total':>18}: {total:>9} inputs", flush=True)
    if failed:
        print(f"failed: {', '.join(failed)}; inputs and logs kept in {work}", flush=True)
        return 1
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
