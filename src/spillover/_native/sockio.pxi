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


def sock_send_now(int fd, object head, object body):
    """Writes ``head`` then ``body`` (bytes-like) in one non-blocking ``sendmsg``, with
    the GIL kept (it never waits: a busy worker's task threads would take the GIL,
    and the caller wait to take it back) for up to 256 KiB in all, as the reads
    keep it; a larger frame's copy into the socket lets the GIL go. Returns the
    bytes the socket took, 0 when it is full; raises ``OSError`` on any other
    failure."""
    cdef Py_buffer hv, bv
    cdef size_t sent = 0
    cdef int rc
    PyObject_GetBuffer(head, &hv, PyBUF_SIMPLE)
    try:
        PyObject_GetBuffer(body, &bv, PyBUF_SIMPLE)
        try:
            if <size_t>(hv.len + bv.len) <= _HELD_READ:
                rc = spl_sock_send_now(fd, hv.buf, <size_t>hv.len, bv.buf, <size_t>bv.len,
                                       &sent)
            else:
                with nogil:
                    rc = spl_sock_send_now(fd, hv.buf, <size_t>hv.len, bv.buf,
                                           <size_t>bv.len, &sent)
        finally:
            PyBuffer_Release(&bv)
    finally:
        PyBuffer_Release(&hv)
    if rc:
        raise OSError(rc, os.strerror(rc))
    return <Py_ssize_t>sent


SOCK_FRAME = SPL_SOCK_FRAME


cdef class Wake:
    """An auto-reset wake-up (``csrc/wake.h``): :meth:`post` from any thread, with or
    without the GIL (the native credit reader posts it without); one :meth:`wait`
    takes the post. ``arm``/``notify_armed``: an output waker's flag, a notify
    wakes only an armed waiter and disarms it."""

    cdef spl_wake w
    cdef bint ready

    def __cinit__(self):
        cdef int r = spl_wake_init(&self.w)
        if r:
            raise OSError(r, os.strerror(r))
        self.ready = True

    def __dealloc__(self):
        if self.ready:
            spl_wake_destroy(&self.w)

    def post(self):
        spl_wake_post(&self.w)

    def arm(self):
        spl_wake_arm(&self.w, 1)

    def disarm(self):
        spl_wake_arm(&self.w, 0)

    def notify_armed(self):
        return bool(spl_wake_notify_armed(&self.w))

    def wait(self, timeout=None):
        """Waits for a post (the GIL let go) at most ``timeout`` seconds (None: no
        limit); True when one came, and it is taken."""
        cdef double t
        cdef int64_t ms = -1
        cdef int got
        if timeout is not None:
            t = timeout
            if not t > 0:  # 0, negative or NaN: no wait
                ms = 0
            elif t < 1e9:
                ms = <int64_t>(t * 1000.0)
                if ms < t * 1000.0:  # whole milliseconds, rounded up: never shorter
                    ms += 1
        with nogil:
            got = spl_wake_wait(&self.w, ms)
        return bool(got)

    @property
    def wakes(self):
        """Notifies that found it armed."""
        return spl_wake_count(&self.w)


cdef class Credit:
    """A producer's credit on one channel: granted by its reader (natively too),
    taken by the producer, without a lock."""

    cdef spl_credit c

    def __cinit__(self, long long initial=0):
        spl_credit_init(&self.c, initial)

    def add(self, long long delta):
        spl_credit_add(&self.c, delta)

    def take(self):
        """Takes one buffer's credit: True, or False when there is none."""
        return bool(spl_credit_take(&self.c))

    @property
    def value(self):
        return spl_credit_get(&self.c)

    @property
    def granted(self):
        """All credit ever granted, the initial included."""
        return spl_credit_granted(&self.c)


def sock_read_credit(int fd, object buf, Py_ssize_t start, Py_ssize_t end, int credit_type,
                     unsigned int channel, Credit credit not None, Wake credit_wake not None,
                     Wake output_wake,
                     double timeout):
    """Reads the consumer's CREDIT frames of ``channel`` (type ``credit_type``) into
    ``buf`` (``[start, end)`` holds what is not parsed yet) and grants their credit to
    ``credit`` as each read brings it, posting ``credit_wake`` and notifying
    ``output_wake`` (may be None), the GIL let go the whole time; returns after
    ``timeout`` seconds, or at once when another kind of frame is next
    (``SOCK_FRAME``), at EOF or on an error. ``(status, start, end, errno)``."""
    cdef Py_buffer view
    cdef size_t s = <size_t>start, e = <size_t>end
    cdef int err = 0, status, ms = _timeout_ms(timeout)
    cdef spl_wake *ow = NULL if output_wake is None else &output_wake.w
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE | PyBUF_WRITABLE)
    try:
        if start < 0 or end < start or end > view.len or view.len < 64:
            raise ValueError(f"a buffer of {view.len} bytes holding [{start}, {end})")
        with nogil:
            status = spl_sock_read_credit(fd, <uint8_t *>view.buf, <size_t>view.len, &s, &e,
                                          <uint8_t>credit_type, <uint32_t>channel,
                                          &credit.c, &credit_wake.w, ow, ms, &err)
    finally:
        PyBuffer_Release(&view)
    return status, <Py_ssize_t>s, <Py_ssize_t>e, err
