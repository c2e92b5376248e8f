# cython: language_level=3
"""Native record framing, Flink-compatible key groups, keyed sums and the key-group filter.

The loops live in ``csrc/keygroups.c``, ``csrc/keysums.c`` and ``csrc/records.c``; this module
only moves buffers in and out (by the buffer protocol, never copied here) and
releases the GIL around every loop over at least ``NOGIL_MIN_BYTES`` of input:
below that, handing the GIL to another thread and waiting to get it back costs
more than the loop (a contended re-acquire waits for the holder to let go, up to
its switch interval). Use :mod:`spillover.keygroups` and :mod:`spillover.records`
rather than this module.
"""

cimport cython
from cpython.buffer cimport PyBUF_FORMAT
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdint cimport SIZE_MAX, int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memset

from spl_records cimport *

cimport numpy as cnp
import numpy as np

cnp.import_array()

cdef enum:
    _NOGIL_MIN = 1 << 20
    _NOGIL_MIN_SUMS = 4096
    _NOGIL_MIN_SCAN = 1 << 20
    _NOGIL_MIN_HASH = 1 << 16
NOGIL_MIN_BYTES = _NOGIL_MIN
"""Inputs (bytes; keys count 8 each) from which a native loop releases the GIL: 1 MiB,
so that the per-buffer loops of a 128 KiB network buffer or a source's batch (the
generator's fill and the key-group demultiplexer, 10 to 30 microseconds each) keep
it. Letting it go costs the thread a futex hand-off each way and a wait behind the
other task threads to take it back, several times the loop."""
NOGIL_MIN_SUMS_KEYS = _NOGIL_MIN_SUMS
"""Keys from which keyed sums release the GIL: 4,096 keys (about 200 microseconds
of hash probes); a network buffer's batch of about 1,000 keys keeps it."""
NOGIL_MIN_HASH_BYTES = _NOGIL_MIN_HASH
"""Keys (8 bytes each) from which key-group hashing of an array releases the GIL:
64 KiB, 8,192 keys. Its large callers (state snapshots and restores, the
comparisons of ``spillover verify``) hash up to whole states, which would hold the
GIL for milliseconds past the Spark worker's 0.5 ms switch interval and keep its
receiving and barrier threads waiting."""
NOGIL_MIN_SCAN_BYTES = _NOGIL_MIN_SCAN
"""Buffers from which a record scan releases the GIL: the scan hops from length
prefix to length prefix, about 10 microseconds for a 128 KiB network buffer of
124-byte records, less than taking the GIL back costs a busy task thread."""


cdef extern from "Python.h":
    ctypedef struct PyThreadState:
        pass
    PyThreadState *PyEval_SaveThread()
    void PyEval_RestoreThread(PyThreadState *)


@cython.linetrace(False)
@cython.profile(False)
cdef inline PyThreadState *_release_if(bint cond) noexcept:
    """Releases the GIL when ``cond`` (a loop big enough); pair with :func:`_reacquire`.
    Between the two only C runs: no Python object may be touched. Cython does not
    know the GIL is gone there, so a debug build's line tracing (which needs it)
    is off from the release to the reacquire: each pair sits in a
    ``with cython.linetrace(False):`` block."""
    return PyEval_SaveThread() if cond else NULL


@cython.linetrace(False)
@cython.profile(False)
cdef inline void _reacquire(PyThreadState *ts) noexcept:
    if ts is not NULL:
        PyEval_RestoreThread(ts)

from spillover.errors import CorruptRecordError

include "debug.pxi"
include "keygroups.pxi"
include "keysums.pxi"
include "records.pxi"
include "filter.pxi"
include "generate.pxi"
