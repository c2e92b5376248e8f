"""Where checkpoints live and what their metadata says.

Layout under ``state.checkpoints.dir``::

    <dir>/<job-name>/chk-<id>/_metadata          JSON, written last (its presence = complete)
    <dir>/<job-name>/chk-<id>/<vertex-uid>-<n>/  a subtask's state files

The metadata is versioned JSON (``format``, ``version``): restore refuses other
formats and newer versions, a different graph fingerprint, and a different max
parallelism, each with a message that says why.

Everywhere else it is one typed value, :class:`CheckpointMetadata`
(``checkpoint_meta.py``); :class:`CheckpointStorage` is its one JSON boundary:
``write_metadata`` moves the acknowledged gates' encoded channel maps into the
channel index, copies a restored checkpoint's files in (NO_CLAIM), makes a
savepoint's paths relative and encodes; ``read`` parses and checks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from spillover.errors import ConfigError, FormatError, StorageError
from spillover.runtime.checkpointing.checkpoint_meta import (
    METADATA_FORMAT,
    METADATA_VERSION,
    ChannelStateMeta,
    CheckpointMetadata,
    OperatorMeta,
    VertexInfo,
    check_metadata,
)
from spillover.storage.channel_index import INDEX_FILE
from spillover.storage.handle import GateStateHandle
from spillover.storage.location import Location, Publication, delete_tree

__all__ = [
    "METADATA_FILE",
    "METADATA_FORMAT",
    "METADATA_VERSION",
    "CheckpointStorage",
    "CompletedCheckpoint",
    "check_metadata",
    "copy_foreign_files",
    "encode_metadata",
    "load_checkpoint",
    "new_metadata",
    "read_checkpoint",
    "referenced_checkpoints",
    "referenced_uris",
    "split_channel_index",
]

METADATA_FILE = "_metadata"


@dataclass
class CompletedCheckpoint:
    checkpoint_id: int
    path: str
    metadata: CheckpointMetadata = field(repr=False)


class CheckpointStorage:
    """Checkpoint directories of one job on local disk or any pyarrow filesystem."""

    def __init__(self, base: str, job_name: str, *, fsync: bool = True) -> None:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", job_name)
        # The metadata is published atomically (Location.publish), so a reader never
        # sees half of it; fsync (state.checkpoints.fsync-metadata, on by default) also
        # makes it survive a machine crash.
        self.fsync = fsync
        self.location = Location.parse(base).child(safe)
        self.local = self.location.local
        self.root = self.location.path  # the job's directory on its filesystem

    @property
    def uri(self) -> str:
        """This job's checkpoint directory: a path, or a URI with its query."""
        return self.location.uri

    def checkpoint_dir(self, checkpoint_id: int) -> str:
        """The directory (path or URI) of one checkpoint, for state writers."""
        return self.location.child(f"chk-{checkpoint_id}").uri

    def subtask_dir(self, checkpoint_id: int, vertex_uid: str, subtask: int) -> str:
        return self.location.child(f"chk-{checkpoint_id}", f"{vertex_uid}-{subtask}").uri

    def _path(self, checkpoint_id: int, name: str = "") -> str:
        p = f"{self.root}/chk-{checkpoint_id}"
        return f"{p}/{name}" if name else p

    # NO_CLAIM restores (execution.state-recovery.claim-mode): the folders of the
    # restored checkpoint, whose files a checkpoint references are copied into it
    # before its metadata is written, so that it is self-contained.
    copy_referenced_from: tuple[Location, ...] = ()

    def write_metadata(
        self, checkpoint_id: int, metadata: CheckpointMetadata, *, relative: bool = False
    ) -> str:
        """Publishes the checkpoint's metadata (its presence completes it): what
        :meth:`metadata_file` gives, published. Returns its path."""
        file = self.metadata_file(checkpoint_id, metadata, relative=relative)
        file.publish()
        return file.location.path

    def metadata_file(
        self, checkpoint_id: int, metadata: CheckpointMetadata, *, relative: bool = False
    ) -> Publication:
        """The checkpoint's metadata file, to publish (the job master publishes it and
        then its event log's record of it, :func:`publish_in_order`): the one
        place it becomes JSON. Tasks wrote their gates' channel index entries beside
        their state and the gates name them (version 3), so nothing but ``_metadata``
        is written; only gates that carry encoded maps (the version 2
        acknowledgement form) would have them put into a channel index beside it
        (:func:`split_channel_index`). After a NO_CLAIM restore, the files it
        references in the restored checkpoint are copied into it first. ``relative``
        (a savepoint): files inside this job's folder are named relative to it."""
        moved: dict[str, str] = {}
        if self.copy_referenced_from:
            into = self.location.child(f"chk-{checkpoint_id}")
            moved = copy_foreign_files(metadata, self.location, into, self.copy_referenced_from)
            if moved:
                refs = referenced_checkpoints(metadata, self.location.prefix, moved)
                metadata = dataclasses.replace(metadata, references=tuple(refs))
        index = self.location.child(f"chk-{checkpoint_id}", INDEX_FILE)
        d, entries = split_channel_index(metadata, index.uri)
        if entries:
            index.publish(entries, fsync=self.fsync, what="channel index")
        if moved:
            d = _map_strings(d, lambda v: moved.get(v, v))
        if relative:
            d = relativize(d, self.location)
        data = encode_metadata(d)
        target = self.location.child(f"chk-{checkpoint_id}", METADATA_FILE)
        return Publication(target, data, fsync=self.fsync, what="checkpoint metadata")

    def read(self, checkpoint_id: int) -> CheckpointMetadata:
        """Checkpoint ``checkpoint_id``'s metadata; :class:`FormatError` naming its file
        when it is damaged, foreign or of a newer version."""
        location = self.location.child(f"chk-{checkpoint_id}", METADATA_FILE)
        return CheckpointMetadata.from_json(self.read_metadata(checkpoint_id), location.path)

    def read_metadata(self, checkpoint_id: int) -> dict[str, Any]:
        """The metadata file's JSON, checked and with relative paths resolved: for
        tools and tests that look at the file itself (everything else :meth:`read`)."""
        location = self.location.child(f"chk-{checkpoint_id}", METADATA_FILE)
        raw = location.read_bytes("checkpoint metadata")
        target = location.path
        try:
            meta = json.loads(raw)
        except ValueError as e:
            raise FormatError("checkpoint metadata is not valid JSON", path=target) from e
        check_metadata(meta, target)
        return resolve_relative(meta, self.location)

    def completed_ids(self) -> list[int]:
        """Ids of checkpoints whose metadata exists, oldest first."""
        return self.listing()[1]

    def highest_id(self) -> int:
        """The highest id of any checkpoint directory, complete or not (0 if none): a
        new run continues after it, so a stopped run's unfinished checkpoint is never
        written into again."""
        return max(self.all_ids(), default=0)

    def all_ids(self) -> list[int]:
        """Ids of every checkpoint directory, complete or not, oldest first."""
        return [cid for cid, _ in self._dirs()]

    def listing(self) -> tuple[list[int], list[int]]:
        """``(all_ids(), completed_ids())`` from one listing of the folder: what a
        sweep of incomplete directories needs, without listing an object store twice."""
        dirs = self._dirs()
        complete = [cid for cid, name in dirs if self.location.child(name, METADATA_FILE).exists()]
        return [cid for cid, _ in dirs], complete

    def _dirs(self) -> list[tuple[int, str]]:
        """``(id, name)`` of every checkpoint directory, oldest first."""
        dirs = []
        for name in self.location.list("checkpoint directory"):
            m = re.fullmatch(r"chk-(\d+)", name)
            if m:
                dirs.append((int(m.group(1)), name))
        return sorted(dirs)

    def latest(self) -> CompletedCheckpoint | None:
        ids = self.completed_ids()
        if not ids:
            return None
        cid = ids[-1]
        return CompletedCheckpoint(cid, self._path(cid), self.read(cid))

    def prepare(self, checkpoint_id: int, like: CheckpointMetadata) -> bool:
        """Makes the folders of checkpoint ``checkpoint_id`` ahead of it on a local disk:
        its directory and, under it, those checkpoint ``like`` (the last completed one)
        wrote its own files in. A writer that finds its folder missing makes it as its
        first step, on the checkpoint's path, and a folder is a new inode (0.1 ms or
        more where a disk recycles many, docs/benchmarks.md); between checkpoints
        nothing waits for it. Best effort: what cannot be made here the writer makes,
        or reports. True when the checkpoint's directory is there."""
        if not self.local:
            return False
        old = self._path(like.checkpoint_id) + "/"
        new = self._path(checkpoint_id)
        folders = {new: None}
        for uri in written_uris(like):
            path = Location.parse(uri).path
            if path.startswith(old):
                folders[os.path.dirname(f"{new}/{path[len(old) :]}")] = None
        try:
            for folder in folders:
                os.makedirs(folder, exist_ok=True)
        except OSError:
            return os.path.isdir(new)
        return True

    def delete(self, checkpoint_id: int) -> None:
        """Removes a checkpoint directory (subsumed or aborted); missing is fine, a
        failure is logged (see :func:`delete_tree`)."""
        delete_tree(self.location.child(f"chk-{checkpoint_id}"), "checkpoint directory")

    def export(self, checkpoint_id: int, target: str) -> str:
        """Copies checkpoint ``checkpoint_id`` into ``target`` (a new directory) as a
        savepoint: every file it points to, those of the earlier checkpoints it
        references included, with its metadata rewritten to point there. It is
        self-contained: no retention or later run deletes it, and it restores at any
        parallelism like the checkpoint. Returns its ``chk-<id>`` directory."""
        meta = self.read(checkpoint_id)
        dst = Location.parse(target)
        if dst.local != self.local:
            raise ConfigError(
                "a savepoint goes to the filesystem of the checkpoints",
                detail=f"{target!r} for checkpoints in {self.uri!r}",
                hint="name a savepoint directory on the same storage",
            )
        if dst.exists():
            raise StorageError(
                "the savepoint directory exists already",
                path=dst.uri,
                hint="name a new directory (a savepoint is never written over)",
            )
        own_refs = referenced_checkpoints(meta, root=self.location.prefix)
        for cid in [checkpoint_id, *own_refs]:
            into = dst.child(f"chk-{cid}")
            src_dir, dst_dir = self._path(cid), into.path
            try:
                if self.local:
                    shutil.copytree(
                        src_dir,
                        dst_dir,
                        ignore=shutil.ignore_patterns(METADATA_FILE + "*"),
                        copy_function=_link_or_copy,
                    )
                else:
                    import pyarrow.fs as pafs

                    dst.filesystem.create_dir(dst_dir, recursive=True)
                    pafs.copy_files(
                        src_dir,
                        dst_dir,
                        source_filesystem=self.location.filesystem,
                        destination_filesystem=dst.filesystem,
                    )
                    if cid == checkpoint_id:  # written anew below, rewritten
                        into.child(METADATA_FILE).delete(what="checkpoint metadata")
            except OSError as e:
                raise StorageError(
                    "cannot copy the checkpoint into the savepoint",
                    path=dst_dir,
                    errno=e.errno,
                    detail=str(e),
                ) from e
        # Files in checkpoints elsewhere (a savepoint the job restored, still being
        # replayed): copied into this one's folder, not mapped by their id.
        moved = copy_foreign_files(meta, self.location, dst.child(f"chk-{checkpoint_id}"))
        old_prefix, new_prefix = self.location.prefix + "/chk-", dst.prefix + "/chk-"

        def rewrite(value: str) -> str:
            if value in moved:
                return moved[value]
            if value.startswith(old_prefix):
                path = value[len(old_prefix) :].partition("?")[0]
                return new_prefix + path + (f"?{dst.query}" if dst.query else "")
            return value

        saved = dataclasses.replace(
            map_uris(meta, rewrite),
            references=tuple(own_refs),
            savepoint_from=self._path(checkpoint_id),
        )
        savepoints = CheckpointStorage(dst.parent.uri, dst.name, fsync=True)
        savepoints.write_metadata(checkpoint_id, saved, relative=True)
        return dst.child(f"chk-{checkpoint_id}").uri


def encode_metadata(metadata: dict[str, Any]) -> bytes:
    """The bytes of a metadata file. Compact: an indented dump goes through the
    pure-Python encoder (8x slower), and this write is on the critical path of every
    checkpoint. `spillover inspect --json` prints a readable summary."""
    return json.dumps(metadata, sort_keys=True, separators=(",", ":")).encode()


def _link_or_copy(src: str, dst: str) -> None:
    """Checkpoint files are never written again: a hard link is a copy, unless the
    filesystem has none."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _storage_of(path: str) -> tuple[CheckpointStorage, int]:
    chk = Location.parse(path)
    # The id as written (no leading zeros, ASCII digits): chk-01 is not chk-1's directory.
    if not re.fullmatch(r"chk-(0|[1-9][0-9]*)", chk.name) or "\0" in path:
        raise ConfigError(f"not a checkpoint directory: {path!r}", hint="give .../chk-<id>")
    job = chk.parent
    return CheckpointStorage(job.parent.uri, job.name), int(chk.name[4:])


def load_checkpoint(path: str) -> CheckpointMetadata:
    """The metadata of the checkpoint or savepoint at ``path`` (its ``chk-<id>``
    directory)."""
    storage, cid = _storage_of(path)
    return storage.read(cid)


def read_checkpoint(path: str) -> dict[str, Any]:
    """The metadata file's JSON of the checkpoint or savepoint at ``path`` (for tools
    and tests that look at the file; everything else :func:`load_checkpoint`)."""
    storage, cid = _storage_of(path)
    return storage.read_metadata(cid)


_CHK_PART = re.compile(r"/chk-(\d+)/")


def new_metadata(
    *,
    job_name: str,
    checkpoint_id: int,
    trigger_ms: int,
    fingerprint: str,
    settings: Mapping[str, Any],
    tasks: Mapping[str, OperatorMeta],
    final: bool,
    graph: Mapping[str, VertexInfo] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> CheckpointMetadata:
    """A checkpoint completed now, at the current metadata version; its
    ``references`` are those its subtasks' files point into
    (:func:`referenced_checkpoints`)."""
    meta = CheckpointMetadata(
        version=METADATA_VERSION,
        job=job_name,
        checkpoint_id=checkpoint_id,
        trigger_ms=trigger_ms,
        completed_ms=int(time.time() * 1000),
        graph_fingerprint=fingerprint,
        settings=settings,
        final=final,
        tasks=tasks,
        graph=graph,
        extra=extra or {},
    )
    return dataclasses.replace(meta, references=tuple(referenced_checkpoints(meta)))


def split_channel_index(meta: CheckpointMetadata, index_uri: str) -> tuple[dict[str, Any], bytes]:
    """The metadata's JSON with every acknowledged gate's encoded channel maps
    (``GateStateHandle.entry``, the version 2 acknowledgement form) named as
    ``"index": [offset, length]`` into the channel index ``index_uri``, and that
    index's bytes: the entries, unchanged, one after another (empty: no gate carried
    one, and the JSON names no index). References name whole handles, maps inline,
    as ever. Nothing is decoded."""
    if meta.channel_index is not None:  # its gates name the index it has already
        return meta.to_json(), b""
    entries: list[bytes] = []
    at = 0

    def place(entry: bytes) -> int:
        nonlocal at
        offset = at
        entries.append(entry)
        at += len(entry)
        return offset

    d = meta.to_json(index_uri, place)
    if entries:
        d["channel_index"] = {"uri": index_uri, "size": at}
    return d, b"".join(entries)


def referenced_checkpoints(
    meta: CheckpointMetadata, root: str | None = None, moved: Mapping[str, str] | None = None
) -> list[int]:
    """Ids of the other checkpoints whose state files this one points into: its
    channel-state references (recovered data it had not replayed when it was taken)
    and the state of subtasks that had exited before it (FLIP-147). With ``root``
    (a job's checkpoint folder, its ``Location.prefix``) only those in it: a file of
    a restored savepoint elsewhere is no checkpoint of the job's. ``moved``: files
    copied elsewhere (:func:`copy_foreign_files`), counted where they are now."""
    own = meta.checkpoint_id
    found: set[int] = set()
    for uri in referenced_uris(meta):
        if moved is not None:
            uri = moved.get(uri, uri)
        if root is not None and not uri.startswith(root + "/chk-"):
            continue
        m = _CHK_PART.search(uri, len(root) if root is not None else 0)
        if m is not None and int(m.group(1)) != own:
            found.add(int(m.group(1)))
    return sorted(found)


def referenced_uris(meta: CheckpointMetadata) -> list[str]:
    """Every file URI a checkpoint's references and exited subtasks' state name
    (those :func:`referenced_checkpoints` reads), in order, once each."""
    return _state_uris(
        meta, lambda cs: (piece.handle for ref in cs.references for piece in ref.pieces)
    )


def written_uris(meta: CheckpointMetadata) -> list[str]:
    """Every file URI a checkpoint's subtasks name as their own (their gates' files and
    channel index entries, keyed state, other handles), in order, once each; not the
    older checkpoints' files it references."""
    return _state_uris(meta, lambda cs: (*cs.input, *cs.output))


def _state_uris(
    meta: CheckpointMetadata, gates: Callable[[ChannelStateMeta], Iterable[GateStateHandle]]
) -> list[str]:
    """The URIs of the ``gates`` of each subtask's channel state (with their index
    entries'), then of its keyed state and other handles."""
    found: dict[str, None] = {}
    for op in meta.tasks.values():
        for st in op.subtasks.values():
            cs = st.channel_state
            if cs is not None:
                for handle in gates(cs):
                    _add_uri(handle.uri, found)
                    if handle.index is not None:  # its maps' entry, elsewhere
                        _add_uri(handle.index.uri, found)
            _add_uris(st.keyed, found)
            _add_uris(st.handles, found)
    return list(found)


def _add_uri(value: str, found: dict[str, None]) -> None:
    if "/chk-" in value and _CHK_PART.search(value):
        found.setdefault(value)


def _add_uris(value: Any, found: dict[str, None]) -> None:
    """Adds the URIs among the strings of ``value`` (JSON: an opaque state handle),
    depth first, in order."""
    if type(value) is str:
        _add_uri(value, found)
    elif isinstance(value, dict):
        for v in value.values():
            _add_uris(v, found)
    elif isinstance(value, list | tuple):
        for v in value:
            _add_uris(v, found)
    elif isinstance(value, Mapping):
        for v in value.values():
            _add_uris(v, found)


def copy_foreign_files(
    meta: CheckpointMetadata, root: Location, into: Location, also: tuple[Location, ...] = ()
) -> dict[str, str]:
    """Copies the files checkpoint ``meta`` references outside the job's checkpoint
    folder ``root`` (in a savepoint it was restored from), or inside any folder of
    ``also``, into ``into``'s ``restored/`` folder; returns each old URI's new one."""
    moved: dict[str, str] = {}
    uris = [
        u
        for u in referenced_uris(meta)
        if not _under(u, root, "chk-") or any(_under(u, folder) for folder in also)
    ]
    for n, uri in enumerate(uris):
        src = Location.parse(uri)
        dst = into.child("restored", str(n), src.name)
        try:
            if src.local and dst.local:
                os.makedirs(os.path.dirname(dst.path), exist_ok=True)
                _link_or_copy(src.path, dst.path)
            else:
                import pyarrow.fs as pafs

                dst.filesystem.create_dir(dst.parent.path, recursive=True)
                pafs.copy_files(
                    src.path,
                    dst.path,
                    source_filesystem=src.filesystem,
                    destination_filesystem=dst.filesystem,
                )
        except OSError as e:
            raise StorageError(
                "cannot copy a referenced file of a restored checkpoint",
                path=uri,
                errno=e.errno,
                detail=str(e),
            ) from e
        moved[uri] = dst.uri
    return moved


def _under(uri: str, folder: Location, child: str = "") -> bool:
    """Whether ``uri`` is inside ``folder`` (in a child whose name starts ``child``):
    a job's own checkpoints are its folder's ``chk-*``, not its ``savepoints``."""
    return uri.partition("?")[0].startswith(f"{folder.prefix}/{child}")


# In a savepoint's metadata, a file inside the savepoint's folder is named relative to
# it, so that the folder restores wherever it is copied or moved; the metadata says
# so with RELATIVE_PATHS. Metadata without it names files absolutely (and reads so).
RELATIVE = "relative:"
RELATIVE_PATHS = "relative_paths"


def relativize(meta: dict[str, Any], folder: Location) -> dict[str, Any]:
    """The metadata's JSON ``meta`` with every URI inside ``folder`` (the savepoint's,
    the one holding its ``chk-<id>``) relative to it."""
    prefix = folder.prefix + "/"

    def rel(value: str) -> str:
        if value.startswith(prefix):
            return RELATIVE + value[len(prefix) :].partition("?")[0]
        return value

    out: dict[str, Any] = _map_strings(meta, rel)
    out[RELATIVE_PATHS] = True
    return out


def resolve_relative(meta: dict[str, Any], folder: Location) -> dict[str, Any]:
    """The metadata's JSON ``meta`` as read from ``folder`` (the one holding its
    ``chk-<id>``): relative URIs made absolute there. Metadata with absolute URIs is
    returned as it is."""
    if not meta.pop(RELATIVE_PATHS, False):
        return meta

    def resolve(value: str) -> str:
        if value.startswith(RELATIVE):
            return folder.child(*value[len(RELATIVE) :].split("/")).uri
        return value

    out: dict[str, Any] = _map_strings(meta, resolve)
    return out


def map_uris(meta: CheckpointMetadata, f: Callable[[str], str]) -> CheckpointMetadata:
    """``meta`` with ``f`` applied to every string its JSON holds (URIs among them),
    keys aside: through its JSON, so nothing it holds is missed (a relocation, not on
    any checkpoint's path). Only metadata as read (its maps in an index or inline)."""
    d = _map_strings(meta.to_json(), f)
    return CheckpointMetadata.from_json(d)


def _map_strings(value: Any, f: Callable[[str], str]) -> Any:
    """``value`` (JSON) with ``f`` applied to every string in it, keys aside."""
    if isinstance(value, str):
        return f(value)
    if isinstance(value, dict):
        return {k: _map_strings(v, f) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_strings(v, f) for v in value]
    return value
