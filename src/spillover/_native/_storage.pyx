# cython: language_level=3
"""Native core of the storage engine: framing, checksums, the batched and the
threaded writer, and the zero-copy blocks the streaming reader hands out.

Every loop and every I/O call runs with the GIL released; buffers arrive
through the buffer protocol and are never copied in Python."""

from cpython.buffer cimport (
    PyBUF_SIMPLE,
    PyBUF_WRITABLE,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.memoryview cimport PyMemoryView_FromMemory
from cpython.buffer cimport PyBUF_READ
from libc.errno cimport EIO, errno
from posix.unistd cimport read
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy, memmove

from spl cimport *

import os

import numpy

from spillover.errors import (
    BadMagicError,
    ClosedError,
    CorruptFrameError,
    CorruptHeaderError,
    StorageError,
    TruncatedFileError,
    UnsupportedVersionError,
)

FORMAT_VERSION = SPL_FORMAT_VERSION
HEADER_SIZE = SPL_HEADER_SIZE
FRAME_HEADER_SIZE = SPL_FRAME_HEADER_SIZE
TRAILER_SIZE = SPL_TRAILER_SIZE
MAX_PAYLOAD = SPL_MAX_PAYLOAD

# Below this a checksum is cheaper than releasing and taking back the GIL.
DEF GIL_RELEASE_MIN = 16384
DEF MAX_VIEWS = 512
DEF SMALL_CHANNELS = 1024
cdef char *FMT_B = "B"


def crc32c(data, uint32_t value=0):
    """CRC32C of a contiguous buffer, extending ``value``."""
    cdef const uint8_t[::1] v = memoryview(data).cast("B")
    cdef uint32_t r
    with nogil:
        r = spl_crc32c(value, &v[0] if v.shape[0] else NULL, v.shape[0])
    return r


def crc32c_hardware():
    """True when CRC32C runs on the CPU's crc32 instruction."""
    return bool(spl_crc32c_hw())


def error_for(int code, str path, offset, str detail=None):
    """The exception for a format error code found at ``offset`` of ``path``."""
    if code == SPL_E_MAGIC:
        return BadMagicError(
            "not a spillover state file", path=path, offset=0, detail=detail,
            hint="the file does not start with the state-file magic")
    if code == SPL_E_VERSION:
        return UnsupportedVersionError(
            "unsupported state-file format version", path=path, offset=8, detail=detail,
            hint=f"this reader supports format version {SPL_FORMAT_VERSION}; upgrade spillover")
    if code == SPL_E_HEADER:
        return CorruptHeaderError("corrupt state header", path=path, offset=0, detail=detail)
    if code == SPL_E_FRAME_HEADER:
        return CorruptHeaderError("corrupt frame header", path=path, offset=offset, detail=detail)
    if code == SPL_E_PAYLOAD_CRC:
        return CorruptFrameError(
            "frame payload fails its checksum", path=path, offset=offset, detail=detail)
    if code == SPL_E_TRAILER:
        return CorruptHeaderError("corrupt trailer", path=path, offset=offset, detail=detail)
    if code == SPL_E_TRUNCATED:
        return TruncatedFileError("state file is truncated", path=path, offset=offset,
                                  detail=detail)
    return StorageError("storage failure", path=path, offset=offset, detail=detail)


def encode_state_header(uint64_t checkpoint_id, uint32_t subtask_index, uint32_t gate_id,
                        uint8_t gate_kind, uint8_t codec, bytes file_id):
    """The 64-byte state header of format v1."""
    cdef spl_state_header h
    if len(file_id) != 16:
        raise ValueError("file_id must be 16 bytes")
    h.checkpoint_id = checkpoint_id
    h.subtask_index = subtask_index
    h.gate_id = gate_id
    h.gate_kind = gate_kind
    h.codec = codec
    memcpy(h.file_id, PyBytes_AS_STRING(file_id), 16)
    out = PyBytes_FromStringAndSize(NULL, SPL_HEADER_SIZE)
    spl_encode_state_header(<uint8_t *>PyBytes_AS_STRING(out), &h)
    return out


def decode_state_header(const uint8_t[::1] data, str path=None):
    """Fields of a state header as a dict; raises the matching FormatError."""
    cdef spl_state_header h
    if data.shape[0] < SPL_HEADER_SIZE:
        raise TruncatedFileError("file is shorter than a state header", path=path,
                                 offset=data.shape[0])
    cdef int rc = spl_decode_state_header(&data[0], &h)
    if rc == SPL_E_VERSION:
        raise error_for(rc, path, 8, f"file has format version {h.version}")
    if rc:
        raise error_for(rc, path, 0)
    return {
        "format_version": h.version,
        "checkpoint_id": h.checkpoint_id,
        "subtask_index": h.subtask_index,
        "gate_id": h.gate_id,
        "gate_kind": h.gate_kind,
        "codec": h.codec,
        "file_id": bytes((<char *>h.file_id)[:16]),
    }


def encode_trailer(uint64_t frame_count, uint64_t raw_bytes, uint64_t stored_bytes,
                   bytes file_id):
    """The 64-byte trailer of format v1."""
    cdef spl_trailer t
    if len(file_id) != 16:
        raise ValueError("file_id must be 16 bytes")
    t.frame_count = frame_count
    t.raw_bytes = raw_bytes
    t.stored_bytes = stored_bytes
    memcpy(t.file_id, PyBytes_AS_STRING(file_id), 16)
    out = PyBytes_FromStringAndSize(NULL, SPL_TRAILER_SIZE)
    spl_encode_trailer(<uint8_t *>PyBytes_AS_STRING(out), &t)
    return out


def decode_trailer(const uint8_t[::1] data, str path=None, offset=None):
    """Fields of a trailer as a dict; raises CorruptHeaderError when damaged."""
    cdef spl_trailer t
    if data.shape[0] != SPL_TRAILER_SIZE or spl_decode_trailer(&data[0], &t):
        raise error_for(SPL_E_TRAILER, path, offset,
                        "the file does not end in a valid trailer; it was not closed cleanly "
                        "or it was damaged")
    return {
        "frame_count": t.frame_count,
        "raw_bytes": t.raw_bytes,
        "stored_bytes": t.stored_bytes,
        "file_id": bytes((<char *>t.file_id)[:16]),
    }


cdef int _py_sink(void *ctx, const iovec *iov, int n) noexcept with gil:
    """Sink for Python streams: one write call per batch, with the batch coalesced."""
    cdef NativeStorer self = <NativeStorer>ctx
    cdef size_t total = 0, off = 0
    cdef int i
    for i in range(n):
        total += iov[i].iov_len
    try:
        buf = PyByteArray_FromStringAndSize(NULL, total)
        dst = PyByteArray_AS_STRING(buf)
        with nogil:
            for i in range(n):
                memcpy(dst + off, iov[i].iov_base, iov[i].iov_len)
                off += iov[i].iov_len
        self.sink_write(buf)
    except BaseException as e:
        self.sink_exc = e
        return EIO
    return 0


cdef class NativeStorer:
    """Writes one state file through the C writer; see spillover.storage.Storer."""

    cdef spl_writer *w
    # Blocking mode holds the caller's buffers per batch slot until it is written.
    cdef Py_buffer views[SPL_WRITER_SLOTS][MAX_VIEWS]
    cdef int nviews[SPL_WRITER_SLOTS]
    cdef uint64_t released  # batches whose views are released
    cdef object sink_write
    cdef object sink_exc
    cdef object compress
    cdef bint async_mode
    cdef bint closed
    cdef bint in_append
    cdef bytes file_id
    cdef readonly str path
    cdef readonly uint64_t frames
    cdef readonly uint64_t raw_bytes
    cdef readonly uint64_t stored_bytes
    cdef dict _big_channels  # stats of channel ids >= SMALL_CHANNELS
    cdef uint64_t *_small  # frames, raw bytes per channel id < SMALL_CHANNELS
    cdef uint64_t *_small_range  # first frame's offset, end of the last, per small id
    cdef uint64_t pos  # file offset of the next frame

    def __cinit__(self, int fd, object sink_write, bytes header, bytes file_id, object compress,
                  size_t batch_bytes, size_t pool_bytes, str path):
        cdef int k
        for k in range(SPL_WRITER_SLOTS):
            self.nviews[k] = 0
        self.released = 0
        self.sink_write = sink_write
        self.compress = compress
        self.async_mode = pool_bytes > 0
        self.file_id = file_id
        self.path = path
        self._big_channels = {}
        self._small = <uint64_t *>calloc(2 * SMALL_CHANNELS, sizeof(uint64_t))
        self._small_range = <uint64_t *>calloc(2 * SMALL_CHANNELS, sizeof(uint64_t))
        if self._small == NULL or self._small_range == NULL:
            raise MemoryError()
        self.pos = len(header)
        if fd < 0 and sink_write is None:
            raise ValueError("a storer needs a file descriptor or a write callable")
        self.w = spl_writer_new(fd, <spl_sink_fn>_py_sink if fd < 0 else <spl_sink_fn>NULL,
                                <void *>self, batch_bytes,
                                pool_bytes)
        if self.w == NULL:
            raise MemoryError("cannot allocate the writer (pool or thread)")
        cdef int flush_needed
        self._check(spl_writer_put_raw(self.w, PyBytes_AS_STRING(header), len(header),
                                       &flush_needed))

    def __dealloc__(self):
        self._release_views()
        if self.w != NULL:
            with nogil:
                spl_writer_free(self.w)
            self.w = NULL
        free(self._small)
        self._small = NULL
        free(self._small_range)
        self._small_range = NULL

    cdef dict _per_channel(self, uint64_t *pairs, int first):
        """``{channel id: [pairs[2c], pairs[2c + 1]]}`` for the small ids appended to,
        and fields ``first``, ``first + 1`` of the big ids' stats."""
        cdef int c
        out = {}
        if self._small != NULL:
            for c in range(SMALL_CHANNELS):
                if self._small[2 * c]:
                    out[c] = [pairs[2 * c], pairs[2 * c + 1]]
        out.update({k: list(v[first:first + 2]) for k, v in self._big_channels.items()})
        return out

    @property
    def channels(self):
        """``{channel id: [frames, raw bytes]}`` of everything appended."""
        return self._per_channel(self._small, 0)

    @property
    def channel_ranges(self):
        """``{channel id: [first frame's file offset, end of its last frame]}``."""
        return self._per_channel(self._small_range, 2)

    cdef void _release_slot(self, int slot) noexcept:
        cdef int i
        for i in range(self.nviews[slot]):
            PyBuffer_Release(&self.views[slot][i])
        self.nviews[slot] = 0

    cdef void _release_views(self) noexcept:
        cdef int k
        for k in range(SPL_WRITER_SLOTS):
            self._release_slot(k)

    cdef int _check(self, int rc) except -1:
        cdef int err_no = 0
        if rc == 0:
            return 0
        spl_writer_error(self.w, &err_no)
        cause = self.sink_exc
        msg = os.strerror(err_no) if err_no else "write failed"
        if cause is not None:
            exc = StorageError("writing the state file failed", path=self.path,
                               offset=spl_writer_bytes_written(self.w),
                               detail=f"{type(cause).__name__}: {cause}",
                               errno=getattr(cause, "errno", None))
            raise exc from cause
        raise StorageError("writing the state file failed", path=self.path,
                           offset=spl_writer_bytes_written(self.w), detail=msg, errno=err_no)

    cdef int _flush(self) except -1:
        cdef int rc
        with nogil:
            rc = spl_writer_flush(self.w)
        self._release_views()
        self.released = spl_writer_submitted(self.w)
        return self._check(rc)

    cdef int _submit(self) except -1:
        cdef int rc
        with nogil:
            rc = spl_writer_submit(self.w)
        if rc:
            self._release_views()
            return self._check(rc)
        # Buffers of the batches written since the last look are free now.
        cdef uint64_t done = spl_writer_written(self.w)
        while self.released < done:
            self._release_slot(self.released % SPL_WRITER_SLOTS)
            self.released += 1
        return 0

    def append(self, uint32_t channel_id, object buffer, int data_type=0):
        """Frames ``buffer``; see Storer.append for ownership rules."""
        cdef Py_buffer view
        cdef int rc, slot, flush_needed = 0
        cdef uint8_t codec = SPL_CODEC_NONE
        cdef Py_ssize_t raw_len
        cdef int err_no = 0
        if self.closed:
            raise ClosedError("append after close", path=self.path)
        if spl_writer_error(self.w, &err_no):
            self._check(SPL_E_IO)
        if data_type != SPL_DATA and data_type != SPL_EVENT:
            raise ValueError(f"data_type must be 0 (data) or 1 (event), not {data_type}")
        if self.in_append:
            raise RuntimeError("a storer is not thread-safe: append called concurrently")
        try:
            PyObject_GetBuffer(buffer, &view, PyBUF_SIMPLE)
        except TypeError as e:
            raise TypeError(
                f"append needs a bytes-like object (buffer protocol), not {type(buffer).__name__}"
            ) from e
        except (BufferError, ValueError) as e:
            raise BufferError(
                f"append needs one contiguous buffer of bytes, not {type(buffer).__name__}"
            ) from e
        raw_len = view.len
        if raw_len > SPL_MAX_PAYLOAD:
            PyBuffer_Release(&view)
            raise ValueError(f"a buffer holds at most {SPL_MAX_PAYLOAD} bytes, not {raw_len}")
        if self.compress is not None and raw_len > 0:
            try:
                packed = self.compress(buffer, store_size=False)
            except BaseException:
                PyBuffer_Release(&view)
                raise
            if len(packed) < raw_len:
                PyBuffer_Release(&view)
                PyObject_GetBuffer(packed, &view, PyBUF_SIMPLE)
                codec = SPL_CODEC_LZ4
        self.in_append = True
        try:
            if self.async_mode or view.len >= GIL_RELEASE_MIN:
                with nogil:
                    rc = spl_writer_add(self.w, channel_id, <uint8_t>data_type, codec, view.buf,
                                        <uint32_t>view.len, <uint32_t>raw_len, &flush_needed)
            else:
                rc = spl_writer_add(self.w, channel_id, <uint8_t>data_type, codec, view.buf,
                                    <uint32_t>view.len, <uint32_t>raw_len, &flush_needed)
        finally:
            self.in_append = False
        if self.async_mode or rc:
            PyBuffer_Release(&view)
        else:
            slot = spl_writer_submitted(self.w) % SPL_WRITER_SLOTS
            self.views[slot][self.nviews[slot]] = view
            self.nviews[slot] += 1
        self._check(rc)
        self.frames += 1
        self.raw_bytes += raw_len
        self.stored_bytes += view.len
        cdef uint64_t start = self.pos
        self.pos += SPL_FRAME_HEADER_SIZE + <uint64_t>view.len
        if channel_id < SMALL_CHANNELS:  # no Python objects on the common path
            if self._small[2 * channel_id] == 0:
                self._small_range[2 * channel_id] = start
            self._small_range[2 * channel_id + 1] = self.pos
            self._small[2 * channel_id] += 1
            self._small[2 * channel_id + 1] += raw_len
        else:
            stats = self._big_channels.get(channel_id)
            if stats is None:
                self._big_channels[channel_id] = [1, raw_len, start, self.pos]
            else:
                stats[0] += 1
                stats[1] += raw_len
                stats[3] = self.pos
        if flush_needed:
            if self.async_mode:
                self._flush()
            else:
                self._submit()

    def submit(self):
        """Hands the batch being filled to the I/O thread now, without waiting for it
        (unless every batch slot is in flight), so held buffers are written soon."""
        if self.closed:
            raise ClosedError("submit after close", path=self.path)
        cdef int slot = spl_writer_submitted(self.w) % SPL_WRITER_SLOTS
        if not self.async_mode and self.nviews[slot]:
            self._submit()

    def reap(self):
        """Releases the caller's buffers of every batch already written; never waits."""
        cdef uint64_t done
        if self.w == NULL or self.async_mode:
            return
        done = spl_writer_written(self.w)
        while self.released < done:
            self._release_slot(self.released % SPL_WRITER_SLOTS)
            self.released += 1

    def flush(self):
        """Hands everything appended so far to the storage and drops held buffers."""
        if self.closed:
            raise ClosedError("flush after close", path=self.path)
        self._flush()

    def finish(self, bint fsync):
        """Writes the trailer, drains, optionally fsyncs; returns the file size."""
        cdef int rc, flush_needed = 0
        cdef int do_fsync = fsync
        if self.closed:
            raise ClosedError("storer already closed", path=self.path)
        trailer = encode_trailer(self.frames, self.raw_bytes, self.stored_bytes, self.file_id)
        try:
            rc = spl_writer_put_raw(self.w, PyBytes_AS_STRING(trailer), len(trailer),
                                    &flush_needed)
            if rc == 0:
                with nogil:
                    rc = spl_writer_finish(self.w, do_fsync)
            self._release_views()
            self._check(rc)
        finally:
            self.closed = True
        return spl_writer_bytes_written(self.w)

    def discard(self):
        """Stops writing at once and drops everything queued (the caller deletes the file)."""
        self.closed = True
        self._release_views()
        if self.w != NULL:
            with nogil:
                spl_writer_free(self.w)
            self.w = NULL

    @property
    def bytes_written(self):
        return spl_writer_bytes_written(self.w) if self.w != NULL else 0


cdef class OnRelease:
    """Exports another object's bytes, read-only, and calls ``callback`` once every view
    of it has been released.

    Handing ``OnRelease(network_buffer, network_buffer.release)`` to a blocking-mode
    storer persists the buffer without a copy and gives it back to its pool exactly
    when the storer is done with it (written, or copied in non-blocking mode)."""

    cdef Py_buffer view
    cdef bint has_view
    cdef object callback
    cdef int exports
    cdef Py_ssize_t shape[1]

    def __cinit__(self, object obj, object callback):
        PyObject_GetBuffer(obj, &self.view, PyBUF_SIMPLE)
        self.has_view = True
        self.callback = callback
        self.exports = 0

    def __dealloc__(self):
        if self.has_view:
            PyBuffer_Release(&self.view)
        if self.callback is not None:
            self._fire()

    cdef void _fire(self) noexcept:
        cb = self.callback
        self.callback = None
        try:
            cb()
        except BaseException:
            pass  # a release callback must not break the storer's bookkeeping

    def __getbuffer__(self, Py_buffer *buffer, int flags):
        if flags & PyBUF_WRITABLE:
            raise BufferError("OnRelease exports read-only views")
        self.shape[0] = self.view.len
        buffer.buf = self.view.buf
        buffer.obj = self
        buffer.len = self.view.len
        buffer.readonly = 1
        buffer.itemsize = 1
        buffer.format = FMT_B if flags & 0x0004 else NULL
        buffer.ndim = 1
        buffer.shape = self.shape if flags & 0x0008 else NULL
        buffer.strides = &buffer.itemsize if flags & 0x0010 else NULL
        buffer.suboffsets = NULL
        buffer.internal = NULL
        self.exports += 1

    def __releasebuffer__(self, Py_buffer *buffer):
        self.exports -= 1
        if self.exports == 0 and self.callback is not None:
            self._fire()

    def __len__(self):
        return self.view.len


cdef class Block:
    """A read-ahead block (a reference on a C block) for readers that fill blocks from
    Python, e.g. pyarrow files. ``users`` counts the other references: the batch
    made from it and the buffers pointing into it; the block is reused at zero."""

    cdef spl_block *b

    def __cinit__(self, Py_ssize_t capacity):
        self.b = spl_block_new(capacity)
        if self.b == NULL:
            raise MemoryError(f"cannot allocate a read-ahead block of {capacity} bytes")

    def __dealloc__(self):
        spl_block_decref(self.b)

    @property
    def capacity(self):
        return self.b.cap

    @property
    def users(self):
        return self.b.refs - 1

    def __getbuffer__(self, Py_buffer *buffer, int flags):
        buffer.buf = self.b.data
        buffer.obj = self
        buffer.len = self.b.cap
        buffer.readonly = 0
        buffer.itemsize = 1
        buffer.format = FMT_B if flags & 0x0004 else NULL  # PyBUF_FORMAT
        buffer.ndim = 1
        buffer.shape = &buffer.len if flags & 0x0008 else NULL  # PyBUF_ND
        buffer.strides = &buffer.itemsize if flags & 0x0010 else NULL  # PyBUF_STRIDES
        buffer.suboffsets = NULL
        buffer.internal = NULL

    def __releasebuffer__(self, Py_buffer *buffer):
        pass

    def move_tail(self, Block dst, Py_ssize_t start, Py_ssize_t end):
        """Copies bytes [start, end) of this block to the start of ``dst``."""
        if end - start > <Py_ssize_t>dst.b.cap or start < 0 or end > <Py_ssize_t>self.b.cap:
            raise ValueError("tail does not fit the destination block")
        with nogil:
            memmove(dst.b.data, self.b.data + start, end - start)


cdef class RetrievedBuffer:
    """One buffer read back from a state file.

    It exposes its bytes through the buffer protocol, read-only, without a copy:
    ``memoryview(buf)``, ``bytes(buf)``, ``numpy.frombuffer(buf, ...)``. The
    memory stays valid as long as this object or any view of it is alive."""

    cdef readonly uint32_t channel_id
    cdef readonly int data_type
    cdef readonly uint64_t offset
    cdef readonly int codec
    cdef readonly uint32_t stored_length
    cdef public bint more_available
    cdef object owner
    cdef const uint8_t *ptr
    cdef Py_ssize_t length
    cdef Py_ssize_t shape[1]

    def __getbuffer__(self, Py_buffer *buffer, int flags):
        if flags & PyBUF_WRITABLE:
            raise BufferError("retrieved buffers are read-only")
        self.shape[0] = self.length
        buffer.buf = <void *>self.ptr
        buffer.obj = self
        buffer.len = self.length
        buffer.readonly = 1
        buffer.itemsize = 1
        buffer.format = FMT_B if flags & 0x0004 else NULL
        buffer.ndim = 1
        buffer.shape = self.shape if flags & 0x0008 else NULL
        buffer.strides = &buffer.itemsize if flags & 0x0010 else NULL
        buffer.suboffsets = NULL
        buffer.internal = NULL

    def __releasebuffer__(self, Py_buffer *buffer):
        pass

    def __len__(self):
        return self.length

    @property
    def is_event(self):
        """True for event buffers (data_type 1)."""
        return self.data_type == SPL_EVENT

    def tobytes(self):
        """A copy of the bytes."""
        return PyBytes_FromStringAndSize(<const char *>self.ptr, self.length)

    def __repr__(self):
        kind = "event" if self.data_type == SPL_EVENT else "data"
        return f"<RetrievedBuffer channel={self.channel_id} {kind} {self.length} bytes>"


cdef inline RetrievedBuffer _make_buffer(spl_frame_ref *f, uint64_t offset, object owner,
                                  const uint8_t *ptr, Py_ssize_t length):
    cdef RetrievedBuffer b = RetrievedBuffer.__new__(RetrievedBuffer)
    b.channel_id = f.channel_id
    b.data_type = f.data_type
    b.codec = f.codec
    b.stored_length = f.stored_length
    b.offset = offset
    b.owner = owner
    b.ptr = ptr
    b.length = length
    return b


cdef class FrameBatch:
    """The whole frames of one block, handed out one by one in order. Each buffer
    keeps the batch (and so the block) alive."""

    cdef spl_block *block
    cdef Py_ssize_t i
    cdef object decompress
    cdef str path
    cdef bint verify

    def __dealloc__(self):
        spl_block_decref(self.block)

    @property
    def remaining(self):
        return <Py_ssize_t>self.block.nframes - self.i

    def __iter__(self):
        return self

    def __next__(self):
        b = self.next()
        if b is None:
            raise StopIteration
        return b

    cpdef next(self):
        """The next RetrievedBuffer, or None when the batch is used up. Checks the
        payload's checksum first when the retriever verifies."""
        cdef spl_frame_ref *f
        cdef RetrievedBuffer buf
        cdef const uint8_t *ptr
        cdef uint32_t crc
        if self.i >= <Py_ssize_t>self.block.nframes:
            return None
        f = &self.block.frames[self.i]
        ptr = self.block.data + f.payload
        offset = self.block.base + f.payload - SPL_FRAME_HEADER_SIZE
        if self.verify and f.checked != SPL_CRC_OK:
            if f.checked == SPL_CRC_UNCHECKED:
                if f.stored_length >= GIL_RELEASE_MIN:
                    with nogil:
                        crc = spl_crc32c(0, ptr, f.stored_length)
                else:
                    crc = spl_crc32c(0, ptr, f.stored_length)
                f.checked = SPL_CRC_OK if crc == f.payload_crc else SPL_CRC_BAD
            if f.checked == SPL_CRC_BAD:
                raise error_for(SPL_E_PAYLOAD_CRC, self.path, offset)
        self.i += 1
        if f.codec == SPL_CODEC_NONE:
            buf = _make_buffer(f, offset, self, ptr, f.stored_length)
            buf.more_available = self.i < <Py_ssize_t>self.block.nframes
            return buf
        view = PyMemoryView_FromMemory(<char *>ptr, f.stored_length, PyBUF_READ)
        try:
            raw = self.decompress(view, uncompressed_size=f.raw_length)
        except Exception as e:
            raise CorruptFrameError("lz4 frame does not decode", path=self.path, offset=offset,
                                    detail=str(e)) from e
        finally:
            view.release()
        if len(raw) != f.raw_length:
            raise CorruptFrameError("lz4 frame decodes to the wrong length", path=self.path,
                                    offset=offset,
                                    detail=f"expected {f.raw_length}, got {len(raw)}")
        buf = _make_buffer(f, offset, raw, <const uint8_t *>PyBytes_AS_STRING(raw),
                           f.raw_length)
        buf.more_available = self.i < <Py_ssize_t>self.block.nframes
        return buf


    def __getbuffer__(self, Py_buffer *buffer, int flags):
        if flags & PyBUF_WRITABLE:
            raise BufferError("a batch's block is read-only")
        buffer.buf = self.block.data
        buffer.obj = self
        buffer.len = self.block.len
        buffer.readonly = 1
        buffer.itemsize = 1
        buffer.format = FMT_B if flags & 0x0004 else NULL
        buffer.ndim = 1
        buffer.shape = &buffer.len if flags & 0x0008 else NULL
        buffer.strides = &buffer.itemsize if flags & 0x0010 else NULL
        buffer.suboffsets = NULL
        buffer.internal = NULL

    def __releasebuffer__(self, Py_buffer *buffer):
        pass

    @property
    def base_offset(self):
        """File offset of the block's first byte."""
        return self.block.base

    def take_all(self):
        """Every remaining frame at once, as arrays: ``(data, channel_ids, offsets,
        lengths, data_types, file_offsets)``.

        ``data`` is a read-only uint8 array over the block (zero-copy; it keeps the
        block alive) in which frame ``i``'s payload is ``data[offsets[i]:][:lengths[i]]``;
        ``file_offsets[i]`` is where its frame header starts in the file. Payload
        checksums are checked first (GIL released); a damaged frame raises before
        any frame of the batch is handed out. LZ4 frames are decoded into a new
        array instead (one Python call per compressed frame)."""
        cdef Py_ssize_t k, n = <Py_ssize_t>self.block.nframes - self.i, j
        cdef spl_frame_ref *f
        cdef int bad = -1
        cdef bint compressed = False
        cdef uint32_t[::1] ch
        cdef int64_t[::1] off
        cdef int64_t[::1] ln
        cdef uint8_t[::1] dt
        cdef int64_t[::1] fo
        if n < 0:
            n = 0
        channel_ids = numpy.empty(n, numpy.uint32)
        offsets = numpy.empty(n, numpy.int64)
        lengths = numpy.empty(n, numpy.int64)
        data_types = numpy.empty(n, numpy.uint8)
        file_offsets = numpy.empty(n, numpy.int64)
        ch, off, ln, dt, fo = channel_ids, offsets, lengths, data_types, file_offsets
        with nogil:
            for k in range(n):
                f = &self.block.frames[self.i + k]
                if self.verify and f.checked == SPL_CRC_UNCHECKED:
                    f.checked = (SPL_CRC_OK
                                 if spl_crc32c(0, self.block.data + f.payload, f.stored_length)
                                 == f.payload_crc else SPL_CRC_BAD)
                if self.verify and f.checked == SPL_CRC_BAD and bad < 0:
                    bad = <int>k
                if f.codec != SPL_CODEC_NONE:
                    compressed = True
                ch[k] = f.channel_id
                off[k] = <int64_t>f.payload
                ln[k] = f.stored_length
                dt[k] = f.data_type
                fo[k] = <int64_t>(self.block.base + f.payload - SPL_FRAME_HEADER_SIZE)
        if bad >= 0:
            raise error_for(SPL_E_PAYLOAD_CRC, self.path, int(file_offsets[bad]))
        if not compressed:
            data = numpy.frombuffer(self, numpy.uint8)
        else:
            data = self._decoded(offsets, lengths)
        self.i = self.block.nframes
        return data, channel_ids, offsets, lengths, data_types, file_offsets

    cdef object _decoded(self, object offsets, object lengths):
        """The remaining payloads decoded into one new array; ``offsets``/``lengths``
        are rewritten to point into it (the slow path of compressed files)."""
        cdef Py_ssize_t k, n = len(offsets), total = 0, pos = 0, size
        cdef spl_frame_ref *f
        cdef const uint8_t[::1] raw
        for k in range(n):
            f = &self.block.frames[self.i + k]
            total += f.stored_length if f.codec == SPL_CODEC_NONE else f.raw_length
        out = numpy.empty(total, numpy.uint8)
        cdef uint8_t[::1] dst = out
        for k in range(n):
            f = &self.block.frames[self.i + k]
            if f.codec == SPL_CODEC_NONE:
                size = f.stored_length
                if size:
                    memcpy(&dst[pos], self.block.data + f.payload, size)
            else:
                offset = self.block.base + f.payload - SPL_FRAME_HEADER_SIZE
                view = PyMemoryView_FromMemory(<char *>(self.block.data + f.payload),
                                               f.stored_length, PyBUF_READ)
                try:
                    decoded = self.decompress(view, uncompressed_size=f.raw_length)
                except Exception as e:
                    raise CorruptFrameError("lz4 frame does not decode", path=self.path,
                                            offset=offset, detail=str(e)) from e
                finally:
                    view.release()
                if len(decoded) != f.raw_length:
                    raise CorruptFrameError("lz4 frame decodes to the wrong length",
                                            path=self.path, offset=offset,
                                            detail=f"expected {f.raw_length}, got {len(decoded)}")
                size = f.raw_length
                if size:
                    raw = decoded
                    memcpy(&dst[pos], &raw[0], size)
            offsets[k] = pos
            lengths[k] = size
            pos += size
        return out


cdef FrameBatch _make_batch(spl_block *b, bint verify, object decompress, str path):
    """Wraps ``b``, taking over one reference to it."""
    cdef FrameBatch batch = FrameBatch.__new__(FrameBatch)
    batch.block = b
    batch.i = 0
    batch.verify = verify
    batch.decompress = decompress
    batch.path = path
    return batch


def scan_block(Block block, Py_ssize_t length, uint64_t base, bint verify, object decompress,
               str path):
    """Finds the whole frames in ``block[0:length)``, checking every header (GIL
    released); when ``verify``, the batch checks each payload's checksum as it hands
    the buffer out.

    Returns ``(batch, consumed, need, frames, raw_bytes, stored_bytes)``: ``need`` is
    the size of the next, partial frame when its header is complete (else the size of
    a frame header). Raises the matching FormatError, with the file offset, on damage.
    """
    cdef size_t consumed = 0, need = 0, err_at = 0
    cdef uint64_t frames = 0, raw = 0, stored = 0
    cdef int rc
    cdef spl_block *b = block.b
    if length > <Py_ssize_t>b.cap:
        raise ValueError("length exceeds the block")
    b.len = length
    b.base = base
    with nogil:
        rc = spl_block_scan(b, &consumed, &need, &err_at, &frames, &raw, &stored)
    if rc == SPL_E_IO:
        raise MemoryError()
    if rc:
        raise error_for(rc, path, base + err_at)
    spl_block_incref(b)
    return _make_batch(b, verify, decompress, path), consumed, need, frames, raw, stored


cdef class NativeReader:
    """Read-ahead of a local state file by a native thread (see csrc/reader.h)."""

    cdef spl_reader *r
    cdef str path
    cdef bint verify
    cdef object decompress

    def __cinit__(self, int fd, uint64_t start, uint64_t end, size_t block_bytes,
                  size_t max_queued, uint64_t frames, uint64_t raw_bytes, uint64_t stored_bytes,
                  bint verify, object decompress, str path, bint whole=True):
        # whole=False: [start, end) is a byte range of the file, whose frames the
        # caller counts; the trailer's sums cover the whole file and are not checked.
        self.path = path
        self.verify = verify
        self.decompress = decompress
        self.r = spl_reader_new(fd, start, end, block_bytes, max_queued,
                                frames if whole else SPL_READER_UNCHECKED, raw_bytes,
                                stored_bytes, verify)
        if self.r == NULL:
            raise MemoryError("cannot start the read-ahead thread")

    def __dealloc__(self):
        self.close()

    def next_batch(self, double timeout):
        """The next FrameBatch; None when none is ready within ``timeout`` seconds
        (negative: wait as long as it takes); False at the end. Raises what the reader
        found wrong."""
        cdef int status = 0, err_no = 0
        cdef uint64_t err_offset = 0
        cdef int wait_ms = -1 if timeout < 0 else <int>(timeout * 1000)
        cdef spl_block *b
        if self.r == NULL:
            raise ClosedError("retriever is closed", path=self.path)
        if wait_ms == 0:
            b = spl_reader_next(self.r, 0, &status, &err_offset, &err_no)
        else:
            with nogil:
                b = spl_reader_next(self.r, wait_ms, &status, &err_offset, &err_no)
        if b != NULL:
            return _make_batch(b, self.verify, self.decompress, self.path)
        if status == SPL_READER_WAIT:
            return None
        if status == SPL_READER_DONE:
            return False
        if status == SPL_E_IO:
            raise StorageError("reading the state file failed", path=self.path,
                               offset=err_offset, detail=os.strerror(err_no), errno=err_no)
        if status == SPL_E_TRAILER:
            raise CorruptHeaderError("trailer does not match the frames", path=self.path,
                                     offset=err_offset)
        if status == SPL_E_FRAME_HEADER and err_offset >= 0:
            raise error_for(status, self.path, err_offset,
                            "corrupt frame header, or a frame runs past the end of the data")
        raise error_for(status, self.path, err_offset)

    def close(self):
        """Stops the thread; batches and buffers already handed out stay valid."""
        if self.r != NULL:
            with nogil:
                spl_reader_free(self.r)
            self.r = NULL


# -- baselines for the benchmarks: the same I/O without the format ---------------------


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
