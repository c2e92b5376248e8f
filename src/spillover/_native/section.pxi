# A staged section appended to a shared state file (csrc/section.h).

SECTION_CREATE = SPL_SECTION_CREATE
SECTION_FSYNC = SPL_SECTION_FSYNC
SECTION_EMPTY = SPL_SECTION_EMPTY
PUBLISH_REPLACE = SPL_PUBLISH_REPLACE

_STEPS = {
    SPL_STEP_MKDIR: "mkdir",
    SPL_STEP_OPEN: "open",
    SPL_STEP_COPY: "copy",
    SPL_STEP_FSYNC: "fsync",
    SPL_STEP_CLOSE: "close",
    SPL_STEP_RENAME: "rename",
    SPL_STEP_LINK: "link",
    SPL_STEP_DIRSYNC: "dirsync",
}


def append_sections(list sections, str path, int flags, bint keep_gil=False):
    """Copies a part's staged sections into one file, each followed by its index entry
    (csrc/section.h), in one call: the file opened, fsynced (``SECTION_FSYNC``) and
    closed once, the GIL let go once (not at all with ``keep_gil``: for a few hundred
    KiB from memory the copy is shorter than taking the GIL back on a busy worker).
    ``sections``: ``(staged fd, bytes, offset in the file, in memory, entry)`` each,
    the entry (bytes, maybe empty) written right after the section. ``flags``:
    ``SECTION_*``. Stops at the first failure; returns ``(errno or 0, step: "mkdir",
    "open", "copy", "fsync" or "close", opened, [emptied per section])``."""
    cdef bytes p = os.fsencode(path)
    cdef const char *cp = p
    cdef Py_ssize_t n = len(sections), i
    cdef spl_section *ss = <spl_section *>calloc(n + 1, sizeof(spl_section))
    cdef int rc = 0, step = 0, opened = 0
    if ss == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            fd, count, at, in_memory, e = sections[i]
            if not isinstance(e, bytes):
                raise TypeError("an index entry is bytes")
            ss[i].src = fd
            ss[i].count = count
            ss[i].at = at
            ss[i].in_memory = 1 if in_memory else 0
            ss[i].extra_len = len(<bytes>e)
            ss[i].extra = <const void *>PyBytes_AS_STRING(e) if ss[i].extra_len else NULL
        # `sections` holds the entries (bytes) alive through the call.
        if keep_gil:
            rc = spl_append_sections(cp, ss, <size_t>n, flags, &step, &opened)
        else:
            with nogil:
                rc = spl_append_sections(cp, ss, <size_t>n, flags, &step, &opened)
        return (rc, _STEPS.get(step, "copy"), bool(opened),
                [bool(ss[i].emptied) for i in range(n)])
    finally:
        free(ss)


def copy_range(int src, int dst, uint64_t count, uint64_t at, bint in_memory):
    """Copies ``count`` bytes from offset 0 of ``src`` to offset ``at`` of ``dst`` in the
    kernel where it can (csrc/section.h), with the GIL let go: 0 or an errno value
    (EIO if ``src`` ends early)."""
    cdef int rc
    with nogil:
        rc = spl_copy_range(src, dst, count, at, in_memory)
    return rc


def write_new_file(str path, const uint8_t[::1] data, int flags):
    """Writes ``data`` as a new file at ``path`` (its directories made; an existing
    file is refused with EEXIST at "open"), fsynced with ``SECTION_FSYNC``, in one
    call with the GIL released once; returns ``(errno or 0, the step that failed)``
    (see csrc/section.h)."""
    cdef bytes p = os.fsencode(path)
    cdef const char *cp = p
    cdef const uint8_t *ptr = &data[0] if data.shape[0] else NULL
    cdef size_t n = data.shape[0]
    cdef int rc, step = 0
    with nogil:
        rc = spl_write_new_file(cp, ptr, n, flags, &step)
    return rc, _STEPS.get(step, "write").replace("copy", "write")


def publish_file(str tmp, str path, const uint8_t[::1] data, int flags):
    """Publishes ``data`` as the file ``path`` through the new file ``tmp`` beside it
    (renamed over ``path`` with ``PUBLISH_REPLACE``, else hard-linked to it: an
    existing ``path`` is EEXIST at "link"), the file and its directory fsynced with
    ``SECTION_FSYNC``, in one call with the GIL released once; returns ``(errno or
    0, the step that failed)`` (see csrc/section.h)."""
    cdef bytes t = os.fsencode(tmp)
    cdef bytes p = os.fsencode(path)
    cdef const char *ct = t
    cdef const char *cp = p
    cdef const uint8_t *ptr = &data[0] if data.shape[0] else NULL
    cdef size_t n = data.shape[0]
    cdef int rc, step = 0
    with nogil:
        rc = spl_publish_file(ct, cp, ptr, n, flags, &step)
    return rc, _STEPS.get(step, "write").replace("copy", "write")


PUBLISH_MAX = SPL_PUBLISH_MAX


def publish_files(list files):
    """Publishes ``files``, ``(tmp, path, data, flags)`` each, in order (csrc/section.h,
    ``spl_publish_files``): every file's data written and synced first, then each
    renamed or linked and its directory synced in turn, so that none is visible
    before every earlier one is; one call with the GIL released once. Returns
    ``(errno or 0, the index of the file that failed, the step that failed)``."""
    cdef size_t n = len(files), i, at = 0
    cdef int rc, step = 0
    if n > <size_t>SPL_PUBLISH_MAX:
        raise ValueError(f"at most {SPL_PUBLISH_MAX} files per call, not {n}")
    cdef const char *tmps[SPL_PUBLISH_MAX]
    cdef const char *paths[SPL_PUBLISH_MAX]
    cdef const void *datas[SPL_PUBLISH_MAX]
    cdef size_t lens[SPL_PUBLISH_MAX]
    cdef int flags[SPL_PUBLISH_MAX]
    cdef const uint8_t[::1] view
    keep = []  # the encoded names and the data's views, alive through the call
    for i in range(n):
        tmp, path, data, flag = files[i]
        t, p = os.fsencode(tmp), os.fsencode(path)
        view = data
        keep.append((t, p, view))
        tmps[i] = t
        paths[i] = p
        datas[i] = &view[0] if view.shape[0] else NULL
        lens[i] = view.shape[0]
        flags[i] = flag
    with nogil:
        rc = spl_publish_files(n, tmps, paths, datas, lens, flags, &at, &step)
    return rc, <Py_ssize_t>at, _STEPS.get(step, "write").replace("copy", "write")
