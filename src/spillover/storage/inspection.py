"""Reading a state file or a storage directory back as a summary, checking every frame."""

from __future__ import annotations

import os
from typing import Any

from spillover._native import _storage as native
from spillover.errors import SpilloverError, StorageError
from spillover.storage.backends import ArrowBackend, LocalBackend, backend_for, readinto_exact
from spillover.storage.channel_index import INDEX_MAGIC, decode_entry
from spillover.storage.handle import Codec, GateKind
from spillover.storage.location import Location
from spillover.storage.options import StorageOptions
from spillover.storage.retriever import Retriever


def inspect_state_file(
    uri: str,
    *,
    verify: bool = True,
    filesystem: Any = None,
    section: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Header fields, per-channel frame counts and sizes of one state file, or of one
    gate's ``section`` ``(offset, size)`` of a shared file (its handle's).

    Reads every frame (so every checksum is checked when ``verify``); raises the
    file's :class:`~spillover.errors.SpilloverError` when it is damaged.
    """
    loc = Location.parse(uri, filesystem)
    backend, name = backend_for(loc.parent), loc.name
    opts = StorageOptions(verify_checksums=verify)
    channels: dict[int, dict[str, int]] = {}
    with Retriever(backend, name, opts, section=section) as r:
        for buf in r:
            c = channels.setdefault(
                buf.channel_id,
                {"frames": 0, "events": 0, "raw_bytes": 0, "stored_bytes": 0, "lz4_frames": 0},
            )
            c["frames"] += 1
            c["events"] += buf.data_type
            c["raw_bytes"] += len(buf)
            c["stored_bytes"] += buf.stored_length
            c["lz4_frames"] += buf.codec == Codec.LZ4
        header, trailer, size = r.header, r.trailer, r.size
    return {
        "uri": r.uri,
        "size": size,
        "format_version": header["format_version"],
        "checkpoint_id": header["checkpoint_id"],
        "subtask_index": header["subtask_index"],
        "gate_id": header["gate_id"],
        "gate_kind": GateKind(header["gate_kind"]).name.lower(),
        "codec": Codec(header["codec"]).label or "none",
        "file_id": header["file_id"].hex(),
        "frame_count": trailer["frame_count"],
        "raw_bytes": trailer["raw_bytes"],
        "stored_bytes": trailer["stored_bytes"],
        "checksums_verified": verify,
        "channels": {str(k): v for k, v in sorted(channels.items())},
    } | ({} if section is None else {"offset": section[0]})


def shared_sections(uri: str, filesystem: Any = None) -> list[tuple[int, int]] | None:
    """The sections ``(offset, size)`` of a shared state file (docs/format.md, "Shared
    files"), in file order; None for a file of one gate, and for one whose sections
    cannot be told apart (damaged, or ending in a failed copy): read whole, it says
    what is wrong.

    Found from the end: each section's trailer gives its size (header, frames and
    trailer), and the header that size before it must repeat the trailer's file id.
    A section may be followed by its index section (a channel index entry, metadata
    version 3), skipped: the last intact entry that ends where the section would
    (:func:`_entry_before`).
    """
    hs, ts, fs = native.HEADER_SIZE, native.TRAILER_SIZE, native.FRAME_HEADER_SIZE
    loc = Location.parse(uri, filesystem)
    backend, name = backend_for(loc.parent), loc.name
    sections: list[tuple[int, int]] = []
    try:
        f, end = backend.open_read(name)
    except SpilloverError:
        return None
    file_size = end
    try:
        while end > 0:
            tail = bytearray(ts)
            f.seek(end - ts)
            if end < hs + ts or readinto_exact(f, memoryview(tail)) != ts:
                return None
            try:
                trailer = native.decode_trailer(tail, uri, end - ts)
            except SpilloverError:
                start = _entry_before(f, end)
                if start is None:
                    raise
                end = start
                continue
            size = hs + ts + fs * trailer["frame_count"] + trailer["stored_bytes"]
            if size > end:
                return None
            head = bytearray(hs)
            f.seek(end - size)
            if readinto_exact(f, memoryview(head)) != hs:
                return None
            if native.decode_state_header(head, uri)["file_id"] != trailer["file_id"]:
                return None
            sections.append((end - size, size))
            end -= size
    except (SpilloverError, OSError):
        return None
    finally:
        f.close()
    # One section that is the whole file is a gate file of its own, read whole; one
    # followed by its index section is a shared file's only member.
    if len(sections) > 1 or (sections and sections[0][1] != file_size):
        return sections[::-1]
    return None


_ENTRY_WINDOW = 1 << 20  # bytes searched back for an index section's start


def _entry_before(f: Any, end: int) -> int | None:
    """Where an intact channel index entry ending at ``end`` starts (its magic, then
    a CRC that holds), searched within the last :data:`_ENTRY_WINDOW` bytes."""
    start = max(0, end - _ENTRY_WINDOW)
    f.seek(start)
    window = bytearray(end - start)
    if readinto_exact(f, memoryview(window)) != len(window):
        return None
    at = len(window)
    while (at := window.rfind(INDEX_MAGIC, 0, at)) >= 0:
        try:
            decode_entry(memoryview(window)[at:])
        except SpilloverError:
            continue
        return start + at
    return None


def state_files(uri: str, filesystem: Any = None) -> list[str]:
    """The state files named by ``uri``: the file itself, or every ``*.spill`` in a
    directory and its subdirectories (a directory's own files first, then each
    subdirectory's, by name)."""
    base = uri.partition("?")[0]
    if base.endswith(".spill"):
        return [uri]
    backend = backend_for(uri, filesystem)
    if isinstance(backend, LocalBackend):
        if not os.path.isdir(backend.root):
            return [uri]
        names = []
        for top, dirs, files in os.walk(backend.root):  # symlinked directories not followed
            dirs.sort()
            rel = os.path.relpath(top, backend.root)
            names += [n if rel == "." else os.path.join(rel, n) for n in sorted(files)]
    elif isinstance(backend, ArrowBackend):
        names = _arrow_walk(backend)
    else:
        names = backend.list()
    return [backend.uri_of(n) for n in names if n.endswith(".spill")]


def _arrow_walk(backend: ArrowBackend) -> list[str]:
    """Every file under an :class:`ArrowBackend`'s root, as ``sub/dir/name``, in the
    order of :func:`state_files`."""
    import pyarrow.fs as pafs

    try:
        infos = backend.fs.get_file_info(
            pafs.FileSelector(backend.root, allow_not_found=True, recursive=True)
        )
    except OSError as e:
        raise StorageError(
            "cannot list storage directory",
            path=backend.uri_prefix,
            errno=e.errno,
            detail=f"{type(e).__name__}: {e}",
        ) from e
    start = len(backend.root) + 1 if backend.root else 0
    names = [i.path[start:] for i in infos if i.type == pafs.FileType.File]
    return sorted(names, key=lambda n: (n.split("/")[:-1], n))
