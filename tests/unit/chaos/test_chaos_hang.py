"""A scenario that does not end says where it is: the job master's attempt, its
stop and pending checkpoints (whom each waits for), each subtask's lifecycle and
barrier state, and every thread's stack, in the report and, compactly, in the
error the JSON keeps."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spillover.chaos import scenario_for
from spillover.chaos.runner import IsolatedRunner, Outcome, hang_report
from spillover.chaos.scenario import Scenario
from spillover.deploy.local import LocalExecutor
from spillover.runtime.api import Operator
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.graph import StreamEnvironment
from support.rest_jobs import config

_RELEASE = threading.Event()


class StuckSink(Operator):
    """A sink whose first batch blocks until the test lets it go: the induced hang."""

    def process(self, batch: Any, input_index: int = 0) -> None:
        wait_for_the_test()


def wait_for_the_test() -> None:
    _RELEASE.wait(120)


def _stuck_job() -> StreamEnvironment:
    env = StreamEnvironment("stuck", parallelism=1, max_parallelism=128)
    env.from_source(
        GeneratorSource(partitions=1, records_per_partition=10**9, payload_bytes=16),
        uid="source",
    ).rebalance().sink(StuckSink(), uid="sink")
    return env


def _until(what: str, check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} never held"
        time.sleep(0.02)


def test_a_hang_report_names_the_checkpoint_the_stuck_subtask_holds_up_and_its_stack(
    tmp_path: Path,
) -> None:
    _RELEASE.clear()
    ex = LocalExecutor(
        _stuck_job(), config(tmp_path, **{"execution.checkpointing.unaligned.enabled": False})
    )
    runner = threading.Thread(target=lambda: ex.run(timeout=120), daemon=True)
    runner.start()
    try:

        def held_up() -> bool:
            c = ex.diagnosis().coordinator
            return c is not None and any(("sink", 0) in p.waiting_for for p in c.pending)

        _until("a checkpoint waiting for the stuck sink", held_up)
        where = hang_report()
    finally:
        _RELEASE.set()
        ex.cancel()
        runner.join(60)
    (job,) = where.jobs
    assert (job.job_name, job.attempt, job.stop) == ("stuck", 0, "none")
    # The source took the checkpoint; its barrier waits behind the data the sink
    # does not take, and its acknowledgement may wait with it.
    # (Under load a checkpoint may complete before the sink's first batch.)
    pending = re.compile(r"checkpoint \d+ \(aligned, [0-9.]+ s\) waits for sink#0(,source#0)?")
    summary = where.summary().split(" | ")
    assert summary[0] == "job stuck: attempt 0, stop none"
    assert re.fullmatch(
        r"coordinator running, next id \d+, no stop, no final checkpoint yet; "
        r"completed \[\d*\]; last ended: .*",
        summary[1],
    ), summary
    assert pending.fullmatch(summary[2]), summary
    assert summary[3:] == ["data ended: -", "exited: -"]
    text = where.text().splitlines()
    (sink,) = [line for line in text if line.startswith("  sink#0 alive: running, last snapshot ")]
    assert "; barriers WaitingForFirstBarrier, " in sink
    assert any(line.startswith("  source#0 alive: running, last snapshot ") for line in text)
    stuck = [line for line in text if "wait_for_the_test < test_chaos_hang.py" in line]
    assert len(stuck) == 1 and stuck[0].startswith("1 thread(s) [task sink#0]: "), text
    assert "threads:" in text


def never_ends(s: Scenario, workdir: str) -> Outcome:
    """A scenario's run that hangs (in the child, nothing releases it)."""
    wait_for_the_test()
    raise AssertionError("released")


def test_a_scenario_past_its_limit_ends_with_where_it_was(tmp_path: Path) -> None:
    """The child reports where it is once the limit passed, and the runner ends it:
    the error is one line, the report has the stacks; the next scenario gets a new
    child."""
    s = scenario_for("29-35")
    with IsolatedRunner(timeout_s=1.0, run=never_ends) as runner:
        outcome = runner(s, str(tmp_path))
        assert not outcome.exact and outcome.kind == "Hang"
        assert outcome.error == "Hang: the scenario had not ended after 1 s: no job running"
        text = outcome.report.splitlines()
        assert text[:2] == ["no job running", "threads:"]
        main = [line for line in text if line.startswith("1 thread(s) [MainThread]: ")]
        assert len(main) == 1 and "wait_for_the_test < test_chaos_hang.py" in main[0]
        assert re.search(r" never_ends < runner\.py:[0-9]+ _serve < ", main[0]), main[0]
        assert runner(s, str(tmp_path)).error == outcome.error
