# The GeneratorSource's batch in one pass (csrc/generate.c).


def generate_fill(
    cnp.ndarray out not None,
    tuple offsets,
    cnp.ndarray parts not None,
    cnp.ndarray starts not None,
    cnp.ndarray counts not None,
    uint64_t seed_mix,
    uint64_t keys,
    const uint8_t[::1] pattern,
):
    """Fills ``out`` (a C-contiguous 1-D array of records) with generated records, block
    after block: ``counts[b]`` records of partition ``parts[b]`` from seq ``starts[b]``
    (see ``csrc/generate.h``). ``offsets`` are the byte offsets of the fields
    ``(partition, seq, key, payload, payload_len)``; ``keys`` 0 leaves the key field
    alone; ``pattern`` is the letters A..Z repeated, 26 + payload_len bytes."""
    cdef spl_gen_layout layout
    if cnp.PyArray_NDIM(out) != 1 or not cnp.PyArray_IS_C_CONTIGUOUS(out) or not cnp.PyArray_ISWRITEABLE(out):
        raise ValueError("out must be a writable C-contiguous 1-D array")
    layout.itemsize = <size_t>cnp.PyArray_ITEMSIZE(out)
    layout.partition, layout.seq, layout.key, layout.payload, layout.payload_len = offsets
    if (
        layout.partition + 4 > layout.itemsize
        or layout.seq + 8 > layout.itemsize
        or layout.key + 8 > layout.itemsize
        or layout.payload + layout.payload_len > layout.itemsize
    ):
        raise ValueError(f"field offsets {offsets} do not fit records of {layout.itemsize} bytes")
    if <size_t>pattern.shape[0] < 26 + layout.payload_len:
        raise ValueError(f"the pattern needs {26 + layout.payload_len} bytes, got {pattern.shape[0]}")
    _check_int64(parts, "parts", True, False)
    _check_int64(starts, "starts", True, False)
    _check_int64(counts, "counts", True, False)
    cdef size_t m = <size_t>cnp.PyArray_DIM(parts, 0)
    if <size_t>cnp.PyArray_DIM(starts, 0) != m or <size_t>cnp.PyArray_DIM(counts, 0) != m:
        raise ValueError("parts, starts and counts must be as long")
    cdef const int64_t *c = <const int64_t *>cnp.PyArray_DATA(counts)
    cdef const int64_t *s = <const int64_t *>cnp.PyArray_DATA(starts)
    cdef int64_t total = 0
    cdef size_t b
    for b in range(m):
        if c[b] < 0 or s[b] < 0:
            raise ValueError("counts and starts must be >= 0")
        total += c[b]
    if total != cnp.PyArray_DIM(out, 0):
        raise ValueError(f"the blocks hold {total} records, out {out.shape[0]}")
    cdef uint8_t *o = <uint8_t *>cnp.PyArray_DATA(out)
    cdef const int64_t *p = <const int64_t *>cnp.PyArray_DATA(parts)
    cdef const uint8_t *pat = &pattern[0] if pattern.shape[0] else NULL
    with cython.linetrace(False):
        ts = _release_if(<size_t>total * layout.itemsize >= _NOGIL_MIN)
        spl_gen_fill(o, &layout, p, s, c, m, seed_mix, keys, pat)
        _reacquire(ts)
