# The one way this extension exports bytes through the buffer protocol.

from cpython.buffer cimport PyBUF_FORMAT, PyBUF_ND, PyBUF_STRIDES


cdef inline int export_bytes(Py_buffer *buffer, object owner, const void *ptr,
                             Py_ssize_t length, Py_ssize_t *shape, bint readonly, int flags,
                             str refusal) except -1:
    """Fills ``buffer`` with a 1-D view of ``length`` bytes at ``ptr`` owned by ``owner``;
    a writable request on ``readonly`` bytes raises ``BufferError(refusal)``."""
    if readonly and flags & PyBUF_WRITABLE:
        raise BufferError(refusal)
    shape[0] = length
    buffer.buf = <void *>ptr
    buffer.obj = owner
    buffer.len = length
    buffer.readonly = readonly
    buffer.itemsize = 1
    buffer.format = FMT_B if flags & PyBUF_FORMAT else NULL
    buffer.ndim = 1
    buffer.shape = shape if flags & PyBUF_ND else NULL
    buffer.strides = &buffer.itemsize if flags & PyBUF_STRIDES else NULL
    buffer.suboffsets = NULL
    buffer.internal = NULL
    return 0
