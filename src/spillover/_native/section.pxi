# A staged section appended to a shared state file (csrc/section.h).

SECTION_CREATE = SPL_SECTION_CREATE
SECTION_FSYNC = SPL_SECTION_FSYNC
SECTION_EMPTY = SPL_SECTION_EMPTY

_STEPS = {
    SPL_STEP_MKDIR: "mkdir",
    SPL_STEP_OPEN: "open",
    SPL_STEP_COPY: "copy",
    SPL_STEP_FSYNC: "fsync",
    SPL_STEP_CLOSE: "close",
}


def append_section(int src, str path, uint64_t count, uint64_t at, int flags):
    """Copies ``count`` bytes from the start of ``src`` to offset ``at`` of ``path`` in one
    call with the GIL released once; returns ``(errno or 0, the step that failed:
    "mkdir", "open", "copy", "fsync" or "close", opened, emptied)`` (see
    csrc/section.h)."""
    cdef bytes p = os.fsencode(path)
    cdef const char *cp = p
    cdef int rc, step = 0, opened = 0, emptied = 0
    with nogil:
        rc = spl_append_section(src, cp, count, at, flags, &step, &opened, &emptied)
    return rc, _STEPS.get(step, "copy"), bool(opened), bool(emptied)


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
