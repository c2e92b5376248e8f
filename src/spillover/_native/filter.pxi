# The key-group filter / demultiplexer (csrc/records.c).


cdef class _Carry:
    """One input channel's record cut by a buffer boundary (storage reused)."""

    cdef spl_carry c

    def __cinit__(self):
        memset(&self.c, 0, sizeof(self.c))
        self.c.self_alloc = 1

    def __dealloc__(self):
        spl_carry_free(&self.c)


cdef class Demux:
    """Routes records to outputs by key group, packing each output into fixed-size buffers.

    ``table`` (int32, one entry per key group) gives each key group's output,
    -1 to drop. A record cut by an input buffer boundary is completed from the
    next buffer of the same channel. After an error the demux refuses further use.
    """

    cdef spl_demux d
    cdef object _table
    cdef dict _carries
    cdef object _off
    cdef object _len
    cdef object _kgs
    cdef bint _failed

    def __cinit__(
        self,
        const int32_t[::1] table,
        uint32_t n_outputs,
        uint32_t buffer_size,
        int kind,
        uint32_t offset,
        bint prefixed,
        uint32_t max_len,
        bint whole_records=False,
    ):
        cdef Py_ssize_t i
        memset(&self.d, 0, sizeof(self.d))
        if buffer_size < 1:
            raise ValueError("buffer_size must be at least 1")
        if spl_packer_init(&self.d.packer, buffer_size, n_outputs) != SPL_REC_OK:
            raise MemoryError()
        self.d.packer.whole = whole_records
        self._table = table  # keeps the memory alive
        self.d.table = &table[0]
        self.d.max_p = <int32_t>table.shape[0]
        for i in range(table.shape[0]):
            if table[i] < 0:
                self.d.drops = 1
                break
        self.d.mod = spl_mod_make(<uint32_t>table.shape[0])
        self.d.key = _keyspec(kind, offset, prefixed)
        self.d.max_len = max_len
        self._carries = {}
        self._off = np.empty(0, dtype=np.int64)
        self._len = np.empty(0, dtype=np.int64)
        self._kgs = np.empty(0, dtype=np.int32)

    def __dealloc__(self):
        spl_packer_free(&self.d.packer)

    @property
    def routed(self):
        """Records routed to an output so far."""
        return self.d.routed

    @property
    def dropped(self):
        """Records dropped so far (their key group maps to -1)."""
        return self.d.dropped

    def pending(self):
        """``{channel: bytes}`` of records begun and not yet complete, per input channel."""
        cdef _Carry cr
        res = {}
        for ch, cr in self._carries.items():
            if cr.c.hdr_have:
                res[ch] = cr.c.hdr_have + cr.c.have
        return res

    def pending_output_bytes(self):
        """Bytes routed but still in partly filled output buffers."""
        cdef uint32_t o
        return sum(self.d.packer.outs[o].pos for o in range(self.d.packer.n_outs))

    cdef int _fail(self, int rc, size_t at) except -1:
        self._failed = True
        _raise_rc(rc, at, "filtering records")

    cdef int _check_usable(self) except -1:
        if self._failed:
            raise RuntimeError("the demux failed earlier and its state is lost; make a new one")
        return 0

    def push(self, object buffer, object channel, object selector):
        """Routes the records of one input buffer; returns completed ``(output, buffer)`` pairs.

        ``selector`` is None for the native key, else a callable that maps a
        record's payload (bytes) to its key group (the slow path).
        """
        cdef const uint8_t[::1] buf = _as_bytes(buffer)
        cdef size_t n = buf.shape[0], pos = 0, used = 0, count = 0, cap
        cdef int rc = SPL_REC_OK
        cdef int32_t kg
        cdef _Carry cr
        cdef const uint8_t *p
        cdef int64_t[::1] o
        cdef int64_t[::1] l
        cdef int32_t[::1] k
        cdef Py_ssize_t i
        self._check_usable()
        if n == 0:
            return []
        p = &buf[0]
        cr = self._carries.get(channel)
        if cr is not None and cr.c.hdr_have:
            with cython.linetrace(False):
                ts = _release_if(n >= _NOGIL_MIN)
                rc = spl_carry_feed(&cr.c, p, n, self.d.max_len, &used)
                _reacquire(ts)
            pos = used
            if rc == SPL_REC_OK:
                kg = -1
                if selector is not None:
                    kg = selector(PyBytes_FromStringAndSize(<const char *>cr.c.data, cr.c.len))
                with nogil:
                    rc = spl_demux_route(&self.d, cr.c.data, cr.c.len, kg)
                spl_carry_reset(&cr.c)
                if rc:
                    self._fail(rc, 0)
            elif rc != SPL_REC_MORE:
                self._fail(rc, 0)
        if pos < n and (cr is None or not cr.c.hdr_have):
            if selector is None:
                with cython.linetrace(False):
                    ts = _release_if(n >= _NOGIL_MIN)
                    rc = spl_demux_run(&self.d, p, n, &pos, NULL, SIZE_MAX, &count)
                    _reacquire(ts)
            else:
                cap = (n - pos) // SPL_REC_PREFIX + 1
                if <size_t>self._off.shape[0] < cap:
                    self._off = np.empty(cap, dtype=np.int64)
                    self._len = np.empty(cap, dtype=np.int64)
                    self._kgs = np.empty(cap, dtype=np.int32)
                o = self._off
                l = self._len
                k = self._kgs
                start = pos
                with nogil:
                    rc = spl_rec_scan(p, n, &pos, self.d.max_len, &o[0], &l[0], cap, &count)
                if rc:
                    self._fail(rc, pos)
                for i in range(<Py_ssize_t>count):
                    k[i] = selector(PyBytes_FromStringAndSize(<const char *>p + o[i], l[i]))
                pos = start
                with nogil:
                    rc = spl_demux_run(&self.d, p, n, &pos, &k[0], count, &count)
            if rc:
                self._fail(rc, pos)
            if pos < n:
                if cr is None:
                    cr = _Carry()
                    self._carries[channel] = cr
                with cython.linetrace(False):
                    ts = _release_if(n - pos >= _NOGIL_MIN)
                    rc = spl_carry_feed(&cr.c, p + pos, n - pos, self.d.max_len, &used)
                    _reacquire(ts)
                if rc != SPL_REC_MORE:
                    self._fail(rc, pos)
        return _take_full(&self.d.packer)

    def push_rows(self, const uint8_t[:, ::1] rows):
        """Routes whole fixed-width records, one per row of ``rows`` (a record
        batch's bytes, no length prefixes), as ``push`` would route them framed;
        returns the completed ``(output, buffer)`` pairs. Native key only."""
        cdef size_t n = rows.shape[0], width = rows.shape[1], count = 0
        cdef int rc
        self._check_usable()
        if n == 0:
            return []
        with cython.linetrace(False):
            ts = _release_if(n * width >= _NOGIL_MIN)
            rc = spl_demux_rows(&self.d, &rows[0, 0], n, width, &count)
            _reacquire(ts)
        if rc:
            self._fail(rc, count * width)
        return _take_full(&self.d.packer)

    def set_keep_all(self, bint keep_all):
        """Every record to output 0 without reading its key (a channel taken whole)."""
        self.d.keep_all = keep_all

    def push_frames(self, object data, const int64_t[::1] offsets, const int64_t[::1] lengths,
                    const int32_t[::1] slots, list channels):
        """Routes the records of many input buffers in one call, GIL released.

        Buffer ``i`` is ``data[offsets[i]:offsets[i] + lengths[i]]`` of input channel
        ``channels[slots[i]]`` (skipped when ``slots[i] < 0``); buffers are taken in
        order, as ``push`` would take them one by one (native key only). Returns the
        completed ``(output, buffer)`` pairs. On error raises with the buffer's index
        in ``detail``."""
        cdef const uint8_t[::1] buf = _as_bytes(data)
        cdef Py_ssize_t n = offsets.shape[0], i, m = len(channels)
        cdef size_t err_frame = 0, err_at = 0
        cdef int rc
        cdef _Carry cr
        cdef spl_carry **carries
        self._check_usable()
        if lengths.shape[0] != n or slots.shape[0] != n:
            raise ValueError("offsets, lengths and slots differ in length")
        if n == 0:
            return []
        for i in range(n):
            if slots[i] >= m:
                raise ValueError(f"slot {slots[i]} has no channel")
            if slots[i] >= 0 and (offsets[i] < 0 or lengths[i] < 0
                                  or offsets[i] + lengths[i] > buf.shape[0]):
                raise ValueError(f"buffer {i} lies outside the data")
        carries = <spl_carry **>malloc(max(m, 1) * sizeof(spl_carry *))
        if carries == NULL:
            raise MemoryError()
        try:
            for i in range(m):
                cr = self._carries.get(channels[i])
                if cr is None:
                    cr = _Carry()
                    self._carries[channels[i]] = cr
                carries[i] = &cr.c
            with nogil:
                rc = spl_demux_frames(&self.d, &buf[0] if buf.shape[0] else NULL, &offsets[0],
                                      &lengths[0], &slots[0], <size_t>n, carries, &err_frame,
                                      &err_at)
        finally:
            free(carries)
        if rc:
            try:
                self._fail(rc, err_at)
            except CorruptRecordError as e:
                raise CorruptRecordError(e.message, detail=f"{e.detail}, in buffer {err_frame}",
                                         hint=e.hint) from None
        return _take_full(&self.d.packer)

    def flush(self):
        """Hands out every partly filled output buffer too."""
        self._check_usable()
        if spl_packer_flush(&self.d.packer):
            raise MemoryError()
        return _take_full(&self.d.packer)

    def drop_pending(self, object channel):
        """Forgets the partly read record of one channel."""
        cdef _Carry cr = self._carries.pop(channel, None)
        if cr is not None:
            spl_carry_reset(&cr.c)


def route_frames(const uint32_t[::1] channel_ids, const int64_t[::1] lengths,
                 const uint8_t[::1] data_types, const int32_t[::1] lut,
                 Py_ssize_t n_streams):
    """A read-ahead block's frames given to their streams in one call.

    ``slots[i]`` is ``lut[channel_ids[i]]``, -1 for a channel past the table's end
    (no stream reads it). Returns ``(slots, wanted, fed, frames, events)``: the
    int32 slots, how many frames some stream reads, per stream the payload bytes
    and frames it gets (int64, ``n_streams`` each), and whether a frame some stream
    reads is not data. A few frames a block: the GIL is kept."""
    cdef Py_ssize_t n = channel_ids.shape[0], nl = lut.shape[0], i, wanted = 0
    cdef int32_t v
    cdef bint events = False
    if lengths.shape[0] != n or data_types.shape[0] != n:
        raise ValueError("channel_ids, lengths and data_types differ in length")
    if n_streams < 0:
        raise ValueError(f"n_streams {n_streams} < 0")
    for i in range(nl):
        if lut[i] >= n_streams:
            raise ValueError(f"channel {i} maps to stream {lut[i]} of {n_streams}")
    slots = np.empty(n, np.int32)
    fed = np.zeros(n_streams, np.int64)
    frames = np.zeros(n_streams, np.int64)
    cdef int32_t[::1] s = slots
    cdef int64_t[::1] f = fed
    cdef int64_t[::1] c = frames
    for i in range(n):
        v = lut[channel_ids[i]] if channel_ids[i] < <uint32_t>nl else -1
        if v < 0:
            v = -1
        s[i] = v
        if v >= 0:
            wanted += 1
            f[v] += lengths[i]
            c[v] += 1
            if data_types[i] != 0:
                events = True
    return slots, wanted, fed, frames, events
