"""Shared fixtures: storage backends for the contract tests, an S3 API server on loopback."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from support.s3 import s3_server, s3_uri  # noqa: F401 (s3_server is a fixture)

pytest_plugins = ["support.native_leaks"]

# Property tests assert on what happens, never on how fast: on a loaded machine a
# generated example may take seconds, which is neither a failure nor a slow strategy.
settings.register_profile("spillover", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("spillover")


@pytest.fixture(params=["local-path", "file-uri", "arrow-local", "s3"])
def storage_location(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """A fresh storage directory on each backend: ``(uri, extra open_storage kwargs)``."""
    kind = request.param
    if kind == "local-path":
        return str(tmp_path / "store"), {}
    if kind == "file-uri":
        return f"file://{tmp_path / 'store'}", {}
    if kind == "arrow-local":
        import pyarrow.fs as pafs

        return str(tmp_path / "store"), {"filesystem": pafs.LocalFileSystem()}
    server = request.getfixturevalue("s3_server")
    return s3_uri(server, f"run-{uuid.uuid4().hex}"), {}


@pytest.fixture
def rescale_exact(tmp_path: Path) -> Callable[..., None]:
    """``rescale_exact(topology, old, new, policy="unaligned")``: runs a built-in topology
    at ``old`` with two induced failures, restores its latest checkpoint at ``new``,
    and asserts the run was exact and that the checkpoint held in-flight data it replayed."""
    from spillover.verify import VerifySpec, verify

    def check(topology: str, old: int, new: int, policy: str = "unaligned") -> None:
        spec = VerifySpec(
            topology=topology,
            policy=policy,
            parallelism=old,
            rescale_to=new,
            records=30_000,
            failures=2,
            rate_per_subtask=30_000,
            seed=old * 100 + new,
        )
        report = verify(spec, str(tmp_path))
        assert report.exact, report.text()
        assert report.restored_inflight > 0, "the restored checkpoint held no in-flight data"
        assert report.inflight_replayed > 0

    return check
