"""A fault-injecting pyarrow filesystem: the local disk, with errors and latency
where a test says (open, write, close, rename, list, delete), for storage-fault
tests. Register it for a URI scheme with :func:`faulty_dir`. Checkpoint storage
renames only on local paths (through ``os``, never through pyarrow):
:func:`failing_renames` makes those renames consult the same faults."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from spillover.storage import location as _location
from spillover.storage.location import register_filesystem

Rule = Callable[[str, str], BaseException | None]
"""``(operation, path)`` -> the error to raise, or None."""


@dataclass
class Faults:
    """What goes wrong, changed by the test while jobs run (thread-safe enough: the
    rules list is replaced whole)."""

    rules: list[Rule] = field(default_factory=list)
    latency_s: float = 0.0  # added to every write-side operation
    counts: dict[str, int] = field(default_factory=dict)  # errors raised per operation
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def disarm(self) -> None:
        """No more faults (the counts stay)."""
        self.rules, self.latency_s = [], 0.0

    def check(self, op: str, path: str) -> None:
        if self.latency_s and op != "info":
            time.sleep(self.latency_s)
        for rule in list(self.rules):
            e = rule(op, path)
            if e is not None:
                with self._lock:
                    self.counts[op] = self.counts.get(op, 0) + 1
                raise e


def fail(ops: set[str], where: str, error: Callable[[], BaseException]) -> Rule:
    """Raises ``error()`` for ``ops`` on paths containing ``where``."""
    return lambda op, path: error() if op in ops and where in path else None


def hold(ops: set[str], where: str, release: threading.Event, held: threading.Event) -> Rule:
    """Blocks ``ops`` on paths containing ``where`` until ``release`` is set (a hung
    request); sets ``held`` whenever one is blocked, so a test can wait for that."""

    def rule(op: str, path: str) -> BaseException | None:
        if op in ops and where in path:
            held.set()
            release.wait()
        return None

    return rule


def enospc() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


class _Stream:
    """An output stream whose writes and close consult the faults."""

    def __init__(self, inner: Any, faults: Faults, path: str) -> None:
        self.inner, self.faults, self.path = inner, faults, path

    def write(self, data: Any) -> int:
        self.faults.check("write", self.path)
        return int(self.inner.write(data))

    def close(self) -> None:
        try:
            self.faults.check("close", self.path)
        finally:
            self.inner.close()

    def flush(self) -> None:
        self.inner.flush()

    @property
    def closed(self) -> bool:
        return bool(self.inner.closed)

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return int(self.inner.tell())


class FaultyHandler(pafs.FileSystemHandler):  # type: ignore[misc]
    """The local filesystem, consulting :class:`Faults` before each operation."""

    def __init__(self, faults: Faults) -> None:
        self.fs = pafs.LocalFileSystem()
        self.faults = faults

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FaultyHandler) and other.faults is self.faults

    def __ne__(self, other: object) -> bool:
        return not self == other

    def get_type_name(self) -> str:
        return "faulty"

    def normalize_path(self, path: str) -> str:
        return path

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        for p in paths:
            self.faults.check("info", p)
        return self.fs.get_file_info(paths)  # type: ignore[no-any-return]

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        self.faults.check("list", selector.base_dir)
        return self.fs.get_file_info(selector)  # type: ignore[no-any-return]

    def create_dir(self, path: str, recursive: bool) -> None:
        self.faults.check("mkdir", path)
        self.fs.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self.faults.check("delete", path)
        self.fs.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self.faults.check("delete", path)
        self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        raise OSError(errno.EPERM, "not on a test filesystem")

    def delete_file(self, path: str) -> None:
        self.faults.check("delete", path)
        self.fs.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        self.faults.check("rename", dest)
        self.fs.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self.faults.check("open", dest)
        self.fs.copy_file(src, dest)

    def open_input_stream(self, path: str) -> Any:
        self.faults.check("read", path)
        return self.fs.open_input_stream(path)

    def open_input_file(self, path: str) -> Any:
        self.faults.check("read", path)
        return self.fs.open_input_file(path)

    def open_output_stream(self, path: str, metadata: Any) -> Any:
        self.faults.check("open", path)
        return pa.PythonFile(_Stream(self.fs.open_output_stream(path), self.faults, path), mode="w")

    def open_append_stream(self, path: str, metadata: Any) -> Any:
        raise OSError(errno.EOPNOTSUPP, "appends are not supported")


@contextmanager
def faulty_dir(
    base: str, scheme: str = "faulty", faults: Faults | None = None
) -> Iterator[tuple[str, Faults]]:
    """``(URI of base on the faulty filesystem, its faults)`` while registered
    (``faults``, or new ones)."""
    faults = faults if faults is not None else Faults()
    register_filesystem(scheme, pafs.PyFileSystem(FaultyHandler(faults)))
    try:
        yield f"{scheme}://{base}", faults
    finally:
        register_filesystem(scheme, None)


@contextmanager
def failing_renames(faults: Faults) -> Iterator[Faults]:
    """While active, ``os.replace``, ``os.rename`` and ``os.link`` (a hard link is how
    the job event log gives a segment its name without replacing one), and a local
    publish's native call (:data:`spillover.storage.location.publish_file`, which
    renames or links in C) and an ordered group's (``publish_files``), consult
    ``faults`` as operation ``rename`` with the destination path, in every thread.
    A failing native publish gives its error as the call would after a failed
    rename or link: nothing published, nothing left (in a group: from the failing
    file on)."""
    saved = {name: getattr(os, name) for name in ("replace", "rename", "link")}
    real_publish, real_publish_files = _location.publish_file, _location.publish_files

    def wrap(name: str) -> Callable[..., None]:
        real = saved[name]

        def renamed(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            faults.check("rename", os.fsdecode(dst))
            real(src, dst, *args, **kwargs)

        return renamed

    def publish(tmp: str, path: str, data: Any, flags: int) -> tuple[int, str]:
        try:
            faults.check("rename", path)
        except OSError as e:
            replace = flags & _location.PUBLISH_REPLACE
            return e.errno or errno.EIO, "rename" if replace else "link"
        return real_publish(tmp, path, data, flags)

    def publish_files(files: list[tuple[str, str, Any, int]]) -> tuple[int, int, str]:
        # In order, as the call renames or links them: the files before a failing one
        # are published, it and the later ones not.
        for i, (_, path, _, flags) in enumerate(files):
            try:
                faults.check("rename", path)
            except OSError as e:
                if i:
                    rc, at, step = real_publish_files(files[:i])
                    if rc:
                        return rc, at, step
                replace = flags & _location.PUBLISH_REPLACE
                return e.errno or errno.EIO, i, "rename" if replace else "link"
        return real_publish_files(files)

    for name in saved:
        setattr(os, name, wrap(name))
    _location.publish_file, _location.publish_files = publish, publish_files
    try:
        yield faults
    finally:
        for name, real in saved.items():
            setattr(os, name, real)
        _location.publish_file, _location.publish_files = real_publish, real_publish_files
