# The state-file writer (csrc/writer.h) and zero-copy release of appended buffers.

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
    # A staging file of this machine (memory or io.tmp.dirs): only then is the
    # trailer written with the GIL kept; NFS or FUSE may block any write.
    cdef public bint staged
    # A gate staged in memory: before a buffer takes its stored bytes past `bound`
    # the writer is drained and `on_bound` called, once (it moves the gate to a file).
    cdef uint64_t bound
    cdef object on_bound

    def __cinit__(self, int fd, object sink_write, bytes header, bytes file_id, object compress,
                  size_t batch_bytes, size_t pool_bytes, str path):
        cdef int k
        for k in range(SPL_WRITER_SLOTS):
            self.nviews[k] = 0
        self.released = 0
        self.staged = False
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
        self._free()  # first: the thread may still be writing from the held views
        self._release_views()
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
        offset = spl_writer_bytes_written(self.w)
        if cause is not None:
            exc = error_for(SPL_E_IO, self.path, offset, f"{type(cause).__name__}: {cause}",
                            errno=getattr(cause, "errno", None) or 0,
                            message="writing the state file failed")
            raise exc from cause
        raise error_for(SPL_E_IO, self.path, offset, None if err_no else "write failed",
                        errno=err_no, message="writing the state file failed")

    cdef int _flush(self) except -1:
        cdef int rc
        with nogil:
            rc = spl_writer_flush(self.w)
        self._release_views()
        self.released = spl_writer_submitted(self.w)
        return self._check(rc)

    cdef int _submit(self) except -1:
        cdef int rc
        # The GIL is let go even when a slot is free (the batch only handed over):
        # kept, the paced checkpoint took 0.24 ms longer to its last acknowledgement
        # (docs/benchmarks.md, "Storers' threads pooled"); letting it go lets the
        # worker's other task threads take their part of the checkpoint sooner.
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
        # What the staged file would hold: its frames so far, this one with its header,
        # and the trailer still to come (empty buffers are 24 bytes each, not nothing).
        if self.bound and (self.pos + SPL_FRAME_HEADER_SIZE + <uint64_t>view.len
                           + SPL_TRAILER_SIZE > self.bound):
            self._cross_bound(&view)
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

    def set_bound(self, uint64_t bound, object on_bound):
        """Before a buffer would take the file past ``bound`` bytes (0: none; frame headers
        and the trailer count), drains the writer and calls ``on_bound()`` once, with no
        writes in flight (a gate staged in memory moves to a file there); an exception
        it raises fails that append, and the next append tries again."""
        self.bound = bound
        self.on_bound = on_bound if bound else None

    cdef int _cross_bound(self, Py_buffer *view) except -1:
        """The bound is crossed: drain, then ``on_bound`` (``view``, the buffer being
        appended, is released if either fails)."""
        cb, bound = self.on_bound, self.bound
        self.on_bound, self.bound = None, 0
        try:
            self._flush()
            cb()
        except BaseException:
            # Still staged where it was: bounded as before, so a caller that goes on
            # appending after the error never grows it past its bound.
            self.on_bound, self.bound = cb, bound
            PyBuffer_Release(view)
            raise
        return 0

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
            if (rc == 0 and not do_fsync and self.staged
                    and spl_writer_finish_is_quick(self.w, QUICK_FINISH_BYTES)):
                # Only the trailer left and the thread idle: one short write, with
                # the GIL kept (taking it back can cost a switch interval).
                rc = spl_writer_finish(self.w, 0)
            elif rc == 0:
                with nogil:
                    rc = spl_writer_finish(self.w, do_fsync)
            self._release_views()
            self._check(rc)
        finally:
            self.closed = True
            self.on_bound = None
        return spl_writer_bytes_written(self.w)

    def discard(self):
        """Stops writing at once and drops everything queued (the caller deletes the file)."""
        self.closed = True
        self.on_bound = None
        self._free()  # stops the thread (it may be writing from the views) first
        self._release_views()

    cdef void _free(self) noexcept:
        """Frees the writer; the GIL is let go only if its thread must be joined (a
        finished writer's never is: taking the GIL back can wait on a busy worker)."""
        if self.w == NULL:
            return
        if spl_writer_running(self.w):
            with nogil:
                spl_writer_free(self.w)
        else:
            spl_writer_free(self.w)
        self.w = NULL

    @property
    def bytes_written(self):
        return spl_writer_bytes_written(self.w) if self.w != NULL else 0


def writer_pool_stats():
    """``(threads ever created, threads parked now)`` of the process's pool of storer
    writer threads: a storer hands its batches to a parked thread when there is one."""
    cdef uint64_t created = 0
    cdef int parked = 0
    spl_writer_pool_stats(&created, &parked)
    return created, parked


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
        export_bytes(buffer, self, self.view.buf, self.view.len, self.shape, True, flags,
                     "OnRelease exports read-only views")
        self.exports += 1

    def __releasebuffer__(self, Py_buffer *buffer):
        self.exports -= 1
        if self.exports == 0 and self.callback is not None:
            self._fire()

    def __len__(self):
        return self.view.len
