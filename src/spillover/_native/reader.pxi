# The native read-ahead thread of local state files (csrc/reader.h).

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
            raise error_for(status, self.path, err_offset, errno=err_no,
                            message="reading the state file failed")
        if status == SPL_E_TRAILER:
            raise error_for(status, self.path, err_offset,
                            message="trailer does not match the frames")
        if status == SPL_E_FRAME_HEADER:
            raise error_for(status, self.path, err_offset,
                            "corrupt frame header, or a frame runs past the end of the data")
        raise error_for(status, self.path, err_offset)

    def close(self):
        """Stops the thread; batches and buffers already handed out stay valid."""
        if self.r != NULL:
            with nogil:
                spl_reader_free(self.r)
            self.r = NULL
