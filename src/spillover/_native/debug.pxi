# Debug builds (SPILLOVER_DEBUG=1) count native handles; see csrc/debug.h.

cdef extern from "debug.h" nogil:
    long spl_debug_live_handles()


def live_handles():
    """Native handles of this extension alive now; -1 when not a debug build."""
    return spl_debug_live_handles()
