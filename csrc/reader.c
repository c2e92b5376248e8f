#include "reader.h"
#include "debug.h"

#include "bufcache.h"
#include "crc32c.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

spl_block *spl_block_new(size_t cap) {
    spl_block *b = calloc(1, sizeof(*b));
    if (!b) return NULL;
    b->data = spl_buf_get(cap, &b->alloc);
    b->frames_cap = 64;
    b->frames = malloc(b->frames_cap * sizeof(spl_frame_ref));
    if (!b->data || !b->frames) {
        spl_buf_put(b->data, b->alloc);
        free(b->frames);
        free(b);
        return NULL;
    }
    b->cap = cap;
    b->refs = 1;
    SPL_HANDLE_NEW();
    return b;
}

void spl_block_incref(spl_block *b) {
    SPL_ASSERT(__atomic_load_n(&b->refs, __ATOMIC_RELAXED) > 0); /* never revive a freed block */
    __atomic_add_fetch(&b->refs, 1, __ATOMIC_RELAXED);
}

void spl_block_decref(spl_block *b) {
    if (b && __atomic_sub_fetch(&b->refs, 1, __ATOMIC_ACQ_REL) == 0) {
        SPL_HANDLE_FREE();
        spl_buf_put(b->data, b->alloc);
        free(b->frames);
        free(b);
    }
}

static int block_refs(spl_block *b) { return __atomic_load_n(&b->refs, __ATOMIC_ACQUIRE); }

int spl_block_scan(spl_block *b, size_t *consumed, size_t *need, size_t *err_at,
                   uint64_t *frames, uint64_t *raw, uint64_t *stored) {
    size_t pos = 0, got, used, at = 0;
    int rc;
    b->nframes = 0;
    for (;;) {
        rc = spl_scan_frames(b->data + pos, b->len - pos, b->frames + b->nframes,
                             b->frames_cap - b->nframes, 0, &got, &used, &at);
        for (size_t k = b->nframes; k < b->nframes + got; k++) {
            b->frames[k].payload += pos;
            *raw += b->frames[k].raw_length;
            *stored += b->frames[k].stored_length;
        }
        b->nframes += got;
        *frames += got;
        if (rc) {
            *err_at = pos + at;
            return rc;
        }
        pos += used;
        if (b->nframes < b->frames_cap) break;
        spl_frame_ref *grown = realloc(b->frames, 2 * b->frames_cap * sizeof(spl_frame_ref));
        if (!grown) {
            *err_at = pos;
            return SPL_E_IO;
        }
        b->frames = grown;
        b->frames_cap *= 2;
    }
    *consumed = pos;
    *need = SPL_FRAME_HEADER_SIZE;
    if (b->len - pos >= SPL_FRAME_HEADER_SIZE) {
        const uint8_t *p = b->data + pos + 8;
        *need += (size_t)p[0] | ((size_t)p[1] << 8) | ((size_t)p[2] << 16) | ((size_t)p[3] << 24);
    }
    return SPL_OK;
}

void spl_block_check_payloads(spl_block *b) {
    for (size_t k = 0; k < b->nframes; k++) {
        spl_frame_ref *f = &b->frames[k];
        if (f->checked == SPL_CRC_UNCHECKED)
            f->checked = spl_crc32c(0, b->data + f->payload, f->stored_length) == f->payload_crc
                             ? SPL_CRC_OK
                             : SPL_CRC_BAD;
    }
}

#define POOL_MAX 64

struct spl_reader {
    int fd;
    uint64_t pos, end;
    size_t block_bytes;
    size_t max_queued;
    uint64_t expect_frames, expect_raw, expect_stored;
    int verify;

    pthread_t thread;
    int thread_started;
    pthread_mutex_t mu;
    pthread_cond_t cv_ready; /* the consumer waits for a block */
    pthread_cond_t cv_space; /* the reader waits for queue room or a free block */
    spl_block *head, *tail;
    size_t queued;
    int stop;
    int done;
    int error;
    int err_no;
    uint64_t err_offset;

    spl_block *pool[POOL_MAX];
    int npool;
};

static void fail(spl_reader *r, int code, uint64_t offset, int err_no) {
    pthread_mutex_lock(&r->mu);
    if (!r->error) {
        r->error = code;
        r->err_offset = offset;
        r->err_no = err_no;
    }
    r->done = 1;
    pthread_cond_broadcast(&r->cv_ready);
    pthread_mutex_unlock(&r->mu);
}

/* A pooled block nobody else references and large enough, else a new one
 * (pooled while the pool has room). */
static spl_block *acquire(spl_reader *r, size_t cap, spl_block *keep) {
    for (int i = 0; i < r->npool; i++) {
        spl_block *b = r->pool[i];
        if (b != keep && b->cap >= cap && block_refs(b) == 1) {
            spl_block_incref(b);
            return b;
        }
    }
    spl_block *b = spl_block_new(cap);
    if (!b) return NULL;
    if (r->npool < POOL_MAX && r->npool < (int)r->max_queued + 3) {
        r->pool[r->npool++] = b;
        spl_block_incref(b);
    } else {
        /* Drop a pooled block that only the pool holds, to keep the pool small. */
        for (int i = 0; i < r->npool; i++) {
            if (block_refs(r->pool[i]) == 1 && r->pool[i] != keep) {
                spl_block_decref(r->pool[i]);
                r->pool[i] = b;
                spl_block_incref(b);
                break;
            }
        }
    }
    return b;
}

static void *reader_main(void *arg) {
    spl_reader *r = arg;
    spl_block *carry = NULL;
    size_t carry_start = 0, carry_len = 0, need = SPL_FRAME_HEADER_SIZE;
    uint64_t frames = 0, raw = 0, stored = 0;
    for (;;) {
        pthread_mutex_lock(&r->mu);
        while (!r->stop && r->queued >= r->max_queued) pthread_cond_wait(&r->cv_space, &r->mu);
        int stop = r->stop;
        pthread_mutex_unlock(&r->mu);
        if (stop) break;

        uint64_t left = r->end - r->pos;
        if (left == 0) {
            if (carry_len) {
                fail(r, SPL_E_FRAME_HEADER, r->pos - carry_len, 0);
                break;
            }
            if (r->expect_frames != SPL_READER_UNCHECKED &&
                (frames != r->expect_frames || raw != r->expect_raw ||
                 stored != r->expect_stored)) {
                fail(r, SPL_E_TRAILER, r->end, 0);
                break;
            }
            pthread_mutex_lock(&r->mu);
            r->done = 1;
            pthread_cond_broadcast(&r->cv_ready);
            pthread_mutex_unlock(&r->mu);
            break;
        }
        if (need - carry_len > left) {
            fail(r, SPL_E_FRAME_HEADER, r->pos - carry_len, 0);
            break;
        }
        size_t cap = need > r->block_bytes ? need : r->block_bytes;
        spl_block *b = acquire(r, cap, NULL);
        if (!b) {
            fail(r, SPL_E_IO, r->pos, ENOMEM);
            break;
        }
        if (carry_len) memmove(b->data, carry->data + carry_start, carry_len);
        size_t want = b->cap - carry_len;
        if (want > left) want = (size_t)left;
        size_t got = 0;
        while (got < want) {
            ssize_t n = pread(r->fd, b->data + carry_len + got, want - got, (off_t)(r->pos + got));
            if (n < 0 && errno == EINTR) continue;
            if (n < 0) {
                fail(r, SPL_E_IO, r->pos + got, errno);
                break;
            }
            if (n == 0) {
                fail(r, SPL_E_TRUNCATED, r->pos + got, 0);
                break;
            }
            got += (size_t)n;
        }
        if (got < want) {
            spl_block_decref(b);
            break;
        }
        b->base = r->pos - carry_len;
        b->len = carry_len + got;
        r->pos += got;
        size_t consumed = 0, err_at = 0;
        int rc = spl_block_scan(b, &consumed, &need, &err_at, &frames, &raw, &stored);
        if (rc) {
            fail(r, rc, b->base + err_at, rc == SPL_E_IO ? ENOMEM : 0);
            spl_block_decref(b);
            break;
        }
        if (r->verify) spl_block_check_payloads(b);
        if (carry) spl_block_decref(carry);
        carry = b; /* our reference now keeps the tail alive */
        carry_start = consumed;
        carry_len = b->len - consumed;
        if (b->nframes) {
            spl_block_incref(b);
            pthread_mutex_lock(&r->mu);
            b->next = NULL;
            if (r->tail)
                r->tail->next = b;
            else
                r->head = b;
            r->tail = b;
            r->queued++;
            pthread_cond_signal(&r->cv_ready);
            pthread_mutex_unlock(&r->mu);
        }
    }
    if (carry) spl_block_decref(carry);
    return NULL;
}

spl_reader *spl_reader_new(int fd, uint64_t start, uint64_t end, size_t block_bytes,
                           size_t max_queued, uint64_t expect_frames, uint64_t expect_raw,
                           uint64_t expect_stored, int verify) {
    spl_reader *r = calloc(1, sizeof(*r));
    if (!r) return NULL;
    r->fd = fd;
    r->pos = start;
    r->end = end;
    r->block_bytes = block_bytes;
    r->max_queued = max_queued ? max_queued : 1;
    r->expect_frames = expect_frames;
    r->expect_raw = expect_raw;
    r->expect_stored = expect_stored;
    r->verify = verify;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv_ready, NULL);
    pthread_cond_init(&r->cv_space, NULL);
    int rc = pthread_create(&r->thread, NULL, reader_main, r);
    if (rc) {
        free(r);
        errno = rc;
        return NULL;
    }
    r->thread_started = 1;
    SPL_HANDLE_NEW();
    return r;
}

spl_block *spl_reader_next(spl_reader *r, int wait_ms, int *status, uint64_t *err_offset,
                           int *err_no) {
    struct timespec deadline;
    if (wait_ms > 0) {
        clock_gettime(CLOCK_REALTIME, &deadline);
        deadline.tv_sec += wait_ms / 1000;
        deadline.tv_nsec += (long)(wait_ms % 1000) * 1000000L;
        if (deadline.tv_nsec >= 1000000000L) {
            deadline.tv_sec++;
            deadline.tv_nsec -= 1000000000L;
        }
    }
    pthread_mutex_lock(&r->mu);
    while (!r->head && !r->done && wait_ms != 0) {
        if (wait_ms < 0) {
            pthread_cond_wait(&r->cv_ready, &r->mu);
        } else if (pthread_cond_timedwait(&r->cv_ready, &r->mu, &deadline) == ETIMEDOUT) {
            break;
        }
    }
    spl_block *b = r->head;
    if (b) {
        r->head = b->next;
        if (!r->head) r->tail = NULL;
        r->queued--;
        b->next = NULL;
        pthread_cond_signal(&r->cv_space);
        *status = SPL_OK;
    } else if (r->done) {
        *status = r->error ? r->error : SPL_READER_DONE;
        *err_offset = r->err_offset;
        *err_no = r->err_no;
    } else {
        *status = SPL_READER_WAIT;
    }
    pthread_mutex_unlock(&r->mu);
    return b;
}

void spl_reader_free(spl_reader *r) {
    if (!r) return;
    SPL_HANDLE_FREE();
    if (r->thread_started) {
        pthread_mutex_lock(&r->mu);
        r->stop = 1;
        pthread_cond_broadcast(&r->cv_space);
        pthread_mutex_unlock(&r->mu);
        pthread_join(r->thread, NULL);
    }
    while (r->head) {
        spl_block *b = r->head;
        r->head = b->next;
        spl_block_decref(b);
    }
    for (int i = 0; i < r->npool; i++) spl_block_decref(r->pool[i]);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv_ready);
    pthread_cond_destroy(&r->cv_space);
    free(r);
}
