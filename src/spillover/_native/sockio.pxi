# Socket reads and writes with the GIL let go once per call (csrc/sockio.h).

SOCK_DONE = SPL_SOCK_DONE
SOCK_TIMEOUT = SPL_SOCK_TIMEOUT
SOCK_EOF = SPL_SOCK_EOF
SOCK_ERROR = SPL_SOCK_ERROR


cdef inline int _timeout_ms(double timeout):
    return -1 if timeout < 0 else <int>(timeout * 1000.0 + 0.5)


def sock_read_frame(int fd, object buf, Py_ssize_t got, Py_ssize_t header, Py_ssize_t length_at,
                    int whole_type_skip, double timeout):
    """Reads the next frame's ``header`` bytes (its type in the first, its payload's
    length a little-endian u32 at ``length_at``) into ``buf`` (``got`` bytes of it
    are there already) and, unless its type is ``whole_type_skip`` or it does not fit,
    its payload right after it, waiting at most ``timeout`` seconds (< 0: no limit)
    for each read; the GIL is let go once. Returns ``(status, got, errno)``:
    ``SOCK_DONE``, ``SOCK_TIMEOUT`` (call again with ``got``), ``SOCK_EOF`` or
    ``SOCK_ERROR``."""
    cdef Py_buffer view
    cdef size_t g = <size_t>got
    cdef int err = 0, status, ms = _timeout_ms(timeout)
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE | PyBUF_WRITABLE)
    try:
        if got < 0 or got > view.len or length_at < 0 or header < length_at + 4 \
                or view.len < header:
            raise ValueError(f"a frame buffer of {view.len} bytes with {got} read, "
                             f"a header of {header} with the length at {length_at}")
        with nogil:
            status = spl_sock_read_frame(fd, <uint8_t *>view.buf, <size_t>view.len,
                                         <size_t>header, <size_t>length_at, &g,
                                         whole_type_skip, ms, &err)
    finally:
        PyBuffer_Release(&view)
    return status, <Py_ssize_t>g, err


def sock_read_into(int fd, object dst, Py_ssize_t got, object ahead, double timeout):
    """Fills ``dst`` (``got`` bytes of it are there already), letting each read run on
    into ``ahead`` (the next frame's header); waits and lets the GIL go like
    :func:`sock_read_frame`. Returns ``(status, got, ahead_got, errno)``."""
    cdef Py_buffer d, a
    cdef size_t g = <size_t>got, ag = 0
    cdef int err = 0, status, ms = _timeout_ms(timeout)
    PyObject_GetBuffer(dst, &d, PyBUF_SIMPLE | PyBUF_WRITABLE)
    try:
        PyObject_GetBuffer(ahead, &a, PyBUF_SIMPLE | PyBUF_WRITABLE)
        try:
            if got < 0 or got > d.len:
                raise ValueError(f"a buffer of {d.len} bytes with {got} read")
            with nogil:
                status = spl_sock_read_into(fd, <uint8_t *>d.buf, <size_t>d.len, &g,
                                            <uint8_t *>a.buf, <size_t>a.len, &ag, ms, &err)
        finally:
            PyBuffer_Release(&a)
    finally:
        PyBuffer_Release(&d)
    return status, <Py_ssize_t>g, <Py_ssize_t>ag, err


def sock_send_each(list fds, list payloads, double timeout):
    """Writes ``payloads[i]`` (bytes) whole to socket ``fds[i]`` for each, one after
    the other, with the GIL let go once for all (MSG_NOSIGNAL; a socket that takes
    nothing for ``timeout`` seconds, < 0: no limit, fails with ETIMEDOUT). A failed
    socket does not stop the others. Returns ``[(bytes sent, errno or 0), ...]``."""
    cdef Py_ssize_t n = len(fds), i
    if len(payloads) != n:
        raise ValueError("sock_send_each needs one payload per socket")
    cdef int *cfds = <int *>calloc(n + 1, sizeof(int))
    cdef const uint8_t **data = <const uint8_t **>calloc(n + 1, sizeof(uint8_t *))
    cdef size_t *lens = <size_t *>calloc(n + 1, sizeof(size_t))
    cdef size_t *sent = <size_t *>calloc(n + 1, sizeof(size_t))
    cdef int *errs = <int *>calloc(n + 1, sizeof(int))
    cdef int ms = _timeout_ms(timeout)
    cdef bytes p
    try:
        if not (cfds and data and lens and sent and errs):
            raise MemoryError()
        for i in range(n):
            p = payloads[i]  # bytes: kept alive by the list during the call
            cfds[i] = fds[i]
            data[i] = <const uint8_t *>PyBytes_AS_STRING(p)
            lens[i] = <size_t>len(p)
        with nogil:
            spl_sock_send_each(<int>n, cfds, data, lens, ms, sent, errs)
        return [(<Py_ssize_t>sent[i], errs[i]) for i in range(n)]
    finally:
        free(cfds)
        free(<void *>data)
        free(lens)
        free(sent)
        free(errs)


def sock_send_now(int fd, object head, object body):
    """Writes what the socket takes now of ``head`` then ``body`` (any contiguous
    buffers) in one ``sendmsg`` that never waits. Below 256 KiB the GIL is kept: the
    copy into the socket is shorter than taking the GIL back on a busy worker (the
    writer is a task thread, whose next take waits behind the others). Returns
    ``(bytes written, errno or 0)``; a full socket is ``(0, 0)``."""
    cdef Py_buffer a, b
    cdef long n
    PyObject_GetBuffer(head, &a, PyBUF_SIMPLE)
    try:
        PyObject_GetBuffer(body, &b, PyBUF_SIMPLE)
        try:
            if a.len + b.len < GIL_RELEASE_MIN:
                n = spl_sock_send_now(fd, <const uint8_t *>a.buf, <size_t>a.len,
                                      <const uint8_t *>b.buf, <size_t>b.len)
            else:
                with nogil:
                    n = spl_sock_send_now(fd, <const uint8_t *>a.buf, <size_t>a.len,
                                          <const uint8_t *>b.buf, <size_t>b.len)
        finally:
            PyBuffer_Release(&b)
    finally:
        PyBuffer_Release(&a)
    if n >= 0:
        return n, 0
    return 0, -n
