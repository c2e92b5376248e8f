"""The rescaling recovery test kit for users' own jobs: the pytest plugin
(``spillover.testing``), ``VerifySpec(job=...)`` and ``spillover verify --job``.

The plugin is exercised as a user meets it, in a separate pytest run (``pytester``)
over a test file that defines its own job; the checker's verdicts on broken jobs
are shown directly.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spillover.cli import main
from spillover.errors import ConfigError
from spillover.runtime.api import Batch, Operator, OperatorContext
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.runtime.connectors.parquet import batch_to_arrow
from spillover.runtime.graph import StreamEnvironment
from spillover.runtime.jobmaster import JobResult
from spillover.testing import assert_exact, cases
from spillover.verify import Report, RunOutput, VerifySpec, compare, load_job, verify

pytest_plugins = ["pytester"]

# A user's job, as a user's test module would hold it: orders counted per customer key,
# each record leaving with the keyed subtask that counted it, a sink slower than the
# source (backpressure, so unaligned checkpoints hold in-flight data).
JOB = """
import numpy as np

from spillover.runtime.api import Batch, Operator, StateDescriptor
from spillover.runtime.graph import StreamEnvironment
from spillover.runtime.operators import KeyedProcess
from spillover.runtime.connectors.parquet import ParquetSink
from spillover.runtime.connectors.throttled import ThrottledSink
from spillover.runtime.connectors.generator import GeneratorSource
from spillover.verify import stamp_subtask

RECORDS = 24_000
OUT = np.dtype([("partition", "<i4"), ("seq", "<i8"), ("key", "<i8")])


def count_orders(batch, states):
    keys, counts = np.unique(batch["key"], return_counts=True)
    states["orders"].put(keys, counts)
    out = np.empty(len(batch), OUT)
    for name in OUT.names:
        out[name] = batch[name]
    return out


class DropsAfterRestart(Operator):
    \"\"\"A deliberate bug: forgets every 100th record once the job restarted.\"\"\"

    out_dtype = OUT

    def process(self, batch: Batch, input_index: int = 0) -> None:
        if self.ctx.attempt > 0:
            batch = batch[batch["seq"] % 100 != 0]
        self.ctx.output.emit(batch)


def make_job(out_dir, name, parallelism, broken=False):
    env = StreamEnvironment(name, parallelism=parallelism, max_parallelism=128)
    source = GeneratorSource(
        partitions=4,  # fixed: partitions move between subtasks when rescaling
        records_per_partition=RECORDS // 4,
        rate_per_subtask=20_000,
        keys=500,
        payload_bytes=16,
        batch_size=256,
    )
    orders = env.from_source(source, uid="orders")
    counted = orders.key_by("key").process(
        KeyedProcess(count_orders, [StateDescriptor("orders", "sum")], OUT), uid="count"
    )
    if broken:
        counted = counted.process(DropsAfterRestart(), uid="drops")
    sink = ThrottledSink(12_000, inner=ParquetSink(out_dir))
    stamp_subtask(counted).sink(sink, uid="sink")
    return env


def make_broken_job(out_dir, name, parallelism):
    return make_job(out_dir, name, parallelism, broken=True)
"""

USER_TESTS = """
import pytest

from spillover.testing import assert_exact


@pytest.mark.spillover_rescale(parallelism=2, rescale_to=3, policy="unaligned", failures=2,
                               records=RECORDS)
def test_orders_recover_exactly(spillover_verify):
    report = spillover_verify(make_job, state_uid="count", state="orders")
    assert_exact(report)
    print(report.text())


@pytest.mark.spillover_rescale(parallelism=2, rescale_to=3, failures=2, records=RECORDS)
def test_broken_orders(spillover_verify):
    assert_exact(spillover_verify(make_broken_job))
"""


def _run_inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, *args: str) -> Any:
    """A separate pytest run with the plugin enabled as ``-p`` (not installed here)."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    return pytester.runpytest("-p", "spillover.testing", "--strict-markers", *args)


def test_user_job_recovers_exactly_and_a_broken_one_is_named(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_orders=JOB + USER_TESTS)
    result = _run_inner(pytester, monkeypatch, "-s", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    # The good job, restored at 3 from a checkpoint with in-flight data: every check ran.
    assert "job test_orders:make_job, parallelism 2 -> 3, policy unaligned" in out
    assert re.search(r"which held [1-9]\d* bytes of in-flight data", out)
    assert "order per (partition, key) kept" in out
    assert "every key in its subtask's key groups" in out
    assert "final keyed state of count equal" in out
    # The broken one fails with the lost records named: every one a 100th seq.
    assert "job test_orders:make_broken_job" in out and "NOT EXACT" in out
    lost = re.search(r"(\d+) lost \(partition, seq\): ((?:\(\d+, \d+\)(?:, )?)+)", out)
    assert lost is not None, out
    seqs = [int(s) for s in re.findall(r"\(\d+, (\d+)\)", lost.group(2))]
    assert seqs and all(s % 100 == 0 for s in seqs)


def test_the_marker_parametrizes(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(
        test_cases="""
        import pytest

        @pytest.mark.spillover_rescale(parallelism=2, rescale_to=[3, 1])
        @pytest.mark.spillover_rescale(parallelism=4, rescale_to=2, policy="timeout", records=5000)
        def test_pairs(spillover_case):
            c = spillover_case
            assert (c.parallelism, c.rescale_to) in {(2, 3), (2, 1), (4, 2)}
            assert c.failures == 2 and c.job is None

        def test_default(spillover_case):
            assert (spillover_case.parallelism, spillover_case.rescale_to) == (2, 3)
            assert spillover_case.policy == "unaligned"

        @pytest.mark.spillover_rescale(parallelism=3, rescale_to=5)
        class TestClass:
            def test_from_class(self, spillover_case):
                assert (spillover_case.parallelism, spillover_case.rescale_to) == (3, 5)

            @pytest.mark.spillover_rescale(parallelism=6, rescale_to=2)
            def test_own_marker_wins(self, spillover_case):
                assert (spillover_case.parallelism, spillover_case.rescale_to) == (6, 2)
        """
    )
    result = _run_inner(pytester, monkeypatch, "-v", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=6)
    result.stdout.fnmatch_lines_random(
        [
            "*test_pairs?2to3-unaligned-f2? PASSED*",
            "*test_pairs?2to1-unaligned-f2? PASSED*",
            "*test_pairs?4to2-timeout-f2-records=5000? PASSED*",
            "*test_from_class?3to5-unaligned-f2? PASSED*",
            "*test_own_marker_wins?6to2-unaligned-f2? PASSED*",
        ]
    )


def test_a_bad_marker_argument_is_refused() -> None:
    with pytest.raises(TypeError, match=r"unknown argument.*rescale"):
        cases([{"rescale": 3}])
    specs = cases([{"policy": ["aligned", "unaligned"], "failures": (1, 3)}])
    assert [(s.policy, s.failures) for s in specs] == [
        ("aligned", 1),
        ("aligned", 3),
        ("unaligned", 1),
        ("unaligned", 3),
    ]


# --- verdicts on broken jobs, directly ------------------------------------------------------


class EagerParquetSink(Operator):
    """A deliberate bug: writes every batch at once instead of committing on checkpoint
    completion, so records replayed after a restore are written twice."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def open(self, ctx: OperatorContext) -> None:
        super().open(ctx)
        Path(self.directory).mkdir(parents=True, exist_ok=True)

    def process(self, batch: Batch, input_index: int = 0) -> None:
        import pyarrow.parquet as pq

        name = f"eager-{self.ctx.subtask_index}-{uuid.uuid4().hex}.parquet"
        pq.write_table(batch_to_arrow(batch), f"{self.directory}/{name}")


def make_eager_job(out_dir: str, name: str, parallelism: int) -> StreamEnvironment:
    env = StreamEnvironment(name, parallelism=parallelism, max_parallelism=128)
    source = GeneratorSource(
        partitions=4, records_per_partition=5000, rate_per_subtask=20_000, payload_bytes=16
    )
    env.from_source(source, uid="src").key_by("key").map(lambda b: b, uid="keyed").sink(
        EagerParquetSink(out_dir), uid="sink"
    )
    return env


def test_a_sink_without_two_phase_commit_duplicates(tmp_path: Path) -> None:
    spec = VerifySpec(
        job=make_eager_job, parallelism=2, rescale_to=3, policy="unaligned", failures=2
    )
    spec.records = 20_000  # per source: places the induced failures
    report = verify(spec, str(tmp_path))
    assert not report.exact and report.duplicated and not report.lost
    with pytest.raises(AssertionError) as e:
        assert_exact(report)
    p, s, times = report.duplicated[0]
    assert f"duplicated (partition, seq, times): ({p}, {s}, {times})" in str(e.value)


def _output(rows: Sequence[tuple[int, ...]], state: dict[Any, Any] | None = None) -> RunOutput:
    dtype = [(n, "<i8") for n in ("partition", "seq", "key", "total", "subtask", "parallelism")]
    result = JobResult("job", "finished", 1, 0.1)
    return RunOutput(result, np.array(rows, dtype), state or {}, max_parallelism=128)


def test_every_kind_of_difference_is_named() -> None:
    # Keys 1 and 4 lie in key groups 86 and 7 of 128: subtasks 1 and 0 of 2.
    good = [(0, 0, 1, 1, 1, 2), (0, 1, 1, 3, 1, 2), (1, 0, 4, 1, 0, 2), (1, 1, 4, 3, 0, 2)]
    expected = _output(good, {1: 2, 4: 2})
    spec = VerifySpec(job="user:job")
    assert compare(spec, expected, _output(good, {1: 2, 4: 2})).exact
    bad = [
        (0, 1, 1, 3, 1, 2),  # committed before seq 0 of its key
        (0, 0, 1, 1, 1, 2),
        (1, 0, 4, 1, 1, 2),  # key 4 committed by subtask 1
        (1, 1, 4, 4, 0, 2),  # a wrong total
        (7, 7, 4, 1, 0, 2),  # never made without failures
    ]
    report = compare(spec, expected, _output(bad, {1: 2, 4: 3}))
    assert not report.exact
    assert report.reordered == [(0, 0)]
    assert report.misplaced == [(1, 0, 4, 7, 1, 2)]
    assert report.wrong_totals == [(1, 1, 4)]
    assert report.unexpected == [(7, 7)]
    assert report.state_mismatch == [(4, 2, 3)]
    text = report.text()
    for line in (
        "1 reordered (partition, seq): (0, 0)",
        "subtask, parallelism): (1, 0, 4, 7, 1, 2)",
        "1 wrong running total (partition, seq, total): (1, 1, 4)",
        "1 not in the failure-free output (partition, seq): (7, 7)",
        "1 final state differs (key, expected, found): (4, 2, 3)",
    ):
        assert line in text, text
    # Order checks off: only the other differences count.
    unordered = compare(VerifySpec(job="user:job", order=None), expected, _output(bad))
    assert unordered.reordered == [] and unordered.misplaced


def test_shortfalls_fail_strict_checks() -> None:
    base = compare(VerifySpec(job="u:j"), _output([(0, 0, 1, 1, 1, 2)]), _output([]))
    report = Report(**{**base.__dict__, "exact": True, "failures_fired": []})
    report.spec = VerifySpec(job="u:j", failures=2, rescale_to=3, policy="unaligned")
    assert len(report.shortfalls()) == 2
    assert "WARNING: only 0 of 2 induced failures happened" in report.text()
    with pytest.raises(AssertionError, match="proved less than asked"):
        assert_exact(report)
    assert_exact(report, strict=False)


# --- the command line and job references -----------------------------------------------------


def test_cli_verifies_a_job_named_by_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module = f"orders_job_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(JOB))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    argv = ["verify", "--job", f"{module}:make_job", "--parallelism", "2", "--rescale-to", "3"]
    argv += ["--policy", "unaligned", "--failures", "2", "--records", "24000"]
    argv += ["--state", "count:orders", "--strict", "--json", str(tmp_path / "report.json")]
    code = main(argv)
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"job {module}:make_job, parallelism 2 -> 3" in out and "EXACT" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["exact"] and report["spec"]["state_uid"] == "count"
    monkeypatch.delitem(sys.modules, module)


def test_job_references(tmp_path: Path) -> None:
    path = tmp_path / "jobs_file.py"
    path.write_text(textwrap.dedent(JOB))
    factory = load_job(f"{path}:make_job")
    env = factory(str(tmp_path / "out"), "refs", 2)
    assert [n.uid for n in env.nodes] == ["orders", "count", "subtask-stamp", "sink"]
    assert VerifySpec(job=f"{path}:make_job").describe() == f"job {path}:make_job"
    assert VerifySpec(job=make_eager_job).describe() == f"job {__name__}:make_eager_job"
    for ref in ("no_colon", "spillover.verify:missing", "no_such_module_x:f", f"{path}.x:f"):
        with pytest.raises(ConfigError):
            load_job(ref)
