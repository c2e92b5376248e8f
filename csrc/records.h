/* Records in network buffers: framing, reassembly of records that span
 * buffers, packing into fixed-size buffers, and the key-group filter /
 * demultiplex loop. No Python here.
 *
 * Framing: every record is a 4-byte little-endian length (0 .. 2^31 - 1)
 * followed by that many payload bytes. A buffer is a run of framed records;
 * a record, its length prefix included, may be cut anywhere by a buffer
 * boundary and continue in the next buffer of the same channel. */
#ifndef SPL_RECORDS_H
#define SPL_RECORDS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "keygroups.h"

#define SPL_REC_PREFIX 4
#define SPL_REC_MAX_LENGTH 0x7FFFFFFFu

enum {
    SPL_REC_OK = 0,
    SPL_REC_MORE = 1,        /* carry: input used up, the record is still incomplete */
    SPL_REC_NEED_ALLOC = 2,  /* carry: length known, the caller must provide storage */
    SPL_REC_E_NOMEM = -1,
    SPL_REC_E_TOO_LARGE = -2, /* a length prefix exceeds the configured limit */
    SPL_REC_E_SHORT_KEY = -3, /* a record is too short to hold its key field */
};

static inline uint32_t spl_le32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

static inline uint64_t spl_le64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline void spl_put_le32(uint8_t *p, uint32_t v) {
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    memcpy(p, &v, 4);
}

/* ---- reassembly of one channel's record cut by a buffer boundary ---- */

typedef struct {
    uint8_t hdr[4];
    uint32_t hdr_have; /* prefix bytes seen; 0 means no record in progress */
    uint32_t len;      /* payload length, valid once hdr_have == 4 */
    uint32_t have;     /* payload bytes collected */
    uint32_t cap;      /* capacity of data */
    uint8_t *data;
    int self_alloc; /* 1: data is malloc'd and grown here; 0: NEED_ALLOC asks the caller */
} spl_carry;

/* Feeds buf[0..n) to the record in progress (or starts one); *used = bytes
 * taken. Returns SPL_REC_OK when the record is complete (payload in data[0..len)),
 * SPL_REC_MORE when all of buf was taken, SPL_REC_NEED_ALLOC (call again with
 * buf + *used once data/cap hold len bytes), or an error. */
int spl_carry_feed(spl_carry *c, const uint8_t *buf, size_t n, uint32_t max_len, size_t *used);
/* Forgets the record in progress (keeps self-allocated storage for reuse). */
void spl_carry_reset(spl_carry *c);
void spl_carry_free(spl_carry *c);

/* Whole records of buf[*pos..n): payload offsets and lengths, up to max_out
 * of them. Stops at the first record that does not end inside the buffer and
 * leaves *pos at its start (n when the buffer ends on a record boundary). */
int spl_rec_scan(const uint8_t *buf, size_t n, size_t *pos, uint32_t max_len, int64_t *offsets,
                 int64_t *lengths, size_t max_out, size_t *count);

/* spl_rec_scan for records of `width` payload bytes each: counts the whole
 * records from the incoming *pos without writing their offsets (the i-th
 * payload is at that *pos + SPL_REC_PREFIX + i * (SPL_REC_PREFIX + width)).
 * Stops at the first record that does not end inside the buffer, or at the
 * first header of another length: *bad is then that length (-1 when none). A
 * header above max_len (width's own included) is SPL_REC_E_TOO_LARGE, as in
 * spl_rec_scan. */
int spl_rec_scan_fixed(const uint8_t *buf, size_t n, size_t *pos, uint32_t width, uint32_t max_len,
                       size_t *count, int64_t *bad);

/* ---- packing records into fixed-size buffers, one stream per output ---- */

typedef struct {
    uint8_t *buf; /* NULL until the first byte is written */
    uint8_t *base; /* the allocation buf lies in */
    uint32_t pos;
} spl_out;

typedef struct {
    uint8_t *buf;  /* the buffer's bytes, inside base */
    uint8_t *base; /* malloc'd; ownership (free(base)) passes to whoever takes it */
    int32_t output;
    uint32_t size;
} spl_full;

/* A few spare allocations of one size, shared by a packer and the buffers it handed
 * out (which may outlive it). Buffers given back while the pool has room are kept
 * for the packer's next buffers: a fresh large allocation costs page faults and
 * zeroing on every use, a reused one does not. Thread-safe; reference-counted (the
 * packer holds one reference, each buffer handed out another). */
typedef struct spl_pool spl_pool;

spl_pool *spl_pool_new(size_t alloc, uint32_t cap); /* one reference, or NULL */
uint8_t *spl_pool_get(spl_pool *pl);                /* a spare, or a new allocation */
void spl_pool_put(spl_pool *pl, uint8_t *base);     /* kept as a spare, or freed */
void spl_pool_retain(spl_pool *pl);
void spl_pool_release(spl_pool *pl); /* the last reference frees the pool and its spares */
void spl_pool_close(spl_pool *pl);   /* the owner's release: spares freed, none kept after */
uint32_t spl_pool_spares(spl_pool *pl);

typedef struct {
    uint32_t size; /* bytes per buffer */
    uint32_t n_outs;
    uint32_t whole; /* nonzero: a record that does not fit in what is left of a
                       buffer starts the next one instead of being split, when at
                       most an eighth of the buffer is left empty */
    spl_out *outs;
    spl_full *full; /* buffers completed and not yet taken, in completion order */
    size_t n_full, full_cap;
    spl_pool *pool; /* where buffers come from; a taken full[i].base goes back with
                       spl_pool_put, then spl_pool_release (retain the pool on taking) */
} spl_packer;

int spl_packer_init(spl_packer *p, uint32_t size, uint32_t n_outs);
/* Frees the current buffers and any full ones not taken; closes the pool. */
void spl_packer_free(spl_packer *p);
/* Moves every non-empty current buffer to the full list (as a short buffer). */
int spl_packer_flush(spl_packer *p);
int spl_packer_retire(spl_packer *p, uint32_t o);
/* Appends raw bytes to output o (no framing), retiring every buffer it fills. */
int spl_packer_put_bytes(spl_packer *p, uint32_t o, const uint8_t *src, size_t n);
/* Appends data[offsets[i] .. + lengths[i]) raw to output outputs[i] (skipped when < 0),
 * in order: the frames of a read-ahead block joined into each channel's stream. */
int spl_packer_put_frames(spl_packer *p, const uint8_t *data, const int64_t *offsets,
                          const int64_t *lengths, const int32_t *outputs, size_t n);
int spl_packer_put_slow(spl_packer *p, uint32_t o, const uint8_t *prefix, const uint8_t *payload,
                        uint32_t len);
/* Appends many records data[offsets[i] .. offsets[i+1]) to output o. */
int spl_packer_put_batch(spl_packer *p, uint32_t o, const uint8_t *data, const int64_t *offsets,
                         size_t n);
/* Appends n records of width bytes each, data[i * width .. (i + 1) * width), to output o. */
int spl_packer_put_fixed(spl_packer *p, uint32_t o, const uint8_t *data, uint32_t width,
                         size_t n);

/* Appends one record (prefix + payload) to output o. */
static inline int spl_packer_put(spl_packer *p, uint32_t o, const uint8_t *payload, uint32_t len) {
    spl_out *out = &p->outs[o];
    uint8_t prefix[4];
    spl_put_le32(prefix, len);
    if (out->buf && (uint64_t)out->pos + SPL_REC_PREFIX + len <= p->size) {
        memcpy(out->buf + out->pos, prefix, 4);
        if (len) memcpy(out->buf + out->pos + 4, payload, len);
        out->pos += SPL_REC_PREFIX + len;
        return out->pos == p->size ? spl_packer_retire(p, o) : SPL_REC_OK;
    }
    return spl_packer_put_slow(p, o, prefix, payload, len);
}

/* memcpy for the short copies of the filter loop: fixed-size 16-byte moves
 * (the last one overlapping) instead of a call into the general memcpy. */
static inline void spl_copy_short(uint8_t *dst, const uint8_t *src, size_t n) {
    if (n >= 16) {
        if (n > 256) {
            memcpy(dst, src, n);
            return;
        }
        size_t i = 0;
        for (; i + 16 < n; i += 16) __builtin_memcpy(dst + i, src + i, 16);
        __builtin_memcpy(dst + n - 16, src + n - 16, 16);
    } else if (n >= 8) {
        __builtin_memcpy(dst, src, 8);
        __builtin_memcpy(dst + n - 8, src + n - 8, 8);
    } else if (n >= 4) {
        __builtin_memcpy(dst, src, 4);
        __builtin_memcpy(dst + n - 4, src + n - 4, 4);
    } else {
        for (size_t i = 0; i < n; i++) dst[i] = src[i];
    }
}

/* Appends a record that is already framed in memory: framed[0..4+len). */
static inline int spl_packer_put_framed(spl_packer *p, uint32_t o, const uint8_t *framed,
                                        uint32_t len) {
    spl_out *out = &p->outs[o];
    if (out->buf && (uint64_t)out->pos + SPL_REC_PREFIX + len <= p->size) {
        spl_copy_short(out->buf + out->pos, framed, SPL_REC_PREFIX + (size_t)len);
        out->pos += SPL_REC_PREFIX + len;
        return out->pos == p->size ? spl_packer_retire(p, o) : SPL_REC_OK;
    }
    return spl_packer_put_slow(p, o, framed, framed + SPL_REC_PREFIX, len);
}

/* ---- keys and the key-group filter ---- */

typedef struct {
    int kind;        /* SPL_KEY_* */
    uint32_t offset; /* byte offset of the key field in the payload */
    int prefixed;    /* str/bytes: 1 = 4-byte LE length then bytes; 0 = the rest of the payload */
} spl_keyspec;

/* Java hash code of the key of one payload, or SPL_REC_E_SHORT_KEY. */
static inline int spl_key_hash(const spl_keyspec *k, const uint8_t *rec, uint32_t len,
                               int32_t *hash) {
    uint64_t off = k->offset;
    switch (k->kind) {
    case SPL_KEY_INT32:
        if (off + 4 > len) return SPL_REC_E_SHORT_KEY;
        *hash = (int32_t)spl_le32(rec + off);
        return SPL_REC_OK;
    case SPL_KEY_INT64:
        if (off + 8 > len) return SPL_REC_E_SHORT_KEY;
        *hash = spl_java_hash_int64((int64_t)spl_le64(rec + off));
        return SPL_REC_OK;
    default: {
        uint64_t n;
        if (k->prefixed) {
            if (off + 4 > len) return SPL_REC_E_SHORT_KEY;
            n = spl_le32(rec + off);
            off += 4;
            if (off + n > len) return SPL_REC_E_SHORT_KEY;
        } else {
            if (off > len) return SPL_REC_E_SHORT_KEY;
            n = len - off;
        }
        *hash = k->kind == SPL_KEY_STR ? spl_java_hash_utf8(rec + off, (size_t)n)
                                       : spl_java_hash_bytes(rec + off, (size_t)n);
        return SPL_REC_OK;
    }
    }
}

/* Key groups of the whole records of buf[*pos..n) into out (up to max_out);
 * stops like spl_rec_scan. On error *pos is the offending record's start. */
int spl_rec_key_groups(const uint8_t *buf, size_t n, size_t *pos, uint32_t max_len,
                       const spl_keyspec *key, int32_t max_p, int32_t *out, size_t max_out,
                       size_t *count);

typedef struct {
    spl_packer packer;
    const int32_t *table; /* key group -> output, -1 = drop; max_p entries, owned by the caller */
    spl_keyspec key;
    spl_mod mod;
    int32_t max_p;
    uint32_t max_len;
    int keep_all; /* every record to output 0, no key read (a channel taken whole) */
    int drops;    /* some key group maps to -1 (see spl_demux_run) */
    int fused;    /* the last chunk dropped nothing: walk the next in one pass (ditto) */
    uint64_t routed, dropped;
} spl_demux;

/* Routes the whole records of buf[*pos..n) to their outputs' packers, in
 * order; stops like spl_rec_scan, or after max_records. kgs == NULL: key
 * groups come from the key spec; else kgs[i] is the i-th record's key group.
 * *count = records consumed; on error *pos is the offending record's start. */
int spl_demux_run(spl_demux *d, const uint8_t *buf, size_t n, size_t *pos, const int32_t *kgs,
                  size_t max_records, size_t *count);
/* Routes n_rows records of width bytes each, rows[i * width ..) (fixed-width rows
 * in place, no length prefixes: a record batch), in order; each goes out behind its
 * prefix as spl_demux_run would route it framed. *count = rows routed (or dropped);
 * on error the row at *count is the offending one. */
int spl_demux_rows(spl_demux *d, const uint8_t *rows, size_t n_rows, size_t width,
                   size_t *count);
/* Routes one payload (e.g. a reassembled record); kg < 0: from the key spec. */
int spl_demux_route(spl_demux *d, const uint8_t *payload, uint32_t len, int32_t kg);

/* Routes the records of many buffers: data[offsets[i] .. + lengths[i]) for every
 * i with slots[i] >= 0, in order, each continuing the record cut in carries[slots[i]]
 * (one per demux channel, self-allocating). On error *err_frame is the buffer's
 * index and *err_at the offending record's start in it. */
int spl_demux_frames(spl_demux *d, const uint8_t *data, const int64_t *offsets,
                     const int64_t *lengths, const int32_t *slots, size_t n, spl_carry **carries,
                     size_t *err_frame, size_t *err_at);

#endif
