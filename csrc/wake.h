/* A wake-up one thread waits on and any thread posts, with or without an
 * interpreter lock: the TCP transport's credit reader wakes a producer waiting
 * for credit from a native loop, without taking the lock (docs/network.md,
 * "Credit without the interpreter"). An auto-reset event: a post is kept until
 * one wait takes it. `armed` is an output waker's flag: a notify wakes only a
 * producer that said it waits (spl_wake_arm) and disarms it. */
#ifndef SPL_WAKE_H
#define SPL_WAKE_H

#include <pthread.h>
#include <stdint.h>

typedef struct spl_wake {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int set;        /* posted, not yet taken by a wait */
    int armed;      /* a producer waits for its output to move */
    uint64_t wakes; /* notifies that found it armed */
} spl_wake;

/* 0, or an errno. */
int spl_wake_init(spl_wake *w);
void spl_wake_destroy(spl_wake *w);
void spl_wake_post(spl_wake *w);
void spl_wake_arm(spl_wake *w, int armed);
/* If armed: disarms, posts and counts a wake; returns whether it did. */
int spl_wake_notify_armed(spl_wake *w);
/* Waits until posted (then takes the post) or `timeout_ms` passes (< 0: no
 * limit). Returns 1 when posted, 0 on timeout. */
int spl_wake_wait(spl_wake *w, int64_t timeout_ms);
uint64_t spl_wake_count(spl_wake *w);

/* A producer's credit on one channel, granted by its reader and taken by the
 * producer, lock-free. */
typedef struct spl_credit {
    int64_t credit;  /* buffers the producer may still send */
    int64_t granted; /* all ever granted */
} spl_credit;

void spl_credit_init(spl_credit *c, int64_t initial);
void spl_credit_add(spl_credit *c, int64_t delta);
/* Takes one buffer's credit if there is any: 1, else 0. */
int spl_credit_take(spl_credit *c);
int64_t spl_credit_get(const spl_credit *c);
int64_t spl_credit_granted(const spl_credit *c);

#endif
