/* A small process-wide cache of large buffers (read blocks, packer buffers).
 *
 * A restore opens a reader per state file and a packer per retriever; each
 * allocated its buffers afresh and freed them at its end, and glibc hands
 * freed megabyte buffers back to the kernel (munmap, or MADV_DONTNEED when a
 * thread's heap shrinks), so every new file and every new retriever faulted in
 * zeroed pages again: a tenth of the bytes a 2->4 replay reads. Freed buffers
 * wait here instead, up to SPL_BUFCACHE_BYTES in all, for the next allocation
 * of about their size. No Python here; thread-safe. */
#ifndef SPL_BUFCACHE_H
#define SPL_BUFCACHE_H

#include <stddef.h>

#define SPL_BUFCACHE_BYTES (16u << 20) /* cached at most, per extension module */
#define SPL_BUFCACHE_MIN (64u << 10)   /* smaller buffers go to malloc and free as usual */

/* A buffer of at least cap bytes: a cached one of cap to 5/4 cap bytes (its size
 * in *got), else malloc(cap). NULL if out of memory. */
void *spl_buf_get(size_t cap, size_t *got);
/* Caches a buffer of cap bytes from spl_buf_get (or malloc), or frees it. */
void spl_buf_put(void *p, size_t cap);
#endif
