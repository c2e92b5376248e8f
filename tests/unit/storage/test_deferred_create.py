"""``StorageOptions.defer_create``: on a pyarrow filesystem a storer is made without a
request; the writer's I/O thread creates the file before its first write, a failure
there is the storer's sticky error naming the file, and a file never created is
neither made nor deleted."""

from __future__ import annotations

import errno
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from spillover.errors import StateFileExistsError, StorageError
from spillover.storage import open_storage
from support.faults import Faults, enospc, fail, faulty_dir

# Creating a state file asks these of the filesystem (exists check, directory, stream).
CREATE = {"info", "mkdir", "open"}


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[tuple[str, Faults, list[tuple[str, int]]]]:
    """``(URI, faults, [(operation, thread id)])``: every operation on a state file."""
    calls: list[tuple[str, int]] = []

    def record(op: str, path: str) -> None:
        if ".spill" in path or op == "mkdir":
            calls.append((op, threading.get_ident()))

    with faulty_dir(str(tmp_path / "ckpt")) as (uri, faults):
        faults.rules = [lambda op, path: record(op, path)]
        yield uri, faults, calls


def _read(uri: str, gate: int = 0) -> list[bytes]:
    with open_storage(uri).create_retriever(gate) as r:
        return [b.tobytes() for b in r]


@pytest.mark.native_only
def test_the_file_is_created_by_the_writers_thread_on_first_write(
    fs: tuple[str, Faults, list[tuple[str, int]]],
) -> None:
    uri, _, calls = fs
    storer = open_storage(uri, defer_create=True).create_storer(0)
    assert calls == [], "create_storer asked the filesystem nothing"
    storer.append(3, b"abc")
    storer.append(3, b"defg")
    storer.close()
    ops = [op for op, _ in calls]
    assert ops[:3] == ["info", "mkdir", "open"]
    assert all(tid != threading.get_ident() for op, tid in calls if op in CREATE)
    assert _read(uri) == [b"abc", b"defg"]


def test_a_gate_closed_with_nothing_written_has_a_valid_empty_file(
    fs: tuple[str, Faults, list[tuple[str, int]]],
) -> None:
    uri, _, _ = fs
    handle = open_storage(uri, defer_create=True).create_storer(0).close()
    assert handle.frame_count == 0
    assert _read(uri) == []


def test_a_failed_creation_surfaces_at_the_next_append_or_at_close_naming_the_file(
    fs: tuple[str, Faults, list[tuple[str, int]]],
) -> None:
    uri, faults, _ = fs
    faults.rules = [fail({"open"}, "in-0", enospc)]
    storer = open_storage(uri, defer_create=True).create_storer(0)
    with pytest.raises(StorageError) as caught:
        for _ in range(100):  # the first batch goes to the I/O thread; a later call fails
            storer.append(1, b"x" * 8192)
            storer.flush()
        storer.close()
    assert caught.value.errno == errno.ENOSPC
    assert caught.value.path == storer.uri
    assert f"cannot create state file [file {storer.uri}]" in str(caught.value)
    storer.discard()
    assert open_storage(uri).gates() == []


def test_an_existing_file_fails_the_storer_and_stays_as_it_was(
    fs: tuple[str, Faults, list[tuple[str, int]]],
) -> None:
    uri, _, _ = fs
    open_storage(uri).create_storer(0).close()  # someone else's file
    storer = open_storage(uri, defer_create=True).create_storer(0)
    with pytest.raises(StorageError) as caught:
        storer.append(1, b"mine")
        storer.close()
    assert caught.value.errno == errno.EEXIST and caught.value.path == storer.uri
    assert isinstance(caught.value.__cause__, StateFileExistsError)
    storer.discard()
    assert _read(uri) == [], "the other file was neither overwritten nor deleted"


def test_a_gate_discarded_before_any_write_asks_the_filesystem_nothing(
    fs: tuple[str, Faults, list[tuple[str, int]]],
) -> None:
    uri, _, calls = fs
    open_storage(uri, defer_create=True).create_storer(0).discard()
    assert calls == []


def test_local_files_are_created_at_once_whatever_the_option(tmp_path: Path) -> None:
    open_storage(tmp_path).create_storer(0).close()
    with pytest.raises(StateFileExistsError):
        open_storage(tmp_path, defer_create=True).create_storer(0)
