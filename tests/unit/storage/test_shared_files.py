"""Shared state files: gates of several subtasks as whole format-v1 sections of one
file, each read back exactly through its handle's offset and size."""

from __future__ import annotations

import dataclasses
import errno
import os
import threading
import time
from pathlib import Path
from typing import IO

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spillover.storage.shared as shared_mod
from spillover.errors import (
    ForeignFileError,
    SpilloverError,
    StorageError,
    TruncatedFileError,
)
from spillover.storage import (
    GateKind,
    GateStateHandle,
    Storage,
    StorageOptions,
    open_retriever,
    open_storage,
)
from spillover.storage.channel_index import encode_entry, resolve_all
from spillover.storage.handle import state_file_name
from spillover.storage.inspection import inspect_state_file, shared_sections
from spillover.storage.location import Location
from spillover.storage.shared import SharedFile, StagingBackend

# (subtask, gate, [(channel, payload), ...])
Gate = tuple[int, int, list[tuple[int, bytes]]]


def _write(
    shared: SharedFile,
    staging: str,
    cid: int,
    gate: Gate,
    recycle: bool = False,
    indexed: bool = False,
) -> GateStateHandle:
    """Stages one gate and appends it; ``recycle`` gives the emptied staging file back
    for later gates, as channel state does; ``indexed``: its channel index entry
    follows it (its index section, as channel state writes it)."""
    subtask, gate_id, buffers = gate
    backend = StagingBackend(staging)
    storer = Storage(backend, StorageOptions(), cid, subtask).create_storer(gate_id)
    for channel, payload in buffers:
        storer.append(channel, payload)
    handle = storer.close()
    staged = backend.take(state_file_name(gate_id, GateKind.INPUT))
    try:
        entry = encode_entry(handle) if indexed else None
        section = shared.append(staged, handle, empty=recycle, entry=entry)
    except BaseException:
        staged.close()
        raise
    if recycle:
        backend.recycle(staged)
    else:
        staged.close()
    return section


def _read(handle: GateStateHandle, channels: list[int] | None = None) -> dict[int, list[bytes]]:
    got: dict[int, list[bytes]] = {}
    with open_retriever(handle, channels=channels) as r:
        for buf in r:
            got.setdefault(buf.channel_id, []).append(bytes(buf))
    return got


def _per_channel(buffers: list[tuple[int, bytes]]) -> dict[int, list[bytes]]:
    want: dict[int, list[bytes]] = {}
    for channel, payload in buffers:
        want.setdefault(channel, []).append(payload)
    return want


_gates = st.lists(
    st.lists(
        st.tuples(st.integers(0, 3), st.binary(min_size=1, max_size=300)), min_size=0, max_size=12
    ),
    min_size=1,
    max_size=6,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    contents=_gates,
    order=st.randoms(use_true_random=False),
    threads=st.booleans(),
    recycle=st.booleans(),
    indexed=st.booleans(),
)
def test_any_order_of_closing_reads_back_each_gate_exactly(
    tmp_path: Path,
    contents: list[list[tuple[int, bytes]]],
    order: object,
    threads: bool,
    recycle: bool,
    indexed: bool,
) -> None:
    """Subtasks close their gates in any order, from any thread, staged in new files or in
    ones earlier gates emptied: every handle reads back exactly its own buffers, per
    channel, in order, and nobody else's."""
    directory = tmp_path / f"chk-{os.urandom(4).hex()}"
    shared = SharedFile(Location.parse(str(directory)), "group.spill")
    gates: list[Gate] = [(i, i % 2, bufs) for i, bufs in enumerate(contents)]
    closing = list(gates)
    order.shuffle(closing)  # type: ignore[attr-defined]
    handles: dict[int, GateStateHandle] = {}
    if threads:

        def close(g: Gate) -> None:
            handles[g[0]] = _write(shared, str(tmp_path), 7, g, recycle, indexed)

        workers = [threading.Thread(target=close, args=(g,)) for g in closing]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    else:
        for g in closing:
            handles[g[0]] = _write(shared, str(tmp_path), 7, g, recycle, indexed)
    index = sum(h.index.length for h in handles.values() if h.index is not None)
    assert os.path.getsize(shared.path) == sum(h.size for h in handles.values()) + index
    if indexed:  # each gate's maps right after its section, read back as they were
        for h in handles.values():
            assert h.index is not None and h.index.offset == (h.offset or 0) + h.size
            (back,) = resolve_all([dataclasses.replace(h, channels={}, channel_ranges={})])
            assert (back.channels, back.channel_ranges) == (h.channels, h.channel_ranges)
    assert sorted(h.offset or 0 for h in handles.values())[0] == 0
    sections = sorted((h.offset or 0, h.size) for h in handles.values())
    # A file of one section is read whole, unless its index section follows it.
    alone = len(sections) == 1 and not indexed
    assert shared_sections(shared.path) == (None if alone else sections)
    for subtask, _, buffers in gates:
        h = GateStateHandle.from_dict(handles[subtask].to_dict())  # through the metadata
        assert h.uri == shared.path and h.subtask_index == subtask
        assert _read(h) == _per_channel(buffers)
        for c in {c for c, _ in buffers}:  # a ranged read of one channel
            assert _read(h, [c]).get(c) == _per_channel(buffers)[c]
        report = inspect_state_file(h.uri, section=(h.offset or 0, h.size))
        assert report["frame_count"] == len(buffers)


def test_handle_without_offset_reads_as_before(tmp_path: Path) -> None:
    """A handle of a file of its own has no offset key, and such a handle reads."""
    s = open_storage(str(tmp_path / "own"), checkpoint_id=1)
    with s.create_storer(3) as w:
        w.append(0, b"abc")
    h = w.close()
    d = h.to_dict()
    assert "offset" not in d and h.offset is None
    assert _read(GateStateHandle.from_dict(d)) == {0: [b"abc"]}


def test_section_is_checked_against_its_handle(tmp_path: Path) -> None:
    shared = SharedFile(Location.parse(str(tmp_path / "d")), "g.spill")
    a = _write(shared, str(tmp_path), 1, (0, 0, [(0, b"x" * 100)]))
    b = _write(shared, str(tmp_path), 1, (1, 0, [(1, b"y" * 50)]))
    assert b.offset == a.size
    foreign = GateStateHandle.from_dict({**a.to_dict(), "file_id": b.file_id})
    with pytest.raises(ForeignFileError):
        open_retriever(foreign)
    shifted = GateStateHandle.from_dict({**b.to_dict(), "offset": 0})  # not b's section
    with pytest.raises(SpilloverError):
        open_retriever(shifted)
    beyond = GateStateHandle.from_dict({**b.to_dict(), "offset": a.size + 10})
    with pytest.raises(TruncatedFileError):
        open_retriever(beyond)


def test_an_emptied_staging_file_stages_the_next_gate_and_leaves_no_old_bytes(
    tmp_path: Path,
) -> None:
    """A staging file comes back empty and rewound after its append, and the next gate
    staged in it (a smaller one) reads back exactly, with nothing of the first."""
    staging = str(tmp_path / "staging")
    shared = SharedFile(Location.parse(str(tmp_path / "d")), "g.spill")
    backend = StagingBackend(staging)
    storer = Storage(backend, StorageOptions(), 1, 0).create_storer(0)
    storer.append(0, b"big" * 5000)
    first = shared.append(
        staged := backend.take(state_file_name(0, GateKind.INPUT)), storer.close(), empty=True
    )
    inode = os.fstat(staged.fileno()).st_ino
    assert os.fstat(staged.fileno()).st_size == 0 and staged.tell() == 0
    backend.recycle(staged)
    second = _write(shared, staging, 1, (1, 0, [(2, b"small")]), recycle=True)
    kind = None if isinstance(staged, shared_mod._StagingFile) and staged.in_memory else staging
    assert os.fstat(shared_mod._SPARES.take(kind).fileno()).st_ino == inode  # reused
    assert _read(first) == {0: [b"big" * 5000]} and _read(second) == {2: [b"small"]}
    assert second.offset == first.size


def test_a_shared_file_makes_its_directories_and_names_what_failed(tmp_path: Path) -> None:
    """The first append makes every missing directory of the file; where one cannot be
    made (a file stands in the way), the error says which step failed, and nothing is
    counted."""
    deep = SharedFile(Location.parse(str(tmp_path / "a" / "b" / "c")), "g.spill")
    h = _write(deep, str(tmp_path), 1, (0, 0, [(0, b"x")]))
    assert h.offset == 0 and _read(h) == {0: [b"x"]}
    (tmp_path / "file").write_bytes(b"")
    blocked = SharedFile(Location.parse(str(tmp_path / "file" / "sub")), "g.spill")
    with pytest.raises(StorageError) as e:
        _write(blocked, str(tmp_path), 1, (0, 0, [(0, b"x")]))
    assert "mkdir" in str(e.value) and e.value.path == blocked.path
    assert blocked.end == 0 and blocked.sections == 0


def test_a_discarded_gate_leaves_nothing_in_the_shared_file(tmp_path: Path) -> None:
    shared = SharedFile(Location.parse(str(tmp_path / "d")), "g.spill")
    backend = StagingBackend(str(tmp_path))
    storer = Storage(backend, StorageOptions(), 1, 0).create_storer(0)
    storer.append(0, b"lost")
    storer.discard()
    assert backend.list() == []
    h = _write(shared, str(tmp_path), 1, (1, 0, [(0, b"kept")]))
    assert h.offset == 0 and _read(h) == {0: [b"kept"]}


def test_a_failed_first_append_is_written_over(tmp_path: Path) -> None:
    """The first section's copy fails after the file was created: the next gate still
    appends, at offset 0, over what the failed copy left."""
    shared = SharedFile(Location.parse(str(tmp_path / "d")), "g.spill")
    backend = StagingBackend(str(tmp_path))
    storer = Storage(backend, StorageOptions(), 1, 0).create_storer(0)
    storer.append(0, b"cut short" * 100)
    handle = storer.close()
    staged = backend.take(state_file_name(0, GateKind.INPUT))
    staged.truncate(handle.size // 2)  # the staged section ends early: the copy fails
    try:
        with pytest.raises(SpilloverError):
            shared.append(staged, handle)
    finally:
        staged.close()
    h = _write(shared, str(tmp_path), 1, (1, 0, [(0, b"kept")]))
    assert h.offset == 0 and _read(h) == {0: [b"kept"]}


def test_sections_are_not_guessed_past_a_failed_copy(tmp_path: Path) -> None:
    """Bytes a failed copy left after the last section: no sections are made up, and
    the file read whole says what is wrong."""
    shared = SharedFile(Location.parse(str(tmp_path / "d")), "g.spill")
    for subtask in range(2):
        _write(shared, str(tmp_path), 1, (subtask, 0, [(0, b"z" * 40)]))
    assert shared_sections(shared.path) is not None
    with open(shared.path, "ab") as f:
        f.write(b"\0" * 100)
    assert shared_sections(shared.path) is None
    with pytest.raises(SpilloverError):
        inspect_state_file(shared.path)


@pytest.mark.parametrize("pure", ["0", "1"])
def test_damage_in_a_section_is_named_at_the_files_offset(
    tmp_path: Path, pure: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shared file is what the error names, so its offset is the file's (the native
    reader and the pure twin alike), not one relative to the section."""
    monkeypatch.setenv("SPILLOVER_PURE", pure)
    shared = SharedFile(Location.parse(str(tmp_path / "d")), "g.spill")
    _write(shared, str(tmp_path), 1, (0, 0, [(0, b"a" * 100)]))
    b = _write(shared, str(tmp_path), 1, (1, 0, [(1, b"b" * 50)]))
    assert b.offset
    short = GateStateHandle.from_dict({**b.to_dict(), "size": b.size - 10})
    with pytest.raises(TruncatedFileError) as cut:  # no trailer where the handle says
        open_retriever(short)
    assert cut.value.offset is not None
    assert b.offset <= cut.value.offset <= b.offset + short.size  # within b's section
    with open_retriever(b) as r:  # where each frame is, as replay errors name it
        frames = r.poll_frames() if r.wait() else None
    assert frames is not None and list(frames.file_offsets) == [b.offset + 64]
    data = bytearray(Path(shared.path).read_bytes())
    data[b.offset + 64 + 24 + 3] ^= 0xFF  # inside b's payload
    Path(shared.path).write_bytes(bytes(data))
    with pytest.raises(SpilloverError) as bad, open_retriever(b) as r:
        list(r)
    assert bad.value.offset == b.offset + 64  # b's first frame


def _spares_ready(root: str) -> None:
    deadline = time.monotonic() + 10
    while not shared_mod._SPARES._spares.get(root):
        assert time.monotonic() < deadline, "no staging file was made ahead"
        time.sleep(0.005)


def test_staging_files_made_ahead_are_new_empty_and_unlinked(tmp_path: Path) -> None:
    root = str(tmp_path / "staging")
    first = shared_mod._SPARES.take(root)
    _spares_ready(root)
    files = [first, *(shared_mod._SPARES.take(root) for _ in range(6))]
    assert len({os.fstat(f.fileno()).st_ino for f in files}) == len(files)
    for i, f in enumerate(files):
        assert os.fstat(f.fileno()).st_size == 0 and f.tell() == 0
        f.write(b"%d" % i)
    # In memory or unlinked: nothing to clean up after a crash.
    assert not os.path.exists(root) or os.listdir(root) == []
    for i, f in enumerate(files):
        f.seek(0)
        assert f.read() == b"%d" % i
        f.close()


def test_a_forked_process_never_writes_its_parents_staging_files(tmp_path: Path) -> None:
    """A child of ``fork`` shares its parent's open files and their offsets: it must
    make its own staging files, or both would write into one."""
    root = str(tmp_path / "staging")
    shared_mod._SPARES.take(root).close()
    _spares_ready(root)
    spares = list(shared_mod._SPARES._spares[root])  # the parent's, made before the fork
    pid = os.fork()
    if pid == 0:  # the child: takes and writes one, whatever it was handed
        code = 1
        try:
            f = shared_mod._SPARES.take(root)
            f.write(b"child" * 1000)
            f.flush()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert [os.fstat(f.fileno()).st_size for f in spares] == [0] * len(spares)


def test_only_a_local_disk_counts_as_local(tmp_path: Path) -> None:
    """A shared file's appends may run on a task thread only where they cannot wait on
    a network: the mount's type decides, and an unknown one is not local."""
    from spillover.storage.shared import on_local_disk

    mounts = tmp_path / "mounts"
    mounts.write_text(
        "/dev/sda1 / ext4 rw 0 0\n"
        "server:/export /mnt/nfs nfs4 rw 0 0\n"
        "s3fs /mnt/bucket fuse.s3fs rw 0 0\n"
        "tmpfs /mnt/my\\040scratch tmpfs rw 0 0\n"
    )
    m = str(mounts)
    assert on_local_disk("/srv/checkpoints", m)
    assert not on_local_disk("/mnt/nfs/checkpoints", m)
    assert not on_local_disk("/mnt/bucket/chk-1", m)
    assert on_local_disk("/mnt/my scratch/chk-1", m)
    assert on_local_disk("/mnt/nfsish/chk-1", m)  # a sibling, not inside the NFS mount
    assert not on_local_disk("/srv", str(tmp_path / "no-such-file"))


def test_a_shared_file_of_one_member_inspects_past_its_index_section(tmp_path: Path) -> None:
    """A group where one member had in-flight data: its section, then its index
    section. `spillover inspect` finds the section (read whole, the file would end
    in the entry, not a trailer)."""
    staging = tmp_path / "staging"
    staging.mkdir()
    shared = SharedFile(Location.parse(str(tmp_path / "chk-1")), "g.spill")
    backend = StagingBackend(str(staging))
    storer = Storage(backend, StorageOptions(), 1, 0).create_storer(0)
    storer.append(0, b"x" * 100)
    h = storer.close()
    staged = backend.take(state_file_name(0, GateKind.INPUT))
    section = shared.append(staged, h, entry=encode_entry(h))
    staged.close()
    assert shared_sections(shared.path) == [(0, section.size)]
    report = inspect_state_file(shared.path, section=(0, section.size))
    assert (report["frame_count"], report["raw_bytes"], report["checksums_verified"]) == (
        1,
        100,
        True,
    )


def test_subtasks_appending_all_their_gates_at_once_side_by_side(tmp_path: Path) -> None:
    """Each subtask appends all its gates in one call while others do the same: every
    section reads back exactly, its entry right after it, and the file is nothing but
    whole sections one after another."""
    shared = SharedFile(Location.parse(str(tmp_path / "d")), "g.spill")
    results: dict[int, list[tuple[GateStateHandle, list[tuple[int, bytes]]]]] = {}
    start = threading.Barrier(4)

    def subtask(i: int) -> None:
        backend = StagingBackend(str(tmp_path))
        storage = Storage(backend, StorageOptions(), 1, i)
        gates = []
        for g in range(3):
            bufs = [(c, os.urandom(1000 + 97 * (i + g + c))) for c in range(3)]
            storer = storage.create_storer(g)
            for channel, payload in bufs:
                storer.append(channel, payload)
            handle = storer.close()
            staged = backend.take(state_file_name(g, GateKind.INPUT))
            gates.append((staged, handle, encode_entry(handle), bufs))
        start.wait()
        sections = shared.append_all([(f, h, e) for f, h, e, _ in gates], empty=True)
        for f, *_ in gates:
            backend.recycle(f)
        results[i] = [(s, bufs) for s, (*_, bufs) in zip(sections, gates, strict=True)]

    threads = [threading.Thread(target=subtask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    handles = [h for i in range(4) for h, _ in results[i]]
    for i in range(4):
        for handle, bufs in results[i]:
            assert _read(handle) == _per_channel(bufs)
            assert handle.index is not None and handle.index.offset == handle.offset + handle.size
    assert shared.sections == 12 and shared.end == os.path.getsize(shared.path)
    assert shared_sections(shared.path) == sorted((h.offset, h.size) for h in handles)
    resolved = resolve_all(handles)
    assert [h.channels for h in resolved] == [
        {c: (1, len(p)) for c, p in bufs} for i in range(4) for _, bufs in results[i]
    ]


def test_the_part_that_makes_the_file_copies_beside_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint's first part makes the file and copies outside the file's lock,
    as every other part does: a second part appends, whole, while the first one's
    copy is still going (it waited for that copy, then for the GIL, before)."""
    shared = SharedFile(Location.parse(str(tmp_path / "d")), "g.spill")
    real = shared_mod.native.append_sections
    copying, go_on = threading.Event(), threading.Event()

    def append_sections(sections: list[object], *args: object) -> object:
        if sections and threading.current_thread().name == "first":
            copying.set()
            assert go_on.wait(30)
        return real(sections, *args)

    monkeypatch.setattr(shared_mod.native, "append_sections", append_sections)
    handles: dict[str, GateStateHandle] = {}

    def part(name: str, subtask: int) -> None:
        handles[name] = _write(shared, str(tmp_path), 1, (subtask, 0, [(0, name.encode() * 50)]))

    first = threading.Thread(target=part, args=("first", 0), name="first")
    first.start()
    assert copying.wait(30)
    part("second", 1)  # the first one's copy has not written a byte yet
    go_on.set()
    first.join(30)
    assert (handles["first"].offset, handles["second"].offset > 0) == (0, True)
    assert _read(handles["first"]) == {0: [b"first" * 50]}
    assert _read(handles["second"]) == {0: [b"second" * 50]}
    assert shared_sections(shared.path) == sorted((h.offset, h.size) for h in handles.values())


def _staged_inodes(staging: str, shared: SharedFile, gates: list[Gate]) -> list[int]:
    """Stages, appends and recycles each gate in turn, as barriers do one after another:
    the inode of each gate's staging file."""
    inodes = []
    for subtask, gate_id, bufs in gates:
        backend = StagingBackend(staging)
        storer = Storage(backend, StorageOptions(), 1, subtask).create_storer(gate_id)
        for channel, payload in bufs:
            storer.append(channel, payload)
        handle = storer.close()
        staged = backend.take(state_file_name(gate_id, GateKind.INPUT))
        inodes.append(os.fstat(staged.fileno()).st_ino)
        section = shared.append(staged, handle, empty=True, entry=encode_entry(handle))
        backend.recycle(staged)
        assert _read(section) == _per_channel(bufs)
    return inodes


@pytest.mark.parametrize("why", ["staging-memory 0", "SPILLOVER_STAGING_MEMORY=0", "no memfd"])
def test_staging_on_disk_where_memory_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    """Without memory staging (``staging-memory`` 0, SPILLOVER_STAGING_MEMORY=0 or no
    memfd_create) gates are staged in unlinked files of the staging directory, copied
    in the kernel, and one file serves gate after gate (no new file at each barrier):
    the same sections come out, and the directory is left empty."""
    if why == "no memfd":
        monkeypatch.setattr(shared_mod, "_MEMFD", False)
    else:
        if why == "SPILLOVER_STAGING_MEMORY=0":
            monkeypatch.setenv("SPILLOVER_STAGING_MEMORY", "0")
        budget = shared_mod.StagingBudget()
        budget.configure(0 if why == "staging-memory 0" else 64 << 20)
        monkeypatch.setattr(shared_mod, "STAGING_BUDGET", budget)
    monkeypatch.setattr(shared_mod, "_SPARES", shared_mod._Spares())
    staging = str(tmp_path / "disk-staging")
    shared = SharedFile(Location.parse(str(tmp_path / "d")), "g.spill")
    gates: list[Gate] = [(s, 0, [(0, b"a" * 5000), (1, b"b" * 300)]) for s in range(3)]
    assert len(set(_staged_inodes(staging, shared, gates))) == 1
    assert os.path.isdir(staging) and os.listdir(staging) == []


@pytest.fixture
def budget(monkeypatch: pytest.MonkeyPatch) -> shared_mod.StagingBudget:
    """A small staging budget of its own (8 KiB a process, 4 KiB a gate)."""
    if not shared_mod._MEMFD:
        pytest.skip("no memfd_create here")
    monkeypatch.delenv("SPILLOVER_STAGING_MEMORY", raising=False)
    b = shared_mod.StagingBudget(per_process=8 << 10, per_gate=4 << 10)
    monkeypatch.setattr(shared_mod, "STAGING_BUDGET", b)
    return b


def test_a_gate_past_its_memory_bound_moves_to_a_file_and_reads_back_exactly(
    tmp_path: Path, budget: shared_mod.StagingBudget
) -> None:
    """A gate staged in memory that outgrows its bound goes on in a temporary file; the
    section comes back byte-exact, and the memory is given back at once."""
    shared = SharedFile(Location.parse(str(tmp_path / "d")), "g.spill")
    gate: Gate = (0, 0, [(i % 3, bytes([i]) * 1500) for i in range(40)])
    backend = StagingBackend(str(tmp_path / "staging"))
    storer = Storage(backend, StorageOptions(), 1, 0).create_storer(0)
    for channel, payload in gate[2]:
        storer.append(channel, payload)
    name = state_file_name(0, GateKind.INPUT)
    assert budget.used == 0 and backend.memory_limit(name) == 0  # moved
    handle = storer.close()
    staged = backend.take(name)
    section = shared.append(staged, handle, empty=True)
    backend.recycle(staged)
    assert not staged.closed  # a spare file of the staging directory now
    assert shared_mod._SPARES.take(str(tmp_path / "staging")) is staged
    assert _read(section) == _per_channel(gate[2])


def test_a_process_whose_budget_is_taken_stages_the_next_gate_in_a_file(
    tmp_path: Path, budget: shared_mod.StagingBudget
) -> None:
    """Two gates take the budget; a third is staged in a file from its start; closing,
    discarding or failing a gate gives its share back."""
    backend = StagingBackend(str(tmp_path / "staging"))
    storage = Storage(backend, StorageOptions(), 1, 0)
    a, b, c = (storage.create_storer(g) for g in range(3))
    names = [state_file_name(g, GateKind.INPUT) for g in range(3)]
    assert [backend.memory_limit(n) for n in names] == [4 << 10, 4 << 10, 0]
    assert budget.used == 8 << 10
    for s in (a, b, c):
        s.append(0, b"x" * 100)
    a._abandon()  # a discarded gate (abort)
    backend.delete(names[0])
    assert budget.used == 4 << 10
    shared = SharedFile(Location.parse(str(tmp_path / "d")), "g.spill")
    handle = b.close()
    staged = backend.take(names[1])
    shared.append(staged, handle, empty=True)
    backend.recycle(staged)  # appended and emptied
    assert budget.used == 0
    d = storage.create_storer(3)
    assert backend.memory_limit(state_file_name(3, GateKind.INPUT)) == 4 << 10
    d.append(0, b"y" * 10)
    d.close()
    backend.take(state_file_name(3, GateKind.INPUT)).close()  # a failed append closes it
    assert budget.used == 0
    c.close()
    backend.take(names[2]).close()


def test_staging_falls_back_to_files_once_memfd_create_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """memfd_create refused at runtime (an old kernel, a seccomp filter): this gate and
    every later one of the process is staged in a file, and reads back exactly."""

    def refuse(*_: object) -> int:
        raise OSError(errno.ENOSYS, "memfd_create")

    monkeypatch.setattr(shared_mod, "_MEMFD", True)
    monkeypatch.setattr(shared_mod, "_SPARES", shared_mod._Spares())
    monkeypatch.setattr(os, "memfd_create", refuse, raising=False)
    shared = SharedFile(Location.parse(str(tmp_path / "d")), "g.spill")
    staging = str(tmp_path / "staging")
    gates: list[Gate] = [(s, 0, [(0, b"m" * 3000)]) for s in range(2)]
    handles = [_write(shared, staging, 1, g, recycle=True) for g in gates]
    assert shared_mod._MEMFD is False
    for handle, (_, _, bufs) in zip(handles, gates, strict=True):
        assert _read(handle) == _per_channel(bufs)


def test_only_a_staged_gate_may_finish_with_the_gil_kept(tmp_path: Path) -> None:
    """A gate written straight to its own file (maybe NFS or FUSE) lets the GIL go for
    its trailer; only a staging file of this machine may keep it."""
    staged = Storage(StagingBackend(str(tmp_path / "s")), StorageOptions(), 1, 0)
    own = open_storage(str(tmp_path / "own"), checkpoint_id=1)
    a, b = staged.create_storer(0), own.create_storer(0)
    assert a._native.staged and not b._native.staged
    a.close()
    b.close()


def _stage(staging: str, subtask: int, payload: bytes) -> tuple[IO[bytes], GateStateHandle]:
    backend = StagingBackend(staging)
    storer = Storage(backend, StorageOptions(), 1, subtask).create_storer(0)
    storer.append(0, payload)
    handle = storer.close()
    return backend.take(state_file_name(0, GateKind.INPUT)), handle


def test_a_copy_failing_without_an_errno_leaves_the_part_behind_it_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Part A's copy is held up, part B takes its places after A's and finishes, then
    A's copy raises (no errno): B reads back exactly, and so does a part after both;
    a last failing part's places are taken by the next."""
    shared = SharedFile(Location.parse(str(tmp_path / "d")), "g.spill")
    staging = str(tmp_path / "s")
    first = _write(shared, staging, 1, (0, 0, [(0, b"0" * 50)]))
    real = shared_mod.native.append_sections
    b_done = threading.Event()

    def append_sections(*args: object) -> object:
        if threading.current_thread().name == "part-a":
            assert b_done.wait(10)
            raise RuntimeError("not an errno")
        return real(*args)

    monkeypatch.setattr(shared_mod.native, "append_sections", append_sections)
    a_staged, a_handle = _stage(staging, 1, b"a" * 700)
    errors: list[BaseException] = []

    def part_a() -> None:
        try:
            shared.append(a_staged, a_handle)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=part_a, name="part-a")
    t.start()
    while shared.end == first.size:  # A has taken its places
        time.sleep(0.001)
    b_staged, b_handle = _stage(staging, 2, b"b" * 300)
    b = shared.append(b_staged, b_handle)
    b_done.set()
    t.join(10)
    assert [type(e) for e in errors] == [RuntimeError]
    c = _write(shared, staging, 1, (3, 0, [(0, b"c" * 90)]))
    assert _read(b) == {0: [b"b" * 300]} and _read(c) == {0: [b"c" * 90]}
    assert b.offset == first.size + a_handle.size  # after A's unused places
    end = shared.end
    a_staged.close()
    a_staged, a_handle = _stage(staging, 4, b"d" * 20)  # part_a's next part
    t = threading.Thread(target=part_a, name="part-a")
    t.start()
    t.join(10)
    assert shared.end == end  # the last places taken, given back
    for f in (a_staged, b_staged):
        f.close()


@pytest.mark.parametrize("in_memory", [True, False], ids=["memory", "file"])
def test_a_forked_child_closing_its_copy_leaves_the_parents_staged_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_memory: bool
) -> None:
    """A process forked while a gate is staged (a Spark worker's fork, a subprocess)
    closes its copy of the staging file: the parent's staged bytes stay whole, and the
    child's staging budget starts empty."""
    if in_memory and not shared_mod._MEMFD:
        pytest.skip("no memfd_create here")
    f = shared_mod._staging_file(None if in_memory else str(tmp_path / "staging"))
    f.write(b"x" * 5000)
    f.flush()
    taken = shared_mod.STAGING_BUDGET.reserve()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: close its copy, report its budget, leave at once
        try:
            f.close()
            os.write(w, str(shared_mod.STAGING_BUDGET.used).encode())
        finally:
            os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    child_used = os.read(r, 64)
    os.close(r)
    shared_mod.STAGING_BUDGET.release(taken)
    assert os.waitstatus_to_exitcode(status) == 0
    assert os.fstat(f.fileno()).st_size == 5000
    assert child_used == b"0"
    f.close()


_PART_SCRIPT = """
import os, sys
from spillover.storage import GateKind, Storage, StorageOptions, open_retriever
from spillover.storage import shared as shared_mod
from spillover.storage.handle import state_file_name
from spillover.storage.location import Location
from spillover.storage.shared import SharedFile, StagingBackend

root, fsync, moved = sys.argv[1], sys.argv[2] == "fsync", sys.argv[3] == "moved"
shared = SharedFile(Location.parse(os.path.join(root, "d")), "g.spill", fsync=fsync)
backend = StagingBackend(os.path.join(root, "s"))
storage = Storage(backend, StorageOptions(), 1, 0)


def part(gates):
    closed = []
    for g in gates:
        s = storage.create_storer(g)
        s.append(0, bytes([g]) * 3000)
        if moved and g == 1:
            backend.spill(s._name)  # as past its memory bound
        closed.append((backend.take(state_file_name(g, GateKind.INPUT)), s.close(), b"e" * 7))
    return shared.append_all(closed)


part([0])  # creates the file
os.write(2, b"PART-OF-THREE")
handles = part([1, 2, 3])
os.write(2, b"DONE")
for g, h in zip([1, 2, 3], handles):
    with open_retriever(h) as r:
        assert [bytes(b) for b in r] == [bytes([g]) * 3000]
print("read back")
"""


def _traced_part(tmp_path: Path, calls: str, *args: str) -> list[str]:
    """The system calls ``calls`` made while a subtask's part of three gates (each staged
    in memory unless ``moved``: the first moved to a file) is appended to a shared
    file (``fsync``: with fsync on), as strace saw them; the part reads back."""
    import shutil
    import subprocess
    import sys

    if shutil.which("strace") is None:
        pytest.skip("no strace here")
    trace = tmp_path / "trace"
    run = subprocess.run(
        [
            *("strace", "-f", "-qq", "-e", f"trace={calls},write", "-o", str(trace)),
            *(sys.executable, "-c", _PART_SCRIPT, str(tmp_path), *args),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(shared_mod.__file__).parents[2])},
        timeout=120,
    )
    if run.returncode != 0 and "ptrace" in run.stderr:
        pytest.skip("ptrace not permitted here")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "read back"
    lines = trace.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if "PART-OF-THREE" in line)
    end = next(i for i, line in enumerate(lines) if "DONE" in line)
    return [line for line in lines[start:end] if "write(" not in line]


def test_a_part_of_several_gates_is_fsynced_once(tmp_path: Path) -> None:
    """With fsync on, a subtask's part of three gates reaches the disk with one fsync of
    the shared file, not one per gate (each costs a disk flush), and reads back."""
    calls = _traced_part(tmp_path, "fsync,fdatasync", "fsync", "memory")
    assert sum("fsync(" in line for line in calls) == 1


def test_a_gate_moved_to_a_file_is_copied_in_the_kernel_beside_gates_in_memory(
    tmp_path: Path,
) -> None:
    """A part of two gates staged in memory and one moved to a file: the moved one is
    copied file to file in the kernel (copy_file_range), the others from memory
    (sendfile), whatever the process stages, and all read back."""
    if not hasattr(os, "memfd_create"):
        pytest.skip("no memfd_create here")
    calls = _traced_part(tmp_path, "copy_file_range,sendfile", "no-fsync", "moved")
    assert sum("copy_file_range(" in line for line in calls) >= 1
    assert sum("sendfile(" in line for line in calls) >= 2


def test_a_gate_that_cannot_move_out_of_memory_fails_with_one_storage_error(
    tmp_path: Path, budget: shared_mod.StagingBudget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The move of a staged gate to a file fails (a full disk): the append raises one
    StorageError with the errno and the staging directory, and the gate's memory comes
    back once it is discarded."""
    monkeypatch.setattr(shared_mod.native, "copy_range", lambda *_: errno.ENOSPC)
    backend = StagingBackend(str(tmp_path / "staging"))
    storer = Storage(backend, StorageOptions(), 1, 0).create_storer(0)
    with pytest.raises(StorageError) as caught:
        for _ in range(10):
            storer.append(0, b"z" * 1500)
    assert caught.value.errno == errno.ENOSPC and str(tmp_path / "staging") in str(caught.value)
    storer.discard()
    assert budget.used == 0


def test_a_gate_moved_by_positioned_writes_goes_on_at_the_end_of_its_file(
    tmp_path: Path, budget: shared_mod.StagingBudget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The move's copy may fall back to pread and pwrite (which leave the file's offset
    alone): the gate's later buffers still follow its earlier ones, and it reads back
    exactly."""

    def positioned(src: int, dst: int, count: int, at: int, _: bool) -> int:
        os.pwrite(dst, os.pread(src, count, 0), at)
        return 0

    monkeypatch.setattr(shared_mod.native, "copy_range", positioned)
    gate: Gate = (0, 0, [(i % 2, bytes([i]) * 1000) for i in range(12)])
    shared = SharedFile(Location.parse(str(tmp_path / "d")), "g.spill")
    section = _write(shared, str(tmp_path / "staging"), 1, gate)
    assert budget.used == 0
    assert _read(section) == _per_channel(gate[2])


@pytest.mark.parametrize("tiny", [False, True], ids=["sizes", "tiny"])
def test_a_staged_gate_moves_once_and_never_holds_more_than_its_bound_in_memory(
    tmp_path: Path, budget: shared_mod.StagingBudget, monkeypatch: pytest.MonkeyPatch, tiny: bool
) -> None:
    """Buffers of any size, empty ones too: the gate moves to a file exactly once,
    before a buffer would take its memory past its bound (4 KiB here), and reads back
    exactly."""
    moves: list[int] = []
    real = StagingBackend.spill

    def spill(self: StagingBackend, name: str) -> None:
        moves.append(os.fstat(self._files[name].fileno()).st_size)  # in memory now
        real(self, name)

    monkeypatch.setattr(StagingBackend, "spill", spill)
    sizes = [700, 1, 1200, 0, 1500, 3000, 5000, 10, 4096]
    gate: Gate = (0, 0, [(i % 2, bytes([i]) * n) for i, n in enumerate(sizes)])
    if tiny:  # each frame's header counts: 300 tiny buffers are 7 KiB staged
        gate = (0, 0, [(i % 2, bytes([i % 256]) * (i % 2)) for i in range(300)])
    shared = SharedFile(Location.parse(str(tmp_path / "d")), "g.spill")
    section = _write(shared, str(tmp_path / "staging"), 1, gate)
    assert len(moves) == 1 and moves[0] <= budget.per_gate
    assert _read(section) == _per_channel(gate[2])


def test_once_the_budget_is_taken_file_staged_gates_reuse_one_file(
    tmp_path: Path, budget: shared_mod.StagingBudget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two open gates hold the whole memory budget: the gates staged at later barriers
    go to a file, and one file serves them all, not a new one each; a gate moved out
    of memory leaves its file as a spare too. Everything reads back."""
    monkeypatch.setattr(shared_mod, "_SPARES", shared_mod._Spares())
    holders = Storage(StagingBackend(str(tmp_path / "s")), StorageOptions(), 1, 9)
    held = [holders.create_storer(g) for g in range(2)]
    assert budget.used == budget.per_process
    staging = str(tmp_path / "staging")
    shared = SharedFile(Location.parse(str(tmp_path / "d")), "g.spill")
    gates: list[Gate] = [(s, 0, [(0, bytes([s]) * 700)]) for s in range(3)]
    assert len(set(_staged_inodes(staging, shared, gates))) == 1
    for s in held:
        s.discard()
    moved: Gate = (5, 0, [(0, b"m" * 3000), (0, b"n" * 3000)])  # past its 4 KiB: moved
    [inode] = _staged_inodes(staging, shared, [moved])
    assert budget.used == 0
    assert os.fstat(shared_mod._SPARES.take(staging).fileno()).st_ino == inode  # a spare
    assert os.listdir(staging) == []


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.ENOMEM])
def test_a_passing_memfd_create_failure_stages_one_gate_in_a_file_not_all(
    tmp_path: Path, budget: shared_mod.StagingBudget, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """memfd_create fails for a while (descriptors or memory short): the gate staged then
    goes to a file and gives its memory share back; once memfd_create works again the
    next gate is staged in memory. Both read back exactly."""
    real = os.memfd_create
    failing = [True]

    def memfd_create(*args: object) -> int:
        if failing[0]:
            raise OSError(code, os.strerror(code))
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(shared_mod, "_SPARES", shared_mod._Spares())
    monkeypatch.setattr(os, "memfd_create", memfd_create)
    shared = SharedFile(Location.parse(str(tmp_path / "d")), "g.spill")
    staging = str(tmp_path / "staging")
    backend = StagingBackend(staging)
    storage = Storage(backend, StorageOptions(), 1, 0)
    sections = []
    for gate_id, in_memory in ((0, False), (1, True)):
        storer = storage.create_storer(gate_id)
        name = state_file_name(gate_id, GateKind.INPUT)
        assert (backend.memory_limit(name) > 0) is in_memory
        assert budget.used == (budget.per_gate if in_memory else 0)
        storer.append(0, bytes([gate_id]) * 2000)
        staged = backend.take(name)
        sections.append(shared.append(staged, storer.close(), empty=True))
        backend.recycle(staged)
        failing[0] = False  # the next checkpoint: memfd_create works again
    assert shared_mod._MEMFD
    assert [_read(s) for s in sections] == [{0: [bytes([g]) * 2000]} for g in (0, 1)]
    assert budget.used == 0 and os.listdir(staging) == []
