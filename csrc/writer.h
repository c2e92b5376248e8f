/* The state-file writer. It frames buffers (frame.h) and hands bytes to a sink:
 * a file descriptor (writev, never holding the GIL) or a callback (for sinks
 * that live in Python, e.g. pyarrow streams; the callback takes the GIL).
 *
 * Blocking mode batches (header, payload) iovecs that point at the caller's
 * memory and writes them with one writev per batch: no copy. The caller keeps
 * each payload alive and unmodified until the batch is flushed.
 *
 * Non-blocking mode copies each frame into a bounded ring and a writer thread
 * persists it; an append waits while the ring is full. An I/O error is sticky:
 * every later call returns it. A storer is used from one thread at a time. */
#ifndef SPL_WRITER_H
#define SPL_WRITER_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

/* Writes every byte of iov[0:n); returns 0, or an errno value on failure. */
typedef int (*spl_sink_fn)(void *ctx, const struct iovec *iov, int n);

typedef struct spl_writer spl_writer;

/* fd >= 0 selects the fd sink, else `sink` is used. pool_bytes > 0 selects
 * non-blocking mode with a ring of that size. Returns NULL when out of memory
 * or when the thread cannot start (errno set). */
spl_writer *spl_writer_new(int fd, spl_sink_fn sink, void *sink_ctx, size_t batch_bytes,
                           size_t pool_bytes);

/* Frames one buffer. Blocking: queues iovecs and sets *flush_needed when the
 * batch is full (the caller must call spl_writer_flush before the next add).
 * Non-blocking: copies into the ring, waiting for room. The payload is
 * checksummed here. Returns SPL_OK or the sticky error. */
int spl_writer_add(spl_writer *w, uint32_t channel_id, uint8_t data_type, uint8_t codec,
                   const void *payload, uint32_t stored_length, uint32_t raw_length,
                   int *flush_needed);

/* Queues raw bytes (the state header and the trailer; at most 64 bytes). */
int spl_writer_put_raw(spl_writer *w, const void *data, size_t len, int *flush_needed);

/* Blocking: writes the pending batch. Non-blocking: waits until the ring is
 * empty. After it returns, no payload given to spl_writer_add is referenced. */
int spl_writer_flush(spl_writer *w);

/* Flushes, stops the writer thread, and fsyncs the fd when asked. */
int spl_writer_finish(spl_writer *w, int do_fsync);

/* The sticky error and its errno (0 when none). */
int spl_writer_error(spl_writer *w, int *err_no);

/* Bytes handed to the sink so far. */
uint64_t spl_writer_bytes_written(spl_writer *w);

/* Stops the thread if still running and frees everything. */
void spl_writer_free(spl_writer *w);

#endif
