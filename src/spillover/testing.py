"""A pytest plugin that proves your own jobs recover exactly from unaligned checkpoints,
also at another parallelism.

Installed with spillover (entry point ``spillover``); without installing, enable it
with ``-p spillover.testing``. It offers:

- ``spillover_verify``: a fixture; ``spillover_verify(make_job, **spec)`` runs the
  job (a :class:`~spillover.verify.JobFactory` or ``"module:function"``) without and
  with induced failures, in the test's ``tmp_path``, and returns the
  :class:`~spillover.verify.Report`;
- ``@pytest.mark.spillover_rescale(parallelism=2, rescale_to=3, policy="unaligned",
  failures=2, records=20_000, **spec)``: runs the test once per case (a list value
  runs one case per element, several markers one case per marker); any other
  :class:`~spillover.verify.VerifySpec` field may be given;
- ``spillover_case``: a fixture, the case's :class:`~spillover.verify.VerifySpec`
  (the defaults above without a marker);
- :func:`assert_exact`: fails with the report's text unless the run was exact.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pytest

if TYPE_CHECKING:
    from spillover.verify import JobFactory, Report, VerifySpec

__all__ = ["CASE_DEFAULTS", "MARKER", "Verifier", "assert_exact", "cases"]

MARKER = "spillover_rescale"
CASE_DEFAULTS: dict[str, Any] = {
    "parallelism": 2,
    "rescale_to": 3,
    "policy": "unaligned",
    "failures": 2,
    "records": 20_000,
}


class Verifier(Protocol):
    """The ``spillover_verify`` fixture: runs ``job`` under the test's case, with
    ``spec`` overriding any :class:`~spillover.verify.VerifySpec` field."""

    def __call__(self, job: JobFactory | str, /, **spec: Any) -> Report: ...


def cases(kwargs_per_marker: Iterable[Mapping[str, Any]]) -> list[VerifySpec]:
    """One :class:`~spillover.verify.VerifySpec` per marker and per combination of its
    list values, on top of ``CASE_DEFAULTS``."""
    from spillover.verify import VerifySpec

    names = {f.name for f in dataclasses.fields(VerifySpec)}
    out = []
    for kwargs in kwargs_per_marker:
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(
                f"{MARKER} got unknown argument(s) {', '.join(unknown)}; "
                f"it takes the fields of spillover.verify.VerifySpec"
            )
        merged = {**CASE_DEFAULTS, **kwargs}
        axes = [
            [(k, x) for x in v] if isinstance(v, list | tuple) else [(k, v)]
            for k, v in merged.items()
        ]
        out += [VerifySpec(**dict(combo)) for combo in itertools.product(*axes)]
    return out


def _case_id(spec: VerifySpec) -> str:
    shape = f"{spec.parallelism}to{spec.rescale_to}" if spec.rescale_to else f"p{spec.parallelism}"
    parts = [shape, spec.policy, f"f{spec.failures}"]
    shown = {"parallelism", "rescale_to", "policy", "failures"}
    default = {**type(spec)().__dict__, **CASE_DEFAULTS}
    parts += [
        f"{k}={v}" for k, v in spec.__dict__.items() if k not in shown and v != default.get(k)
    ]
    return "-".join(parts)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(parallelism=2, rescale_to=3, policy='unaligned', failures=2, "
        "records=20000, **spec): run the test once per case of spillover_verify "
        "(list values: one case each)",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "spillover_case" not in metafunc.fixturenames:
        return
    marks = list(metafunc.definition.iter_markers_with_node(MARKER))
    if not marks:
        return
    closest = marks[0][0]  # markers on the test win over those on its class or module
    found = [m for node, m in marks if node is closest]
    for m in found:
        if m.args:
            raise TypeError(f"{MARKER} takes keyword arguments only, got {m.args!r}")
    specs = cases(reversed([m.kwargs for m in found]))  # decorators apply bottom-up
    metafunc.parametrize("spillover_case", specs, ids=[_case_id(s) for s in specs], indirect=True)


@pytest.fixture
def spillover_case(request: pytest.FixtureRequest) -> VerifySpec:
    """The case of the test: its ``spillover_rescale`` marker's values, else the defaults."""
    param = getattr(request, "param", None)
    if param is not None:
        spec: VerifySpec = param
        return spec
    return cases([{}])[0]


@pytest.fixture
def spillover_verify(spillover_case: VerifySpec, tmp_path: Path) -> Verifier:
    """Runs a job under the test's case and returns the report; each call gets its own
    directory under ``tmp_path``."""
    from spillover.verify import verify

    counter = itertools.count()

    def run(job: JobFactory | str, /, **spec: Any) -> Report:
        case = dataclasses.replace(spillover_case, job=job, **spec)
        return verify(case, str(tmp_path / f"spillover-verify-{next(counter)}"))

    return run


def assert_exact(report: Report, *, strict: bool = True) -> None:
    """Fails with ``report.text()`` (naming the records, keys and subtasks involved)
    unless the run was exact; with ``strict``, also when it proved less than asked
    (fewer failures happened, or a rescale restored no in-flight data)."""
    __tracebackhide__ = True
    if not report.exact:
        raise AssertionError(report.text())
    if strict and report.shortfalls():
        raise AssertionError(
            "the run was exact but proved less than asked (strict=False accepts it):\n"
            + report.text()
        )
