# Baselines for the benchmarks: the same I/O without the format.

def raw_write_baseline(int fd, list buffers, size_t batch_bytes):
    """Writes ``buffers`` to ``fd`` with the storer's batched writev and nothing else:
    the machine's own limit for what the storer does. Returns the bytes written."""
    cdef Py_buffer views[MAX_VIEWS]
    cdef iovec iov[MAX_VIEWS]
    cdef int n = 0, rc = 0, i
    cdef size_t pending = 0
    cdef uint64_t total = 0
    cdef Py_ssize_t k = 0, count = len(buffers)
    try:
        while k < count or n:
            if k < count:
                PyObject_GetBuffer(buffers[k], &views[n], PyBUF_SIMPLE)
                iov[n].iov_base = views[n].buf
                iov[n].iov_len = views[n].len
                pending += views[n].len
                n += 1
                k += 1
            if pending >= batch_bytes or n == MAX_VIEWS or (k == count and n):
                with nogil:
                    rc = spl_fd_write_all(fd, iov, n)
                for i in range(n):
                    PyBuffer_Release(&views[i])
                n = 0
                total += pending
                pending = 0
                if rc:
                    raise OSError(rc, os.strerror(rc))
    finally:
        for i in range(n):
            PyBuffer_Release(&views[i])
    return total


def raw_read_baseline(int fd, Block block):
    """Reads ``fd`` to its end into one reused block: the machine's own read limit.
    Returns the bytes read."""
    cdef ssize_t r
    cdef uint64_t total = 0
    with nogil:
        while True:
            r = read(fd, block.b.data, block.b.cap)
            if r <= 0:
                break
            total += r
    if r < 0:
        raise OSError(errno, os.strerror(errno))
    return total
