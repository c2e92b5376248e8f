"""The file-system steps a :class:`Location` owns (read a whole file, publish one
atomically, delete, list), the same on every backend: a local path, a file:// URI,
pyarrow's local and in-memory filesystems and S3 (moto on loopback); and each
failure of the storage under them as the one specific error naming the URI."""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spillover.errors import StateFileExistsError, StateFileNotFoundError, StorageError
from spillover.storage import location as location_module
from spillover.storage.location import FileKind, Location, delete_tree
from support.faults import Faults, enospc, fail, failing_renames, faulty_dir
from support.stores import Store
from support.synced import durable_steps


@pytest.fixture
def engine() -> str:
    """The primitives do not depend on the engine: run each test once."""
    return "native"


def root(store: Store) -> Location:
    """A fresh directory of this backend (a new one per call: hypothesis examples
    share the fixture)."""
    return store.location(store.uri).child(f"t-{uuid.uuid4().hex[:8]}")


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(first=st.binary(max_size=4096), second=st.binary(max_size=70000))
def test_publish_then_read_gives_back_exactly_the_bytes(
    store: Store, first: bytes, second: bytes
) -> None:
    loc = root(store).child("sub", "file.bin")
    loc.publish(first)
    assert loc.read_bytes() == first
    loc.publish(second, fsync=True)  # replaces the whole file
    assert loc.read_bytes() == second
    assert store.read_bytes(loc.uri) == second


def test_publish_without_overwrite_refuses_an_existing_file_and_keeps_it(store: Store) -> None:
    loc = root(store).child("once")
    loc.publish(b"first", overwrite=False)
    with pytest.raises(StateFileExistsError) as ei:
        loc.publish(b"second", overwrite=False, what="segment", hint="one writer per log")
    assert ei.value.path == loc.uri and ei.value.errno == errno.EEXIST
    assert "segment" in ei.value.message and ei.value.hint == "one writer per log"
    assert loc.read_bytes() == b"first"
    assert loc.parent.list() == ["once"]  # no temporary file left behind


def test_a_missing_file_is_not_found_naming_its_uri(store: Store) -> None:
    loc = root(store).child("nothing-here")
    assert not loc.exists()
    with pytest.raises(StateFileNotFoundError) as ei:
        loc.read_bytes("lease")
    assert ei.value.path == loc.uri and ei.value.errno == errno.ENOENT
    assert "lease not found" in str(ei.value)
    loc.delete()  # missing_ok by default
    with pytest.raises(StateFileNotFoundError):
        loc.delete(missing_ok=False)


def test_delete_removes_a_file_or_a_whole_tree(store: Store) -> None:
    top = root(store)
    for name in ("a", "b"):
        top.child(name).publish(name.encode())
    top.child("d", "e", "f").publish(b"deep")
    top.child("a").delete()
    assert not top.child("a").exists() and top.child("b").exists()
    top.delete(recursive=True)
    assert top.list() == []
    assert not top.child("d", "e", "f").exists()
    top.delete(recursive=True)  # gone already: fine
    with pytest.raises(StateFileNotFoundError):
        top.delete(recursive=True, missing_ok=False)


def test_list_and_children_say_names_and_kinds(store: Store) -> None:
    top = root(store)
    assert top.list() == [] and top.children() == []  # not there yet
    top.child("z.bin").publish(b"12345")
    top.child("a.bin").publish(b"")
    top.child("dir", "inner").publish(b"x")
    assert top.list() == ["a.bin", "dir", "z.bin"]
    kinds = {e.name: e.kind for e in top.children()}
    assert kinds == {"z.bin": FileKind.FILE, "a.bin": FileKind.FILE, "dir": FileKind.DIRECTORY}
    assert {e.location.uri for e in top.children()} == {
        top.child(n).uri for n in ("a.bin", "dir", "z.bin")
    }
    assert top.child("dir").children()[0].location.read_bytes() == b"x"


def test_a_trailing_slash_names_the_same_directory(store: Store) -> None:
    """``dir/`` and ``dir`` are one location: its children have no empty path
    component (which pyarrow's object stores refuse), and delete and list work."""
    top = root(store)
    slashed = store.location(top.prefix + "/" + (f"?{top.query}" if top.query else ""))
    assert (slashed.path, slashed.uri) == (top.path, top.uri)
    staged = slashed.child("_staging", "part-0")
    assert staged.uri == top.child("_staging", "part-0").uri
    staged.publish(b"staged")
    assert slashed.child("_staging").list() == ["part-0"]
    staged.delete(missing_ok=False)
    slashed.delete(recursive=True)
    assert not top.exists()


def test_an_exclusive_output_refuses_an_existing_file(store: Store) -> None:
    loc = root(store).child("state.arrow")
    with loc.open_output(exclusive=True) as out:
        out.write(b"state")
    loc.sync()
    with pytest.raises(StateFileExistsError) as ei:
        loc.open_output("keyed-state file", exclusive=True, hint="a directory per checkpoint")
    assert ei.value.hint == "a directory per checkpoint" and ei.value.path == loc.uri
    assert loc.read_bytes() == b"state"


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.binary(max_size=70000))
def test_write_new_makes_its_directories_writes_the_bytes_and_refuses_a_second(
    store: Store, data: bytes
) -> None:
    loc = root(store).child("chk-1", "count-0", "state.arrow")  # no directory exists yet
    loc.write_new(data, what="keyed-state file")
    assert loc.read_bytes() == data
    with pytest.raises(StateFileExistsError) as ei:
        loc.write_new(b"other", what="keyed-state file", hint="a directory per checkpoint")
    assert ei.value.hint == "a directory per checkpoint" and ei.value.path == loc.uri
    assert loc.read_bytes() == data


# ---- failing storage: each step's failure is a StorageError naming the URI


def _eio() -> OSError:
    return OSError(errno.EIO, "Input/output error")


STEPS = {
    "publish": (("open", "write", "close", "mkdir"), lambda loc: loc.publish(b"data")),
    "read": (("read",), lambda loc: loc.read_bytes()),
    "delete": (("delete",), lambda loc: loc.delete()),
    "delete-tree": (("delete",), lambda loc: loc.parent.delete(recursive=True)),
    "list": (("list",), lambda loc: loc.parent.list()),
}


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    step=st.sampled_from(sorted(STEPS)),
    error=st.sampled_from([_eio, enospc, lambda: PermissionError(errno.EACCES, "denied")]),
    data=st.data(),
)
def test_a_failing_filesystem_gives_a_storage_error_naming_the_uri(
    tmp_path: Path, step: str, error: object, data: st.DataObject
) -> None:
    ops, run = STEPS[step]
    op = data.draw(st.sampled_from(ops), label="failing operation")
    base = tmp_path / uuid.uuid4().hex[:8]
    with faulty_dir(str(base)) as (uri, faults):
        loc = Location.parse(uri).child("dir", "file")
        loc.publish(b"before")
        faults.rules = [fail({op}, "/dir", error)]  # type: ignore[arg-type]
        with pytest.raises(StorageError) as ei:
            run(loc)
    e = ei.value
    assert type(e) is StorageError  # neither "not found" nor "exists"
    assert e.path is not None and e.path.startswith(uri)
    assert e.errno == error().errno  # type: ignore[operator]
    assert faults.counts.get(op, 0) >= 1


def test_a_failing_local_rename_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    old, new = (Location.parse(str(tmp_path / "dir")).child(n) for n in ("_metadata", "seg-2"))
    old.publish(b"old")
    with failing_renames(Faults()) as faults:
        faults.rules = [fail({"rename"}, "/dir/", _eio)]
        for loc, overwrite in ((old, True), (new, False)):
            with pytest.raises(StorageError) as ei:
                loc.publish(b"new", overwrite=overwrite, fsync=True)
            assert type(ei.value) is StorageError
            assert ei.value.path == loc.uri and ei.value.errno == errno.EIO
    assert old.read_bytes() == b"old" and not new.exists()
    assert os.listdir(tmp_path / "dir") == ["_metadata"]


def _without_links(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    """A local filesystem whose hard links fail with ``code``: the native publish's
    and ``os.link``."""
    real = location_module.publish_file

    def publish(tmp: str, path: str, data: Any, flags: int) -> tuple[int, str]:
        if flags & location_module.PUBLISH_REPLACE:
            return real(tmp, path, data, flags)
        return code, "link"  # as the call returns it: the temporary file removed

    def no_links(src: object, dst: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(location_module, "publish_file", publish)
    monkeypatch.setattr(os, "link", no_links)


@pytest.mark.parametrize("code", [errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV])
def test_without_hard_links_a_new_file_still_never_replaces_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    _without_links(monkeypatch, code)
    loc = Location.parse(str(tmp_path)).child("seg-1")
    loc.publish(b"first", overwrite=False)
    with pytest.raises(StateFileExistsError):
        loc.publish(b"second", overwrite=False)
    assert loc.read_bytes() == b"first" and os.listdir(tmp_path) == ["seg-1"]


def test_any_other_failure_of_the_hard_link_is_a_storage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a filesystem without hard links falls back to check-then-rename: a link
    that failed otherwise (an I/O error, a full directory) publishes nothing."""
    _without_links(monkeypatch, errno.EIO)
    loc = Location.parse(str(tmp_path)).child("seg-1")
    with pytest.raises(StorageError) as ei:
        loc.publish(b"data", overwrite=False)
    assert type(ei.value) is StorageError and ei.value.errno == errno.EIO
    assert ei.value.path == loc.uri
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("overwrite", [True, False])
def test_a_publish_onto_a_directory_fails_and_leaves_no_temporary(
    tmp_path: Path, overwrite: bool
) -> None:
    """The native publish's own failures (a rename onto a directory, a link onto an
    existing name): the right error, the directory untouched, no temporary file."""
    (tmp_path / "taken").mkdir()
    loc = Location.parse(str(tmp_path)).child("taken")
    with pytest.raises(StorageError) as ei:
        loc.publish(b"data", overwrite=overwrite, fsync=True)
    if overwrite:
        assert type(ei.value) is StorageError and ei.value.errno == errno.EISDIR
    else:
        assert isinstance(ei.value, StateFileExistsError)
    assert os.listdir(tmp_path) == ["taken"] and os.listdir(tmp_path / "taken") == []


# ---- local durability and local failures (native I/O, patched where it calls os)


def _inode(path: str | Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _record_fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The (device, inode) of every descriptor ``os.fsync`` is called with."""
    synced: list[tuple[int, int]] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        synced.append((st.st_dev, st.st_ino))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


@pytest.mark.parametrize("overwrite", [True, False])
def test_a_synced_publish_syncs_the_file_and_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overwrite: bool
) -> None:
    """A local publish is one native call (csrc/section.h ``spl_publish_file``: the
    file fsynced before its name is given, the directory after): what it is asked."""
    synced = _record_fsyncs(monkeypatch)
    asked: list[int] = []
    real = location_module.publish_file

    def publish(tmp: str, path: str, data: Any, flags: int) -> tuple[int, str]:
        asked.append(flags & location_module.PUBLISH_FSYNC)
        return real(tmp, path, data, flags)

    monkeypatch.setattr(location_module, "publish_file", publish)
    loc = Location.parse(str(tmp_path)).child("dir", "_metadata")
    loc.publish(b"unsynced", overwrite=overwrite)
    loc.delete()
    loc.publish(b"durable", fsync=True, overwrite=overwrite)
    assert asked == [0, location_module.PUBLISH_FSYNC] and synced == []
    assert loc.read_bytes() == b"durable" and os.listdir(tmp_path / "dir") == ["_metadata"]


def test_sync_makes_a_written_file_and_its_directory_entry_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced = _record_fsyncs(monkeypatch)
    loc = Location.parse(str(tmp_path)).child("state", "keyed.arrow")
    with loc.open_output(exclusive=True) as out:
        out.write(b"state")
    assert synced == []
    loc.sync()
    assert synced == [_inode(loc.path), _inode(tmp_path / "state")]


def test_a_synced_write_new_syncs_the_file_and_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced = _record_fsyncs(monkeypatch)  # the directory's; the file's is the native call's
    loc = Location.parse(str(tmp_path)).child("state", "keyed.arrow")
    loc.write_new(b"unsynced")
    assert synced == []
    loc.delete()
    loc.write_new(b"durable", fsync=True)
    assert synced == [_inode(tmp_path / "state")] and loc.read_bytes() == b"durable"


def test_a_write_new_under_a_file_is_a_storage_error_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "plain").write_bytes(b"a file, not a directory")
    loc = Location.parse(str(tmp_path)).child("plain", "state.arrow")
    with pytest.raises(StorageError) as ei:
        loc.write_new(b"state", what="keyed-state file")
    assert type(ei.value) is StorageError and ei.value.errno == errno.ENOTDIR
    assert ei.value.path == loc.uri


def _fail_os(
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    where: str,
    errors: list[OSError],
    error: Any = None,
) -> None:
    """Makes ``os.<name>`` (``open`` as the location module calls it) raise
    ``error()`` (an EIO by default) for a path ending in ``where``, recording what
    it raised in ``errors``; other calls go through (a descriptor too)."""
    import builtins

    from spillover.storage import location as location_module

    real = builtins.open if name == "open" else getattr(os, name)

    def failing(path: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(path, str | bytes | os.PathLike) and os.fsdecode(path).endswith(where):
            e = (error or _eio)()
            errors.append(e)
            raise e
        return real(path, *args, **kwargs)

    if name == "open":
        monkeypatch.setattr(location_module, "open", failing, raising=False)
    else:
        monkeypatch.setattr(os, name, failing)


LOCAL_STEPS = {  # step: (os function, failing path's end, run, error names the file)
    "read": ("open", "file", lambda loc: loc.read_bytes(), True),
    "delete": ("remove", "file", lambda loc: loc.delete(), True),
    "list": ("listdir", "dir", lambda loc: loc.parent.list(), False),
    "children": ("scandir", "dir", lambda loc: loc.parent.children(), False),
    "delete-tree": ("unlink", "file", lambda loc: loc.parent.delete(recursive=True), False),
}


@pytest.mark.parametrize("step", sorted(LOCAL_STEPS))
def test_a_failing_local_step_gives_a_storage_error_naming_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    name, where, run, names_file = LOCAL_STEPS[step]
    loc = Location.parse(str(tmp_path)).child("dir", "file")
    loc.publish(b"before")
    raised: list[OSError] = []
    _fail_os(monkeypatch, name, where, raised)
    with pytest.raises(StorageError) as ei:
        run(loc)
    assert raised, f"os.{name} was not called"
    assert type(ei.value) is StorageError and ei.value.errno == errno.EIO
    assert ei.value.path == (loc.uri if names_file else loc.parent.uri)
    monkeypatch.undo()
    assert loc.read_bytes() == b"before"  # a failed step changed nothing


def test_a_tree_delete_removes_what_it_can_and_raises_the_first_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    top = Location.parse(str(tmp_path)).child("chk-3")
    for name in ("a/keep-1", "a/gone", "b/keep-2", "b/x", "c/y", "z"):
        top.child(*name.split("/")).publish(b"x")
    raised: list[OSError] = []
    _fail_os(monkeypatch, "unlink", "keep-1", raised)
    _fail_os(
        monkeypatch, "unlink", "keep-2", raised, lambda: PermissionError(errno.EACCES, "denied")
    )
    real_unlink = os.unlink

    def removed_meanwhile(path: Any, *args: Any, **kwargs: Any) -> None:
        real_unlink(path, *args, **kwargs)
        if os.fsdecode(path).endswith("gone"):  # as if another deleter came first
            raise FileNotFoundError(errno.ENOENT, "No such file or directory")

    monkeypatch.setattr(os, "unlink", removed_meanwhile)
    with pytest.raises(StorageError) as ei:
        top.delete(recursive=True, what="checkpoint directory")
    assert len(raised) == 2
    assert ei.value.errno == raised[0].errno  # the first failure, after all attempts
    assert ei.value.path == top.uri and "checkpoint directory" in ei.value.message
    monkeypatch.undo()
    left = sorted(str(p.relative_to(tmp_path / "chk-3")) for p in (tmp_path / "chk-3").rglob("*"))
    assert left == ["a", "a/keep-1", "b", "b/keep-2"]  # all else is gone


@pytest.mark.parametrize("caller", ["delete_tree", "checkpoint", "batch"])
def test_a_tree_nobody_reads_is_deleted_or_a_warning_says_why(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    caller: str,
) -> None:
    """Retention's checkpoint deletes and a batch run's clean-up share one helper: a
    failure costs space, so it is logged (naming the directory), never raised."""
    from spillover.runtime.batch import scheduler
    from spillover.runtime.checkpointing.metadata import CheckpointStorage

    storage = CheckpointStorage(str(tmp_path), "job")
    tree = storage.location.child("chk-7")
    tree.child("op-0", "state").publish(b"x")
    delete: dict[str, Any] = {
        "delete_tree": lambda: delete_tree(tree),
        "checkpoint": lambda: storage.delete(7),
        "batch": lambda: scheduler.delete_tree(tree),
    }
    raised: list[OSError] = []
    _fail_os(monkeypatch, "unlink", "state", raised)
    with caplog.at_level("WARNING"):
        delete[caller]()
    assert raised and tree.child("op-0", "state").exists()
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert tree.uri in caplog.text and "Input/output error" in caplog.text
    monkeypatch.undo()
    caplog.clear()
    delete[caller]()
    delete[caller]()  # gone already: nothing to say
    assert not tree.exists() and caplog.records == []


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (`make browser`)")
@pytest.mark.parametrize("overwrite", [True, False])
def test_a_synced_publish_syncs_in_order_as_the_system_sees_it(
    tmp_path: Path, overwrite: bool
) -> None:
    """The system calls of one synced publish, traced: the temporary file is fsynced
    before it gets its name (rename or link), the directory after; a publish that
    lost a sync would lose metadata or an event-log segment on power loss."""
    trace = tmp_path / "trace"
    target = tmp_path / "dir" / "_metadata"
    code = (
        "from spillover.storage.location import Location\n"
        f"Location.parse({str(target)!r}).publish(b'durable', fsync=True, overwrite={overwrite})\n"
    )
    order = durable_steps(code, trace, {str(target)})
    step = "rename" if overwrite else "link"
    file_sync = next(i for i, o in enumerate(order) if ".tmp-" in o)
    named = order.index(f"{step} {target}")
    dir_sync = order.index(f"fsync {target.parent}")
    assert file_sync < named < dir_sync, order
    assert target.read_bytes() == b"durable"
