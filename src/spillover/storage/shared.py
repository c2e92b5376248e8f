"""Shared state files: the gates of several subtasks in one file per checkpoint.

A shared file is a concatenation of **sections**, each a whole format-v1 gate file
(header, frames, trailer) exactly as :class:`~spillover.storage.Storer` writes it
alone; a section's :class:`~spillover.storage.GateStateHandle` names the shared
file, the section's ``offset`` and its ``size`` (docs/format.md, "Shared files").

Several subtasks append to one file during one checkpoint and each closes its
gates at its own time, so a section cannot be written in place while it grows:
its offset is known only when it closes. A gate is therefore **staged**: its
storer writes into a staging file (:class:`StagingBackend`) through the native
writer's thread, in memory (a ``memfd``: no file of the filesystem is written
before the close; bounded per gate and per process by :data:`STAGING_BUDGET`, past
which a gate moves to a file) or, with no room in that budget (none with
``staging-memory`` 0 or ``SPILLOVER_STAGING_MEMORY=0``) or without ``memfd_create``,
an unlinked temporary file; the caller's buffers are given back as soon as
written. When a
subtask's gates close, :meth:`SharedFile.append_all` takes their places at the end
of the shared file under the file's lock and writes the finished sections there
(``sendfile`` from memory, ``copy_file_range`` from a file, else ``pread`` and
``pwrite``) outside it, in one native call, so the bytes reach the shared file
once; the emptied staging file, of either kind, is kept for the next gate. No task waits for
another's gate or for its copy, a failed or discarded gate leaves nothing a handle
names, and every section a handle names is whole.

Each section may be followed by its gate's **index section**: the gate's channel
index entry (``spillover.storage.channel_index``, metadata version 3), written
in the same native call right after the section, so the handle names its
maps by an offset in the same file and no acknowledgement carries them.

A shared file needs a local filesystem (one that can append at an offset); on an
object store the group's sections are published as one object instead
(:mod:`spillover.storage.shared_objects`).
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import io
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import IO, Any

from spillover._native import _storage as native
from spillover.errors import StateFileExistsError, StateFileNotFoundError, StorageError
from spillover.storage.backends import storage_error
from spillover.storage.handle import GateStateHandle, IndexRef
from spillover.storage.location import Location, fsync_directory

__all__ = ["STAGING_BUDGET", "SharedFile", "StagingBackend", "StagingBudget", "write_at"]

_log = logging.getLogger(__name__)


class _Spares:
    """Staging files ready for use, a few per kind: in memory (the key ``None``) and
    unlinked temporary files of each of the few directories last used. A gate staged
    at a barrier takes one instead of creating it (for a temporary file a directory
    check and an open, about a millisecond on a busy machine) on the task thread. A
    staged file, once its section is appended and it is emptied, comes back
    (:meth:`give`) as a spare of its kind now (a gate moved out of memory is a file),
    so in a steady job the same few files serve every checkpoint, whether its gates
    are staged in memory or in files; one background thread makes more only when a
    kind runs low. A process made by ``fork`` drops its parent's spares (their file
    offsets are shared with the parent)."""

    AHEAD = 8  # spares made per kind when it runs low
    LOW = 4  # fewer than this left after a take: make more (not at every barrier)
    KEEP = 16  # spares kept per kind at most (files given back beyond it close)
    ROOTS = 5  # kinds kept (memory and 4 directories); the spares of older ones close

    def __init__(self) -> None:
        self._reset()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._after_fork)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._spares: dict[str | None, list[IO[bytes]]] = {}  # the oldest kind first
        self._wanted: list[str | None] = []
        self._thread: threading.Thread | None = None

    def _after_fork(self) -> None:
        old = [f for spares in self._spares.values() for f in spares]
        self._reset()
        for f in old:
            with contextlib.suppress(OSError):
                f.close()

    def take(self, root: str | None) -> IO[bytes]:
        """An empty staging file: in memory for ``None``, else an unlinked temporary file
        in ``root`` (made here if none is ready; OSError if it cannot be)."""
        with self._lock:
            spares = self._spares.pop(root, [])
            spare = spares.pop() if spares else None
            self._spares[root] = spares  # the most recent directory last
            if len(spares) < self.LOW and root not in self._wanted:
                self._wanted.append(root)
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._fill, name="staging-spares", daemon=True
                    )
                    self._thread.start()
                self._wake.notify()
        if spare is not None:
            return spare
        return _staging_file(root)

    def give(self, root: str | None, f: IO[bytes]) -> None:
        """Takes back an emptied, rewound staging file of kind ``root`` (as in
        :meth:`take`) for a later take."""
        with self._lock:
            spares = self._spares.setdefault(root, [])
            kept = len(spares) < self.KEEP
            if kept:
                spares.append(f)
            evicted = self._evict()
        for old in evicted if kept else [f, *evicted]:
            old.close()

    def _evict(self) -> list[IO[bytes]]:
        """The spares of the kinds used longest ago, past :attr:`ROOTS`, taken out (to be
        closed outside the lock)."""
        evicted = []
        while len(self._spares) > self.ROOTS:
            evicted.extend(self._spares.pop(next(iter(self._spares))))
        return evicted

    def _fill(self) -> None:
        while True:
            with self._lock:
                while not self._wanted:
                    self._wake.wait()
                root = self._wanted.pop(0)
                missing = self.AHEAD - len(self._spares.get(root, ()))
            made: list[IO[bytes]] = []
            with contextlib.suppress(OSError):  # take() makes its own, and says why not
                for _ in range(missing):
                    made.append(_staging_file(root))
            with self._lock:  # under those given back: a take reuses those first
                self._spares.setdefault(root, [])[:0] = made
                evicted = self._evict()
            for f in evicted:
                f.close()


_SPARES = _Spares()


KEEP_GIL_BYTES = 512 << 10
"""A part's sections of at most this many bytes, staged in memory and not fsynced, are
written into the shared file with the GIL kept: copying 512 KiB from memory into
the page cache takes about 0.15 ms, while taking the GIL back after letting it go
can wait a switch interval (0.5 ms on a Spark worker, 5 ms on the threads
executor) behind busy task threads."""


class StagingBudget:
    """The bytes of gates this process stages in memory at most: ``per_process`` across
    every live staged gate, ``per_gate`` for one. ``memfd`` pages are shared memory:
    outside the process's RSS and never swapped without swap, so an unbounded stage
    could get a worker killed with nothing in its metrics. A gate is staged in memory
    only if ``per_gate`` is free here when it opens (:meth:`reserve`); it moves to a
    file once it holds ``per_gate`` bytes (:meth:`StagingBackend.spill`). Thread-safe."""

    def __init__(self, per_process: int = 64 << 20, per_gate: int = 4 << 20) -> None:
        self._lock = threading.Lock()
        self._gate_bound = per_gate
        # SPILLOVER_STAGING_MEMORY=0 is staging-memory 0 for the process, whatever is set
        self._off = os.environ.get("SPILLOVER_STAGING_MEMORY") == "0"
        self.per_process = 0 if self._off else per_process
        self.per_gate = min(per_gate, self.per_process)
        self.used = 0
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        """A forked child stages nothing of its parent's: its budget starts empty, with
        a lock no parent thread can hold."""
        self._lock = threading.Lock()
        self.used = 0

    def configure(self, per_process: int) -> None:
        """Sets the bound per process (``execution.checkpointing.unaligned.staging-memory``);
        the bound per gate stays, or is the whole budget if smaller. 0: every gate is
        staged in a file, as with SPILLOVER_STAGING_MEMORY=0 (which wins over it)."""
        with self._lock:
            self.per_process = 0 if self._off else per_process
            self.per_gate = min(self._gate_bound, self.per_process)

    def reserve(self) -> int:
        """Takes ``per_gate`` bytes for a gate to stage in memory: the bytes taken, 0 if
        the budget has no room (the gate is then staged in a file)."""
        with self._lock:
            n = self.per_gate
            if n <= 0 or self.used + n > self.per_process:
                return 0
            self.used += n
            return n

    def release(self, n: int) -> None:
        with self._lock:
            self.used -= n


STAGING_BUDGET = StagingBudget()
"""This process's bound on gates staged in memory."""


class _StagingFile(io.FileIO):
    """A staging file (unlinked): emptied as it closes in the process that made it,
    which frees its pages or blocks even where a process forked meanwhile still holds
    its descriptor. A forked child closing its copy empties nothing: the file is its
    parent's, perhaps being written."""

    in_memory = False  # a memfd (copied with sendfile, not copy_file_range)

    def __init__(self, fd: int, mode: str) -> None:
        super().__init__(fd, mode)
        self._pid = os.getpid()

    def close(self) -> None:
        if not self.closed and os.getpid() == self._pid:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fileno(), 0)
        super().close()


class _MemoryFile(_StagingFile):
    """A staging file in memory (a ``memfd``) and the bytes of :data:`STAGING_BUDGET` it
    holds (:attr:`reserved`, given back once it is emptied, moved or closed)."""

    reserved = 0
    in_memory = True  # False once its bytes are moved to a file (its fd now names that)

    def unreserve(self) -> None:
        n, self.reserved = self.reserved, 0
        if n:
            STAGING_BUDGET.release(n)

    def close(self) -> None:
        if not self.closed:
            self.unreserve()
        super().close()


def _temporary_fd(root: str) -> int:
    """The descriptor of a new unlinked temporary file in ``root`` (made if missing)."""
    os.makedirs(root, exist_ok=True)
    # O_TMPFILE where the filesystem has it: the file never has a name to leave behind.
    with tempfile.TemporaryFile(dir=root, prefix="spillover-staging-") as f:
        return os.dup(f.fileno())


def _temporary_file(root: str) -> IO[bytes]:
    """An unlinked temporary file in ``root`` (made if missing)."""
    return _StagingFile(_temporary_fd(root), "w+b")


def _staging_file(root: str | None) -> IO[bytes]:
    """A new empty staging file: in memory (a ``memfd``) for ``None``, else an unlinked
    temporary file in ``root``; OSError if it cannot be made."""
    if root is None:
        return _MemoryFile(os.memfd_create("spillover-staging", os.MFD_CLOEXEC), "w+b")
    return _temporary_file(root)


_MEMFD = hasattr(os, "memfd_create")
"""Whether gates may be staged in memory here: False once ``memfd_create`` is refused
for good (an old kernel, a seccomp filter), not for an error in :data:`_TRANSIENT`."""


_TRANSIENT = frozenset({errno_mod.EMFILE, errno_mod.ENFILE, errno_mod.ENOMEM})
"""``memfd_create`` errors that pass (descriptors or memory short for a while): that
gate is staged in a file, and the next one tries memory again."""


def _take_memory() -> _MemoryFile | None:
    """A staging file in memory, or None where ``memfd_create`` fails (logged)."""
    global _MEMFD
    try:
        f = _SPARES.take(None)
    except OSError as e:
        if e.errno in _TRANSIENT:
            _log.warning("a gate is staged in a file: memfd_create failed (%s)", e)
        else:  # refused for good (an old kernel, a seccomp filter)
            _MEMFD = False
            _log.warning("gates are staged in files: memfd_create failed (%s)", e)
        return None
    assert isinstance(f, _MemoryFile)
    return f


def _keep_open(fsync: bool) -> None:
    pass


_STAGING_HINT = "check io.tmp.dirs: the channel state of shared files is staged there"


class StagingBackend:
    """A :class:`~spillover.storage.backends.Backend` whose files are staging files (in
    memory, else unlinked temporary files in a local directory): a gate's section
    until :meth:`take` hands it on."""

    def __init__(self, root: str | None = None) -> None:
        self.root = os.path.abspath(root or tempfile.gettempdir())
        self._files: dict[str, IO[bytes]] = {}

    def uri_of(self, name: str) -> str:
        return os.path.join(self.root, name)

    def create(self, name: str) -> tuple[int, Callable[[Any], Any] | None, Callable[[bool], None]]:
        if name in self._files:
            raise StateFileExistsError("state file already exists", path=self.uri_of(name))
        try:
            f: IO[bytes] | None = self._in_memory()
            if f is None:  # no room in memory (or staging-memory 0): a file, reused
                f = _SPARES.take(self.root)
        except OSError as e:
            raise storage_error("cannot create a staging file", self.root, e, _STAGING_HINT) from e
        self._files[name] = f
        # The writer writes to f's own descriptor, which f keeps open (and the staged
        # bytes with it) until the section is appended: nothing to close here.
        return f.fileno(), None, _keep_open

    @staticmethod
    def _in_memory() -> _MemoryFile | None:
        """A staging file in memory holding its share of :data:`STAGING_BUDGET`, or None
        if the budget has no room or ``memfd_create`` fails."""
        if not _MEMFD or not (reserved := STAGING_BUDGET.reserve()):
            return None
        f = _take_memory()
        if f is None:
            STAGING_BUDGET.release(reserved)
        else:
            f.reserved = reserved
        return f

    def memory_limit(self, name: str) -> int:
        """The bytes ``name`` may stage in memory before it must :meth:`spill` (0: it
        is staged in a file)."""
        f = self._files[name]
        return f.reserved if isinstance(f, _MemoryFile) else 0

    def spill(self, name: str) -> None:
        """Moves the staged bytes of ``name`` from memory into a temporary file, under the
        same descriptor (its writer goes on there), and gives its memory back to
        :data:`STAGING_BUDGET`. Only while nothing writes to it: its writer's thread
        calls this with its writer drained."""
        f = self._files[name]
        if not isinstance(f, _MemoryFile) or not f.reserved:
            return
        try:
            fd, disk = f.fileno(), _temporary_fd(self.root)
            memory = -1
            try:
                size = os.fstat(fd).st_size
                rc = native.copy_range(fd, disk, size, 0, True)
                if rc:  # EIO: the memory file shrank under us
                    raise OSError(rc, os.strerror(rc))
                os.lseek(disk, size, os.SEEK_SET)  # the writer goes on at the end
                memory = os.dup(fd)
                os.dup2(disk, fd, inheritable=False)
                os.ftruncate(memory, 0)  # only now: until dup2, fd still wrote there
            finally:
                os.close(disk)  # not emptied: fd names the same file now
                if memory >= 0:
                    os.close(memory)
        except OSError as e:
            raise storage_error(
                "cannot move a staged gate out of memory", self.root, e, _STAGING_HINT
            ) from e
        f.in_memory = False
        f.unreserve()

    def open_read(self, name: str) -> Any:
        raise StateFileNotFoundError("a staged section is read from its shared file", path=name)

    def take(self, name: str) -> IO[bytes]:
        """The staged file of a closed gate; the caller closes it (which deletes it)."""
        return self._files.pop(name)

    def recycle(self, f: IO[bytes]) -> None:
        """Keeps a taken file, emptied after its append, for another gate, as a spare of
        its kind now (a gate moved out of memory left a file of this directory); a
        closed one is dropped."""
        if isinstance(f, _MemoryFile):
            f.unreserve()
        if not f.closed:
            in_memory = isinstance(f, _StagingFile) and f.in_memory
            _SPARES.give(None if in_memory else self.root, f)

    def delete(self, name: str) -> None:
        f = self._files.pop(name, None)
        if f is not None:
            f.close()

    def list(self) -> list[str]:
        return sorted(self._files)


_LOCAL_FILESYSTEMS = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "bcachefs", "tmpfs", "ramfs", "overlay"}
)


def on_local_disk(path: str, mounts: str = "/proc/self/mounts") -> bool:
    """Whether ``path`` lies on a filesystem of this machine's own disks or memory (by
    the type of its mount in ``mounts``): False for a network filesystem (NFS, a FUSE
    mount of an object store) and wherever it cannot tell. A few system calls: ask
    once per checkpoint directory root, not per file."""
    try:
        with open(mounts, encoding="utf-8", errors="replace") as f:
            table = [fields[1:3] for fields in map(str.split, f) if len(fields) >= 3]
    except OSError:
        return False
    real = os.path.realpath(path)
    best, kind = "", ""
    for point, fstype in table:
        point = point.replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fstype
    return kind in _LOCAL_FILESYSTEMS


class SharedFile:
    """One shared state file of one checkpoint: closed gates appended whole, one at a
    time. Thread-safe; the file is created by the first append."""

    def __init__(
        self, directory: Location, name: str, *, fsync: bool = False, local: bool | None = None
    ) -> None:
        if not directory.local:
            raise ValueError(f"shared state files need a local filesystem, not {directory.uri}")
        self.directory = directory.path
        self.path = os.path.join(directory.path, name)
        self.fsync = fsync
        self.end = 0
        self.sections = 0
        self._created = False
        self._lock = threading.Lock()  # held only to count places (and to make the file)
        self._local = local

    @property
    def local(self) -> bool:
        """Whether the file is on a local disk (appending never waits on a network):
        as given, else asked once (:func:`on_local_disk`)."""
        if self._local is None:
            self._local = on_local_disk(self.directory)
        return self._local

    def append(
        self,
        staged: IO[bytes],
        handle: GateStateHandle,
        *,
        empty: bool = False,
        entry: bytes | None = None,
    ) -> GateStateHandle:
        """Copies a closed gate's staged section (``handle`` its own handle) into the file,
        then ``entry`` (its channel index entry) right after it, as its index section;
        returns the handle of the section in this file (``index`` naming the entry).
        ``empty``: afterwards the staged file is empty and rewound, ready to stage
        another gate, or closed where it could not be emptied (after an error the
        caller still has it, and closes it). See :meth:`append_all`."""
        return self.append_all([(staged, handle, entry)], empty=empty)[0]

    def append_all(
        self,
        sections: Sequence[tuple[IO[bytes], GateStateHandle, bytes | None]],
        *,
        empty: bool = False,
    ) -> list[GateStateHandle]:
        """:meth:`append` for a subtask's closed gates, ``(staged file, handle, entry)``
        each, one after another in the file: their handles in this file.

        The sections' places (their sizes and their entries') are taken together under
        the file's lock, and the copies into them run outside it, in one native call
        (it opens, copies in the kernel, writes each entry, fsyncs if asked and
        closes, with the GIL let go once: on a busy worker each time it is taken back
        costs). Parts closing at the same time so copy side by side and none waits
        for another's copy; the checkpoint's first part only makes the file under the
        lock (:meth:`_create`), then copies outside it too. On an error nothing is
        counted: the places are written over by the next sections if none was taken
        after them, else left unused (no handle names them; the checkpoint is
        declined); every section a handle names stays whole."""
        if not sections:
            return []
        sizes = [h.size + (len(e) if e is not None else 0) for _, h, e in sections]
        total = sum(sizes)
        with self._lock:
            offset = self.end
            if not self._created:
                self._create()  # raises with nothing counted
            self.end += total
        try:
            rc, step, emptied = self._copy(sections, sizes, offset, empty)
        except BaseException:  # not an errno (a bad argument, an interrupt)
            self._give_back(offset, total)
            raise
        if rc:
            self._give_back(offset, total)
            raise self._error(rc, step, offset)
        with self._lock:
            self.sections += len(sections)
        out = []
        at = offset
        for (staged, handle, entry), size, done in zip(sections, sizes, emptied, strict=True):
            if empty and not done:
                staged.close()
            index = (
                IndexRef(self.path, at + handle.size, size - handle.size)
                if entry is not None
                else None
            )
            out.append(replace(handle, uri=self.path, offset=at, index=index))
            at += size
        return out

    def _give_back(self, offset: int, size: int) -> None:
        """Failed places from ``offset``: if they are the last taken, the next sections go
        over them; else they stay unused (no handle names them)."""
        with self._lock:
            if self.end == offset + size:
                self.end = offset

    def _copy(
        self,
        sections: Sequence[tuple[IO[bytes], GateStateHandle, bytes | None]],
        sizes: Sequence[int],
        offset: int,
        empty: bool,
    ) -> tuple[int, str, list[bool]]:
        """The native copy of the sections (``sizes``: each with its entry) from
        ``offset`` on into the file made already, opened and fsynced once: ``(errno or
        0, step, emptied per section)``."""
        flags = (native.SECTION_FSYNC if self.fsync else 0) | (native.SECTION_EMPTY if empty else 0)
        places = []
        at = offset
        for (staged, handle, entry), size in zip(sections, sizes, strict=True):
            # Per file: a gate moved out of memory is copied in the kernel (copy_file_range).
            memory = isinstance(staged, _StagingFile) and staged.in_memory
            places.append((staged.fileno(), handle.size, at, memory, entry or b""))
            at += size
        keep_gil = (
            all(memory for _, _, _, memory, _ in places)
            and not self.fsync
            and self.local
            and at - offset <= KEEP_GIL_BYTES
        )
        rc, step, _, emptied = native.append_sections(places, self.path, flags, keep_gil)
        return rc, step, emptied

    def _create(self) -> None:
        """Makes the file, empty, under the lock (and with ``fsync`` its directory entry
        durable), so that every part copies outside it, the first one too: a part that
        waited for the first one's copy waited again for the GIL after it, milliseconds
        on a busy worker. Without fsync the GIL stays held: a few metadata calls."""
        rc, step, opened, _ = native.append_sections(
            [], self.path, native.SECTION_CREATE, not self.fsync
        )
        # Ours once opened: later sections open it without O_EXCL.
        self._created = self._created or opened
        if rc == 0 and self.fsync:
            try:
                fsync_directory(self.directory)
            except OSError as e:
                rc, step = e.errno or errno_mod.EIO, "fsync of its directory"
        if rc:
            raise self._error(rc, step, self.end)

    def _error(self, rc: int, step: str, offset: int) -> StorageError:
        """What a failed creation or copy raises."""
        if step == "open" and rc == errno_mod.EEXIST:  # only a creation opens with O_EXCL
            return StateFileExistsError(
                "shared state file already exists",
                path=self.path,
                errno=rc,
                hint="each checkpoint needs its own directory",
            )
        return StorageError(
            "cannot write shared state file",
            path=self.path,
            offset=offset,
            errno=rc,
            detail=f"{step}: {os.strerror(rc)}",
            hint="check that the storage is reachable and writable",
        )


def write_at(
    path: str, offset: int, data: bytes, *, fsync: bool = False, create: bool = False
) -> None:
    """Writes ``data`` at byte ``offset`` of the local file ``path`` (an index section
    after a section just copied there); ``create``: the file may not exist yet."""
    flags = os.O_WRONLY | getattr(os, "O_CLOEXEC", 0) | (os.O_CREAT if create else 0)
    fd = os.open(path, flags, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
