/* Record framing, reassembly, packing and the key-group filter loop. */
#include "records.h"
#include "debug.h"
#include "bufcache.h"

#include <pthread.h>
#include <stdlib.h>

/* ---- reassembly ---- */

int spl_carry_feed(spl_carry *c, const uint8_t *buf, size_t n, uint32_t max_len, size_t *used) {
    size_t u = 0;
    while (c->hdr_have < SPL_REC_PREFIX) {
        if (u == n) {
            *used = u;
            return SPL_REC_MORE;
        }
        c->hdr[c->hdr_have++] = buf[u++];
        if (c->hdr_have == SPL_REC_PREFIX) {
            c->len = spl_le32(c->hdr);
            c->have = 0;
            if (c->len > max_len) {
                *used = u;
                return SPL_REC_E_TOO_LARGE;
            }
        }
    }
    if (c->cap < c->len) {
        if (!c->self_alloc) {
            *used = u;
            return SPL_REC_NEED_ALLOC;
        }
        uint8_t *d = realloc(c->data, c->len);
        if (!d) {
            *used = u;
            return SPL_REC_E_NOMEM;
        }
        c->data = d;
        c->cap = c->len;
    }
    size_t take = c->len - c->have;
    if (take > n - u) take = n - u;
    if (take) memcpy(c->data + c->have, buf + u, take);
    c->have += (uint32_t)take;
    *used = u + take;
    return c->have == c->len ? SPL_REC_OK : SPL_REC_MORE;
}

void spl_carry_reset(spl_carry *c) {
    c->hdr_have = 0;
    c->len = 0;
    c->have = 0;
    if (!c->self_alloc) {
        c->data = NULL;
        c->cap = 0;
    }
}

void spl_carry_free(spl_carry *c) {
    if (c->self_alloc) free(c->data);
    c->data = NULL;
    c->cap = 0;
    spl_carry_reset(c);
}

/* How far ahead the record walks prefetch: the next record's address hangs on
 * this one's length, which keeps loads from running ahead (a prefetch past the
 * buffer's end is harmless). */
#define SPL_REC_PREFETCH 2048

/* The scan predicts each record's length to be the one before's: the next
 * record's address then comes from a register, not from the length just loaded,
 * so the loads of successive records overlap; a length that differs takes a
 * branch, rarely taken where records of one serializer are of one width. Over
 * cached 104-byte records the scan ran some 20 % faster. */
int spl_rec_scan(const uint8_t *buf, size_t n, size_t *pos, uint32_t max_len, int64_t *offsets,
                 int64_t *lengths, size_t max_out, size_t *count) {
    size_t p = *pos, k = 0, step = 0;
    uint64_t predicted = UINT64_MAX; /* no length yet: equal to none */
    uint32_t len = 0;
    int rc = SPL_REC_OK;
    while (k < max_out && p + SPL_REC_PREFIX <= n) {
        __builtin_prefetch(buf + p + SPL_REC_PREFETCH);
        uint32_t got = spl_le32(buf + p);
        if (__builtin_expect(got != predicted, 0)) {
            if (got > max_len) {
                rc = SPL_REC_E_TOO_LARGE;
                break;
            }
            predicted = got;
            len = got;
            step = SPL_REC_PREFIX + (size_t)got;
        }
        if (step > n - p) break;
        offsets[k] = (int64_t)(p + SPL_REC_PREFIX);
        lengths[k] = len;
        k++;
        p += step;
    }
    *pos = p;
    *count = k;
    return rc;
}

int spl_rec_scan_fixed(const uint8_t *buf, size_t n, size_t *pos, uint32_t width, uint32_t max_len,
                       size_t *count, int64_t *bad) {
    size_t p = *pos, k = 0, step = SPL_REC_PREFIX + (size_t)width;
    int rc = SPL_REC_OK;
    *bad = -1;
    while (p + SPL_REC_PREFIX <= n) {
        __builtin_prefetch(buf + p + SPL_REC_PREFETCH);
        uint32_t got = spl_le32(buf + p);
        if (__builtin_expect(got != width || width > max_len, 0)) {
            if (got > max_len)
                rc = SPL_REC_E_TOO_LARGE;
            else
                *bad = got;
            break;
        }
        if (step > n - p) break;
        k++;
        p += step;
    }
    *pos = p;
    *count = k;
    return rc;
}

/* ---- the buffer pool ---- */

struct spl_pool {
    pthread_mutex_t mu;
    size_t alloc;
    uint32_t cap, n, refs;
    int closed; /* the packer is gone: no spares kept */
    uint8_t *spare[];
};

spl_pool *spl_pool_new(size_t alloc, uint32_t cap) {
    spl_pool *pl = malloc(sizeof *pl + cap * sizeof(uint8_t *));
    if (!pl) return NULL;
    if (pthread_mutex_init(&pl->mu, NULL)) {
        free(pl);
        return NULL;
    }
    pl->alloc = alloc;
    pl->cap = cap;
    pl->n = 0;
    pl->refs = 1;
    pl->closed = 0;
    SPL_HANDLE_NEW();
    return pl;
}

uint8_t *spl_pool_get(spl_pool *pl) {
    uint8_t *b = NULL;
    pthread_mutex_lock(&pl->mu);
    if (pl->n) b = pl->spare[--pl->n];
    pthread_mutex_unlock(&pl->mu);
    size_t got;
    return b ? b : spl_buf_get(pl->alloc, &got);
}

void spl_pool_put(spl_pool *pl, uint8_t *base) {
    if (!base) return;
    pthread_mutex_lock(&pl->mu);
    int keep = !pl->closed && pl->n < pl->cap;
    if (keep) pl->spare[pl->n++] = base;
    pthread_mutex_unlock(&pl->mu);
    if (!keep) spl_buf_put(base, pl->alloc);
}

void spl_pool_retain(spl_pool *pl) {
    pthread_mutex_lock(&pl->mu);
    pl->refs++;
    pthread_mutex_unlock(&pl->mu);
}

void spl_pool_release(spl_pool *pl) {
    pthread_mutex_lock(&pl->mu);
    uint32_t left = --pl->refs;
    pthread_mutex_unlock(&pl->mu);
    if (left) return;
    SPL_HANDLE_FREE();
    for (uint32_t i = 0; i < pl->n; i++) spl_buf_put(pl->spare[i], pl->alloc);
    pthread_mutex_destroy(&pl->mu);
    free(pl);
}

void spl_pool_close(spl_pool *pl) {
    pthread_mutex_lock(&pl->mu);
    pl->closed = 1;
    uint32_t n = pl->n;
    pl->n = 0;
    pthread_mutex_unlock(&pl->mu);
    for (uint32_t i = 0; i < n; i++) spl_buf_put(pl->spare[i], pl->alloc);
    spl_pool_release(pl);
}

uint32_t spl_pool_spares(spl_pool *pl) {
    pthread_mutex_lock(&pl->mu);
    uint32_t n = pl->n;
    pthread_mutex_unlock(&pl->mu);
    return n;
}

/* ---- packing ---- */

#define SPL_SKEW_MIN_SIZE 8192
#define SPL_SKEW_MAX 4096          /* a buffer starts up to this far into its allocation */
#define SPL_POOL_BYTES (8u << 20)  /* spares a packer keeps, at most */
#define SPL_POOL_MAX 16

int spl_packer_init(spl_packer *p, uint32_t size, uint32_t n_outs) {
    memset(p, 0, sizeof *p);
    p->outs = calloc(n_outs ? n_outs : 1, sizeof *p->outs);
    if (!p->outs) return SPL_REC_E_NOMEM;
    size_t alloc = (size_t)size + (size >= SPL_SKEW_MIN_SIZE ? SPL_SKEW_MAX : 0);
    size_t cap = SPL_POOL_BYTES / alloc;
    if (cap < 2) cap = 2;
    if (cap > SPL_POOL_MAX) cap = SPL_POOL_MAX;
    p->pool = spl_pool_new(alloc, (uint32_t)cap);
    if (!p->pool) {
        free(p->outs);
        p->outs = NULL;
        return SPL_REC_E_NOMEM;
    }
    p->size = size;
    p->n_outs = n_outs;
    return SPL_REC_OK;
}

void spl_packer_free(spl_packer *p) {
    size_t alloc = p->pool ? p->pool->alloc : 0;
    if (p->outs)
        for (uint32_t o = 0; o < p->n_outs; o++) spl_buf_put(p->outs[o].base, alloc);
    for (size_t i = 0; i < p->n_full; i++) spl_buf_put(p->full[i].base, alloc);
    if (p->pool) spl_pool_close(p->pool);
    free(p->outs);
    free(p->full);
    memset(p, 0, sizeof *p);
}

int spl_packer_retire(spl_packer *p, uint32_t o) {
    if (p->n_full == p->full_cap) {
        size_t cap = p->full_cap ? 2 * p->full_cap : 16;
        spl_full *f = realloc(p->full, cap * sizeof *f);
        if (!f) return SPL_REC_E_NOMEM;
        p->full = f;
        p->full_cap = cap;
    }
    spl_out *out = &p->outs[o];
    p->full[p->n_full++] =
        (spl_full){.buf = out->buf, .base = out->base, .output = (int32_t)o, .size = out->pos};
    out->buf = NULL;
    out->base = NULL;
    out->pos = 0;
    return SPL_REC_OK;
}

int spl_packer_flush(spl_packer *p) {
    for (uint32_t o = 0; o < p->n_outs; o++) {
        if (p->outs[o].pos) {
            int rc = spl_packer_retire(p, o);
            if (rc) return rc;
        }
    }
    return SPL_REC_OK;
}

/* Copies src into output o, retiring every buffer it fills. */
int spl_packer_put_bytes(spl_packer *p, uint32_t o, const uint8_t *src, size_t n) {
    spl_out *out = &p->outs[o];
    while (n) {
        if (!out->buf) {
            /* Output buffers come from malloc at similar offsets modulo the
             * cache's set stride, and fill at similar rates: with many outputs
             * their write positions would fight over a few cache sets. Start
             * each output at its own cache-line offset instead. */
            size_t skew = p->size >= SPL_SKEW_MIN_SIZE ? (o * 7u % 64u) * 64u : 0;
            out->base = spl_pool_get(p->pool);
            if (!out->base) return SPL_REC_E_NOMEM;
            out->buf = out->base + skew;
            out->pos = 0;
        }
        size_t take = p->size - out->pos;
        if (take > n) take = n;
        memcpy(out->buf + out->pos, src, take);
        out->pos += (uint32_t)take;
        src += take;
        n -= take;
        if (out->pos == p->size) {
            int rc = spl_packer_retire(p, o);
            if (rc) return rc;
        }
    }
    return SPL_REC_OK;
}

int spl_packer_put_slow(spl_packer *p, uint32_t o, const uint8_t *prefix, const uint8_t *payload,
                        uint32_t len) {
    /* Whole records: cut the buffer short rather than split a record that fits in
     * one, unless that would leave more than an eighth of the buffer empty. */
    if (p->whole && p->outs[o].pos && (uint64_t)SPL_REC_PREFIX + len <= p->size &&
        p->size - p->outs[o].pos <= p->size / 8) {
        int rc = spl_packer_retire(p, o);
        if (rc) return rc;
    }
    int rc = spl_packer_put_bytes(p, o, prefix, SPL_REC_PREFIX);
    return rc ? rc : spl_packer_put_bytes(p, o, payload, len);
}

int spl_packer_put_batch(spl_packer *p, uint32_t o, const uint8_t *data, const int64_t *offsets,
                         size_t n) {
    for (size_t i = 0; i < n; i++) {
        int rc = spl_packer_put(p, o, data + offsets[i], (uint32_t)(offsets[i + 1] - offsets[i]));
        if (rc) return rc;
    }
    return SPL_REC_OK;
}

int spl_packer_put_fixed(spl_packer *p, uint32_t o, const uint8_t *data, uint32_t width,
                         size_t n) {
    for (size_t i = 0; i < n; i++) {
        int rc = spl_packer_put(p, o, data + i * (size_t)width, width);
        if (rc) return rc;
    }
    return SPL_REC_OK;
}

/* ---- key groups and the filter ---- */

/* Specialised by the compiler for each key kind, like demux_loop below. */
static inline __attribute__((always_inline)) int key_groups_loop(
    const uint8_t *buf, size_t n, size_t *pos, uint32_t max_len, const spl_keyspec *key_in,
    spl_mod md, int32_t *out, size_t max_out, size_t *count, int kind) {
    spl_keyspec key = *key_in;
    key.kind = kind;
    size_t p = *pos, k = 0;
    int rc = SPL_REC_OK;
    while (k < max_out && p + SPL_REC_PREFIX <= n) {
        __builtin_prefetch(buf + p + SPL_REC_PREFETCH);
        uint32_t len = spl_le32(buf + p);
        if (len > max_len) {
            rc = SPL_REC_E_TOO_LARGE;
            break;
        }
        if (len > n - p - SPL_REC_PREFIX) break;
        int32_t h;
        rc = spl_key_hash(&key, buf + p + SPL_REC_PREFIX, len, &h);
        if (rc) break;
        out[k++] = spl_key_group_of_hash(h, md);
        p += SPL_REC_PREFIX + (size_t)len;
    }
    *pos = p;
    *count = k;
    return rc;
}

int spl_rec_key_groups(const uint8_t *buf, size_t n, size_t *pos, uint32_t max_len,
                       const spl_keyspec *key, int32_t max_p, int32_t *out, size_t max_out,
                       size_t *count) {
    spl_mod md = spl_mod_make((uint32_t)max_p);
    switch (key->kind) {
    case SPL_KEY_INT32:
        return key_groups_loop(buf, n, pos, max_len, key, md, out, max_out, count, SPL_KEY_INT32);
    case SPL_KEY_INT64:
        return key_groups_loop(buf, n, pos, max_len, key, md, out, max_out, count, SPL_KEY_INT64);
    case SPL_KEY_STR:
        return key_groups_loop(buf, n, pos, max_len, key, md, out, max_out, count, SPL_KEY_STR);
    default:
        return key_groups_loop(buf, n, pos, max_len, key, md, out, max_out, count, SPL_KEY_BYTES);
    }
}

int spl_demux_route(spl_demux *d, const uint8_t *payload, uint32_t len, int32_t kg) {
    if (d->keep_all) {
        d->routed++;
        return spl_packer_put(&d->packer, 0, payload, len);
    }
    if (kg < 0) {
        int32_t h;
        int rc = spl_key_hash(&d->key, payload, len, &h);
        if (rc) return rc;
        kg = spl_key_group_of_hash(h, d->mod);
    }
    int32_t o = d->table[kg];
    if (o < 0) {
        d->dropped++;
        return SPL_REC_OK;
    }
    d->routed++;
    return spl_packer_put(&d->packer, (uint32_t)o, payload, len);
}

/* The loop body, specialised by the compiler for each key kind (kind is a
 * constant at every call site below), so the switch in spl_key_hash folds. */
static inline __attribute__((always_inline)) int demux_loop(spl_demux *d, const uint8_t *buf,
                                                            size_t n, size_t *pos,
                                                            const int32_t *kgs, size_t max_records,
                                                            size_t *count, int kind) {
    const int32_t *table = d->table;
    const spl_mod md = d->mod;
    const uint32_t max_len = d->max_len;
    spl_keyspec key = d->key;
    key.kind = kind;
    size_t p = *pos, k = 0;
    uint64_t dropped = 0;
    int rc = SPL_REC_OK;
    while (k < max_records && p + SPL_REC_PREFIX <= n) {
        __builtin_prefetch(buf + p + SPL_REC_PREFETCH);
        uint32_t len = spl_le32(buf + p);
        if (len > max_len) {
            rc = SPL_REC_E_TOO_LARGE;
            break;
        }
        if (len > n - p - SPL_REC_PREFIX) break;
        int32_t kg;
        if (d->keep_all) {
            rc = spl_packer_put_framed(&d->packer, 0, buf + p, len);
            if (rc) break;
            k++;
            p += SPL_REC_PREFIX + (size_t)len;
            continue;
        } else if (kgs) {
            kg = kgs[k];
        } else {
            int32_t h;
            rc = spl_key_hash(&key, buf + p + SPL_REC_PREFIX, len, &h);
            if (rc) break;
            kg = spl_key_group_of_hash(h, md);
        }
        int32_t o = table[kg];
        if (o >= 0) {
            rc = spl_packer_put_framed(&d->packer, (uint32_t)o, buf + p, len);
            if (rc) break;
        } else {
            dropped++;
        }
        k++;
        p += SPL_REC_PREFIX + (size_t)len;
    }
    d->dropped += dropped;
    d->routed += k - dropped;
    *pos = p;
    *count = k;
    return rc;
}

#define SPL_DEMUX_CHUNK 1024

/* The fused loop, one walk that hashes and routes each record in turn. */
static int demux_fused(spl_demux *d, const uint8_t *buf, size_t n, size_t *pos,
                       size_t max_records, size_t *count) {
    switch (d->key.kind) {
    case SPL_KEY_INT32:
        return demux_loop(d, buf, n, pos, NULL, max_records, count, SPL_KEY_INT32);
    case SPL_KEY_INT64:
        return demux_loop(d, buf, n, pos, NULL, max_records, count, SPL_KEY_INT64);
    case SPL_KEY_STR:
        return demux_loop(d, buf, n, pos, NULL, max_records, count, SPL_KEY_STR);
    default:
        return demux_loop(d, buf, n, pos, NULL, max_records, count, SPL_KEY_BYTES);
    }
}

int spl_demux_run(spl_demux *d, const uint8_t *buf, size_t n, size_t *pos, const int32_t *kgs,
                  size_t max_records, size_t *count) {
    if (kgs) return demux_loop(d, buf, n, pos, kgs, max_records, count, d->key.kind);
    if (!d->drops || d->keep_all) return demux_fused(d, buf, n, pos, max_records, count);
    /* A table that drops some key groups: a chunk at a time, in two passes (key
     * groups first, then routing) while the chunks drop records, fused while
     * they drop none. Routing keeps or drops each record on a branch that
     * mispredicts wherever kept and dropped records mix; fused with hashing,
     * each miss also stalled the hashes of the records after it, so such chunks
     * hash all their records first, with no branch, and route them after. A
     * chunk that dropped nothing says the records come from key groups the
     * table keeps (a shared read's old channel, whose key groups all belong to
     * its parts): there the branch is predicted and one walk is cheaper than
     * two, until a chunk drops again. The hint outlives the call: a frame
     * holds fewer records than a chunk. */
    int32_t chunk[SPL_DEMUX_CHUNK];
    size_t done = 0;
    int rc = SPL_REC_OK;
    while (done < max_records) {
        size_t want = max_records - done < SPL_DEMUX_CHUNK ? max_records - done : SPL_DEMUX_CHUNK;
        size_t routed = 0, walked = 0; /* walked: records hashed, routed or not */
        uint64_t dropped = d->dropped;
        if (d->fused) {
            rc = demux_fused(d, buf, n, pos, want, &routed);
            walked = routed;
        } else {
            size_t p = *pos;
            int hrc = spl_rec_key_groups(buf, n, &p, d->max_len, &d->key, d->max_p, chunk, want,
                                         &walked);
            rc = demux_loop(d, buf, n, pos, chunk, walked, &routed, d->key.kind);
            if (!rc) rc = hrc; /* the records before a bad one are routed first */
        }
        done += routed;
        if (routed) d->fused = d->dropped == dropped;
        if (rc || walked < want) break;
    }
    *count = done;
    return rc;
}

/* The rows loop, specialised per key kind like demux_loop. */
static inline __attribute__((always_inline)) int rows_loop(spl_demux *d, const uint8_t *rows,
                                                           size_t n_rows, uint32_t width,
                                                           size_t *count, int kind) {
    const int32_t *table = d->table;
    const spl_mod md = d->mod;
    spl_keyspec key = d->key;
    key.kind = kind;
    size_t k = 0;
    uint64_t dropped = 0;
    int rc = SPL_REC_OK;
    for (; k < n_rows; k++) {
        const uint8_t *row = rows + k * (size_t)width;
        uint32_t o = 0;
        if (!d->keep_all) {
            int32_t h;
            rc = spl_key_hash(&key, row, width, &h);
            if (rc) break;
            int32_t t = table[spl_key_group_of_hash(h, md)];
            if (t < 0) {
                dropped++;
                continue;
            }
            o = (uint32_t)t;
        }
        rc = spl_packer_put(&d->packer, o, row, width);
        if (rc) break;
    }
    d->dropped += dropped;
    d->routed += k - dropped;
    *count = k;
    return rc;
}

int spl_demux_rows(spl_demux *d, const uint8_t *rows, size_t n_rows, size_t width,
                   size_t *count) {
    *count = 0;
    if (width > d->max_len) return SPL_REC_E_TOO_LARGE;
    if (n_rows == 0) return SPL_REC_OK;
    uint32_t w = (uint32_t)width;
    switch (d->key.kind) {
    case SPL_KEY_INT32:
        return rows_loop(d, rows, n_rows, w, count, SPL_KEY_INT32);
    case SPL_KEY_INT64:
        return rows_loop(d, rows, n_rows, w, count, SPL_KEY_INT64);
    case SPL_KEY_STR:
        return rows_loop(d, rows, n_rows, w, count, SPL_KEY_STR);
    default:
        return rows_loop(d, rows, n_rows, w, count, SPL_KEY_BYTES);
    }
}

int spl_packer_put_frames(spl_packer *p, const uint8_t *data, const int64_t *offsets,
                          const int64_t *lengths, const int32_t *outputs, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (outputs[i] < 0) continue;
        int rc = spl_packer_put_bytes(p, (uint32_t)outputs[i], data + offsets[i],
                                      (size_t)lengths[i]);
        if (rc) return rc;
    }
    return SPL_REC_OK;
}

int spl_demux_frames(spl_demux *d, const uint8_t *data, const int64_t *offsets,
                     const int64_t *lengths, const int32_t *slots, size_t n, spl_carry **carries,
                     size_t *err_frame, size_t *err_at) {
    for (size_t i = 0; i < n; i++) {
        if (slots[i] < 0) continue;
        const uint8_t *buf = data + offsets[i];
        size_t len = (size_t)lengths[i], pos = 0, used = 0, count = 0;
        spl_carry *c = carries[slots[i]];
        int rc = SPL_REC_OK;
        *err_frame = i;
        *err_at = 0;
        if (c->hdr_have) {
            rc = spl_carry_feed(c, buf, len, d->max_len, &used);
            pos = used;
            if (rc == SPL_REC_OK) {
                rc = spl_demux_route(d, c->data, c->len, -1);
                spl_carry_reset(c);
                if (rc) return rc;
            } else if (rc != SPL_REC_MORE) {
                return rc;
            }
        }
        if (pos < len && !c->hdr_have) {
            rc = spl_demux_run(d, buf, len, &pos, NULL, SIZE_MAX, &count);
            if (rc) {
                *err_at = pos;
                return rc;
            }
            if (pos < len) {
                rc = spl_carry_feed(c, buf + pos, len - pos, d->max_len, &used);
                if (rc != SPL_REC_MORE) {
                    *err_at = pos;
                    return rc;
                }
            }
        }
    }
    return SPL_REC_OK;
}
