"""Shared state files on object stores: the gates of a group of subtasks in one
object per checkpoint, published once (docs/format.md, "Shared files";
docs/scaling.md, "Shared files on object stores").

An object store (S3, GCS) has no appends and no positioned writes: an object is
whole the moment its upload completes and does not exist before. So, where a local
shared file grows section by section (:class:`~spillover.storage.shared.SharedFile`),
a group's object is written **once, by one writer, after its parts are settled**:

- each subtask's *part* (its gates of one checkpoint) is staged in local unlinked
  temporary files exactly as for a local shared file; when the part closes, its
  sections take their offsets at the end of the group's pending object, and the
  part waits;
- a gate's channel index entry, when the part gives one, follows its section in
  the object (its index section, metadata version 3), so the gate's handle names
  its maps in the same object;
- the object is published (one upload of the concatenated sections) when every
  member of the group has closed its part, or when ``wait`` seconds passed since
  the object's first part closed (a member that is late, slow or never takes part:
  its part goes into the group's next object, ``<name>.<k>.spill``);
- the thread that settles the object uploads it (the last part to close, or the
  first waiter whose wait ran out), so there is one writer per object and no
  thread of the group's own;
- a part returns its handles only after the upload completed, so no
  acknowledgement names an object that does not exist yet;
- a part that fails or is discarded (the checkpoint was declined or aborted)
  **aborts the group's checkpoint**: nothing more is published, every part still
  waiting raises, and objects already published are deleted (the coordinator also
  deletes an aborted checkpoint's directory). A failed upload fails every part in
  it. So an object is either whole, with every section its handles name, or it is
  not referenced at all.

Why not a multipart upload with one part per section: S3 requires every part but
the last to be at least 5 MiB, and a gate's section of an unaligned checkpoint is
usually a few KB; the parts would also have to be numbered before their sizes are
known. One upload per object costs one more local read of staged bytes and keeps
every object store (and pyarrow's own multipart streaming of large objects) usable.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import IO, Any

from spillover.errors import StorageError
from spillover.storage.handle import GateStateHandle, IndexRef
from spillover.storage.location import Location

__all__ = ["PUBLISH_WAIT", "SharedObjects"]

PUBLISH_WAIT = 1.0
"""Seconds a group's object waits, after its first part closed, for the group's other
members before it is published without them (their parts go into a next object)."""


def _pafs() -> Any:
    import pyarrow.fs

    return pyarrow.fs


_OBJECT_STORES = frozenset({"s3", "gcs"})  # pyarrow filesystems that need no directories
_CHUNK = 1 << 20  # bytes read from a staged section per write to the upload


@dataclass
class _Object:
    """One object of the group's checkpoint while its parts close, then published."""

    name: str
    # (staged file, size), or the bytes of an index section, in the object's order
    sections: list[tuple[IO[bytes] | bytes, int]] = field(default_factory=list)
    end: int = 0
    parts: int = 0
    first_closed: float = 0.0
    publishing: bool = False  # taken by its one writer: no more parts join it
    published: bool = False
    error: BaseException | None = None


class SharedObjects:
    """The objects of one group of ``members`` subtasks for one checkpoint, in the
    directory ``directory`` (a non-local :class:`Location`), named ``<name>.spill``,
    then ``<name>.1.spill``, ... Thread-safe: each member's channel-state thread
    opens, closes or fails its own part."""

    def __init__(
        self, directory: Location, name: str, members: int, wait: float = PUBLISH_WAIT
    ) -> None:
        if members < 1:
            raise ValueError(f"a group has at least one member, not {members}")
        self.directory = directory
        self.name = name
        self.members = members
        self.wait = wait
        self._cond = threading.Condition()
        self._settled: set[Hashable] = set()  # members whose part closed, or who left
        self._objects: list[_Object] = []
        self._current: _Object | None = None
        self.aborted: BaseException | None = None

    # -- what members call ------------------------------------------------------------

    def close(
        self,
        sections: Sequence[tuple[IO[bytes], GateStateHandle]],
        member: Hashable = None,
        entries: Sequence[bytes] = (),
    ) -> list[GateStateHandle]:
        """``member``'s part of the checkpoint is closed: adds its gates (staged file
        and its own handle each, in order; each followed by its channel index entry
        when ``entries`` gives one per gate) to the group's pending object and waits
        until that object is published; returns the gates' handles in it (``index``
        naming their entries; a part
        without gates returns at once, unless it is the last and publishes the
        others). The staged files are the object's from here on (closed once
        uploaded or dropped). Raises :class:`StorageError` when the upload failed or
        the checkpoint was aborted (the caller declines)."""
        with self._cond:
            if self.aborted is not None:
                _close_all(s for s, _ in sections)
                raise self._aborted_error()
            obj = self._current
            if obj is None:
                k = len(self._objects)
                obj = _Object(self.name + (f".{k}" if k else "") + ".spill")
                obj.first_closed = time.monotonic()
                self._objects.append(obj)
                self._current = obj
            uri = self.directory.child(obj.name).uri
            handles = []
            for i, (staged, handle) in enumerate(sections):
                offset = obj.end
                obj.sections.append((staged, handle.size))
                obj.end += handle.size
                index = None
                if i < len(entries):
                    index = IndexRef(uri, obj.end, len(entries[i]))
                    obj.sections.append((entries[i], len(entries[i])))
                    obj.end += len(entries[i])
                handles.append(replace(handle, uri=uri, offset=offset, index=index))
            obj.parts += 1
            self._settled.add(member if member is not None else object())
            mine = self._complete  # the last member: it publishes
            if mine:
                self._start_publish(obj)
            else:
                self._cond.notify_all()
                if not handles:
                    return []
        self._wait_published(obj, mine)
        return handles

    def leave(self, member: Hashable) -> None:
        """``member`` takes part in this checkpoint no more (its task ended): the
        object waits for it no longer. A waiting part publishes it, not this caller
        (a task thread that ends)."""
        with self._cond:
            self._settled.add(member)
            self._cond.notify_all()

    @property
    def _complete(self) -> bool:
        return len(self._settled) >= self.members

    def fail(self, error: BaseException | None = None) -> None:
        """A part failed or was discarded: the checkpoint is declined for the whole
        group. Waiting parts raise, later ones too, objects already published are
        deleted; idempotent."""
        with self._cond:
            if self.aborted is not None:
                return
            self.aborted = error or StorageError(
                "checkpoint aborted", path=self.directory.uri, detail="a part was discarded"
            )
            pending = [o for o in self._objects if not o.publishing and not o.published]
            published = [o for o in self._objects if o.published]
            self._current = None
            self._cond.notify_all()
        for o in pending:
            _close_all(s for s, _ in o.sections)
            o.sections.clear()
        for o in published:
            o.error = self.aborted
            self._delete(o)

    @property
    def objects(self) -> list[str]:
        """Names of the objects published so far (and not deleted), empty ones left out."""
        with self._cond:
            return [o.name for o in self._objects if o.published and o.error is None and o.end]

    # -- one writer per object ---------------------------------------------------------

    def _start_publish(self, obj: _Object) -> None:
        """Under the lock: ``obj`` takes no more parts; the caller publishes it."""
        obj.publishing = True
        if self._current is obj:
            self._current = None

    def _wait_published(self, obj: _Object, mine: bool) -> None:
        """Waits until ``obj`` is published, or publishes it: ``mine`` (the last member
        closed into it), or when every other member left or its wait ran out first
        for this caller."""
        with self._cond:
            while not mine and not obj.publishing:
                if self.aborted is not None:
                    raise self._aborted_error()
                left = obj.first_closed + self.wait - time.monotonic()
                if left <= 0 or self._complete:  # late members go into the next object
                    self._start_publish(obj)
                    mine = True
                    break
                self._cond.wait(left)
        if mine:
            self._publish(obj)
        with self._cond:
            while not obj.published and obj.error is None:
                self._cond.wait()
            if obj.error is not None:
                raise obj.error

    def _publish(self, obj: _Object) -> None:
        """Uploads ``obj``'s sections as one object (outside the lock)."""
        target = self.directory.child(obj.name)
        error: BaseException | None = None
        if not obj.sections:  # no member had in-flight data: no object at all
            with self._cond:
                obj.published = True
                self._cond.notify_all()
            return
        try:
            # Exclusive: a late part of a checkpoint the group forgot long ago must not
            # replace an object that handles name (a check, as on every object store).
            out = self._open(target)
            try:
                buf = bytearray(_CHUNK)
                view = memoryview(buf)
                for staged, size in obj.sections:
                    if isinstance(staged, bytes):  # an index section
                        out.write(staged)
                        continue
                    staged.seek(0)
                    left = size
                    while left:
                        n = os.readv(staged.fileno(), [view[: min(left, _CHUNK)]])
                        if not n:
                            raise StorageError(
                                "staged section is shorter than its handle says",
                                path=target.uri,
                                detail=f"{left} of {size} bytes missing",
                            )
                        out.write(view[:n])
                        left -= n
            except BaseException:
                with contextlib.suppress(Exception):
                    out.abort()  # pyarrow: drops a multipart upload, publishes nothing
                raise
            out.close()
        except OSError as e:
            error = e if isinstance(e, StorageError) else target.error("cannot upload", e)
        except BaseException as e:
            error = e
        finally:
            _close_all(s for s, _ in obj.sections)
            obj.sections.clear()
        with self._cond:
            if error is None and self.aborted is not None:
                error = self._aborted_error()
                delete = True
            else:
                delete = False
            obj.error = error
            obj.published = error is None
            if error is not None and self.aborted is None:
                self.aborted = error
            self._cond.notify_all()
        if delete:
            self._delete(obj)

    def _open(self, target: Location) -> Any:
        """An output stream to ``target``, refused if the object exists. On S3 and GCS
        no directory markers are made (an object store needs none: fewer requests
        than :meth:`Location.open_output`); any other filesystem gets its directory."""
        fs = target.filesystem
        if target.local or fs.type_name not in _OBJECT_STORES:
            return target.open_output("shared state object", exclusive=True)
        try:
            if fs.get_file_info(target.path).type != _pafs().FileType.NotFound:
                raise target.exists_error(
                    "shared state object", "each checkpoint needs its own directory"
                )
            return fs.open_output_stream(target.path)
        except OSError as e:
            if isinstance(e, StorageError):
                raise
            raise target.error("cannot create shared state object", e) from e

    def _delete(self, obj: _Object) -> None:
        with contextlib.suppress(Exception):
            self.directory.child(obj.name).delete(what="shared state object")

    def _aborted_error(self) -> StorageError:
        cause = self.aborted
        return StorageError(
            "the checkpoint's shared state object was not published",
            path=self.directory.uri,
            detail=f"the checkpoint was declined for the group: {cause}",
        )


def _close_all(files: Iterable[IO[bytes] | bytes]) -> None:
    for f in files:
        if not isinstance(f, bytes):
            with contextlib.suppress(OSError):
                f.close()
