#include "debug.h"

#ifdef SPL_DEBUG
static long live_handles;

void spl_debug_handle(int delta) { __atomic_add_fetch(&live_handles, delta, __ATOMIC_RELAXED); }

long spl_debug_live_handles(void) { return __atomic_load_n(&live_handles, __ATOMIC_RELAXED); }
#else
long spl_debug_live_handles(void) { return -1; }
#endif
