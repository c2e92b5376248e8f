# Keyed sums into sorted runs (csrc/keysums.c): the heap sum state's add in one call.
#
# The arrays come in as ndarrays, not memoryviews: a keyed aggregate calls this once
# per input buffer (a few hundred records), where acquiring five buffer views would
# cost as much as the loop; the checks below are what a memoryview would check.


SUMS_MAX_KEYS = SPL_SUMS_MAX_KEYS
"""Most keys one :func:`sums_add` call takes."""

SUMS_INDEX_MAX_KEYS = SPL_SUMS_INDEX_MAX_KEYS
"""Most keys a run's hash index (:func:`sums_index`) takes."""


def sums_index(cnp.ndarray keys not None):
    """The hash index of a run's keys (sorted, distinct int64, contiguous): a uint32
    array of a power-of-two size, each slot 0 or 1 + the position of a key, for
    :func:`sums_add` to find keys in the run by one probe sequence. It describes the
    keys as they are now: a run whose keys change needs a new one."""
    _check_int64(keys, "keys", True, False)
    cdef size_t n = <size_t>cnp.PyArray_DIM(keys, 0)
    if n > SPL_SUMS_INDEX_MAX_KEYS:
        raise ValueError(f"a hash index takes at most {SUMS_INDEX_MAX_KEYS} keys, got {n}")
    cdef unsigned bits = spl_sums_index_bits(n)
    slots = cnp.PyArray_EMPTY(1, [<cnp.npy_intp>1 << bits], cnp.NPY_UINT32, 0)
    cdef const int64_t *kp = <const int64_t *>cnp.PyArray_DATA(keys)
    cdef uint32_t *sp = <uint32_t *>cnp.PyArray_DATA(slots)
    with nogil:
        spl_sums_index(kp, n, sp, bits)
    return slots


cdef int _check_int64(cnp.ndarray a, str what, bint contiguous, bint writable) except -1:
    if (
        cnp.PyArray_NDIM(a) != 1
        or cnp.PyArray_TYPE(a) != cnp.NPY_INT64
        or not cnp.PyArray_ISNOTSWAPPED(a)
    ):
        raise TypeError(f"{what} must be a 1-D native int64 array, got {a.dtype} of shape {(<object>a).shape}")
    if contiguous and not cnp.PyArray_IS_C_CONTIGUOUS(a):
        raise ValueError(f"{what} must be contiguous")
    if writable and not cnp.PyArray_ISWRITEABLE(a):
        raise ValueError(f"{what} must be writable")
    return 0


cdef int _run(
    spl_sum_run *run, cnp.ndarray keys, cnp.ndarray sums, cnp.ndarray index, str what
) except -1:
    _check_int64(keys, what + " keys", True, False)
    _check_int64(sums, what + " sums", True, True)
    if cnp.PyArray_DIM(keys, 0) != cnp.PyArray_DIM(sums, 0):
        raise ValueError(f"{what}: {keys.size} keys but {sums.size} sums")
    run.keys = <const int64_t *>cnp.PyArray_DATA(keys)
    run.values = <int64_t *>cnp.PyArray_DATA(sums)
    run.n = <size_t>cnp.PyArray_DIM(keys, 0)
    run.index = NULL
    run.index_bits = 0
    if index is None:
        return 0
    cdef unsigned bits = spl_sums_index_bits(run.n)
    if (
        cnp.PyArray_NDIM(index) != 1
        or cnp.PyArray_TYPE(index) != cnp.NPY_UINT32
        or not cnp.PyArray_IS_C_CONTIGUOUS(index)
        or cnp.PyArray_DIM(index, 0) != (<cnp.npy_intp>1 << bits)
    ):
        raise ValueError(f"{what}: the index is not one sums_index built for {run.n} keys")
    run.index = <const uint32_t *>cnp.PyArray_DATA(index)
    run.index_bits = bits
    return 0


def sums_add(
    cnp.ndarray keys not None,
    cnp.ndarray values,
    int32_t max_parallelism,
    int32_t kg_lo,
    int32_t kg_hi,
    cnp.ndarray main_keys not None,
    cnp.ndarray main_sums not None,
    cnp.ndarray delta_keys not None,
    cnp.ndarray delta_sums not None,
    cnp.ndarray main_index=None,
    cnp.ndarray delta_index=None,
    bint ascending=True,
    bint rows=False,
):
    """Adds ``values[i]`` (1 each when ``values`` is None) to the sum of ``keys[i]``,
    in place in the run (main, then delta: sorted, distinct, disjoint keys) that holds
    the key; int64 wraps. ``keys`` and ``values`` may be strided (a record field).

    A run with an index (:func:`sums_index` of its keys as they are) is searched by
    hash. Returns ``(out, n_out, n_new)``: ``out[0, :n_out]`` the distinct keys
    (ascending, or with ``ascending`` false in the order the batch first has them),
    ``out[1, :n_out]`` their new sums (a key in neither run: its batch sum), and
    ``out[2, :n_new]`` the indices into ``out[0]`` of the keys in neither run, which the
    caller inserts. With ``rows``, ``out`` is 1-D instead: ``out[:2 * n_out]`` the
    (key, sum) pairs side by side (the memory of a record batch of two int64 fields,
    with no copy after the pass) and ``out[2 * n:][:n_new]`` the new keys' indices.
    With ``max_parallelism > 0``, returns None and changes nothing when a key's key
    group lies outside ``kg_lo..kg_hi``."""
    cdef spl_sum_run runs[2]
    _check_int64(keys, "keys", False, False)
    cdef size_t n = <size_t>cnp.PyArray_DIM(keys, 0)
    cdef const void *vp = NULL
    cdef ptrdiff_t vstride = 0
    if values is not None:
        _check_int64(values, "values", False, False)
        if <size_t>cnp.PyArray_DIM(values, 0) != n:
            raise ValueError(f"{n} keys but {values.size} values")
        vp = cnp.PyArray_DATA(values)
        vstride = cnp.PyArray_STRIDE(values, 0)
    _run(&runs[0], main_keys, main_sums, main_index, "the main run")
    _run(&runs[1], delta_keys, delta_sums, delta_index, "the delta run")
    if rows:
        out = cnp.PyArray_EMPTY(1, [3 * <cnp.npy_intp>n], cnp.NPY_INT64, 0)
    else:
        out = cnp.PyArray_EMPTY(2, [3, <cnp.npy_intp>n], cnp.NPY_INT64, 0)
    if n == 0:
        return out, 0, 0
    cdef int64_t *o = <int64_t *>cnp.PyArray_DATA(out)
    cdef int64_t *o_totals = o + 1 if rows else o + n
    cdef size_t o_stride = 2 if rows else 1
    cdef const void *kp = cnp.PyArray_DATA(keys)
    cdef ptrdiff_t kstride = cnp.PyArray_STRIDE(keys, 0)
    cdef size_t n_out = 0, n_new = 0
    cdef int rc
    with cython.linetrace(False):
        ts = _release_if(n >= _NOGIL_MIN_SUMS)
        rc = spl_sums_add(kp, kstride, vp, vstride, n, max_parallelism, kg_lo, kg_hi, runs, 2,
                          ascending, o, o_totals, o_stride, o + 2 * n, &n_out, &n_new)
        _reacquire(ts)
    if rc == SPL_SUMS_E_RANGE:
        return None
    if rc == SPL_SUMS_E_NOMEM:
        raise MemoryError(f"keyed sums: no memory for {n} keys")
    if rc == SPL_SUMS_E_TOO_MANY:
        raise ValueError(f"keyed sums take at most {SUMS_MAX_KEYS} keys a call, got {n}")
    return out, n_out, n_new
