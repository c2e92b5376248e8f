/* Debug build support (SPILLOVER_DEBUG=1 defines SPL_DEBUG):
 *  - SPL_ASSERT(cond): a real assert on an invariant; nothing in a release build;
 *  - live handles: every native handle (writer, reader, block, pool) counts itself
 *    in on creation and out when freed, so a test run can check that it freed all.
 * Each extension module links its own copy of the counter. */
#ifndef SPL_DEBUG_H
#define SPL_DEBUG_H

#ifdef SPL_DEBUG
#include <assert.h>
#define SPL_ASSERT(cond) assert(cond)
void spl_debug_handle(int delta);
#define SPL_HANDLE_NEW() spl_debug_handle(1)
#define SPL_HANDLE_FREE() spl_debug_handle(-1)
#else
#define SPL_ASSERT(cond) ((void)0)
#define SPL_HANDLE_NEW() ((void)0)
#define SPL_HANDLE_FREE() ((void)0)
#endif

/* Native handles alive now; -1 in a release build (nothing is counted). */
long spl_debug_live_handles(void);

#endif
