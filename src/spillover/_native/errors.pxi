# The one status-to-exception mapping of the storage extension.

def error_for(int code, str path, offset, str detail=None, int errno=0, str message=None):
    """The exception for a status ``code`` found at ``offset`` of ``path``: every error
    of this extension becomes an exception here (``message`` replaces the default
    wording of the code; I/O errors keep their ``errno``)."""
    if code == SPL_E_MAGIC:
        return BadMagicError(
            "not a spillover state file", path=path, offset=0, detail=detail,
            hint="the file does not start with the state-file magic")
    if code == SPL_E_VERSION:
        return UnsupportedVersionError(
            "unsupported state-file format version", path=path, offset=8, detail=detail,
            hint=f"this reader supports format version {SPL_FORMAT_VERSION}; upgrade spillover")
    if code == SPL_E_IO:
        return StorageError(message or "state file I/O failed", path=path, offset=offset,
                            detail=detail or (os.strerror(errno) if errno else None),
                            errno=errno or None)
    if code == SPL_E_HEADER:
        return CorruptHeaderError("corrupt state header", path=path, offset=0, detail=detail)
    if code == SPL_E_FRAME_HEADER:
        return CorruptHeaderError("corrupt frame header", path=path, offset=offset, detail=detail)
    if code == SPL_E_PAYLOAD_CRC:
        return CorruptFrameError(
            "frame payload fails its checksum", path=path, offset=offset, detail=detail)
    if code == SPL_E_TRAILER:
        return CorruptHeaderError(message or "corrupt trailer", path=path, offset=offset,
                                  detail=detail)
    if code == SPL_E_TRUNCATED:
        return TruncatedFileError("state file is truncated", path=path, offset=offset,
                                  detail=detail)
    return StorageError("storage failure", path=path, offset=offset, detail=detail)
