# Keyed sums into sorted runs (csrc/keysums.c): the heap sum state's add in one call.
#
# The arrays come in as ndarrays, not memoryviews: a keyed aggregate calls this once
# per input buffer (a few hundred records), where acquiring five buffer views would
# cost as much as the loop; the checks below are what a memoryview would check.


SUMS_MAX_KEYS = SPL_SUMS_MAX_KEYS
"""Most keys one :func:`sums_add` call takes."""


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


cdef int _run(spl_sum_run *run, cnp.ndarray keys, cnp.ndarray sums, str what) except -1:
    _check_int64(keys, what + " keys", True, False)
    _check_int64(sums, what + " sums", True, True)
    if cnp.PyArray_DIM(keys, 0) != cnp.PyArray_DIM(sums, 0):
        raise ValueError(f"{what}: {keys.size} keys but {sums.size} sums")
    run.keys = <const int64_t *>cnp.PyArray_DATA(keys)
    run.values = <int64_t *>cnp.PyArray_DATA(sums)
    run.n = <size_t>cnp.PyArray_DIM(keys, 0)
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
):
    """Adds ``values[i]`` (1 each when ``values`` is None) to the sum of ``keys[i]``,
    in place in the run (main, then delta: sorted, distinct, disjoint keys) that holds
    the key; int64 wraps. ``keys`` and ``values`` may be strided (a record field).

    Returns ``(out, n_out, n_new)``: ``out[0, :n_out]`` the distinct keys, ascending,
    ``out[1, :n_out]`` their new sums (a key in neither run: its batch sum), and
    ``out[2, :n_new]`` the indices into ``out[0]`` of the keys in neither run, which the
    caller inserts. With ``max_parallelism > 0``, returns None and changes nothing when
    a key's key group lies outside ``kg_lo..kg_hi``."""
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
    _run(&runs[0], main_keys, main_sums, "the main run")
    _run(&runs[1], delta_keys, delta_sums, "the delta run")
    out = cnp.PyArray_EMPTY(2, [3, <cnp.npy_intp>n], cnp.NPY_INT64, 0)
    if n == 0:
        return out, 0, 0
    cdef int64_t *o = <int64_t *>cnp.PyArray_DATA(out)
    cdef const void *kp = cnp.PyArray_DATA(keys)
    cdef ptrdiff_t kstride = cnp.PyArray_STRIDE(keys, 0)
    cdef size_t n_out = 0, n_new = 0
    cdef int rc
    ts = _release_if(n * 8 >= _NOGIL_MIN)
    rc = spl_sums_add(kp, kstride, vp, vstride, n, max_parallelism, kg_lo, kg_hi, runs, 2,
                      o, o + n, o + 2 * n, &n_out, &n_new)
    _reacquire(ts)
    if rc == SPL_SUMS_E_RANGE:
        return None
    if rc == SPL_SUMS_E_NOMEM:
        raise MemoryError(f"keyed sums: no memory for {n} keys")
    if rc == SPL_SUMS_E_TOO_MANY:
        raise ValueError(f"keyed sums take at most {SUMS_MAX_KEYS} keys a call, got {n}")
    return out, n_out, n_new
