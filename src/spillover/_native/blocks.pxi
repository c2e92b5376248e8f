# Read-ahead blocks and the read-only buffers and frame batches that point into them.

cdef class Block:
    """A read-ahead block (a reference on a C block) for readers that fill blocks from
    Python, e.g. pyarrow files. ``users`` counts the other references: the batch
    made from it and the buffers pointing into it; the block is reused at zero."""

    cdef spl_block *b
    cdef Py_ssize_t shape[1]

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
        # Writable only while no batch or retrieved buffer points into it: the bytes
        # they hand out must not change under them.
        export_bytes(buffer, self, self.b.data, self.b.cap, self.shape, self.b.refs > 1, flags,
                     "a read-ahead block is read-only while buffers point into it")

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
        export_bytes(buffer, self, self.ptr, self.length, self.shape, True, flags,
                     "retrieved buffers are read-only")

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
    cdef Py_ssize_t shape[1]
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
        export_bytes(buffer, self, self.block.data, self.block.len, self.shape, True, flags,
                     "a batch's block is read-only")

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
