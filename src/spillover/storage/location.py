"""Where storage lives: one value for a local directory or a path on any
``pyarrow.fs`` filesystem, worked out from a URI in one place.

A :class:`Location` keeps what a URI says (``/tmp/x``, ``file:///tmp/x``,
``s3://bucket/dir?endpoint_override=host:port&scheme=http``): the filesystem, the
path on it, and the query (endpoint, region, ...) that every child URI carries on,
so that a URI written into a handle or checkpoint metadata reopens the same place.
Local locations use native I/O (``filesystem`` is None); everything else goes
through pyarrow. "Not found" is told by errno or by the filesystem's own
``FileType.NotFound``, never by an exception's message text.

A location also owns the few file-system steps the runtime's small files need
(checkpoint metadata, the job event log and its lease, keyed-state files): read a
whole file, publish one atomically, delete a file or a tree, list a directory.
Each maps failures once: a missing file is :class:`StateFileNotFoundError`, an
existing one that must not be replaced :class:`StateFileExistsError`, anything
else :class:`StorageError`, all naming the location's URI.
"""

from __future__ import annotations

import builtins
import contextlib
import enum
import errno as errno_mod
import logging
import os
import re
import shutil
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from spillover._native import _storage as native
from spillover.errors import StateFileExistsError, StateFileNotFoundError, StorageError

if TYPE_CHECKING:
    import pyarrow.fs as pafs

__all__ = [
    "PUBLISH_FSYNC",
    "PUBLISH_REPLACE",
    "Entry",
    "FileKind",
    "Location",
    "Publication",
    "delete_tree",
    "fsync_directory",
    "publish_file",
    "publish_files",
    "publish_in_order",
    "register_filesystem",
]

logger = logging.getLogger(__name__)

_REACHABLE = "check that the storage is reachable and writable"

# URI schemes served by a pyarrow filesystem this process registered (a test's
# fault-injecting filesystem, say): ``<scheme>:///abs/path`` is ``/abs/path`` on it.
_REGISTERED: dict[str, Any] = {}

# One filesystem per (scheme, authority, query) in a process, as Flink caches its
# FileSystems: pyarrow's ``from_uri`` of an ``s3://`` URI without ``region=`` asks
# S3 for the bucket's region over the network, which a task thread must not wait
# for at every file it opens. Value: the filesystem and the path of the URI's root.
_OPENED: dict[tuple[str, str, str], tuple[Any, str]] = {}
# A URI path the cache may append as it is: characters pyarrow neither decodes (an
# escape such as ``%20``) nor refuses (a space), so its answer would be the same.
_PLAIN_PATH = re.compile(r"[A-Za-z0-9\-._~/!$&'()*+,;=:@]*")


def register_filesystem(scheme: str, filesystem: Any | None) -> None:
    """Serves URIs ``<scheme>:///path`` in this process with ``filesystem`` (a
    ``pyarrow.fs.FileSystem``; None unregisters). Threads of this process see it,
    other processes (Spark workers) do not."""
    if filesystem is None:
        _REGISTERED.pop(scheme, None)
    else:
        _REGISTERED[scheme] = filesystem


# A local publish's one native call and its flags (module-level: the chaos
# harness's failing renames wrap it, as they wrap ``os.replace`` and ``os.link``).
publish_file = native.publish_file
publish_files = native.publish_files  # several, in order (publish_in_order)
PUBLISH_FSYNC = native.SECTION_FSYNC
PUBLISH_REPLACE = native.PUBLISH_REPLACE


def fsync_directory(path: str) -> None:
    """Makes the entries of the local directory ``path`` durable (a new file's name)."""
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


@dataclass(frozen=True)
class Publication:
    """A file :func:`publish_in_order` publishes: :meth:`Location.publish`'s arguments."""

    location: Location
    data: bytes
    fsync: bool = False
    overwrite: bool = True
    what: str = "file"
    hint: str | None = None

    def publish(self) -> None:
        """This file alone, as :meth:`Location.publish` writes it."""
        self.location.publish(
            self.data, fsync=self.fsync, overwrite=self.overwrite, what=self.what, hint=self.hint
        )


def publish_in_order(files: Sequence[Publication]) -> None:
    """Publishes ``files`` as :meth:`Location.publish` writes each, in order: a file
    becomes visible only after every earlier one is, durably so where it asks for
    fsync. A failure is raised as that publish raises it, with the files before the
    failing one published and the later ones not.

    Local files that all ask for fsync take one native call (``spl_publish_files``):
    every file's data is written and synced first, then each is renamed or linked
    and its directory synced in turn. Their data thus costs one journal commit
    where one publish after the other costs one per file: the job master's
    completion of a checkpoint, its metadata and then the event log's record of it,
    syncs three times, not four. Elsewhere, one publish after the other."""
    native_ok = (
        1 < len(files) <= native.PUBLISH_MAX
        and all(f.location.local and f.fsync for f in files)
        and not any(
            not f.overwrite and os.path.dirname(f.location.path) in _LINKS_REFUSED for f in files
        )
    )
    if not native_ok:
        for f in files:
            f.publish()
        return
    rc, at, step = publish_files(
        [f.location._native_publish(f.data, fsync=True, overwrite=f.overwrite) for f in files]
    )
    if rc:
        failed = files[at]
        failed.location._native_publish_failed(rc, step, failed.what, failed.hint)
        for f in files[at:]:  # hard links refused: this one and the rest, one by one
            f.publish()


def delete_tree(location: Location, what: str = "directory") -> None:
    """Deletes a directory nobody reads any more (a subsumed checkpoint, a finished
    run's results) and what it holds; a missing one is fine. A failure is logged,
    not raised: what is left costs space, never correctness."""
    try:
        location.delete(recursive=True, what=what)
    except StorageError as e:
        logger.warning("could not delete %s %s: %s", what, location.uri, e)


class FileKind(enum.Enum):
    """What a directory entry is."""

    FILE = "file"
    DIRECTORY = "directory"
    OTHER = "other"


def _pafs() -> Any:
    """``pyarrow.fs``, loaded on first use: an engine that only touches local files
    never pays for pyarrow (tens of MB and a slower import)."""
    import pyarrow.fs

    return pyarrow.fs


def _open_filesystem(
    text: str, scheme: str, netloc: str, upath: str, query: str
) -> tuple[Any, str]:
    """``pyarrow.fs.FileSystem.from_uri(text)``, its filesystem reused for every URI
    of the same scheme, authority and query (see ``_OPENED``)."""
    key = (scheme, netloc, query)
    plain = _PLAIN_PATH.fullmatch(upath) is not None and "#" not in text
    opened = _OPENED.get(key) if plain else None
    if opened is not None:
        return opened[0], opened[1] + upath
    try:
        fs, path = _pafs().FileSystem.from_uri(text)
    except (OSError, ValueError) as e:
        raise StorageError(
            "cannot open the filesystem of this URI",
            path=text,
            detail=f"{type(e).__name__}: {e}",
            hint="use a local path or a URI pyarrow.fs understands (s3://, gs://, hdfs://)",
        ) from e
    # The root's path is what pyarrow made of the URI minus the URI's own path (for
    # s3 and gs the bucket, for hdfs nothing); a path pyarrow may rewrite otherwise
    # (an escaped character, say) is neither cached nor served from the cache: each
    # such URI is opened anew.
    if plain and path.endswith(upath) and upath:
        _OPENED.setdefault(key, (fs, path[: len(path) - len(upath)]))
    return fs, path


@dataclass(frozen=True)
class Location:
    """A directory or file: ``path`` on ``filesystem`` (None: the local disk).

    ``prefix`` is the URI without its query (for a local location, the path), and
    ``query`` the URI's query without ``?``.
    """

    path: str
    filesystem: Any = None
    prefix: str = ""
    query: str = ""

    @classmethod
    def parse(cls, uri: str | os.PathLike[str], filesystem: Any = None) -> Location:
        """The location of a local path, a ``file://`` URI or any URI ``pyarrow.fs``
        understands; ``filesystem`` forces a pyarrow filesystem with ``uri`` as its
        path (such a location's URI reopens only with the same filesystem). A
        trailing ``/`` names the same directory (its children have no empty path
        component, which pyarrow's object stores refuse)."""
        text = os.fspath(uri)
        if filesystem is not None:
            path = text.rstrip("/") or "/"
            return cls(path, filesystem, path)
        parsed = urlparse(text)
        if parsed.scheme in _REGISTERED:
            prefix, _, query = text.partition("?")
            path = (parsed.netloc + parsed.path).rstrip("/") or "/"
            return cls(path, _REGISTERED[parsed.scheme], prefix.rstrip("/"), query)
        if parsed.scheme in ("", "file") or (len(parsed.scheme) == 1 and os.name == "nt"):
            path = os.path.abspath(parsed.path if parsed.scheme == "file" else text)
            return cls(path, None, path)
        prefix, _, query = text.partition("?")
        fs, path = _open_filesystem(text, parsed.scheme, parsed.netloc, parsed.path, query)
        return cls(path.rstrip("/"), fs, prefix.rstrip("/"), query)

    @property
    def local(self) -> bool:
        """Whether native local I/O serves this location."""
        return self.filesystem is None

    @property
    def uri(self) -> str:
        """The URI that parses back to this location (a path when local)."""
        return self.prefix + (f"?{self.query}" if self.query else "")

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rpartition("/")[2]

    def child(self, *names: str) -> Location:
        """The location of ``names`` below this one (the query carried on)."""
        if self.local:
            path = os.path.join(self.path, *names)
            return Location(path, None, path)
        tail = "/".join(n.strip("/") for n in names)
        return Location(f"{self.path}/{tail}", self.filesystem, f"{self.prefix}/{tail}", self.query)

    @property
    def parent(self) -> Location:
        """The directory holding this location."""
        if self.local:
            path = os.path.dirname(self.path) or "."
            return Location(path, None, path)
        return Location(
            self.path.rpartition("/")[0],
            self.filesystem,
            self.prefix.rpartition("/")[0],
            self.query,
        )

    def arrow(self) -> tuple[Any, str]:
        """``(pyarrow filesystem, path)``, a local location included."""
        return (self.filesystem or _pafs().LocalFileSystem()), self.path

    def file_type(self) -> pafs.FileType:
        fs, path = self.arrow()
        try:
            return fs.get_file_info(path).type
        except OSError as e:
            raise self.error("cannot reach storage", e) from e

    def exists(self) -> bool:
        """Whether anything is at this location (a local one asks the OS, without
        pyarrow)."""
        if self.local:
            try:
                os.stat(self.path)
            except (FileNotFoundError, NotADirectoryError):
                return False
            except OSError as e:
                raise self.error("cannot reach storage", e) from e
            return True
        return bool(self.file_type() != _pafs().FileType.NotFound)

    def read_bytes(self, what: str = "file") -> bytes:
        """The whole file (a small one: metadata, a log segment, a lease)."""
        try:
            if self.local:
                with open(self.path, "rb") as f:
                    return f.read()
            with self.filesystem.open_input_stream(self.path) as f:
                return bytes(f.read())
        except FileNotFoundError as e:
            raise self.not_found(what) from e
        except OSError as e:
            if not self.local and self._missing():
                raise self.not_found(what) from e
            raise self.error(f"cannot read {what}", e) from e

    def publish(
        self,
        data: bytes,
        *,
        fsync: bool = False,
        overwrite: bool = True,
        what: str = "file",
        hint: str | None = None,
    ) -> None:
        """Writes ``data`` as this file so that a reader sees the old content (or
        none) or all of the new, never a part; its directory is created first.

        Locally: a temporary file beside it (``<name>.tmp-<hex>``, removed on
        failure), then a rename, or without ``overwrite`` a hard link, which never
        replaces a file (without hard links: a check, then a rename). ``fsync``
        makes the file and its directory entry durable before this returns. On
        other filesystems one output stream to the final name (an object store
        publishes the object whole on close); without ``overwrite`` an existing file
        is refused by a check with a race window. An existing file that must not
        be replaced raises :class:`StateFileExistsError` (with ``hint``, the
        caller's advice).
        """
        if self.local:
            self._publish_local(data, fsync=fsync, overwrite=overwrite, what=what, hint=hint)
            return
        if not overwrite and self.exists():
            raise self.exists_error(what, hint)
        self._write_output(data, what)

    def _publish_local(
        self, data: bytes, *, fsync: bool, overwrite: bool, what: str, hint: str | None
    ) -> None:
        """One native call writes the temporary file, fsyncs it, renames or links it
        and fsyncs the directory, so the GIL is let go once: on a busy process each
        take back costs up to a switch interval, and the job master publishes a
        checkpoint's metadata and its event-log record this way on the checkpoint's
        critical path. Without hard links, the check and the rename of
        :func:`_create`."""
        directory = os.path.dirname(self.path)
        if not overwrite and directory in _LINKS_REFUSED:
            self._publish_renamed(data, fsync=fsync, what=what, hint=hint)
            return
        rc, step = publish_file(*self._native_publish(data, fsync=fsync, overwrite=overwrite))
        if rc:
            self._native_publish_failed(rc, step, what, hint)
            self._publish_renamed(data, fsync=fsync, what=what, hint=hint)

    def _native_publish(
        self, data: bytes, *, fsync: bool, overwrite: bool
    ) -> tuple[str, str, memoryview, int]:
        """A native publish's arguments for ``data`` as this file: ``(temporary file
        beside it, path, bytes, flags)``."""
        tmp = f"{self.path}.tmp-{uuid.uuid4().hex[:12]}"
        flags = (PUBLISH_FSYNC if fsync else 0) | (PUBLISH_REPLACE if overwrite else 0)
        return tmp, self.path, memoryview(data).cast("B"), flags

    def _native_publish_failed(self, rc: int, step: str, what: str, hint: str | None) -> None:
        """Raises the error of a native publish of this file that returned ``rc`` at
        ``step``; returns only where the filesystem refused the hard link, remembering
        that (publish it again: later publishes there check, then rename, and do not
        write and sync it all twice)."""
        if rc == errno_mod.EEXIST and step == "link":
            raise self.exists_error(what, hint)
        if rc in _NO_HARD_LINKS and step == "link":
            _LINKS_REFUSED.add(os.path.dirname(self.path))
            return
        raise self._native_error(what, rc, step)

    def _native_error(self, what: str, rc: int, step: str) -> StorageError:
        """A native write's failure: ``rc`` an errno, ``step`` where it failed."""
        return StorageError(
            f"cannot write {what}",
            path=self.uri,
            errno=rc,
            detail=f"{step}: {os.strerror(rc)}",
            hint=_REACHABLE,
        )

    def _publish_renamed(self, data: bytes, *, fsync: bool, what: str, hint: str | None) -> None:
        """A new file published on a filesystem without hard links: a check, then a
        rename (a race window with another writer of the same name)."""
        directory = os.path.dirname(self.path)
        tmp = f"{self.path}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            os.makedirs(directory, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
            _create(tmp, self.path)
            if fsync:
                fsync_directory(directory)
        except FileExistsError as e:
            raise self.exists_error(what, hint) from e
        except OSError as e:
            raise self.error(f"cannot write {what}", e) from e
        finally:
            with contextlib.suppress(OSError):
                os.remove(tmp)

    def delete(
        self, *, missing_ok: bool = True, recursive: bool = False, what: str = "file"
    ) -> None:
        """Removes this file, or with ``recursive`` this directory and everything in
        it (as much of it as can be removed before the first failure is raised). A
        location that is not there is fine with ``missing_ok``, else
        :class:`StateFileNotFoundError`."""
        try:
            if self.local and recursive:
                _remove_tree(self.path)
            elif self.local:
                os.remove(self.path)
            elif recursive:
                self.filesystem.delete_dir(self.path)
            else:
                self.filesystem.delete_file(self.path)
        except FileNotFoundError as e:
            if not missing_ok:
                raise self.not_found(what) from e
        except OSError as e:
            if not self.local and self._missing():
                if missing_ok:
                    return
                raise self.not_found(what) from e
            raise self.error(f"cannot delete {what}", e) from e

    def list(self, what: str = "directory") -> list[str]:
        """Names of the entries of this directory, sorted; none when it is not there.
        Names only: locally one ``os.listdir``, no call per entry."""
        try:
            if self.local:
                try:
                    return sorted(os.listdir(self.path))
                except (FileNotFoundError, NotADirectoryError):
                    return []
            selector = _pafs().FileSelector(self.path, allow_not_found=True)
            return sorted(i.base_name for i in self.filesystem.get_file_info(selector))
        except OSError as e:
            raise self.error(f"cannot list {what}", e) from e

    def children(self, what: str = "directory") -> builtins.list[Entry]:
        """The entries of this directory (not recursive), in no particular order;
        none when it is not there."""
        try:
            if self.local:
                out = []
                try:
                    scan = os.scandir(self.path)
                except (FileNotFoundError, NotADirectoryError):
                    return []
                with scan:
                    for d in scan:
                        out.append(Entry(self.child(d.name), _local_kind(d)))
                return out
            pafs = _pafs()
            selector = pafs.FileSelector(self.path, allow_not_found=True)
            return [
                Entry(self.child(i.base_name), _arrow_kind(i.type))
                for i in self.filesystem.get_file_info(selector)
            ]
        except OSError as e:
            raise self.error(f"cannot list {what}", e) from e

    def sync(self, what: str = "file") -> None:
        """Makes this local file and its directory entry durable (a file written
        through :meth:`open_output`); nothing to do on other filesystems."""
        if not self.local:
            return
        try:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            fsync_directory(os.path.dirname(self.path))
        except OSError as e:
            raise self.error(f"cannot sync {what}", e) from e

    def open_input(self, what: str = "file") -> Any:
        """A random-access pyarrow file (memory-mapped when local); a missing file
        raises :class:`StateFileNotFoundError`."""
        try:
            if self.local:
                import pyarrow as pa

                return pa.memory_map(self.path)
            return self.filesystem.open_input_file(self.path)
        except FileNotFoundError as e:
            raise self.not_found(what) from e
        except OSError as e:
            if self._missing():
                raise self.not_found(what) from e
            raise self.error(f"cannot open {what}", e) from e

    def _write_output(
        self, data: Any, what: str, *, exclusive: bool = False, hint: str | None = None
    ) -> None:
        """Writes ``data`` through :meth:`open_output` and closes the stream; a failed
        write or close is a :class:`StorageError` naming ``what``."""
        out = self.open_output(what, exclusive=exclusive, hint=hint)
        try:
            try:
                out.write(data)
            finally:
                out.close()
        except OSError as e:
            raise self.error(f"cannot write {what}", e) from e

    def open_output(
        self, what: str = "file", *, exclusive: bool = False, hint: str | None = None
    ) -> Any:
        """A pyarrow output stream, its directory created first. ``exclusive``
        refuses a file that exists already (:class:`StateFileExistsError` with
        ``hint``; a check, so two writers racing for one name must be kept apart
        otherwise)."""
        fs, path = self.arrow()
        try:
            if exclusive and fs.get_file_info(path).type != _pafs().FileType.NotFound:
                raise self.exists_error(what, hint)
            fs.create_dir(self.parent.path, recursive=True)
            return fs.open_output_stream(path)
        except StateFileExistsError:
            raise
        except OSError as e:
            raise self.error(f"cannot create {what}", e) from e

    def write_new(
        self, data: Any, *, fsync: bool = False, what: str = "file", hint: str | None = None
    ) -> None:
        """Writes ``data`` (any contiguous buffer) as a new file here, its directory
        created first; an existing file is refused (:class:`StateFileExistsError`
        with ``hint``), and ``fsync`` makes the file and its directory entry durable.
        Locally one native call makes the directories, creates, writes, fsyncs and
        closes, so the GIL is let go once (on a busy process each time it is taken
        back costs up to a switch interval); a failed write removes what it left.
        Elsewhere an output stream, after a check (:meth:`open_output`)."""
        if not self.local:
            self._write_output(data, what, exclusive=True, hint=hint)
            return
        view = memoryview(data).cast("B")  # (pyarrow's buffers say signed bytes)
        rc, step = native.write_new_file(self.path, view, native.SECTION_FSYNC if fsync else 0)
        if rc == errno_mod.EEXIST and step == "open":
            raise self.exists_error(what, hint)
        if rc:
            if step not in ("mkdir", "open"):
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            raise self._native_error(what, rc, step)
        if fsync:
            try:
                fsync_directory(os.path.dirname(self.path))
            except OSError as e:
                raise self.error(f"cannot sync {what}", e) from e

    def _missing(self) -> bool:
        """Whether the file is not there (asked of the filesystem after a failure)."""
        fs, path = self.arrow()
        try:
            return bool(fs.get_file_info(path).type == _pafs().FileType.NotFound)
        except OSError:
            return False

    def not_found(self, what: str = "file") -> StateFileNotFoundError:
        return StateFileNotFoundError(f"{what} not found", path=self.uri, errno=errno_mod.ENOENT)

    def exists_error(self, what: str = "file", hint: str | None = None) -> StateFileExistsError:
        return StateFileExistsError(
            f"{what} exists already", path=self.uri, errno=errno_mod.EEXIST, hint=hint
        )

    def error(self, message: str, e: OSError, hint: str = _REACHABLE) -> StorageError:
        return StorageError(
            message, path=self.uri, errno=e.errno, detail=f"{type(e).__name__}: {e}", hint=hint
        )


@dataclass(frozen=True)
class Entry:
    """One entry of a directory listing: where it is and what it is (no size: a
    local listing would pay a ``stat`` per file for it)."""

    location: Location
    kind: FileKind

    @property
    def name(self) -> str:
        return self.location.name


def _local_kind(d: os.DirEntry[str]) -> FileKind:
    try:
        if d.is_file():
            return FileKind.FILE
        if d.is_dir():
            return FileKind.DIRECTORY
    except FileNotFoundError:
        pass  # gone meanwhile: listed as what it was
    return FileKind.OTHER


def _arrow_kind(t: Any) -> FileKind:
    ft = _pafs().FileType
    if t == ft.File:
        return FileKind.FILE
    if t == ft.Directory:
        return FileKind.DIRECTORY
    return FileKind.OTHER


def _remove_tree(path: str) -> None:
    """``shutil.rmtree`` that removes what it can and then raises the first failure
    (an entry removed meanwhile is no failure)."""
    if not os.path.lexists(path):
        raise FileNotFoundError(errno_mod.ENOENT, "not found", path)
    failed: list[OSError] = []

    def keep_going(exc: BaseException) -> None:
        if isinstance(exc, FileNotFoundError):
            return
        if not isinstance(exc, OSError):
            raise exc
        failed.append(exc)

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=lambda _f, _p, exc: keep_going(exc))
    else:
        shutil.rmtree(path, onerror=lambda _f, _p, info: keep_going(info[1]))
    if failed:
        raise failed[0]


# Directories whose filesystem refused a hard link (a new file is published by a
# check and a rename there).
_LINKS_REFUSED: set[str] = set()

# What os.link raises where a filesystem has no hard links (or not across these
# names): only then does _create fall back to a check and a rename.
_NO_HARD_LINKS = frozenset(
    {errno_mod.EPERM, errno_mod.ENOTSUP, errno_mod.EOPNOTSUPP, errno_mod.EXDEV}
)


def _create(tmp: str, path: str) -> None:
    """Gives the local file ``tmp`` the name ``path`` unless ``path`` exists already
    (a hard link; on a filesystem without hard links a check, then a rename). Any
    other failure of the link is raised."""
    try:
        os.link(tmp, path)
    except OSError as e:
        if e.errno not in _NO_HARD_LINKS:
            raise
        if os.path.lexists(path):
            raise FileExistsError(errno_mod.EEXIST, "file exists", path) from None
        os.rename(tmp, path)
