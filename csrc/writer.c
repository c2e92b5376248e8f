#define _GNU_SOURCE /* pthread_setname_np */
#include "writer.h"
#include "debug.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
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
    int error; /* sticky; written once under mu, read atomically */
    int err_no;
    uint64_t bytes_out;

    /* blocking mode: a ring of batch slots. The caller fills slot
     * `submitted % SLOTS`; the thread writes slots `written .. submitted-1`. */
    batch batches[SPL_WRITER_SLOTS];
    uint64_t submitted; /* batches handed to the thread */
    uint64_t written;   /* batches the thread has finished */

    /* non-blocking mode: a single-producer, single-consumer byte ring */
    int async;
    uint8_t *ring;
    size_t cap;
    size_t wake_bytes;   /* the thread sleeps until this much is queued */
    uint64_t head, tail; /* monotonic byte counters; position = counter % cap */
    int flush_req;

    int stop;
    /* A pool thread runs this writer (from the first submit in blocking mode,
     * from the start in non-blocking mode) until `done`. */
    int thread_started;
    int done;                  /* the thread has left this writer; set under mu */
    unsigned gen;              /* the pool's generation when it started (pool_gen) */
    struct spl_writer *next;   /* in the pool's queue of writers awaiting a thread */
    /* The owner and a running thread each hold a reference: a thread let go of
     * without waiting for it (spl_writer_finish) frees the writer if it ends last. */
    int refs;
    /* mu and the conditions are only for sleeping; the state above is read and
     * written with atomics, and a side that changes it wakes the other only if
     * that one has said it sleeps (thread_sleeps / caller_sleeps). */
    pthread_mutex_t mu;
    pthread_cond_t not_empty, not_full;
    int thread_sleeps, caller_sleeps;
};

#define LOAD(x) __atomic_load_n(&(x), __ATOMIC_SEQ_CST)
#define STORE(x, v) __atomic_store_n(&(x), (v), __ATOMIC_SEQ_CST)

/* A thread handoff costs tens of microseconds on a busy VM; a short spin
 * catches the common case where the other side is about to finish. */
#define SPIN_NS 20000

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* How long a wait may spin: SPIN_NS, or 0 for a thread that may run on one CPU
 * only (a worker pinned to a core): there the other side cannot run while this
 * one spins, so every spin would only delay it (20 us a wait, on the writer
 * thread after each batch it wrote, on the caller at a gate's close). */
static uint64_t spin_ns(void) {
#ifdef __linux__
    cpu_set_t cpus;
    if (sched_getaffinity(0, sizeof cpus, &cpus) == 0 && CPU_COUNT(&cpus) < 2) return 0;
#endif
    return SPIN_NS;
}

/* Waits until `ready` holds: spins a little (see spin_ns), then sleeps on `cv`
 * having set `*flag` so the other side knows to signal. */
#define WAIT_FOR(w, ready, cv, flag)                                              \
    do {                                                                          \
        if (!(ready)) {                                                           \
            uint64_t t0_ = now_ns(), spin_ = spin_ns();                           \
            while (!(ready) && now_ns() - t0_ < spin_) cpu_relax();               \
            if (!(ready)) {                                                       \
                pthread_mutex_lock(&(w)->mu);                                     \
                STORE(*(flag), 1);                                                \
                while (!(ready)) pthread_cond_wait(&(cv), &(w)->mu);              \
                STORE(*(flag), 0);                                                \
                pthread_mutex_unlock(&(w)->mu);                                   \
            }                                                                     \
        }                                                                         \
    } while (0)

static void wake(spl_writer *w, pthread_cond_t *cv, int *flag) {
    if (LOAD(*flag)) {
        pthread_mutex_lock(&w->mu);
        pthread_cond_broadcast(cv);
        pthread_mutex_unlock(&w->mu);
    }
}

static void set_error(spl_writer *w, int err_no) {
    pthread_mutex_lock(&w->mu);
    if (!w->error) {
        w->err_no = err_no;
        STORE(w->error, SPL_E_IO);
    }
    pthread_cond_broadcast(&w->not_full);
    pthread_cond_broadcast(&w->not_empty);
    pthread_mutex_unlock(&w->mu);
}

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
    if (rc == 0) __atomic_add_fetch(&w->bytes_out, total, __ATOMIC_RELAXED);
    return rc;
}

static void reset_batch(batch *b) {
    b->iovcnt = 0;
    b->pending = 0;
    b->small_used = 0;
}

/* Blocking mode: write the submitted batches in order. */
static void batches_loop(spl_writer *w) {
    for (;;) {
        WAIT_FOR(w, LOAD(w->submitted) != w->written || LOAD(w->stop), w->not_empty,
                 &w->thread_sleeps);
        if (LOAD(w->submitted) == w->written) break; /* stopped and idle */
        batch *b = &w->batches[w->written % SPL_WRITER_SLOTS];
        if (!LOAD(w->error) && b->iovcnt) {
            int rc = sink_write(w, b->iov, b->iovcnt);
            if (rc) set_error(w, rc);
        }
        STORE(w->written, w->written + 1);
        wake(w, &w->not_full, &w->caller_sleeps);
    }
}

/* Non-blocking mode: drain the ring in chunks of at most MAX_WRITE. */
static void ring_loop(spl_writer *w) {
    for (;;) {
        WAIT_FOR(w,
                 LOAD(w->head) - w->tail >= w->wake_bytes ||
                     (LOAD(w->head) != w->tail && (LOAD(w->flush_req) || LOAD(w->stop))) ||
                     (LOAD(w->stop) && LOAD(w->head) == w->tail) || LOAD(w->error),
                 w->not_empty, &w->thread_sleeps);
        if (LOAD(w->error)) break;
        uint64_t avail = LOAD(w->head) - w->tail;
        if (avail == 0) break; /* stopped and drained */
        size_t chunk = avail < MAX_WRITE ? (size_t)avail : MAX_WRITE;
        size_t at = (size_t)(w->tail % w->cap);
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
        if (rc) {
            set_error(w, rc);
            break;
        }
        STORE(w->tail, w->tail + chunk);
        wake(w, &w->not_full, &w->caller_sleeps);
    }
}

static void destroy(spl_writer *w) {
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->not_empty);
    pthread_cond_destroy(&w->not_full);
    free(w->ring);
    free(w);
}

static void unref(spl_writer *w) {
    if (__atomic_sub_fetch(&w->refs, 1, __ATOMIC_ACQ_REL) == 0) destroy(w);
}

/* Writer threads are pooled, process-wide: a thread that has finished a writer
 * parks for up to POOL_IDLE_S seconds waiting for the next one, so a storer made
 * at a checkpoint barrier hands its first batch to a parked thread (one wake-up)
 * instead of creating a thread (a clone and its first scheduling, tens to
 * hundreds of microseconds on a busy worker, on the task's path). */
#define POOL_IDLE_S 30
#define POOL_MAX_IDLE 64

static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_cv;
static spl_writer *pool_head, *pool_tail; /* writers handed over, not yet taken */
static int pool_free;                     /* parked threads no queued writer is promised to */
static uint64_t pool_created;             /* threads ever created (spl_writer_pool_stats) */
/* Bumped in a forked child: a writer started under an older generation had its
 * thread in the parent, and nothing in the child will ever run it. */
static unsigned pool_gen;

static void pool_cv_init(void) {
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(&pool_cv, &a);
    pthread_condattr_destroy(&a);
}

/* A forked child has none of the parent's threads: it starts an empty pool. */
static void pool_prepare(void) { pthread_mutex_lock(&pool_mu); }
static void pool_parent(void) { pthread_mutex_unlock(&pool_mu); }
static void pool_child(void) {
    pthread_mutex_init(&pool_mu, NULL);
    pool_cv_init();
    pool_head = pool_tail = NULL;
    pool_free = 0;
    pool_created = 0;
    pool_gen++;
}

/* At load, once: no thread can fork halfway through it (as one could through a
 * lazy pthread_once, registering the handlers twice in the child). */
__attribute__((constructor)) static void pool_init(void) {
    pool_cv_init();
    pthread_atfork(pool_prepare, pool_parent, pool_child);
}

/* Whether a thread of this process runs `w` (not one left in a parent). */
static int has_thread(const spl_writer *w) { return w->thread_started && w->gen == pool_gen; }

/* A writer a forked child inherited with its thread left in the parent: nothing
 * will write what it queued, so it fails (sticky) instead of waiting for ever.
 * No lock: its mutex may have been held by the parent's thread at the fork. */
static int inherited(spl_writer *w) {
    if (!w->thread_started || w->gen == pool_gen) return 0;
    if (!LOAD(w->error)) {
        w->err_no = ECHILD;
        STORE(w->error, SPL_E_IO);
    }
    return 1;
}

static void run_writer(spl_writer *w) {
    if (w->async)
        ring_loop(w);
    else
        batches_loop(w);
    pthread_mutex_lock(&w->mu);
    w->done = 1;
    pthread_cond_broadcast(&w->not_full);
    pthread_mutex_unlock(&w->mu);
    unref(w);
}

/* Waits up to POOL_IDLE_S for a writer handed to the pool; NULL once it is time to
 * end (idle too long, or enough threads parked already). Called with pool_mu held. */
static spl_writer *pool_take(void) {
    if (pool_free >= POOL_MAX_IDLE) return NULL;
    pool_free++;
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += POOL_IDLE_S;
    while (!pool_head) {
        if (pthread_cond_timedwait(&pool_cv, &pool_mu, &until) == ETIMEDOUT && !pool_head) {
            pool_free--; /* the queue is empty: no writer was promised to this thread */
            return NULL;
        }
    }
    /* A queued writer: the thread that queued it already took one off pool_free. */
    spl_writer *w = pool_head;
    pool_head = w->next;
    if (!pool_head) pool_tail = NULL;
    w->next = NULL;
    return w;
}

static void *pool_main(void *arg) {
#ifdef __linux__
    pthread_setname_np(pthread_self(), "spl-writer");
#endif
    spl_writer *w = arg;
    while (w) {
        run_writer(w);
        pthread_mutex_lock(&pool_mu);
        w = pool_take();
        pthread_mutex_unlock(&pool_mu);
    }
    return NULL;
}

/* Gives `w` a thread: a parked one if any, else a new one. Returns 0 or errno. */
static int start_thread(spl_writer *w) {
    __atomic_add_fetch(&w->refs, 1, __ATOMIC_ACQ_REL); /* the thread's reference */
    w->thread_started = 1;
    w->gen = pool_gen;
    pthread_mutex_lock(&pool_mu);
    if (pool_free > 0) {
        pool_free--;
        if (pool_tail)
            pool_tail->next = w;
        else
            pool_head = w;
        pool_tail = w;
        pthread_cond_signal(&pool_cv);
        pthread_mutex_unlock(&pool_mu);
        return 0;
    }
    pool_created++;
    pthread_mutex_unlock(&pool_mu);
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&t, &attr, pool_main, w);
    pthread_attr_destroy(&attr);
    if (rc) {
        w->thread_started = 0;
        __atomic_sub_fetch(&w->refs, 1, __ATOMIC_ACQ_REL);
    }
    return rc;
}

void spl_writer_pool_stats(uint64_t *created, int *parked) {
    pthread_mutex_lock(&pool_mu);
    *created = pool_created;
    *parked = pool_free;
    pthread_mutex_unlock(&pool_mu);
}

spl_writer *spl_writer_new(int fd, spl_sink_fn sink, void *sink_ctx, size_t batch_bytes,
                           size_t pool_bytes) {
    spl_writer *w = calloc(1, sizeof(*w));
    if (!w) return NULL;
    w->fd = fd;
    w->sink = sink;
    w->sink_ctx = sink_ctx;
    w->batch_bytes = batch_bytes ? batch_bytes : (256u << 10);
    if (pool_bytes) {
        w->async = 1;
        w->cap = pool_bytes;
        w->wake_bytes = w->batch_bytes < pool_bytes / 2 ? w->batch_bytes : pool_bytes / 2;
        w->ring = malloc(pool_bytes);
        if (!w->ring) {
            free(w);
            return NULL;
        }
    }
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->not_empty, NULL);
    pthread_cond_init(&w->not_full, NULL);
    w->refs = 1;
    /* Blocking mode starts its thread at the first submit: a gate closed before
     * any batch filled is written on the caller's thread without one. */
    if (w->async) {
        int rc = start_thread(w);
        if (rc) {
            destroy(w);
            errno = rc;
            return NULL;
        }
    }
    SPL_HANDLE_NEW();
    return w;
}

/* Copies bytes into the ring, waiting for room; the writer thread only reads
 * [tail, head), so the copy needs no lock. */
static int ring_put(spl_writer *w, const uint8_t *p, size_t len) {
    while (len) {
        /* Wait for a good share of the ring rather than every freed byte. */
        size_t want = len < w->cap / 4 ? len : w->cap / 4;
        WAIT_FOR(w, w->cap - (size_t)(w->head - LOAD(w->tail)) >= want || LOAD(w->error),
                 w->not_full, &w->caller_sleeps);
        if (LOAD(w->error)) return LOAD(w->error);
        size_t room = w->cap - (size_t)(w->head - LOAD(w->tail));
        size_t at = (size_t)(w->head % w->cap);
        size_t n = len < room ? len : room;
        if (n > w->cap - at) n = w->cap - at;
        memcpy(w->ring + at, p, n);
        p += n;
        len -= n;
        uint64_t before = w->head - LOAD(w->tail);
        STORE(w->head, w->head + n);
        if (before < w->wake_bytes && before + n >= w->wake_bytes)
            wake(w, &w->not_empty, &w->thread_sleeps);
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

int spl_writer_put_raw(spl_writer *w, const void *data, size_t len, int *flush_needed) {
    *flush_needed = 0;
    if (LOAD(w->error)) return LOAD(w->error);
    if (w->async) return ring_put(w, data, len);
    batch *b = &w->batches[w->submitted % SPL_WRITER_SLOTS];
    if (len > SPL_TRAILER_SIZE || b->iovcnt + 1 > MAX_IOV || b->small_used + len > SMALL_ARENA) {
        set_error(w, EINVAL);
        return LOAD(w->error);
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
    if (LOAD(w->error)) return LOAD(w->error);
    spl_frame_header f = {channel_id, data_type, codec, 0, stored_length, raw_length,
                          spl_crc32c(0, payload, stored_length)};
    if (w->async) {
        if (inherited(w)) return LOAD(w->error); /* its ring would never drain */
        uint8_t hdr[SPL_FRAME_HEADER_SIZE];
        spl_encode_frame_header(hdr, &f);
        int rc = ring_put(w, hdr, sizeof hdr);
        return rc ? rc : ring_put(w, payload, stored_length);
    }
    batch *b = &w->batches[w->submitted % SPL_WRITER_SLOTS];
    uint8_t *hdr = b->small + b->small_used;
    spl_encode_frame_header(hdr, &f);
    b->small_used += SPL_FRAME_HEADER_SIZE;
    queue_iov(b, hdr, SPL_FRAME_HEADER_SIZE);
    queue_iov(b, payload, stored_length);
    *flush_needed = batch_full(w, b);
    return SPL_OK;
}

uint64_t spl_writer_submitted(spl_writer *w) { return w->submitted; }

uint64_t spl_writer_written(spl_writer *w) { return LOAD(w->written); }

int spl_writer_submit(spl_writer *w) {
    if (inherited(w)) return LOAD(w->error);
    if (!w->thread_started) {
        if (LOAD(w->error)) return LOAD(w->error);
        int rc = start_thread(w);
        if (rc) { /* nothing is submitted: a flush does not wait for a thread */
            set_error(w, rc);
            return LOAD(w->error);
        }
    }
    /* The next slot must be free: wait while every slot is in flight. */
    WAIT_FOR(w, w->submitted + 1 - LOAD(w->written) < SPL_WRITER_SLOTS, w->not_full,
             &w->caller_sleeps);
    int e = LOAD(w->error);
    STORE(w->submitted, w->submitted + 1);
    /* Woken after an error too: the thread counts the batch as written (it drops
     * it), which a flush waits for; left asleep, it never would (a hang). */
    wake(w, &w->not_empty, &w->thread_sleeps);
    reset_batch(&w->batches[w->submitted % SPL_WRITER_SLOTS]);
    return e;
}

int spl_writer_flush(spl_writer *w) {
    if (inherited(w)) return LOAD(w->error);
    if (w->async) {
        STORE(w->flush_req, 1);
        pthread_mutex_lock(&w->mu);
        pthread_cond_broadcast(&w->not_empty);
        pthread_mutex_unlock(&w->mu);
        WAIT_FOR(w, LOAD(w->head) == LOAD(w->tail) || LOAD(w->error), w->not_full,
                 &w->caller_sleeps);
        STORE(w->flush_req, 0);
        return LOAD(w->error);
    }
    spl_writer_submit(w);
    WAIT_FOR(w, LOAD(w->written) == w->submitted, w->not_full, &w->caller_sleeps);
    return LOAD(w->error);
}

static void stop_thread(spl_writer *w) {
    if (!w->thread_started || inherited(w)) {
        w->thread_started = 0;
        return;
    }
    pthread_mutex_lock(&w->mu);
    STORE(w->stop, 1);
    pthread_cond_broadcast(&w->not_empty);
    while (!w->done) pthread_cond_wait(&w->not_full, &w->mu);
    pthread_mutex_unlock(&w->mu);
    w->thread_started = 0;
}

/* Blocking mode, the thread idle (every submitted batch written) or never started:
 * lets it go without waiting for it to leave, and writes the batch being filled
 * (the trailer) on the caller's thread. Closing a gate then costs one write instead of waking the
 * thread, waiting for its write and joining it (four thread wake-ups, which on
 * a VM with idle cores cost a millisecond or more per gate). Once `stop` is seen
 * with nothing submitted the thread only exits: it never touches the fd again. */
static int finish_here(spl_writer *w) {
    WAIT_FOR(w, LOAD(w->written) == w->submitted, w->not_full, &w->caller_sleeps);
    pthread_mutex_lock(&w->mu);
    STORE(w->stop, 1);
    pthread_cond_broadcast(&w->not_empty);
    pthread_mutex_unlock(&w->mu);
    w->thread_started = 0;
    batch *b = &w->batches[w->submitted % SPL_WRITER_SLOTS];
    if (!LOAD(w->error) && b->iovcnt) {
        int rc = sink_write(w, b->iov, b->iovcnt);
        if (rc) set_error(w, rc);
    }
    reset_batch(b);
    return LOAD(w->error);
}

int spl_writer_finish(spl_writer *w, int do_fsync) {
    int rc;
    if (inherited(w)) {
        w->thread_started = 0;
        return LOAD(w->error);
    }
    if (!w->async && w->fd >= 0) {
        rc = finish_here(w);
    } else {
        rc = spl_writer_flush(w);
        stop_thread(w);
    }
    if (rc) return rc;
    if (do_fsync && w->fd >= 0 && fsync(w->fd) != 0) set_error(w, errno);
    return LOAD(w->error);
}

int spl_writer_finish_is_quick(spl_writer *w, size_t max_bytes) {
    if (w->async || w->fd < 0) return 0;
    if (LOAD(w->written) != w->submitted) return 0;
    return w->batches[w->submitted % SPL_WRITER_SLOTS].pending <= max_bytes;
}

int spl_writer_error(spl_writer *w, int *err_no) {
    pthread_mutex_lock(&w->mu);
    int e = w->error;
    *err_no = w->err_no;
    pthread_mutex_unlock(&w->mu);
    return e;
}

uint64_t spl_writer_bytes_written(spl_writer *w) { return __atomic_load_n(&w->bytes_out, __ATOMIC_RELAXED); }

int spl_writer_running(spl_writer *w) { return has_thread(w); }

void spl_writer_free(spl_writer *w) {
    if (!w) return;
    SPL_HANDLE_FREE();
    if (inherited(w)) {
        /* Its thread, and the reference that thread holds, stayed in the parent:
         * the writer is left allocated rather than waited for. */
        w->thread_started = 0;
    } else if (w->thread_started) {
        /* Abandoned without finish: make the thread drop what is queued, and wait
         * for it (it may be writing to the fd the caller closes next). */
        set_error(w, ECANCELED);
        stop_thread(w);
    }
    unref(w);
}
