#include "wake.h"

#include <errno.h>
#include <time.h>

int spl_wake_init(spl_wake *w) {
    pthread_condattr_t a;
    int r = pthread_condattr_init(&a);
    if (r)
        return r;
    r = pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    if (!r)
        r = pthread_cond_init(&w->cv, &a);
    pthread_condattr_destroy(&a);
    if (r)
        return r;
    r = pthread_mutex_init(&w->mu, NULL);
    if (r) {
        pthread_cond_destroy(&w->cv);
        return r;
    }
    w->set = w->armed = 0;
    w->wakes = 0;
    return 0;
}

void spl_wake_destroy(spl_wake *w) {
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
}

void spl_wake_post(spl_wake *w) {
    pthread_mutex_lock(&w->mu);
    w->set = 1;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

void spl_wake_arm(spl_wake *w, int armed) {
    pthread_mutex_lock(&w->mu);
    w->armed = armed;
    pthread_mutex_unlock(&w->mu);
}

int spl_wake_notify_armed(spl_wake *w) {
    pthread_mutex_lock(&w->mu);
    int was = w->armed;
    if (was) {
        w->armed = 0;
        w->set = 1;
        w->wakes++;
        pthread_cond_signal(&w->cv);
    }
    pthread_mutex_unlock(&w->mu);
    return was;
}

int spl_wake_wait(spl_wake *w, int64_t timeout_ms) {
    struct timespec until;
    if (timeout_ms >= 0) {
        clock_gettime(CLOCK_MONOTONIC, &until);
        until.tv_sec += (time_t)(timeout_ms / 1000);
        until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec += 1;
            until.tv_nsec -= 1000000000L;
        }
    }
    pthread_mutex_lock(&w->mu);
    while (!w->set) {
        int r = timeout_ms >= 0 ? pthread_cond_timedwait(&w->cv, &w->mu, &until)
                                : pthread_cond_wait(&w->cv, &w->mu);
        if (r == ETIMEDOUT)
            break;
    }
    int got = w->set;
    w->set = 0;
    pthread_mutex_unlock(&w->mu);
    return got;
}

uint64_t spl_wake_count(spl_wake *w) {
    pthread_mutex_lock(&w->mu);
    uint64_t n = w->wakes;
    pthread_mutex_unlock(&w->mu);
    return n;
}

void spl_credit_init(spl_credit *c, int64_t initial) {
    __atomic_store_n(&c->credit, initial, __ATOMIC_SEQ_CST);
    __atomic_store_n(&c->granted, initial, __ATOMIC_SEQ_CST);
}

void spl_credit_add(spl_credit *c, int64_t delta) {
    __atomic_add_fetch(&c->granted, delta, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&c->credit, delta, __ATOMIC_SEQ_CST);
}

int spl_credit_take(spl_credit *c) {
    int64_t have = __atomic_load_n(&c->credit, __ATOMIC_SEQ_CST);
    while (have > 0) {
        if (__atomic_compare_exchange_n(&c->credit, &have, have - 1, 0, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST))
            return 1;
    }
    return 0;
}

int64_t spl_credit_get(const spl_credit *c) {
    return __atomic_load_n(&c->credit, __ATOMIC_SEQ_CST);
}

int64_t spl_credit_granted(const spl_credit *c) {
    return __atomic_load_n(&c->granted, __ATOMIC_SEQ_CST);
}
