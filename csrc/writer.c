#include "writer.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "crc32c.h"
#include "frame.h"

/* iovecs per writev; two per frame. */
#define MAX_IOV 1024
/* Larger single writes into fresh files get slower, so cap each syscall. */
#define MAX_WRITE ((size_t)1 << 20)
#define SMALL_ARENA (MAX_IOV / 2 * SPL_FRAME_HEADER_SIZE + 2 * SPL_TRAILER_SIZE)

typedef struct {
    struct iovec iov[MAX_IOV];
    int iovcnt;
    size_t pending;
    uint8_t small[SMALL_ARENA];
    size_t small_used;
} batch;

struct spl_writer {
    int fd;
    spl_sink_fn sink;
    void *sink_ctx;
    size_t batch_bytes;
    int error;
    int err_no;
    uint64_t written;

    /* blocking mode: the caller fills batches[cur] while the thread writes
     * batches[inflight] (-1 when idle) */
    batch batches[2];
    int cur;
    int inflight;

    /* non-blocking mode */
    int async;
    uint8_t *ring;
    size_t cap;
    uint64_t head, tail; /* monotonic byte counters; position = counter % cap */
    int stop;
    int thread_started;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t not_empty, not_full;
};

int spl_fd_write_all(int fd, const struct iovec *iov_in, int n) {
    struct iovec iov[MAX_IOV];
    int cnt = n < MAX_IOV ? n : MAX_IOV;
    memcpy(iov, iov_in, (size_t)cnt * sizeof(struct iovec));
    int first = 0;
    while (first < n) {
        /* take entries up to MAX_WRITE bytes (at least part of one entry) */
        int k = first;
        size_t bytes = 0;
        struct iovec saved = {0};
        int split = -1;
        while (k < n && k - first < MAX_IOV) {
            if (bytes + iov[k].iov_len > MAX_WRITE) {
                if (k == first) {
                    saved = iov[k];
                    iov[k].iov_len = MAX_WRITE;
                    split = k;
                    k++;
                }
                break;
            }
            bytes += iov[k].iov_len;
            k++;
        }
        ssize_t r = writev(fd, iov + first, k - first);
        if (split >= 0) iov[split] = saved;
        if (r < 0) {
            if (errno == EINTR) continue;
            return errno ? errno : EIO;
        }
        size_t done = (size_t)r;
        while (first < n && done >= iov[first].iov_len) {
            done -= iov[first].iov_len;
            first++;
        }
        if (first < n && done) {
            iov[first].iov_base = (uint8_t *)iov[first].iov_base + done;
            iov[first].iov_len -= done;
        }
    }
    return 0;
}

static int sink_write(spl_writer *w, const struct iovec *iov, int n) {
    size_t total = 0;
    for (int i = 0; i < n; i++) total += iov[i].iov_len;
    int rc = w->fd >= 0 ? spl_fd_write_all(w->fd, iov, n) : w->sink(w->sink_ctx, iov, n);
    if (rc == 0) __atomic_add_fetch(&w->written, total, __ATOMIC_RELAXED);
    return rc;
}

static void reset_batch(batch *b) {
    b->iovcnt = 0;
    b->pending = 0;
    b->small_used = 0;
}

/* Blocking mode: write each submitted batch, one at a time. */
static void batches_loop(spl_writer *w) {
    for (;;) {
        while (!w->stop && w->inflight < 0) pthread_cond_wait(&w->not_empty, &w->mu);
        if (w->inflight < 0) break; /* stopped and idle */
        batch *b = &w->batches[w->inflight];
        int rc = 0;
        if (!w->error && b->iovcnt) {
            pthread_mutex_unlock(&w->mu);
            rc = sink_write(w, b->iov, b->iovcnt);
            pthread_mutex_lock(&w->mu);
        }
        if (rc && !w->error) {
            w->error = SPL_E_IO;
            w->err_no = rc;
        }
        w->inflight = -1;
        pthread_cond_broadcast(&w->not_full);
    }
}

/* Non-blocking mode: drain the ring in chunks of at most MAX_WRITE. */
static void ring_loop(spl_writer *w) {
    for (;;) {
        while (!w->stop && w->head == w->tail && !w->error) pthread_cond_wait(&w->not_empty, &w->mu);
        if (w->error || (w->stop && w->head == w->tail)) break;
        uint64_t avail = w->head - w->tail;
        size_t chunk = avail < MAX_WRITE ? (size_t)avail : MAX_WRITE;
        size_t at = (size_t)(w->tail % w->cap);
        pthread_mutex_unlock(&w->mu);

        struct iovec iov[2];
        int n = 1;
        iov[0].iov_base = w->ring + at;
        if (at + chunk <= w->cap) {
            iov[0].iov_len = chunk;
        } else {
            iov[0].iov_len = w->cap - at;
            iov[1].iov_base = w->ring;
            iov[1].iov_len = chunk - iov[0].iov_len;
            n = 2;
        }
        int rc = sink_write(w, iov, n);

        pthread_mutex_lock(&w->mu);
        if (rc) {
            w->error = SPL_E_IO;
            w->err_no = rc;
        } else {
            w->tail += chunk;
        }
        pthread_cond_broadcast(&w->not_full);
    }
}

static void *writer_main(void *arg) {
    spl_writer *w = arg;
    pthread_mutex_lock(&w->mu);
    if (w->async)
        ring_loop(w);
    else
        batches_loop(w);
    pthread_cond_broadcast(&w->not_full);
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

spl_writer *spl_writer_new(int fd, spl_sink_fn sink, void *sink_ctx, size_t batch_bytes,
                           size_t pool_bytes) {
    spl_writer *w = calloc(1, sizeof(*w));
    if (!w) return NULL;
    w->fd = fd;
    w->sink = sink;
    w->sink_ctx = sink_ctx;
    w->batch_bytes = batch_bytes ? batch_bytes : (256u << 10);
    w->inflight = -1;
    if (pool_bytes) {
        w->async = 1;
        w->cap = pool_bytes;
        w->ring = malloc(pool_bytes);
        if (!w->ring) {
            free(w);
            return NULL;
        }
    }
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->not_empty, NULL);
    pthread_cond_init(&w->not_full, NULL);
    int rc = pthread_create(&w->thread, NULL, writer_main, w);
    if (rc) {
        free(w->ring);
        free(w);
        errno = rc;
        return NULL;
    }
    w->thread_started = 1;
    return w;
}

/* Copies bytes into the ring, waiting for room; the writer thread only reads
 * [tail, head), so the copy runs outside the lock. */
static int ring_put(spl_writer *w, const uint8_t *p, size_t len) {
    while (len) {
        pthread_mutex_lock(&w->mu);
        while (!w->error && w->head - w->tail == w->cap) pthread_cond_wait(&w->not_full, &w->mu);
        if (w->error) {
            pthread_mutex_unlock(&w->mu);
            return w->error;
        }
        size_t room = w->cap - (size_t)(w->head - w->tail);
        size_t at = (size_t)(w->head % w->cap);
        pthread_mutex_unlock(&w->mu);

        size_t n = len < room ? len : room;
        if (n > w->cap - at) n = w->cap - at;
        memcpy(w->ring + at, p, n);
        p += n;
        len -= n;

        pthread_mutex_lock(&w->mu);
        w->head += n;
        pthread_cond_signal(&w->not_empty);
        pthread_mutex_unlock(&w->mu);
    }
    return SPL_OK;
}

static int batch_full(const spl_writer *w, const batch *b) {
    return b->pending >= w->batch_bytes || b->iovcnt + 2 > MAX_IOV ||
           b->small_used + SPL_TRAILER_SIZE > SMALL_ARENA;
}

static void queue_iov(batch *b, const void *p, size_t len) {
    if (len == 0) return;
    b->iov[b->iovcnt].iov_base = (void *)p;
    b->iov[b->iovcnt].iov_len = len;
    b->iovcnt++;
    b->pending += len;
}

/* The thread sets the sticky error under the lock; the caller peeks without it. */
#define STICKY(w) __atomic_load_n(&(w)->error, __ATOMIC_ACQUIRE)

int spl_writer_put_raw(spl_writer *w, const void *data, size_t len, int *flush_needed) {
    *flush_needed = 0;
    if (STICKY(w)) return STICKY(w);
    if (w->async) return ring_put(w, data, len);
    batch *b = &w->batches[w->cur];
    if (len > SPL_TRAILER_SIZE || b->iovcnt + 1 > MAX_IOV || b->small_used + len > SMALL_ARENA) {
        w->error = SPL_E_IO;
        w->err_no = EINVAL;
        return w->error;
    }
    uint8_t *dst = b->small + b->small_used;
    memcpy(dst, data, len);
    b->small_used += len;
    queue_iov(b, dst, len);
    *flush_needed = batch_full(w, b);
    return SPL_OK;
}

int spl_writer_add(spl_writer *w, uint32_t channel_id, uint8_t data_type, uint8_t codec,
                   const void *payload, uint32_t stored_length, uint32_t raw_length,
                   int *flush_needed) {
    *flush_needed = 0;
    if (STICKY(w)) return STICKY(w);
    spl_frame_header f = {channel_id, data_type, codec, 0, stored_length, raw_length,
                          spl_crc32c(0, payload, stored_length)};
    if (w->async) {
        uint8_t hdr[SPL_FRAME_HEADER_SIZE];
        spl_encode_frame_header(hdr, &f);
        int rc = ring_put(w, hdr, sizeof hdr);
        return rc ? rc : ring_put(w, payload, stored_length);
    }
    batch *b = &w->batches[w->cur];
    uint8_t *hdr = b->small + b->small_used;
    spl_encode_frame_header(hdr, &f);
    b->small_used += SPL_FRAME_HEADER_SIZE;
    queue_iov(b, hdr, SPL_FRAME_HEADER_SIZE);
    queue_iov(b, payload, stored_length);
    *flush_needed = batch_full(w, b);
    return SPL_OK;
}

int spl_writer_current(spl_writer *w) { return w->cur; }

int spl_writer_submit(spl_writer *w) {
    pthread_mutex_lock(&w->mu);
    while (w->inflight >= 0) pthread_cond_wait(&w->not_full, &w->mu);
    if (!w->error) {
        w->inflight = w->cur;
        pthread_cond_signal(&w->not_empty);
    }
    int e = w->error;
    pthread_mutex_unlock(&w->mu);
    w->cur ^= 1;
    reset_batch(&w->batches[w->cur]);
    return e;
}

int spl_writer_flush(spl_writer *w) {
    pthread_mutex_lock(&w->mu);
    if (w->async) {
        while (!w->error && w->head != w->tail) pthread_cond_wait(&w->not_full, &w->mu);
        int e = w->error;
        pthread_mutex_unlock(&w->mu);
        return e;
    }
    pthread_mutex_unlock(&w->mu);
    spl_writer_submit(w);
    pthread_mutex_lock(&w->mu);
    while (w->inflight >= 0) pthread_cond_wait(&w->not_full, &w->mu);
    int e = w->error;
    pthread_mutex_unlock(&w->mu);
    return e;
}

static void stop_thread(spl_writer *w) {
    if (!w->thread_started) return;
    pthread_mutex_lock(&w->mu);
    w->stop = 1;
    pthread_cond_broadcast(&w->not_empty);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);
    w->thread_started = 0;
}

int spl_writer_finish(spl_writer *w, int do_fsync) {
    int rc = spl_writer_flush(w);
    stop_thread(w);
    if (rc) return rc;
    if (do_fsync && w->fd >= 0 && fsync(w->fd) != 0) {
        w->error = SPL_E_IO;
        w->err_no = errno;
    }
    return w->error;
}

int spl_writer_error(spl_writer *w, int *err_no) {
    pthread_mutex_lock(&w->mu);
    int e = w->error;
    *err_no = w->err_no;
    pthread_mutex_unlock(&w->mu);
    return e;
}

uint64_t spl_writer_bytes_written(spl_writer *w) { return __atomic_load_n(&w->written, __ATOMIC_RELAXED); }

void spl_writer_free(spl_writer *w) {
    if (!w) return;
    if (w->thread_started) {
        /* Abandoned without finish: make the thread drop what is queued. */
        pthread_mutex_lock(&w->mu);
        if (!w->error) {
            w->error = SPL_E_IO;
            w->err_no = ECANCELED;
        }
        pthread_cond_broadcast(&w->not_empty);
        pthread_mutex_unlock(&w->mu);
        stop_thread(w);
    }
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->not_empty);
    pthread_cond_destroy(&w->not_full);
    free(w->ring);
    free(w);
}
