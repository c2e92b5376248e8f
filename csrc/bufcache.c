#include "bufcache.h"

#include <pthread.h>
#include <stdlib.h>

#define SLOTS 32

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static void *bufs[SLOTS];
static size_t caps[SLOTS];
static int n;
static size_t total;
static pthread_once_t once = PTHREAD_ONCE_INIT;

/* A child forked while another thread held the lock would never get it: the
 * child starts with a fresh lock (the cached buffers are its own copies). */
static void reset_in_child(void) { pthread_mutex_init(&mu, NULL); }
static void init(void) { pthread_atfork(NULL, NULL, reset_in_child); }

void *spl_buf_get(size_t cap, size_t *got) {
    *got = cap;
    if (cap >= SPL_BUFCACHE_MIN) {
        pthread_once(&once, init);
        pthread_mutex_lock(&mu);
        int best = -1;
        for (int i = 0; i < n; i++)
            if (caps[i] >= cap && caps[i] - cap <= cap / 4 && (best < 0 || caps[i] < caps[best]))
                best = i;
        if (best >= 0) {
            void *p = bufs[best];
            *got = caps[best];
            total -= caps[best];
            bufs[best] = bufs[--n];
            caps[best] = caps[n];
            pthread_mutex_unlock(&mu);
            return p;
        }
        pthread_mutex_unlock(&mu);
    }
    return malloc(cap ? cap : 1);
}

void spl_buf_put(void *p, size_t cap) {
    if (!p) return;
    if (cap >= SPL_BUFCACHE_MIN && cap <= SPL_BUFCACHE_BYTES) {
        pthread_once(&once, init);
        pthread_mutex_lock(&mu);
        if (n < SLOTS && total + cap <= SPL_BUFCACHE_BYTES) {
            bufs[n] = p;
            caps[n++] = cap;
            total += cap;
            pthread_mutex_unlock(&mu);
            return;
        }
        pthread_mutex_unlock(&mu);
    }
    free(p);
}
