# Record framing: packing into fixed-size buffers, scanning, reassembly (csrc/records.c).

MAX_RECORD_LENGTH = SPL_REC_MAX_LENGTH


cdef class _Chunk:
    """A buffer handed over by the C packer; given back to its pool (or freed) with
    its last view."""

    cdef uint8_t *base
    cdef uint8_t *ptr
    cdef spl_pool *pool
    cdef Py_ssize_t shape[1]
    cdef Py_ssize_t strides[1]

    def __dealloc__(self):
        if self.pool is NULL:
            free(self.base)
        else:
            spl_pool_put(self.pool, self.base)
            spl_pool_release(self.pool)

    def __getbuffer__(self, Py_buffer *view, int flags):
        view.buf = self.ptr
        view.obj = self
        view.len = self.shape[0]
        view.readonly = 0
        view.itemsize = 1
        view.format = <char *>"B" if flags & PyBUF_FORMAT else NULL
        view.ndim = 1
        view.shape = self.shape
        view.strides = self.strides
        view.suboffsets = NULL
        view.internal = NULL

    def __releasebuffer__(self, Py_buffer *view):
        pass


cdef const uint8_t[::1] _as_bytes(object obj) except *:
    """A flat byte view of any contiguous buffer (bytes, numpy, pyarrow, ...), without a copy."""
    cdef const uint8_t[::1] mv
    try:
        mv = obj
    except (ValueError, TypeError, BufferError):
        mv = memoryview(obj).cast("B")  # other item formats or shapes, same bytes
    return mv


cdef object _adopt(uint8_t *base, uint8_t *ptr, size_t size, spl_pool *pool):
    """A numpy uint8 array over ptr[0..size) that gives base back to ``pool`` (frees it
    when NULL) when it dies."""
    cdef _Chunk c = _Chunk.__new__(_Chunk)
    c.base = base
    c.ptr = ptr
    if pool is not NULL:
        spl_pool_retain(pool)
        c.pool = pool
    c.shape[0] = <Py_ssize_t>size
    c.strides[0] = 1
    cdef cnp.npy_intp dims[1]
    dims[0] = <cnp.npy_intp>size
    cdef cnp.ndarray arr = cnp.PyArray_SimpleNewFromData(1, dims, cnp.NPY_UINT8, ptr)
    cnp.set_array_base(arr, c)
    return arr


cdef int _raise_rc(int rc, size_t at, str what) except -1:
    if rc == SPL_REC_E_NOMEM:
        raise MemoryError(f"out of memory while {what}")
    if rc == SPL_REC_E_TOO_LARGE:
        raise CorruptRecordError(
            f"record length prefix too large while {what}",
            detail=f"record starting at byte {at} of the buffer",
            hint="the data is not length-prefixed records, or max_record_size is too small",
        )
    if rc == SPL_REC_E_SHORT_KEY:
        raise CorruptRecordError(
            f"record too short for its key field while {what}",
            detail=f"record starting at byte {at} of the buffer",
            hint="check the key's offset and type against the record layout",
        )
    raise RuntimeError(f"unexpected native status {rc} while {what}")


cdef list _take_full(spl_packer *p):
    """Hands every completed buffer over to Python as (output, array)."""
    cdef size_t i
    cdef list res = []
    for i in range(p.n_full):
        res.append(
            (p.full[i].output, _adopt(p.full[i].base, p.full[i].buf, p.full[i].size, p.pool))
        )
    p.n_full = 0
    return res


cdef class Packer:
    """Packs framed records into fixed-size buffers, one stream per output. With
    ``whole_records``, a record that does not fit in what is left of a buffer starts
    the next one instead of being split, when at most an eighth of the buffer is
    left empty (the buffer is handed out short)."""

    cdef spl_packer p

    def __cinit__(self, uint32_t buffer_size, uint32_t n_outputs, bint whole_records=False):
        memset(&self.p, 0, sizeof(self.p))
        if buffer_size < 1:
            raise ValueError("buffer_size must be at least 1")
        if spl_packer_init(&self.p, buffer_size, n_outputs) != SPL_REC_OK:
            raise MemoryError()
        self.p.whole = whole_records

    def __dealloc__(self):
        spl_packer_free(&self.p)

    def put(self, uint32_t output, object record):
        """Appends one record; returns the buffers it completed."""
        cdef int rc
        cdef const uint8_t[::1] payload = _as_bytes(record)
        if output >= self.p.n_outs:
            raise IndexError(output)
        if <size_t>payload.shape[0] > SPL_REC_MAX_LENGTH:
            raise ValueError("a record is at most 2**31 - 1 bytes")
        with cython.linetrace(False):
            ts = _release_if(payload.shape[0] >= _NOGIL_MIN)
            rc = spl_packer_put(&self.p, output, _bytes_ptr(payload), <uint32_t>payload.shape[0])
            _reacquire(ts)
        if rc:
            _raise_rc(rc, 0, "packing records")
        return _take_full(&self.p)

    def put_batch(self, uint32_t output, object records, const int64_t[::1] offsets):
        """Appends records ``data[offsets[i]:offsets[i+1]]``; returns the buffers completed."""
        cdef const uint8_t[::1] data = _as_bytes(records)
        cdef int rc
        cdef Py_ssize_t i
        cdef size_t n
        if output >= self.p.n_outs:
            raise IndexError(output)
        _check_offsets(data, offsets)
        n = offsets.shape[0] - 1
        with cython.linetrace(False):
            ts = _release_if(data.shape[0] >= _NOGIL_MIN)
            for i in range(<Py_ssize_t>n):
                if offsets[i + 1] - offsets[i] > SPL_REC_MAX_LENGTH:
                    rc = -100
                    break
            else:
                rc = spl_packer_put_batch(&self.p, output, _bytes_ptr(data), &offsets[0], n)
            _reacquire(ts)
        if rc == -100:
            raise ValueError("a record is at most 2**31 - 1 bytes")
        if rc:
            _raise_rc(rc, 0, "packing records")
        return _take_full(&self.p)

    def put_fixed(self, uint32_t output, object records, uint32_t width):
        """Appends the records of ``records``, ``width`` bytes each back to back (a
        structured batch's bytes): :meth:`put_batch` without the offsets."""
        cdef const uint8_t[::1] data = _as_bytes(records)
        cdef int rc
        if output >= self.p.n_outs:
            raise IndexError(output)
        if width < 1 or width > SPL_REC_MAX_LENGTH or <size_t>data.shape[0] % width:
            raise ValueError(f"{data.shape[0]} bytes are not records of {width} bytes")
        with cython.linetrace(False):
            ts = _release_if(data.shape[0] >= _NOGIL_MIN)
            rc = spl_packer_put_fixed(&self.p, output, _bytes_ptr(data), width,
                                      <size_t>data.shape[0] // width)
            _reacquire(ts)
        if rc:
            _raise_rc(rc, 0, "packing records")
        return _take_full(&self.p)

    def put_frames(self, object data, const int64_t[::1] offsets, const int64_t[::1] lengths,
                   const int32_t[::1] outputs):
        """Appends ``data[offsets[i]:offsets[i] + lengths[i]]`` as raw bytes to output
        ``outputs[i]`` (skipped when negative), in order, GIL released: joins each
        channel's buffers into one stream cut into full buffers. Returns the buffers
        completed."""
        cdef const uint8_t[::1] buf = _as_bytes(data)
        cdef Py_ssize_t n = offsets.shape[0], i
        cdef int rc
        if lengths.shape[0] != n or outputs.shape[0] != n:
            raise ValueError("offsets, lengths and outputs differ in length")
        for i in range(n):
            if outputs[i] >= <int32_t>self.p.n_outs:
                raise IndexError(outputs[i])
            if outputs[i] >= 0 and (offsets[i] < 0 or lengths[i] < 0
                                    or offsets[i] + lengths[i] > buf.shape[0]):
                raise ValueError(f"buffer {i} lies outside the data")
        if n == 0:
            return []
        with nogil:
            rc = spl_packer_put_frames(&self.p, &buf[0] if buf.shape[0] else NULL, &offsets[0],
                                       &lengths[0], &outputs[0], <size_t>n)
        if rc:
            _raise_rc(rc, 0, "joining buffers")
        return _take_full(&self.p)

    def flush(self):
        """Hands out every partly filled buffer too (shorter than buffer_size)."""
        if spl_packer_flush(&self.p):
            raise MemoryError()
        return _take_full(&self.p)

    def spares(self):
        """Buffers given back and kept for reuse."""
        return spl_pool_spares(self.p.pool)

    def pending_bytes(self):
        """Bytes sitting in partly filled buffers."""
        cdef uint32_t o
        return sum(self.p.outs[o].pos for o in range(self.p.n_outs))


cdef class Reassembler:
    """Splits one channel's buffers into records, reassembling records that span buffers."""

    cdef spl_carry c
    cdef uint32_t max_len
    cdef object _carry_arr
    cdef object _off
    cdef object _len
    cdef uint64_t _consumed

    def __cinit__(self, uint32_t max_len):
        memset(&self.c, 0, sizeof(self.c))
        self.c.self_alloc = 0
        self.max_len = max_len
        self._off = np.empty(0, dtype=np.int64)
        self._len = np.empty(0, dtype=np.int64)
        self._consumed = 0

    @property
    def pending_bytes(self):
        """Bytes of a record begun in an earlier buffer and not yet complete."""
        return self.c.hdr_have + self.c.have

    def pending_raw(self):
        """The framed bytes of the record in progress (its length prefix, or what of it
        arrived, then its payload so far), exactly as they stood in the buffers: fed to
        a fresh reassembler before the rest of the stream, they complete the record."""
        cdef const char *h = <const char *>&self.c.hdr[0]
        cdef bytes head = h[:self.c.hdr_have]
        if self.c.hdr_have < 4 or self.c.have == 0 or self.c.data == NULL:
            return head
        return head + (<const char *>self.c.data)[:self.c.have]

    cdef object _continue(self, const uint8_t *buf, size_t n, size_t *pos):
        """Feeds buf[*pos..n) to the record in progress; returns it once complete."""
        cdef int rc
        cdef size_t used
        cdef uint8_t[::1] dst
        while True:
            with cython.linetrace(False):
                ts = _release_if(n - pos[0] >= _NOGIL_MIN)
                rc = spl_carry_feed(&self.c, buf + pos[0], n - pos[0], self.max_len, &used)
                _reacquire(ts)
            pos[0] += used
            if rc == SPL_REC_NEED_ALLOC:
                self._carry_arr = np.empty(self.c.len, dtype=np.uint8)
                dst = self._carry_arr
                self.c.data = &dst[0]
                self.c.cap = self.c.len
                continue
            if rc == SPL_REC_OK:
                done = self._carry_arr if self.c.len else np.empty(0, dtype=np.uint8)
                self._carry_arr = None
                spl_carry_reset(&self.c)
                return done
            if rc == SPL_REC_MORE:
                return None
            _raise_rc(rc, self._consumed + pos[0] - used, "reading records")

    def feed(self, object buffer):
        """Records completed by ``buf``: ``(carried, offsets, lengths)``.

        ``carried`` is the payload (a new array) of the record that began in an
        earlier buffer and ends in this one, or None; ``offsets``/``lengths``
        (int64) locate the payloads of the records lying wholly in ``buf``.
        """
        cdef size_t count = 0
        carried = self._scan(buffer, &count)
        return carried, self._off[:count].copy(), self._len[:count].copy()

    def feed_fixed(self, object buffer, uint32_t width):
        """:meth:`feed` for records of ``width`` bytes, without per-buffer arrays:
        ``(carried, start, count, bad)``. When ``bad`` is -1 the ``count`` records lying
        wholly in ``buf`` are the payloads at ``start + i * (width + 4)``; else ``bad``
        is the length of the first header lying whole in ``buf`` after the carried
        record that is not ``width``, and no record of ``buf`` is given: the stream is
        corrupt, and the reader is reset (it cannot be resynchronised). One pass over
        the headers that only compares them (``spl_rec_scan_fixed``)."""
        cdef const uint8_t[::1] buf = _as_bytes(buffer)
        cdef size_t n = buf.shape[0], pos = 0, count = 0, start
        cdef int64_t bad = -1
        cdef int rc
        carried = None
        if n == 0:
            return None, 0, 0, -1
        cdef const uint8_t *p = &buf[0]
        if self.c.hdr_have:
            carried = self._continue(p, n, &pos)
        start = pos
        if pos < n and not self.c.hdr_have:
            with cython.linetrace(False):
                ts = _release_if(n >= _NOGIL_MIN_SCAN)
                rc = spl_rec_scan_fixed(p, n, &pos, width, self.max_len, &count, &bad)
                _reacquire(ts)
            if rc:
                _raise_rc(rc, self._consumed + pos, "reading records")
            if bad >= 0:
                self.reset()
                return carried, 0, 0, bad
            if pos < n:
                self._continue(p, n, &pos)
        self._consumed += n
        if count == 0:
            return carried, 0, 0, -1
        return carried, start + SPL_REC_PREFIX, count, -1

    cdef object _scan(self, object buffer, size_t *count_out):
        """Feeds ``buffer``: returns the carried record (or None) and leaves the offsets
        and lengths of the ``count_out[0]`` records lying wholly in it in ``_off``/``_len``."""
        cdef const uint8_t[::1] buf = _as_bytes(buffer)
        cdef size_t n = buf.shape[0], pos = 0, count = 0, cap
        cdef int rc
        cdef int64_t[::1] o
        cdef int64_t[::1] l
        carried = None
        count_out[0] = 0
        if n == 0:
            return None
        cdef const uint8_t *p = &buf[0]
        if self.c.hdr_have:
            carried = self._continue(p, n, &pos)
        if pos < n and not self.c.hdr_have:
            cap = (n - pos) // SPL_REC_PREFIX + 1
            if <size_t>self._off.shape[0] < cap:
                self._off = np.empty(cap, dtype=np.int64)
                self._len = np.empty(cap, dtype=np.int64)
            o = self._off
            l = self._len
            with cython.linetrace(False):
                ts = _release_if(n >= _NOGIL_MIN_SCAN)
                rc = spl_rec_scan(p, n, &pos, self.max_len, &o[0], &l[0], cap, &count)
                _reacquire(ts)
            if rc:
                _raise_rc(rc, self._consumed + pos, "reading records")
            if pos < n:
                self._continue(p, n, &pos)
        self._consumed += n
        count_out[0] = count
        return carried

    def reset(self):
        """Drops a partly read record."""
        self._carry_arr = None
        spl_carry_reset(&self.c)


def scan_records(const uint8_t[::1] buf, uint32_t max_len):
    """Payload offsets and lengths of the whole records at the start of ``buf``, and where they end."""
    cdef size_t n = buf.shape[0], pos = 0, count = 0, cap = n // SPL_REC_PREFIX + 1
    cdef int rc = SPL_REC_OK
    off = np.empty(cap, dtype=np.int64)
    lens = np.empty(cap, dtype=np.int64)
    cdef int64_t[::1] o = off
    cdef int64_t[::1] l = lens
    if n:
        with nogil:
            rc = spl_rec_scan(&buf[0], n, &pos, max_len, &o[0], &l[0], cap, &count)
    if rc:
        _raise_rc(rc, pos, "scanning records")
    return off[:count].copy(), lens[:count].copy(), pos


cdef spl_keyspec _keyspec(int kind, uint32_t offset, bint prefixed):
    cdef spl_keyspec k
    k.kind = kind
    k.offset = offset
    k.prefixed = prefixed
    return k


def key_groups_of_buffer(
    const uint8_t[::1] buf,
    int32_t max_parallelism,
    int kind,
    uint32_t offset,
    bint prefixed,
    uint32_t max_len,
):
    """Key group of each whole record at the start of ``buf``, and where they end."""
    cdef size_t n = buf.shape[0], pos = 0, count = 0, cap = n // SPL_REC_PREFIX + 1
    cdef int rc = SPL_REC_OK
    cdef spl_keyspec key = _keyspec(kind, offset, prefixed)
    out = np.empty(cap, dtype=np.int32)
    cdef int32_t[::1] o = out
    if n:
        with nogil:
            rc = spl_rec_key_groups(&buf[0], n, &pos, max_len, &key, max_parallelism, &o[0], cap,
                                    &count)
    if rc:
        _raise_rc(rc, pos, "computing key groups")
    return out[:count].copy(), pos
