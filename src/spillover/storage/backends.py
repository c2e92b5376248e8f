"""Where state files live: local files (native I/O) or any ``pyarrow.fs`` filesystem.

A backend turns file names inside one storage directory into writers and
readers. The local backend hands the native writer a file descriptor, so the
whole write path runs without the GIL; the pyarrow backend hands it the
stream's ``write`` and the native writer calls it once per batch.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import os
import threading
from collections.abc import Callable
from typing import Any, Protocol, cast

from spillover.errors import (
    SpilloverError,
    StateFileExistsError,
    StateFileNotFoundError,
    StorageError,
    TruncatedFileError,
)
from spillover.storage.location import Location, fsync_directory


class ReadableFile(Protocol):
    def readinto(self, b: Any) -> int | None: ...
    def seek(self, offset: int, whence: int = ...) -> int: ...
    def close(self) -> None: ...


class Backend(Protocol):
    """The operations the engine needs from a place that holds state files."""

    root: str

    def uri_of(self, name: str) -> str: ...
    def create(self, name: str) -> tuple[int, Callable[[Any], Any] | None, Callable[[bool], None]]:
        """Creates ``name`` exclusively: ``(fd or -1, write or None, close(fsync))``."""
        ...

    def open_read(self, name: str) -> tuple[ReadableFile, int]:
        """Opens ``name`` for reading: ``(file, size)``."""
        ...

    def delete(self, name: str) -> None: ...
    def list(self) -> list[str]: ...


class LocalBackend:
    """State files in a local directory, written and read through file descriptors."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)

    def uri_of(self, name: str) -> str:
        return os.path.join(self.root, name)

    def create(self, name: str) -> tuple[int, Callable[[Any], Any] | None, Callable[[bool], None]]:
        path = self.uri_of(name)
        try:
            os.makedirs(self.root, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError as e:
            raise StateFileExistsError(
                "state file already exists",
                path=path,
                errno=e.errno,
                hint="each checkpoint and subtask needs its own storage directory",
            ) from e
        except OSError as e:
            raise storage_error("cannot create state file", path, e) from e

        def close(fsync: bool) -> None:
            try:
                os.close(fd)
                if fsync:
                    fsync_directory(self.root)
            except OSError as e:
                raise storage_error("cannot close state file", path, e) from e

        return fd, None, close

    def open_read(self, name: str) -> tuple[ReadableFile, int]:
        path = self.uri_of(name)
        try:
            f = open(path, "rb", buffering=0)  # noqa: SIM115 - the retriever owns it
        except FileNotFoundError as e:
            raise StateFileNotFoundError("state file not found", path=path, errno=e.errno) from e
        except OSError as e:
            raise storage_error("cannot open state file", path, e) from e
        return cast(ReadableFile, f), os.fstat(f.fileno()).st_size

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.uri_of(name))

    def list(self) -> list[str]:
        try:
            return sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []


class ArrowBackend:
    """State files on any ``pyarrow.fs.FileSystem`` (S3, GCS, HDFS, local, ...)."""

    def __init__(
        self, fs: Any, root: str, uri_prefix: str, query: str = "", defer_create: bool = False
    ) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.uri_prefix = uri_prefix.rstrip("/")
        self.query = f"?{query}" if query else ""
        self.defer_create = defer_create
        # Deferred files not created yet: deleting one (a discarded gate) asks nothing.
        self._unopened: set[str] = set()

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def uri_of(self, name: str) -> str:
        # The query (endpoint, region, ...) is kept so a handle's URI reopens the file.
        return f"{self.uri_prefix}/{name}{self.query}"

    def create(self, name: str) -> tuple[int, Callable[[Any], Any] | None, Callable[[bool], None]]:
        if self.defer_create:
            return self._create_deferred(name)
        stream = self._open(name)

        def close(fsync: bool) -> None:
            self._finish(stream, name)

        return -1, stream.write, close

    def _open(self, name: str) -> Any:
        """Creates ``name`` exclusively: the exists check, its directory and the
        stream (three requests on an object store)."""
        import pyarrow.fs as pafs

        path = self._path(name)
        try:
            if self.fs.get_file_info(path).type != pafs.FileType.NotFound:
                raise StateFileExistsError(
                    "state file already exists",
                    path=self.uri_of(name),
                    errno=errno_mod.EEXIST,
                    hint="each checkpoint and subtask needs its own storage directory",
                )
            self.fs.create_dir(self.root, recursive=True)
            return self.fs.open_output_stream(path)
        except StateFileExistsError:
            raise
        except OSError as e:
            raise storage_error("cannot create state file", self.uri_of(name), e) from e

    def _finish(self, stream: Any, name: str) -> None:
        try:
            stream.close()
        except OSError as e:
            raise storage_error("cannot finish state file", self.uri_of(name), e) from e

    def _create_deferred(
        self, name: str
    ) -> tuple[int, Callable[[Any], Any] | None, Callable[[bool], None]]:
        """Returns at once; the file is created by the first write, which the native
        writer makes on its I/O thread, so the caller's thread never waits on the
        filesystem. A failure there is the writer's sticky error (raised by a later
        append or by close, naming the file). The writer writes even an empty gate's
        header and trailer through ``write``, so a closed gate always has its file;
        a file never created (its creation failed, or the gate was discarded first)
        is neither closed nor deleted, which also spares someone else's file that
        the exists check found."""
        lock = threading.Lock()
        streams: list[Any] = []
        self._unopened.add(name)

        def write(data: Any) -> Any:
            with lock:
                if not streams:
                    streams.append(self._open(name))
                    self._unopened.discard(name)
            return streams[0].write(data)

        def close(fsync: bool) -> None:
            with lock:
                if streams:
                    self._finish(streams[0], name)

        return -1, write, close

    def open_read(self, name: str) -> tuple[ReadableFile, int]:
        path = self._path(name)
        try:
            f = self.fs.open_input_file(path)
            return cast(ReadableFile, f), int(f.size())
        except FileNotFoundError as e:
            raise StateFileNotFoundError(
                "state file not found", path=self.uri_of(name), errno=errno_mod.ENOENT
            ) from e
        except OSError as e:
            if self._missing(path):
                raise StateFileNotFoundError(
                    "state file not found", path=self.uri_of(name), errno=errno_mod.ENOENT
                ) from e
            raise storage_error("cannot open state file", self.uri_of(name), e) from e

    def _missing(self, path: str) -> bool:
        """Asked of the filesystem after a failed open (its error carries no errno)."""
        import pyarrow.fs as pafs

        try:
            return bool(self.fs.get_file_info(path).type == pafs.FileType.NotFound)
        except OSError:
            return False

    def delete(self, name: str) -> None:
        if name in self._unopened:  # a deferred file never created
            self._unopened.discard(name)
            return
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_file(self._path(name))

    def list(self) -> list[str]:
        import pyarrow.fs as pafs

        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        except OSError as e:
            raise storage_error("cannot list storage directory", self.uri_prefix, e) from e
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.File)


_REACHABLE = "check that the storage is reachable and writable"


def storage_error(message: str, path: str, e: OSError, hint: str = _REACHABLE) -> StorageError:
    """``e`` from storage at ``path`` as the one :class:`StorageError` a user sees."""
    return StorageError(
        message, path=path, errno=e.errno, detail=f"{type(e).__name__}: {e}", hint=hint
    )


def backend_for(
    uri: str | os.PathLike[str] | Location, filesystem: Any = None, defer_create: bool = False
) -> Backend:
    """The backend for a storage directory (see :class:`Location`): native local I/O
    for local paths and ``file://`` URIs, pyarrow for every other filesystem
    (``defer_create``: files are created by their first write, see
    :meth:`ArrowBackend._create_deferred`; local files are always created at once)."""
    loc = uri if isinstance(uri, Location) else Location.parse(uri, filesystem)
    if loc.local:
        return LocalBackend(loc.path)
    return ArrowBackend(loc.filesystem, loc.path, loc.prefix, loc.query, defer_create)


def readinto_exact(f: ReadableFile, view: memoryview) -> int:
    """Reads until ``view`` is full or the file ends; returns the bytes read."""
    got = 0
    total = len(view)
    while got < total:
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


class SectionFile:
    """Bytes ``[base, base + size)`` of a file, read as a file of their own: one gate's
    section of a shared channel-state file (docs/format.md, "Shared files"). Offsets
    are relative to the section; ``raw`` and ``base`` give the whole file's."""

    def __init__(self, raw: Any, base: int, size: int) -> None:
        self.raw = raw
        self.base = base
        self.size = size
        self._pos = 0

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        start = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self.size}[whence]
        self._pos = start + offset
        self.raw.seek(self.base + self._pos)
        return self._pos

    def readinto(self, b: Any) -> int | None:
        view = memoryview(b).cast("B")
        want = max(0, min(len(view), self.size - self._pos))
        n = self.raw.readinto(view[:want]) if want else 0
        self._pos += n or 0
        return n

    def read(self, n: int = -1) -> bytes:
        left = max(0, self.size - self._pos)
        data = bytes(self.raw.read(left if n < 0 else min(n, left)))
        self._pos += len(data)
        return data

    def close(self) -> None:
        self.raw.close()


def name_file_offset(f: Any, e: BaseException) -> None:
    """An error about bytes of the section ``f`` (when it is one), found at an offset
    relative to it, names the shared file's own offset: its path is the file's."""
    if isinstance(f, SectionFile) and isinstance(e, SpilloverError) and e.offset is not None:
        e.offset += f.base


def open_section(
    backend: Backend, name: str, section: tuple[int, int] | None
) -> tuple[ReadableFile, int]:
    """Opens ``name`` for reading, or only its section ``(offset, size)``: ``(file, size)``."""
    f, total = backend.open_read(name)
    if section is None:
        return f, total
    offset, size = section
    if offset + size > total:
        f.close()
        raise TruncatedFileError(
            "shared state file is shorter than the section its handle names",
            path=backend.uri_of(name),
            offset=total,
            detail=f"section [{offset}, {offset + size}), file {total} bytes",
        )
    return cast(ReadableFile, SectionFile(f, offset, size)), size
