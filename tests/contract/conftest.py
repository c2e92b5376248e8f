"""The storage contract runs both ways and on every backend; the subpartition
contract over every channel implementation.

Every test under ``tests/contract`` runs once with the native engine and once with
its pure-Python twin (``SPILLOVER_PURE=1``); a test of a native-only promise (a
held, uncopied buffer) says so with ``@pytest.mark.native_only``. The ``store``
fixture gives a fresh storage directory on each backend: a local path, a
``file://`` URI, pyarrow's local filesystem, pyarrow's in-memory filesystem and
an S3 API server on loopback (moto). The ``links`` fixture builds producer
partitions linked to consumer gates in memory (``LocalChannel``) or over TCP on
loopback (``TcpSubpartition`` to a ``TcpReceiver``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from support.channels import Links
from support.s3 import s3_uri
from support.stores import Store


@pytest.fixture(autouse=True, params=["native", "pure"])
def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which engine ``open_storage`` and ``open_retriever`` give (SPILLOVER_PURE)."""
    if request.param == "pure":
        if request.node.get_closest_marker("native_only") is not None:
            pytest.skip("a promise of the native engine only")
        monkeypatch.setenv("SPILLOVER_PURE", "1")
    else:
        monkeypatch.delenv("SPILLOVER_PURE", raising=False)
    return str(request.param)


@pytest.fixture(params=["local-path", "file-uri", "arrow-local", "memory", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    kind = request.param
    if kind == "local-path":
        return Store(kind, str(tmp_path / "store"))
    if kind == "file-uri":
        return Store(kind, f"file://{tmp_path / 'store'}")
    if kind == "arrow-local":
        fs = pafs.LocalFileSystem()
        return Store(kind, str(tmp_path / "store"), fs, {"filesystem": fs})
    if kind == "memory":
        fs = pafs._MockFileSystem()  # pyarrow's in-memory filesystem
        return Store(kind, "store", fs, {"filesystem": fs})
    server = request.getfixturevalue("s3_server")
    return Store(kind, s3_uri(server, f"run-{uuid.uuid4().hex}"))


@pytest.fixture(params=["local", "tcp"])
def links(request: pytest.FixtureRequest) -> Iterator[Links]:
    """Builds links over one channel implementation; closes them after the test."""
    built = Links(str(request.param))
    try:
        yield built
    finally:
        built.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "[s3" in item.nodeid or "-s3]" in item.nodeid or "-s3-" in item.nodeid:
            item.add_marker(pytest.mark.s3)
