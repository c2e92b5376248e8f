# cython: language_level=3
"""Native record framing, Flink-compatible key groups and the key-group filter.

The loops live in ``csrc/keygroups.c`` and ``csrc/records.c``; this module
only moves buffers in and out (by the buffer protocol, never copied here) and
releases the GIL around every loop. Use :mod:`spillover.keygroups` and
:mod:`spillover.records` rather than this module.
"""

from cpython.buffer cimport PyBUF_FORMAT
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdint cimport SIZE_MAX, int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memset

from spl_records cimport *

cimport numpy as cnp
import numpy as np

cnp.import_array()

from spillover.errors import CorruptRecordError

include "debug.pxi"
include "keygroups.pxi"
include "records.pxi"
include "filter.pxi"
