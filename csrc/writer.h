/* The state-file writer. It frames buffers (frame.h) and hands bytes to a sink:
 * a file descriptor (writev, never holding the GIL) or a callback (for sinks
 * that live in Python, e.g. pyarrow streams; the callback takes the GIL).
 *
 * Blocking mode batches (header, payload) iovecs that point at the caller's
 * memory: no copy. A full batch is submitted to the writer thread, which
 * writes it with writev while the caller fills the next of SPL_WRITER_SLOTS
 * batches, so checksums and the kernel's copy overlap and the caller waits only
 * when every slot is in flight. The caller keeps each payload alive and
 * unmodified until the batch holding it is written (spl_writer_written counts
 * them); spl_writer_flush returns once all are.
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

#define SPL_WRITER_SLOTS 4

/* writev until every byte of iov[0:n) (n <= 1024) is written, in calls of at
 * most 1 MiB; returns 0 or errno. */
int spl_fd_write_all(int fd, const struct iovec *iov, int n);

/* fd >= 0 selects the fd sink, else `sink` is used. pool_bytes > 0 selects
 * non-blocking mode with a ring of that size. Returns NULL when out of memory
 * or when the thread cannot start (errno set). */
spl_writer *spl_writer_new(int fd, spl_sink_fn sink, void *sink_ctx, size_t batch_bytes,
                           size_t pool_bytes);

/* Frames one buffer. Blocking: queues iovecs into the current batch and sets
 * *flush_needed when it is full (the caller must call spl_writer_submit before
 * the next add).
 * Non-blocking: copies into the ring, waiting for room. The payload is
 * checksummed here. Returns SPL_OK or the sticky error. */
int spl_writer_add(spl_writer *w, uint32_t channel_id, uint8_t data_type, uint8_t codec,
                   const void *payload, uint32_t stored_length, uint32_t raw_length,
                   int *flush_needed);

/* Queues raw bytes (the state header and the trailer; at most 64 bytes). */
int spl_writer_put_raw(spl_writer *w, const void *data, size_t len, int *flush_needed);

/* Blocking mode: hands the current batch to the thread and starts the next
 * slot, waiting first while every slot is in flight. */
int spl_writer_submit(spl_writer *w);

/* Batches submitted so far; the one being filled is number `submitted`, in
 * slot `submitted % SPL_WRITER_SLOTS`. */
uint64_t spl_writer_submitted(spl_writer *w);

/* Batches written so far: their payloads are no longer referenced. */
uint64_t spl_writer_written(spl_writer *w);

/* Blocking: submits the current batch and waits until everything is written.
 * Non-blocking: waits until the ring is empty. After it returns, no payload
 * given to spl_writer_add is referenced. */
int spl_writer_flush(spl_writer *w);

/* Flushes, stops the writer thread, and fsyncs the fd when asked. In blocking mode
 * with an fd, the last batch (the trailer) is written on the caller's thread once
 * the thread is idle, and the thread is let go without a join (it frees nothing
 * the caller still uses: the writer is freed by whichever of the two ends last). */
int spl_writer_finish(spl_writer *w, int do_fsync);

/* The sticky error and its errno (0 when none). */
int spl_writer_error(spl_writer *w, int *err_no);

/* Bytes handed to the sink so far. */
uint64_t spl_writer_bytes_written(spl_writer *w);

/* Stops the thread if still running and frees everything. */
void spl_writer_free(spl_writer *w);

/* Whether spl_writer_finish would return at once without fsync: blocking mode on
 * a descriptor, every submitted batch written, and at most `max_bytes` left in the
 * batch being filled (the trailer), so a caller may finish without letting go of
 * a lock it holds (one short write on its own thread). */
int spl_writer_finish_is_quick(spl_writer *w, size_t max_bytes);

/* Whether a writer thread runs this writer (spl_writer_free would wait for it to
 * leave); 0 before the first submit in blocking mode, and after
 * spl_writer_finish, when freeing never waits. */
int spl_writer_running(spl_writer *w);

/* The writer threads ever created in this process, and how many are parked now
 * waiting for a writer (threads are pooled: see writer.c). */
void spl_writer_pool_stats(uint64_t *created, int *parked);

#endif
