"""Operating a job the way a Flink user does, end to end, with the ``spillover`` CLI
and the job's REST API (issue 32's "done when"):

1. starts a backpressured job with ``spillover run --detached``;
2. reads its checkpoints from REST and Prometheus while it runs;
3. takes a savepoint (``spillover savepoint``);
4. rescales it live from 2 to 3 (``spillover rescale``);
5. stops it with ``spillover stop --drain``;
6. moves the savepoint folder of step 3 elsewhere, restarts the job from it with
   ``spillover run --from-savepoint`` at parallelism 3, and drains it again.

(Step 6 resumes step 3's savepoint: the drained one of step 5 records every
operator finished, so nothing would run from it.) Both runs write Parquet, exactly
once; the script checks every generated record is in each run's output once and the
second run carries on where its savepoint was taken. What it prints on stdout is the
same on every run (``tools/operate.expected``); timings and paths go to stderr.

    python tools/operate.py [--executor local|spark] [--workdir DIR]

``tools/operate.py:build`` is also the job ``spillover run`` starts (it reads its
parallelism and output folder from the environment).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

PARTITIONS = 4
OUT_ENV, PARALLELISM_ENV = "SPILLOVER_OPERATE_OUT", "SPILLOVER_OPERATE_PARALLELISM"


def build() -> Any:
    """The job: four endless paced source partitions, key_by, and a Parquet sink
    slower than them, so in-flight data builds up (unaligned checkpoints persist it)."""
    from spillover.streaming import GeneratorSource, ParquetSink, StreamEnvironment, ThrottledSink

    parallelism = int(os.environ.get(PARALLELISM_ENV, "2"))
    env = StreamEnvironment("operate", parallelism=parallelism, max_parallelism=128)
    gen = GeneratorSource(partitions=PARTITIONS, payload_bytes=16, rate_per_subtask=3_000, keys=200)
    sink = ThrottledSink(2_000, inner=ParquetSink(os.environ[OUT_ENV]))
    env.from_source(gen, uid="source").key_by("key").sink(sink, uid="sink")
    return env


class Operator:
    """Runs ``spillover`` commands in a work folder of its own (``SPILLOVER_HOME``,
    checkpoints, savepoints, outputs) and talks to a job's REST API."""

    def __init__(self, workdir: Path, executor: str) -> None:
        self.work = workdir
        self.executor = executor
        self.env = {**os.environ, "SPILLOVER_HOME": str(workdir / "home")}

    def cli(self, *argv: str, **env: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "spillover.cli", *argv],
            capture_output=True,
            text=True,
            timeout=300,
            env={**self.env, **env},
        )
        if out.returncode != 0:
            raise SystemExit(f"spillover {argv[0]} failed ({out.returncode}): {out.stderr}")
        return out.stdout

    def run_detached(self, parallelism: int, run: str, *extra: str) -> str:
        options = [
            "-D", "execution.checkpointing.interval=100 ms",
            "-D", "execution.checkpointing.unaligned.enabled=true",
            "-D", f"state.checkpoints.dir={self.work / run / 'ckpt'}",
            "-D", "state.checkpoints.num-retained=2",
        ]  # fmt: skip
        env = {OUT_ENV: str(self.work / run / "out"), PARALLELISM_ENV: str(parallelism)}
        out = self.cli(
            "run", f"{__file__}:build", "--executor", self.executor, *options, *extra, "--detached",
            **env,
        )  # fmt: skip
        return out.splitlines()[0]

    def entry(self, job_id: str) -> dict[str, Any]:
        (entry,) = [e for e in json.loads(self.cli("list", "--json")) if e["id"] == job_id]
        return entry  # type: ignore[no-any-return]

    def get(self, job_id: str, path: str) -> Any:
        url = self.entry(job_id)["rest_url"] + path
        with urllib.request.urlopen(url, timeout=30) as r:
            data = r.read()
        return data.decode() if path == "/metrics" else json.loads(data)

    def checkpointed(self, job_id: str) -> bool:
        """Whether the job completed a checkpoint; one that ended without is an error."""
        entry = self.entry(job_id)
        if entry["state"] not in ("INITIALIZING", "RUNNING", "RESTARTING"):
            log = self.work / "home" / "jobs" / f"{job_id}.log"
            raise SystemExit(f"job {job_id} ended {entry['state']}: {log.read_text()[-2000:]}")
        return entry["last_checkpoint"] is not None

    def until(self, what: str, check: Any, timeout: float = 120) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            got = check()
            if got:
                return got
            if time.monotonic() > deadline:
                raise SystemExit(f"{what}: not after {timeout:g} s")
            time.sleep(0.1)


def _metric(text: str, name: str) -> float:
    """The value of Prometheus sample ``name`` (one job: one sample)."""
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise SystemExit(f"no metric {name} in /metrics")


def _parts(out: Path) -> set[Path]:
    """The committed Parquet files of the output folder."""
    return set(out.glob("part-*.parquet"))


def _sequences(files: set[Path]) -> dict[int, list[int]]:
    """Per source partition, the sequence numbers in ``files``, sorted."""
    import pyarrow.parquet as pq

    seqs: dict[int, list[int]] = {}
    for f in files:
        table = pq.read_table(f, columns=["partition", "seq"])
        for p, s in zip(table["partition"].to_pylist(), table["seq"].to_pylist(), strict=True):
            seqs.setdefault(int(p), []).append(int(s))
    return {p: sorted(v) for p, v in sorted(seqs.items())}


def _contiguous(seqs: dict[int, list[int]]) -> bool:
    return all(v == list(range(v[0], v[0] + len(v))) for v in seqs.values())


def operate(op: Operator) -> None:
    say = print
    note = lambda *a: print(*a, file=sys.stderr)  # noqa: E731 (timings and paths: not compared)

    # 1. A backpressured job, detached.
    job = op.run_detached(2, "run1")
    entry = op.entry(job)
    say(f"1. started: {entry['name']} {entry['state']}, REST API at 127.0.0.1")
    note(f"   job {job} at {entry['rest_url']}")

    # 2. Its checkpoints, from REST and from Prometheus, while it runs.
    cps = op.until(
        "3 completed checkpoints",
        lambda: (c := op.get(job, f"/jobs/{job}/checkpoints"))["counts"]["completed"] >= 3 and c,
    )
    done = [h for h in cps["history"] if h["status"] == "COMPLETED"]
    kinds = sorted({h["checkpoint_type"] for h in done})
    persisted = any(h["persisted_data"] > 0 for h in done)
    say(
        f"2. REST: checkpoints completed, {', '.join(kinds)}, in-flight data persisted: {persisted}"
    )
    metrics = op.get(job, "/metrics")
    completed = _metric(metrics, "flink_jobmanager_job_numberOfCompletedCheckpoints")
    bp = _metric(metrics, "flink_taskmanager_job_task_backPressuredTimeMsPerSecond")
    enough = completed >= 3
    say(f"   Prometheus: numberOfCompletedCheckpoints >= 3: {enough}, backpressure: {bp >= 0}")

    # 3. A savepoint, the job going on.
    savepoint = Path(op.cli("savepoint", job, "--savepoint-dir", str(op.work / "sp")).strip())
    say(f"3. savepoint taken: {(savepoint / '_metadata').exists()}, job {op.entry(job)['state']}")
    note(f"   {savepoint}")

    # 4. A live rescale from 2 to 3.
    line = op.cli("rescale", job, "--parallelism", "3").strip()
    note(f"   {line}")
    details = op.get(job, f"/jobs/{job}")
    rescale = details["rescale"]
    say(
        f"4. rescaled live from {rescale['from-parallelism']} to {rescale['to-parallelism']}: "
        f"{rescale['status']}, vertices at {[v['parallelism'] for v in details['vertices']]}, "
        f"same job id and REST API: {details['jid'] == job}"
    )
    note(f"   request to first record at 3: {rescale['request-to-first-record-ms']} ms")

    # 5. Stop with drain.
    drained = Path(op.cli("stop", job, "--drain").strip())
    state = op.until("FINISHED", lambda: (s := op.entry(job)["state"]) != "RUNNING" and s)
    out = op.work / "run1" / "out"
    before = _parts(out)
    first = _sequences(before)
    say(f"5. stopped with --drain: {state}, savepoint: {(drained / '_metadata').exists()}")
    say(f"   output: every record of {len(first)} partitions once, in order: {_contiguous(first)}")

    # 6. Move step 3's savepoint, resume from it at 3, drain again. The sink goes on
    # in its folder (its files pending at the savepoint are there); what it commits
    # from the savepoint on are new files.
    moved = op.work / "moved" / savepoint.parent.name
    moved.parent.mkdir()
    shutil.move(str(savepoint.parent), moved)
    resumed = op.run_detached(3, "run1", "--from-savepoint", str(moved / savepoint.name))
    op.until("a checkpoint", lambda: op.checkpointed(resumed))
    op.cli("stop", resumed, "--drain")
    state = op.until("FINISHED", lambda: (s := op.entry(resumed)["state"]) != "RUNNING" and s)
    second = _sequences(_parts(out) - before)
    carried_on = all(second[p][0] <= first[p][-1] + 1 for p in second) and set(second) == set(first)
    say(f"6. moved the savepoint, resumed from it at 3 and drained again: {state}")
    exact = _contiguous(second) and carried_on
    say(f"   output: every record once, in order, from where the savepoint was: {exact}")
    kept = (moved / savepoint.name / "_metadata").exists()
    say(f"   the moved savepoint is still there (no-claim): {kept}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--executor", default="local", choices=("local", "spark"))
    p.add_argument("--workdir", help="where the jobs' files go (default: a new temporary folder)")
    args = p.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="spillover-operate-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    op = Operator(work, args.executor)
    try:
        operate(op)
    finally:
        home = work / "home" / "jobs"
        for f in home.glob("*.json") if home.is_dir() else []:
            entry = json.loads(f.read_text())
            if entry.get("state") in ("RUNNING", "INITIALIZING", "RESTARTING"):
                subprocess.run(
                    [sys.executable, "-m", "spillover.cli", "cancel", entry["id"]],
                    env=op.env, capture_output=True, timeout=120,
                )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
