# Vectorised key-group assignment (csrc/keygroups.c).

KEY_INT32 = SPL_KEY_INT32
KEY_INT64 = SPL_KEY_INT64
KEY_STR = SPL_KEY_STR
KEY_BYTES = SPL_KEY_BYTES


cdef inline const uint8_t *_bytes_ptr(const uint8_t[::1] mv) noexcept nogil:
    return &mv[0] if mv.shape[0] else NULL


def key_groups_from_hashes(const int32_t[::1] hashes, int32_t max_parallelism):
    """Key group of each Java hash code (murmur hash, then modulo max parallelism)."""
    cdef size_t n = hashes.shape[0]
    out = np.empty(n, dtype=np.int32)
    cdef int32_t[::1] o = out
    if n:
        with cython.linetrace(False):
            ts = _release_if(n * 8 >= _NOGIL_MIN_HASH)
            spl_key_groups_from_hashes(&hashes[0], n, max_parallelism, &o[0])
            _reacquire(ts)
    return out


def key_groups_int32(const int32_t[::1] keys, int32_t max_parallelism):
    """Key group of each int32 key (Java ``Integer.hashCode``)."""
    cdef size_t n = keys.shape[0]
    out = np.empty(n, dtype=np.int32)
    cdef int32_t[::1] o = out
    if n:
        with cython.linetrace(False):
            ts = _release_if(n * 8 >= _NOGIL_MIN_HASH)
            spl_key_groups_int32(&keys[0], n, max_parallelism, &o[0])
            _reacquire(ts)
    return out


def key_groups_int64(const int64_t[::1] keys, int32_t max_parallelism):
    """Key group of each int64 key (Java ``Long.hashCode``)."""
    cdef size_t n = keys.shape[0]
    out = np.empty(n, dtype=np.int32)
    cdef int32_t[::1] o = out
    if n:
        with cython.linetrace(False):
            ts = _release_if(n * 8 >= _NOGIL_MIN_HASH)
            spl_key_groups_int64(&keys[0], n, max_parallelism, &o[0])
            _reacquire(ts)
    return out


cdef int _check_offsets(const uint8_t[::1] data, const int64_t[::1] offsets) except -1:
    cdef Py_ssize_t i, n = offsets.shape[0]
    cdef Py_ssize_t bad = -1
    if n == 0:
        raise ValueError("offsets needs n + 1 entries (at least one)")
    with nogil:
        if offsets[0] < 0 or offsets[n - 1] > data.shape[0]:
            bad = 0
        else:
            for i in range(1, n):
                if offsets[i] < offsets[i - 1]:
                    bad = i
                    break
    if bad >= 0:
        raise ValueError(
            f"offsets must be non-decreasing and within data (0..{data.shape[0]}); "
            f"bad entry near index {bad}"
        )
    return 0


def java_hashes_packed(const uint8_t[::1] data, const int64_t[::1] offsets, int kind):
    """Java hash code of each key ``data[offsets[i]:offsets[i+1]]`` (str: UTF-8)."""
    _check_offsets(data, offsets)
    cdef size_t n = offsets.shape[0] - 1
    out = np.empty(n, dtype=np.int32)
    cdef int32_t[::1] o = out
    if n:
        with nogil:
            spl_java_hashes_packed(_bytes_ptr(data), &offsets[0], n, kind, &o[0])
    return out


def key_groups_packed(
    const uint8_t[::1] data, const int64_t[::1] offsets, int kind, int32_t max_parallelism
):
    """Key group of each key ``data[offsets[i]:offsets[i+1]]`` (str: UTF-8)."""
    _check_offsets(data, offsets)
    cdef size_t n = offsets.shape[0] - 1
    out = np.empty(n, dtype=np.int32)
    cdef int32_t[::1] o = out
    if n:
        with nogil:
            spl_key_groups_packed(_bytes_ptr(data), &offsets[0], n, kind, max_parallelism, &o[0])
    return out
