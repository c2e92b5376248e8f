# cython: language_level=3
"""Native core of the storage engine: framing, checksums, the batched and the
threaded writer, and the zero-copy blocks the streaming reader hands out.

Every loop and every I/O call runs with the GIL released; buffers arrive
through the buffer protocol and are never copied in Python."""

from cpython.buffer cimport (
    PyBUF_SIMPLE,
    PyBUF_WRITABLE,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.memoryview cimport PyMemoryView_FromMemory
from cpython.buffer cimport PyBUF_READ
from libc.errno cimport EIO, errno
from posix.unistd cimport read
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy, memmove

from spl cimport *

import os

import numpy

from spillover.errors import (
    BadMagicError,
    ClosedError,
    CorruptFrameError,
    CorruptHeaderError,
    StorageError,
    TruncatedFileError,
    UnsupportedVersionError,
)

FORMAT_VERSION = SPL_FORMAT_VERSION
HEADER_SIZE = SPL_HEADER_SIZE
FRAME_HEADER_SIZE = SPL_FRAME_HEADER_SIZE
TRAILER_SIZE = SPL_TRAILER_SIZE
MAX_PAYLOAD = SPL_MAX_PAYLOAD

# Below this a checksum is cheaper than releasing and taking back the GIL: a
# 32 KiB network buffer's CRC32C takes about 2.5 us, 256 KiB about 13 us, while
# taking the GIL back on a busy worker can wait the switch interval (0.5 ms), and
# a checkpoint appends tens of network buffers on the task thread at once.
DEF GIL_RELEASE_MIN = 262144
# A storer's finish keeps the GIL when no more than this is left to write (the
# trailer, a last small batch) and its thread is idle: see NativeStorer.finish.
DEF QUICK_FINISH_BYTES = 65536
DEF MAX_VIEWS = 512
DEF SMALL_CHANNELS = 1024
cdef char *FMT_B = "B"
include "errors.pxi"
include "export.pxi"
include "debug.pxi"
include "format.pxi"
include "writer.pxi"
include "blocks.pxi"
include "reader.pxi"
include "baselines.pxi"
include "section.pxi"
include "sockio.pxi"
