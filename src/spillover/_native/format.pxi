# Format v1: checksums, the state header and the trailer.

def crc32c(data, uint32_t value=0):
    """CRC32C of a contiguous buffer, extending ``value``."""
    cdef const uint8_t[::1] v = memoryview(data).cast("B")
    cdef uint32_t r
    with nogil:
        r = spl_crc32c(value, &v[0] if v.shape[0] else NULL, v.shape[0])
    return r


def crc32c_hardware():
    """True when CRC32C runs on the CPU's crc32 instruction."""
    return bool(spl_crc32c_hw())


def encode_state_header(uint64_t checkpoint_id, uint32_t subtask_index, uint32_t gate_id,
                        uint8_t gate_kind, uint8_t codec, bytes file_id):
    """The 64-byte state header of format v1."""
    cdef spl_state_header h
    if len(file_id) != 16:
        raise ValueError("file_id must be 16 bytes")
    h.checkpoint_id = checkpoint_id
    h.subtask_index = subtask_index
    h.gate_id = gate_id
    h.gate_kind = gate_kind
    h.codec = codec
    memcpy(h.file_id, PyBytes_AS_STRING(file_id), 16)
    out = PyBytes_FromStringAndSize(NULL, SPL_HEADER_SIZE)
    spl_encode_state_header(<uint8_t *>PyBytes_AS_STRING(out), &h)
    return out


def decode_state_header(const uint8_t[::1] data, str path=None):
    """Fields of a state header as a dict; raises the matching FormatError."""
    cdef spl_state_header h
    if data.shape[0] < SPL_HEADER_SIZE:
        raise TruncatedFileError("file is shorter than a state header", path=path,
                                 offset=data.shape[0])
    cdef int rc = spl_decode_state_header(&data[0], &h)
    if rc == SPL_E_VERSION:
        raise error_for(rc, path, 8, f"file has format version {h.version}")
    if rc:
        raise error_for(rc, path, 0)
    return {
        "format_version": h.version,
        "checkpoint_id": h.checkpoint_id,
        "subtask_index": h.subtask_index,
        "gate_id": h.gate_id,
        "gate_kind": h.gate_kind,
        "codec": h.codec,
        "file_id": bytes((<char *>h.file_id)[:16]),
    }


def encode_trailer(uint64_t frame_count, uint64_t raw_bytes, uint64_t stored_bytes,
                   bytes file_id):
    """The 64-byte trailer of format v1."""
    cdef spl_trailer t
    if len(file_id) != 16:
        raise ValueError("file_id must be 16 bytes")
    t.frame_count = frame_count
    t.raw_bytes = raw_bytes
    t.stored_bytes = stored_bytes
    memcpy(t.file_id, PyBytes_AS_STRING(file_id), 16)
    out = PyBytes_FromStringAndSize(NULL, SPL_TRAILER_SIZE)
    spl_encode_trailer(<uint8_t *>PyBytes_AS_STRING(out), &t)
    return out


def decode_trailer(const uint8_t[::1] data, str path=None, offset=None):
    """Fields of a trailer as a dict; raises CorruptHeaderError when damaged."""
    cdef spl_trailer t
    if data.shape[0] != SPL_TRAILER_SIZE or spl_decode_trailer(&data[0], &t):
        raise error_for(SPL_E_TRAILER, path, offset,
                        "the file does not end in a valid trailer; it was not closed cleanly "
                        "or it was damaged")
    return {
        "frame_count": t.frame_count,
        "raw_bytes": t.raw_bytes,
        "stored_bytes": t.stored_bytes,
        "file_id": bytes((<char *>t.file_id)[:16]),
    }
