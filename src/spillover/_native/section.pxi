# A staged section appended to a shared state file (csrc/section.h).

SECTION_CREATE = SPL_SECTION_CREATE
SECTION_FSYNC = SPL_SECTION_FSYNC
SECTION_EMPTY = SPL_SECTION_EMPTY
SECTION_MEMORY = SPL_SECTION_MEMORY

_STEPS = {
    SPL_STEP_MKDIR: "mkdir",
    SPL_STEP_OPEN: "open",
    SPL_STEP_COPY: "copy",
    SPL_STEP_FSYNC: "fsync",
    SPL_STEP_CLOSE: "close",
}


cdef int _append_all(Py_ssize_t n, int *fds, const char *path, uint64_t *cs, uint64_t *ts,
                     const uint8_t **eps, size_t *ens, int flags, int *rc, int *step,
                     int *any_opened, int *emptied) noexcept nogil:
    """The loop of append_sections: the index of the failed section, or -1."""
    cdef Py_ssize_t i
    cdef int f, opened = 0
    for i in range(n):
        f = flags if i == 0 else flags & ~SPL_SECTION_CREATE
        rc[0] = spl_append_section(fds[i], path, cs[i], ts[i], eps[i], ens[i], f, step,
                                   &opened, &emptied[i])
        if opened:
            any_opened[0] = 1
        if rc[0]:
            return <int>i
    return -1


def append_sections(list srcs, str path, list counts, list ats, int flags, list entries,
                    bint keep_gil=False):
    """Copies staged sections into one file, each followed by its index entry
    (csrc/section.h), in one call (one release of the GIL for a subtask's gates, none
    with ``keep_gil``: for a few hundred KiB from memory the copy is shorter than
    taking the GIL back on a busy worker): section ``i`` is ``counts[i]`` bytes of
    ``srcs[i]`` at ``ats[i]``, ``entries[i]`` (bytes) right after it. ``flags``:
    ``SECTION_*``; ``SECTION_CREATE`` applies to the first only. Stops at the first
    failure; returns ``(errno or 0, step: "mkdir", "open", "copy", "fsync" or
    "close", index of the failed section or -1, opened, [emptied per section])``."""
    cdef bytes p = os.fsencode(path)
    cdef const char *cp = p
    cdef Py_ssize_t n = len(srcs), i
    if len(counts) != n or len(ats) != n or len(entries) != n:
        raise ValueError("append_sections needs as many counts, offsets and entries as sections")
    cdef int *fds = <int *>calloc(n + 1, sizeof(int))
    cdef uint64_t *cs = <uint64_t *>calloc(n + 1, sizeof(uint64_t))
    cdef uint64_t *ts = <uint64_t *>calloc(n + 1, sizeof(uint64_t))
    cdef const uint8_t **eps = <const uint8_t **>calloc(n + 1, sizeof(uint8_t *))
    cdef size_t *ens = <size_t *>calloc(n + 1, sizeof(size_t))
    cdef int *emptied = <int *>calloc(n + 1, sizeof(int))
    cdef int rc = 0, step = 0, any_opened = 0, failed = -1
    try:
        if not (fds and cs and ts and eps and ens and emptied):
            raise MemoryError()
        for i in range(n):
            fds[i] = srcs[i]
            cs[i] = counts[i]
            ts[i] = ats[i]
            e = entries[i]
            if not isinstance(e, bytes):
                raise TypeError("an index entry is bytes")
            ens[i] = len(<bytes>e)
            eps[i] = <const uint8_t *>PyBytes_AS_STRING(e) if ens[i] else NULL
        if keep_gil:
            failed = _append_all(n, fds, cp, cs, ts, eps, ens, flags, &rc, &step, &any_opened,
                                 emptied)
        else:
            with nogil:
                failed = _append_all(n, fds, cp, cs, ts, eps, ens, flags, &rc, &step,
                                     &any_opened, emptied)
        return (rc, _STEPS.get(step, "copy"), failed, bool(any_opened),
                [bool(emptied[i]) for i in range(n)])
    finally:
        free(fds)
        free(cs)
        free(ts)
        free(eps)
        free(ens)
        free(emptied)


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
