# C declarations of csrc/{keygroups,keysums,records,generate}.h; no code here.
from libc.stddef cimport ptrdiff_t
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t


cdef extern from "keygroups.h" nogil:
    enum:
        SPL_KEY_INT32
        SPL_KEY_INT64
        SPL_KEY_STR
        SPL_KEY_BYTES

    ctypedef struct spl_mod:
        pass

    int32_t spl_murmur_hash(int32_t code)
    void spl_key_groups_from_hashes(const int32_t *hashes, size_t n, int32_t max_p, int32_t *out)
    void spl_key_groups_int32(const int32_t *keys, size_t n, int32_t max_p, int32_t *out)
    void spl_key_groups_int64(const int64_t *keys, size_t n, int32_t max_p, int32_t *out)
    void spl_key_groups_packed(const uint8_t *data, const int64_t *offsets, size_t n, int kind,
                               int32_t max_p, int32_t *out)
    void spl_java_hashes_packed(const uint8_t *data, const int64_t *offsets, size_t n, int kind,
                                int32_t *out)
    spl_mod spl_mod_make(uint32_t d)


cdef extern from "keysums.h" nogil:
    enum:
        SPL_SUMS_OK
        SPL_SUMS_E_RANGE
        SPL_SUMS_E_NOMEM
        SPL_SUMS_E_TOO_MANY

    const size_t SPL_SUMS_MAX_KEYS
    const size_t SPL_SUMS_INDEX_MAX_KEYS

    ctypedef struct spl_sum_run:
        const int64_t *keys
        int64_t *values
        size_t n
        const uint32_t *index
        unsigned index_bits

    unsigned spl_sums_index_bits(size_t n)
    void spl_sums_index(const int64_t *keys, size_t n, uint32_t *slots, unsigned bits)

    int spl_sums_add(const void *keys, ptrdiff_t key_stride, const void *values,
                     ptrdiff_t value_stride, size_t n, int32_t max_p,
                     int32_t kg_lo, int32_t kg_hi, spl_sum_run *runs, size_t n_runs,
                     int ascending, int64_t *out_keys, int64_t *out_totals, size_t out_stride,
                     int64_t *out_new, size_t *n_out, size_t *n_new)


cdef extern from "records.h" nogil:
    enum:
        SPL_REC_PREFIX
        SPL_REC_MAX_LENGTH
        SPL_REC_OK
        SPL_REC_MORE
        SPL_REC_NEED_ALLOC
        SPL_REC_E_NOMEM
        SPL_REC_E_TOO_LARGE
        SPL_REC_E_SHORT_KEY

    ctypedef struct spl_carry:
        uint8_t hdr[4]
        uint32_t hdr_have
        uint32_t len
        uint32_t have
        uint32_t cap
        uint8_t *data
        int self_alloc

    int spl_carry_feed(spl_carry *c, const uint8_t *buf, size_t n, uint32_t max_len, size_t *used)
    void spl_carry_reset(spl_carry *c)
    void spl_carry_free(spl_carry *c)
    int spl_rec_scan(const uint8_t *buf, size_t n, size_t *pos, uint32_t max_len,
                     int64_t *offsets, int64_t *lengths, size_t max_out, size_t *count)
    int spl_rec_scan_fixed(const uint8_t *buf, size_t n, size_t *pos, uint32_t width,
                           uint32_t max_len, size_t *count, int64_t *bad)

    ctypedef struct spl_out:
        uint8_t *buf
        uint32_t pos

    ctypedef struct spl_full:
        uint8_t *buf
        uint8_t *base
        int32_t output
        uint32_t size

    ctypedef struct spl_pool:
        pass

    void spl_pool_put(spl_pool *pl, uint8_t *base)
    void spl_pool_retain(spl_pool *pl)
    void spl_pool_release(spl_pool *pl)
    uint32_t spl_pool_spares(spl_pool *pl)

    ctypedef struct spl_packer:
        uint32_t size
        uint32_t n_outs
        uint32_t whole
        spl_out *outs
        spl_full *full
        size_t n_full
        spl_pool *pool

    int spl_packer_init(spl_packer *p, uint32_t size, uint32_t n_outs)
    void spl_packer_free(spl_packer *p)
    int spl_packer_flush(spl_packer *p)
    int spl_packer_put(spl_packer *p, uint32_t o, const uint8_t *payload, uint32_t len)
    int spl_packer_put_batch(spl_packer *p, uint32_t o, const uint8_t *data,
                             const int64_t *offsets, size_t n)
    int spl_packer_put_fixed(spl_packer *p, uint32_t o, const uint8_t *data, uint32_t width,
                             size_t n)

    ctypedef struct spl_keyspec:
        int kind
        uint32_t offset
        int prefixed

    int spl_rec_key_groups(const uint8_t *buf, size_t n, size_t *pos, uint32_t max_len,
                           const spl_keyspec *key, int32_t max_p, int32_t *out, size_t max_out,
                           size_t *count)

    ctypedef struct spl_demux:
        spl_packer packer
        const int32_t *table
        spl_keyspec key
        spl_mod mod
        int32_t max_p
        uint32_t max_len
        int keep_all
        int drops
        int fused
        uint64_t routed
        uint64_t dropped

    int spl_demux_run(spl_demux *d, const uint8_t *buf, size_t n, size_t *pos,
                      const int32_t *kgs, size_t max_records, size_t *count)
    int spl_demux_rows(spl_demux *d, const uint8_t *rows, size_t n_rows, size_t width,
                       size_t *count)
    int spl_demux_route(spl_demux *d, const uint8_t *payload, uint32_t len, int32_t kg)
    int spl_demux_frames(spl_demux *d, const uint8_t *data, const int64_t *offsets,
                         const int64_t *lengths, const int32_t *slots, size_t n,
                         spl_carry **carries, size_t *err_frame, size_t *err_at)
    int spl_packer_put_frames(spl_packer *p, const uint8_t *data, const int64_t *offsets,
                              const int64_t *lengths, const int32_t *outputs, size_t n)


cdef extern from "generate.h" nogil:
    ctypedef struct spl_gen_layout:
        size_t itemsize
        size_t partition
        size_t seq
        size_t key
        size_t payload
        size_t payload_len

    void spl_gen_fill(uint8_t *out, const spl_gen_layout *layout, const int64_t *parts,
                      const int64_t *starts, const int64_t *counts, size_t m, uint64_t seed_mix,
                      uint64_t keys, const uint8_t *pattern)
