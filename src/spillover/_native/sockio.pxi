# Socket reads that let the GIL go at most once per call, and only to wait
# (csrc/sockio.h): what the socket holds already is read with the GIL kept.

SOCK_DONE = SPL_SOCK_DONE
SOCK_TIMEOUT = SPL_SOCK_TIMEOUT
SOCK_EOF = SPL_SOCK_EOF
SOCK_ERROR = SPL_SOCK_ERROR


# At most this much is read into a buffer with the GIL kept (a few tens of us
# of copying); the rest of it is read with the GIL let go.
cdef size_t _HELD_READ = 256 * 1024


cdef inline int _timeout_ms(double timeout):
    return -1 if timeout < 0 else <int>(timeout * 1000.0 + 0.5)


def sock_read_frame(int fd, object buf, Py_ssize_t got, Py_ssize_t header, Py_ssize_t length_at,
                    int whole_type_skip, double timeout):
    """Reads the next frame's ``header`` bytes (its type in the first, its payload's
    length a little-endian u32 at ``length_at``) into ``buf`` (``got`` bytes of it
    are there already) and, unless its type is ``whole_type_skip`` or it does not fit,
    its payload right after it, waiting at most ``timeout`` seconds (< 0: no limit)
    for each read; the GIL is let go once, and only if the frame is not there
    whole already (non-blocking reads first, with the GIL kept: a short copy is
    cheaper than a hand-off of the lock). Returns ``(status, got, errno)``:
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
        status = spl_sock_read_frame(fd, <uint8_t *>view.buf, <size_t>view.len,
                                     <size_t>header, <size_t>length_at, &g,
                                     whole_type_skip, SPL_SOCK_NO_WAIT, &err)
        if status == SPL_SOCK_TIMEOUT and ms != 0:
            with nogil:
                status = spl_sock_read_frame(fd, <uint8_t *>view.buf, <size_t>view.len,
                                             <size_t>header, <size_t>length_at, &g,
                                             whole_type_skip, ms, &err)
    finally:
        PyBuffer_Release(&view)
    return status, <Py_ssize_t>g, err


def sock_read_into(int fd, object dst, Py_ssize_t got, object ahead, double timeout):
    """Fills ``dst`` (``got`` bytes of it are there already), letting each read run on
    into ``ahead`` (the next frame's header); reads, waits and lets the GIL go like
    :func:`sock_read_frame`, except that at most 256 KiB are read with the GIL kept
    (the rest of a large buffer is read with it let go, even if there already).
    Returns ``(status, got, ahead_got, errno)``."""
    cdef Py_buffer d, a
    cdef size_t g = <size_t>got, ag = 0, held
    cdef int err = 0, status, ms = _timeout_ms(timeout)
    PyObject_GetBuffer(dst, &d, PyBUF_SIMPLE | PyBUF_WRITABLE)
    try:
        PyObject_GetBuffer(ahead, &a, PyBUF_SIMPLE | PyBUF_WRITABLE)
        try:
            if got < 0 or got > d.len:
                raise ValueError(f"a buffer of {d.len} bytes with {got} read")
            # The pass with the GIL kept stops after _HELD_READ bytes (and then does
            # not run on into ``ahead``): a segment may be 16 MiB, and a copy that
            # long would hold up every task thread of the worker.
            held = min(<size_t>d.len, g + _HELD_READ)
            status = spl_sock_read_into(fd, <uint8_t *>d.buf, held, &g,
                                        <uint8_t *>a.buf,
                                        <size_t>a.len if held == <size_t>d.len else 0,
                                        &ag, SPL_SOCK_NO_WAIT, &err)
            if (status == SPL_SOCK_TIMEOUT and ms != 0) or \
                    (status == SPL_SOCK_DONE and g < <size_t>d.len):
                with nogil:
                    status = spl_sock_read_into(fd, <uint8_t *>d.buf, <size_t>d.len, &g,
                                                <uint8_t *>a.buf, <size_t>a.len, &ag, ms,
                                                &err)
        finally:
            PyBuffer_Release(&a)
    finally:
        PyBuffer_Release(&d)
    return status, <Py_ssize_t>g, <Py_ssize_t>ag, err


def sock_recv(int fd, object buf, Py_ssize_t start, double timeout):
    """Reads what the socket holds into ``buf[start:]``, waiting at most ``timeout``
    seconds (< 0: no limit) when nothing is there yet; the GIL is let go only to
    wait. Returns ``(status, n, errno)``: ``SOCK_DONE`` with ``n`` > 0 bytes read,
    else ``SOCK_TIMEOUT``, ``SOCK_EOF`` or ``SOCK_ERROR`` with ``n`` 0."""
    cdef Py_buffer view
    cdef size_t n = 0
    cdef int err = 0, status, ms = _timeout_ms(timeout)
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE | PyBUF_WRITABLE)
    try:
        if start < 0 or start >= view.len:
            raise ValueError(f"a buffer of {view.len} bytes read from {start}")
        status = spl_sock_recv(fd, <uint8_t *>view.buf + start, <size_t>(view.len - start),
                               &n, SPL_SOCK_NO_WAIT, &err)
        if status == SPL_SOCK_TIMEOUT and ms != 0:
            with nogil:
                status = spl_sock_recv(fd, <uint8_t *>view.buf + start,
                                       <size_t>(view.len - start), &n, ms, &err)
    finally:
        PyBuffer_Release(&view)
    return status, <Py_ssize_t>n, err
