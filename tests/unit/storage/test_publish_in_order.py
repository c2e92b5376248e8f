"""Publishing several files in order (:func:`publish_in_order`): a checkpoint's
metadata and then the job event log's record of it. Whatever fails, a file is never
visible before the ones ahead of it, no temporary file is left, and the error is
the one a publish of the failing file alone gives; the group's one native call
syncs every file's data before the first name is given, and each name's
directory before the next name."""

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

from spillover.errors import StateFileExistsError, StorageError
from spillover.storage import location as location_module
from spillover.storage.location import Location, Publication, publish_in_order
from support.faults import Faults, fail, failing_renames
from support.synced import durable_steps

# One file of a group: (directory index, name index, data, overwrite); names are
# drawn from a few, so that a group can hit a file that exists, or one of its own.
_FILE = st.tuples(st.integers(0, 2), st.integers(0, 2), st.binary(max_size=3000), st.booleans())


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _model(existing: dict[str, bytes], files: list[Any]) -> tuple[dict[str, bytes], int]:
    """What publishing ``files`` one after the other leaves, and the index of the one
    that fails (a new file whose name is taken), -1 for none."""
    tree = dict(existing)
    for i, (d, n, data, overwrite) in enumerate(files):
        name = f"d{d}/f{n}"
        if not overwrite and name in tree:
            return tree, i
        tree[name] = data
    return tree, -1


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    existing=st.dictionaries(
        st.tuples(st.integers(0, 2), st.integers(0, 2)), st.binary(max_size=50)
    ),
    files=st.lists(_FILE, min_size=1, max_size=5),
    fsync=st.booleans(),
)
def test_a_group_publishes_as_one_publish_after_another_would(
    tmp_path: Path, existing: dict[tuple[int, int], bytes], files: list[Any], fsync: bool
) -> None:
    """Against the model of one publish after the other: the same files, the same
    bytes, the failure at the same file (a new file whose name is taken, refused with
    the publish's own error), and nothing else in the directories."""
    root = tmp_path / uuid.uuid4().hex[:8]
    before = {f"d{d}/f{n}": data for (d, n), data in existing.items()}
    for name, data in before.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    base = Location.parse(str(root))
    group = [
        Publication(base.child(f"d{d}", f"f{n}"), data, fsync, overwrite, f"file {i}")
        for i, (d, n, data, overwrite) in enumerate(files)
    ]
    expected, failing = _model(before, files)
    if failing < 0:
        publish_in_order(group)
    else:
        with pytest.raises(StateFileExistsError) as ei:
            publish_in_order(group)
        assert ei.value.path == group[failing].location.uri
    assert _tree(root) == expected  # no temporary file either


def test_a_failing_name_leaves_the_files_ahead_published_and_the_rest_not(
    tmp_path: Path,
) -> None:
    """A storage fault at the second file's rename or link (the event log's record):
    the metadata ahead of it is published, the record and what follows are not, no
    temporary file is left, and the error names the record."""
    base = Location.parse(str(tmp_path))
    group = [
        Publication(base.child("chk-3", "_metadata"), b"meta", True, True, "checkpoint metadata"),
        Publication(base.child("_events", "seg-4"), b"record", True, False, "segment"),
        Publication(base.child("_events", "seg-5"), b"more", True, False, "segment"),
    ]
    with failing_renames(Faults()) as faults:
        faults.rules = [fail({"rename"}, "seg-4", lambda: OSError(errno.EIO, "I/O error"))]
        with pytest.raises(StorageError) as ei:
            publish_in_order(group)
    assert ei.value.path == group[1].location.uri and ei.value.errno == errno.EIO
    assert _tree(tmp_path) == {os.path.join("chk-3", "_metadata"): b"meta"}


@pytest.mark.parametrize("code", [errno.EPERM, errno.EXDEV])
def test_without_hard_links_the_group_still_publishes_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """A filesystem that refuses the group's hard link: the file and the ones after it
    are published one by one (a check, then a rename), an existing name still refused."""
    real = location_module.publish_files

    def refuse_links(files: list[tuple[str, str, Any, int]]) -> tuple[int, int, str]:
        for i, (_, _, _, flags) in enumerate(files):
            if not flags & location_module.PUBLISH_REPLACE:
                if i:
                    rc, at, step = real(files[:i])
                    assert rc == 0, (rc, at, step)
                return code, i, "link"
        return real(files)

    def no_links(src: object, dst: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(location_module, "publish_files", refuse_links)
    monkeypatch.setattr(os, "link", no_links)
    base = Location.parse(str(tmp_path))
    meta, seg = base.child("chk-1", "_metadata"), base.child("_events", "seg-1")
    publish_in_order([Publication(meta, b"m", True, True), Publication(seg, b"s", True, False)])
    assert meta.read_bytes() == b"m" and seg.read_bytes() == b"s"
    with pytest.raises(StateFileExistsError):
        publish_in_order(
            [Publication(meta, b"m2", True, True), Publication(seg, b"x", True, False)]
        )
    assert meta.read_bytes() == b"m2" and seg.read_bytes() == b"s"
    assert sorted(os.listdir(tmp_path / "_events")) == ["seg-1"]


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (`make browser`)")
def test_a_synced_group_syncs_every_file_then_names_each_after_the_last_is_durable(
    tmp_path: Path,
) -> None:
    """The system calls of one synced group, traced: every temporary file is fsynced
    before the first name is given; each file's name (rename or link) comes before
    its directory's fsync, and that before the next file's name. A record made
    visible before its checkpoint's metadata is durable could name a checkpoint a
    crash lost."""
    trace = tmp_path / "trace"
    meta = tmp_path / "chk-7" / "_metadata"
    seg = tmp_path / "_events" / "events-00000009.log"
    code = (
        "from spillover.storage.location import Location, Publication, publish_in_order\n"
        f"publish_in_order([Publication(Location.parse({str(meta)!r}), b'm', True, True),\n"
        f"                  Publication(Location.parse({str(seg)!r}), b's', True, False)])\n"
    )
    order = durable_steps(code, trace, {str(meta), str(seg)})
    file_syncs = [i for i, o in enumerate(order) if ".tmp-" in o]
    assert len(file_syncs) == 2, order
    steps = [f"rename {meta}", f"fsync {meta.parent}", f"link {seg}", f"fsync {seg.parent}"]
    at = [order.index(s) for s in steps]
    assert max(file_syncs) < at[0] and at == sorted(at), order
    assert meta.read_bytes() == b"m" and seg.read_bytes() == b"s"
