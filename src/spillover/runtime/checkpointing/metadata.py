"""Where checkpoints live and what their metadata says.

Layout under ``state.checkpoints.dir``::

    <dir>/<job-name>/chk-<id>/_metadata          JSON, written last (its presence = complete)
    <dir>/<job-name>/chk-<id>/<vertex-uid>-<n>/  a subtask's state files

The metadata is versioned JSON (``format``, ``version``): restore refuses other
formats and newer versions, a different graph fingerprint, and a different max
parallelism, each with a message that says why.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

from spillover.errors import ConfigError, FormatError, StorageError
from spillover.storage.channel_index import INDEX_ENTRY, INDEX_FILE
from spillover.storage.handle import GateStateHandle
from spillover.storage.location import Location, delete_tree

METADATA_FORMAT = "spillover-checkpoint"
METADATA_VERSION = 2  # 2: per-channel maps in the channel index (docs/format.md)
METADATA_FILE = "_metadata"


@dataclass
class CompletedCheckpoint:
    checkpoint_id: int
    path: str
    metadata: dict[str, Any] = field(repr=False)


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

    def write_metadata(self, checkpoint_id: int, metadata: dict[str, Any]) -> str:
        """Publishes the checkpoint's metadata (its presence completes it); gates'
        channel maps the tasks encoded go first into the checkpoint's channel index
        beside it (:func:`split_channel_index`). After a NO_CLAIM restore, the files
        it references in the restored checkpoint are copied into it first."""
        if self.copy_referenced_from:
            into = self.location.child(f"chk-{checkpoint_id}")
            moved = copy_foreign_files(metadata, self.location, into, self.copy_referenced_from)
            if moved:
                metadata = _map_strings(metadata, lambda v: moved.get(v, v))
                metadata["references"] = referenced_checkpoints(metadata, self.location.prefix)
        metadata, entries = split_channel_index(metadata)
        if entries:
            index = self.location.child(f"chk-{checkpoint_id}", INDEX_FILE)
            data = b"".join(entries)
            index.publish(data, fsync=self.fsync, what="channel index")
            metadata["channel_index"] = {"uri": index.uri, "size": len(data)}
        data = encode_metadata(metadata)
        target = self.location.child(f"chk-{checkpoint_id}", METADATA_FILE)
        target.publish(data, fsync=self.fsync, what="checkpoint metadata")
        return target.path

    def read_metadata(self, checkpoint_id: int) -> dict[str, Any]:
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
        return self._ids(completed=True)

    def highest_id(self) -> int:
        """The highest id of any checkpoint directory, complete or not (0 if none): a
        new run continues after it, so a stopped run's unfinished checkpoint is never
        written into again."""
        return max(self._ids(completed=False), default=0)

    def all_ids(self) -> list[int]:
        """Ids of every checkpoint directory, complete or not, oldest first."""
        return self._ids(completed=False)

    def _ids(self, *, completed: bool) -> list[int]:
        ids = []
        for name in self.location.list("checkpoint directory"):
            m = re.fullmatch(r"chk-(\d+)", name)
            if m and (not completed or self.location.child(name, METADATA_FILE).exists()):
                ids.append(int(m.group(1)))
        return sorted(ids)

    def latest(self) -> CompletedCheckpoint | None:
        ids = self.completed_ids()
        if not ids:
            return None
        cid = ids[-1]
        return CompletedCheckpoint(cid, self._path(cid), self.read_metadata(cid))

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
        meta = self.read_metadata(checkpoint_id)
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

        saved = relativize(_map_strings(meta, rewrite), dst)
        saved["references"] = own_refs
        saved["savepoint"] = {"from": self._path(checkpoint_id)}
        CheckpointStorage(dst.parent.uri, dst.name, fsync=True).write_metadata(checkpoint_id, saved)
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


def read_checkpoint(path: str) -> dict[str, Any]:
    """The metadata of the checkpoint or savepoint at ``path`` (its ``chk-<id>``
    directory)."""
    chk = Location.parse(path)
    # The id as written (no leading zeros, ASCII digits): chk-01 is not chk-1's directory.
    if not re.fullmatch(r"chk-(0|[1-9][0-9]*)", chk.name) or "\0" in path:
        raise ConfigError(f"not a checkpoint directory: {path!r}", hint="give .../chk-<id>")
    job = chk.parent
    return CheckpointStorage(job.parent.uri, job.name).read_metadata(int(chk.name[4:]))


_CHK_PART = re.compile(r"/chk-(\d+)/")


def check_metadata(meta: Any, path: str) -> None:
    if not isinstance(meta, dict) or meta.get("format") != METADATA_FORMAT:
        raise FormatError("not spillover checkpoint metadata", path=path)
    version = meta.get("version")
    # Version 1 (every gate's channel maps inline) is read as ever.
    if not isinstance(version, int) or version > METADATA_VERSION or version < 1:
        raise FormatError(
            "unsupported checkpoint metadata version",
            path=path,
            detail=f"found {version!r}, this version reads up to {METADATA_VERSION}",
            hint="restore with the spillover version that wrote it, or newer",
        )


def check_compatible(meta: dict[str, Any], fingerprint: str, max_parallelism: int) -> None:
    """Refuses to restore a checkpoint into a job it cannot belong to."""
    settings = meta.get("settings", {})
    if settings.get("max-parallelism") != max_parallelism:
        raise ConfigError(
            "max parallelism changed",
            detail=f"checkpoint {meta['checkpoint_id']} was taken with "
            f"{settings.get('max-parallelism')}, the job has {max_parallelism}",
            hint="keep pipeline.max-parallelism unchanged across restores",
        )
    if meta.get("graph_fingerprint") != fingerprint:
        raise ConfigError(
            "the job graph changed since the checkpoint",
            detail=f"checkpoint graph {meta.get('graph_fingerprint')}, job graph {fingerprint}",
            hint="restore into the same topology, uids and parallelism (rescaling comes later)",
        )


def new_metadata(
    *,
    job_name: str,
    checkpoint_id: int,
    trigger_ms: int,
    fingerprint: str,
    settings: dict[str, Any],
    tasks: dict[str, Any],
    final: bool,
) -> dict[str, Any]:
    return {
        "format": METADATA_FORMAT,
        "version": METADATA_VERSION,
        "job": job_name,
        "checkpoint_id": checkpoint_id,
        "trigger_ms": trigger_ms,
        "completed_ms": int(time.time() * 1000),
        "graph_fingerprint": fingerprint,
        "settings": settings,
        "final": final,
        "tasks": tasks,
    }


def split_channel_index(meta: dict[str, Any]) -> tuple[dict[str, Any], list[bytes]]:
    """The metadata with every gate's encoded channel maps (``index_entry``, as
    ``channel_state.gate_entry`` gives them) replaced by ``"index": [offset, length]``
    into the concatenation of those entries, and the entries in that order. Only the
    dicts on the way to such a gate are copied; the input is left as it was."""
    entries: list[bytes] = []
    at = 0
    tasks: dict[str, Any] = {}
    for uid, entry in (meta.get("tasks") or {}).items():
        subtasks: dict[str, Any] = {}
        for sub, st in (entry.get("subtasks") or {}).items():
            cs = st.get("channel_state") or {}
            sides: dict[str, Any] = {}
            for side in ("input", "output"):
                gates = cs.get(side) or []
                if any(INDEX_ENTRY in g for g in gates):
                    moved = []
                    for g in gates:
                        if INDEX_ENTRY in g:
                            g = dict(g)
                            raw = g.pop(INDEX_ENTRY)
                            g["index"] = [at, len(raw)]
                            entries.append(raw)
                            at += len(raw)
                        moved.append(g)
                    sides[side] = moved
            refs = cs.get("references") or []
            if any(INDEX_ENTRY in p["handle"] for r in refs for p in r["pieces"]):
                # A reference names a whole handle, maps inline, as ever.
                sides["references"] = [
                    {**r, "pieces": [{**p, "handle": _inline(p["handle"])} for p in r["pieces"]]}
                    for r in refs
                ]
            subtasks[sub] = {**st, "channel_state": {**cs, **sides}} if sides else st
        tasks[uid] = {**entry, "subtasks": subtasks}
    if not entries:
        return meta, []
    return {**meta, "tasks": tasks}, entries


def _inline(handle: dict[str, Any]) -> dict[str, Any]:
    return GateStateHandle.from_dict(handle).to_dict() if INDEX_ENTRY in handle else handle


def referenced_checkpoints(meta: dict[str, Any], root: str | None = None) -> list[int]:
    """Ids of the other checkpoints whose state files this one points into: its
    channel-state references (recovered data it had not replayed when it was taken)
    and the state of subtasks that had exited before it (FLIP-147). With ``root``
    (a job's checkpoint folder, its ``Location.prefix``) only those in it: a file of
    a restored savepoint elsewhere is no checkpoint of the job's."""
    own = int(meta.get("checkpoint_id", -1))
    found: set[int] = set()

    def add(uri: str) -> None:
        if root is not None and not uri.startswith(root + "/chk-"):
            return
        m = _CHK_PART.search(uri, len(root) if root is not None else 0)
        if m is not None and int(m.group(1)) != own:
            found.add(int(m.group(1)))

    for uri in _referenced_uris(meta):
        add(uri)
    return sorted(found)


def _referenced_uris(meta: dict[str, Any]) -> list[str]:
    """Every file URI a checkpoint's references and exited subtasks' state name
    (those :func:`referenced_checkpoints` reads), in order, once each."""
    found: dict[str, None] = {}

    def walk(value: Any) -> None:
        if isinstance(value, str):
            if _CHK_PART.search(value):
                found.setdefault(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    for entry in (meta.get("tasks") or {}).values():
        for st in (entry.get("subtasks") or {}).values():
            for ref in (st.get("channel_state") or {}).get("references", []):
                for piece in ref["pieces"]:
                    walk(piece["handle"]["uri"])
            walk([st.get("keyed"), st.get("handles")])
    return list(found)


def copy_foreign_files(
    meta: dict[str, Any], root: Location, into: Location, also: tuple[Location, ...] = ()
) -> dict[str, str]:
    """Copies the files checkpoint ``meta`` references outside the job's checkpoint
    folder ``root`` (in a savepoint it was restored from), or inside any folder of
    ``also``, into ``into``'s ``restored/`` folder; returns each old URI's new one."""
    moved: dict[str, str] = {}
    uris = [
        u
        for u in _referenced_uris(meta)
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
    """``meta`` with every URI inside ``folder`` (the savepoint's, the one holding its
    ``chk-<id>``) relative to it."""
    prefix = folder.prefix + "/"

    def rel(value: str) -> str:
        if value.startswith(prefix):
            return RELATIVE + value[len(prefix) :].partition("?")[0]
        return value

    out: dict[str, Any] = _map_strings(meta, rel)
    out[RELATIVE_PATHS] = True
    return out


def resolve_relative(meta: dict[str, Any], folder: Location) -> dict[str, Any]:
    """``meta`` as read from ``folder`` (the one holding its ``chk-<id>``): relative
    URIs made absolute there. Metadata with absolute URIs is returned as it is."""
    if not meta.pop(RELATIVE_PATHS, False):
        return meta

    def resolve(value: str) -> str:
        if value.startswith(RELATIVE):
            return folder.child(*value[len(RELATIVE) :].split("/")).uri
        return value

    out: dict[str, Any] = _map_strings(meta, resolve)
    return out


def _map_strings(value: Any, f: Any) -> Any:
    """``value`` (JSON) with ``f`` applied to every string in it, keys aside."""
    if isinstance(value, str):
        return f(value)
    if isinstance(value, dict):
        return {k: _map_strings(v, f) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_strings(v, f) for v in value]
    return value
