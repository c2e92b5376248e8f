"""Where storage lives: one value for a local directory or a path on any
``pyarrow.fs`` filesystem, worked out from a URI in one place.

A :class:`Location` keeps what a URI says (``/tmp/x``, ``file:///tmp/x``,
``s3://bucket/dir?endpoint_override=host:port&scheme=http``): the filesystem, the
path on it, and the query (endpoint, region, ...) that every child URI carries on,
so that a URI written into a handle or checkpoint metadata reopens the same place.
Local locations use native I/O (``filesystem`` is None); everything else goes
through pyarrow. "Not found" is told by errno or by the filesystem's own
``FileType.NotFound``, never by an exception's message text.
"""

from __future__ import annotations

import errno as errno_mod
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from spillover.errors import StateFileNotFoundError, StorageError

if TYPE_CHECKING:
    import pyarrow.fs as pafs

__all__ = ["Location", "register_filesystem"]

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
        path (such a location's URI reopens only with the same filesystem)."""
        text = os.fspath(uri)
        if filesystem is not None:
            return cls(text, filesystem, text)
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
        return bool(self.file_type() != _pafs().FileType.NotFound)

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

    def open_output(self, what: str = "file") -> Any:
        """A pyarrow output stream, its directory created first."""
        fs, path = self.arrow()
        try:
            fs.create_dir(self.parent.path, recursive=True)
            return fs.open_output_stream(path)
        except OSError as e:
            raise self.error(f"cannot create {what}", e) from e

    def _missing(self) -> bool:
        """Whether the file is not there (asked of the filesystem after a failure)."""
        fs, path = self.arrow()
        try:
            return bool(fs.get_file_info(path).type == _pafs().FileType.NotFound)
        except OSError:
            return False

    def not_found(self, what: str = "file") -> StateFileNotFoundError:
        return StateFileNotFoundError(f"{what} not found", path=self.uri, errno=errno_mod.ENOENT)

    def error(self, message: str, e: OSError, hint: str = _REACHABLE) -> StorageError:
        return StorageError(
            message, path=self.uri, errno=e.errno, detail=f"{type(e).__name__}: {e}", hint=hint
        )
