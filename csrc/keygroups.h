/* Flink-compatible key groups: Java hashCode() of a key, Flink's murmur hash,
 * then modulo the max parallelism (KeyGroupRangeAssignment). No Python here.
 *
 * The hash functions are static inline so the record filter loops in
 * records.c inline them; keygroups.c holds the vectorised batch versions. */
#ifndef SPL_KEYGROUPS_H
#define SPL_KEYGROUPS_H

#include <stddef.h>
#include <stdint.h>

/* Kinds of key, as hashed by Java: Integer, Long, String, byte[] (Arrays.hashCode). */
enum { SPL_KEY_INT32 = 0, SPL_KEY_INT64 = 1, SPL_KEY_STR = 2, SPL_KEY_BYTES = 3 };

/* Flink's MathUtils.murmurHash(int): one murmur3 round with a fixed length of
 * 4, the murmur3 finaliser, then a non-negative result (MIN_VALUE maps to 0).
 * Unsigned arithmetic gives Java's wrap-around int semantics without UB. */
static inline int32_t spl_murmur_hash(int32_t code) {
    uint32_t h = (uint32_t)code;
    h *= 0xcc9e2d51u;
    h = (h << 15) | (h >> 17);
    h *= 0x1b873593u;
    h = (h << 13) | (h >> 19);
    h = h * 5u + 0xe6546b64u;
    h ^= 4u;
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    h ^= h >> 16;
    /* Java: code >= 0 ? code : code != MIN_VALUE ? -code : 0. Without a branch:
     * the sign of a hash is a coin toss, and a branch on it mispredicted every
     * other record, a third of the key-group pass. The absolute value in two's
     * complement, then the top bit cleared: only MIN_VALUE has it, and maps to 0. */
    uint32_t neg = 0u - (h >> 31);
    return (int32_t)(((h ^ neg) - neg) & 0x7fffffffu);
}

/* Long.hashCode(v) = (int)(v ^ (v >>> 32)). */
static inline int32_t spl_java_hash_int64(int64_t v) {
    uint64_t u = (uint64_t)v;
    return (int32_t)(uint32_t)(u ^ (u >> 32));
}

/* Arrays.hashCode(byte[]) with Java's signed bytes. */
static inline int32_t spl_java_hash_bytes(const uint8_t *s, size_t n) {
    uint32_t h = 1;
    for (size_t i = 0; i < n; i++) h = 31u * h + (uint32_t)(int32_t)(int8_t)s[i];
    return (int32_t)h;
}

/* String.hashCode() of the string that Java's UTF-8 decoder makes of s[0..n).
 * Code points above U+FFFF count as their two UTF-16 surrogates; a malformed
 * sequence counts as one U+FFFD per maximal subpart (Unicode's recommended
 * practice, as Java's decoder does), except that Java takes a well-formed
 * 3-byte encoding of a surrogate (ED A0..BF 80..BF) as a single bad unit. */
static inline int32_t spl_java_hash_utf8(const uint8_t *s, size_t n) {
    uint32_t h = 0;
    size_t i = 0;
    while (i < n) {
        /* ASCII runs are the common case: four characters per step. */
        while (i + 4 <= n) {
            uint32_t w;
            __builtin_memcpy(&w, s + i, 4);
            if (w & 0x80808080u) break;
            h = h * 923521u + (uint32_t)s[i] * 29791u + (uint32_t)s[i + 1] * 961u +
                (uint32_t)s[i + 2] * 31u + (uint32_t)s[i + 3];
            i += 4;
        }
        if (i >= n) break;
        uint32_t b0 = s[i];
        if (b0 < 0x80) {
            h = 31u * h + b0;
            i++;
            continue;
        }
        uint32_t need, cp, lo = 0x80, hi = 0xBF;
        if (b0 >= 0xC2 && b0 <= 0xDF) {
            need = 1;
            cp = b0 & 0x1F;
        } else if (b0 >= 0xE0 && b0 <= 0xEF) {
            need = 2;
            cp = b0 & 0x0F;
            if (b0 == 0xE0) lo = 0xA0; /* ED A0..BF xx decodes to a surrogate: see below */
        } else if (b0 >= 0xF0 && b0 <= 0xF4) {
            need = 3;
            cp = b0 & 0x07;
            if (b0 == 0xF0) lo = 0x90;
            else if (b0 == 0xF4) hi = 0x8F;
        } else {
            h = 31u * h + 0xFFFDu;
            i++;
            continue;
        }
        size_t j = i + 1;
        uint32_t k = 0;
        for (; k < need && j < n; k++, j++) {
            uint32_t b = s[j];
            if (b < lo || b > hi) break;
            cp = (cp << 6) | (b & 0x3F);
            lo = 0x80;
            hi = 0xBF;
        }
        if (k < need) { /* maximal subpart s[i..j) becomes one U+FFFD */
            h = 31u * h + 0xFFFDu;
            i = j;
            continue;
        }
        i = j;
        if (cp >= 0xD800 && cp <= 0xDFFF) {
            /* An encoded surrogate is one malformed unit of 3 bytes to Java's
             * decoder (where Unicode's practice, and Python, see 3 units). */
            h = 31u * h + 0xFFFDu;
        } else if (cp < 0x10000) {
            h = 31u * h + cp;
        } else {
            cp -= 0x10000;
            h = 31u * h + (0xD800u + (cp >> 10));
            h = 31u * h + (0xDC00u + (cp & 0x3FF));
        }
    }
    return (int32_t)h;
}

/* x % d for 32-bit x without a hardware division (Lemire, Kaser, Kurz 2019,
 * "Faster remainder by direct computation"); exact for every x and d >= 1. */
typedef struct {
    uint64_t m;
    uint32_t d;
} spl_mod;

static inline spl_mod spl_mod_make(uint32_t d) {
    spl_mod r;
    r.d = d;
    r.m = UINT64_MAX / d + 1;
    return r;
}

static inline uint32_t spl_mod_apply(spl_mod md, uint32_t x) {
    uint64_t low = md.m * x;
    return (uint32_t)(((__uint128_t)low * md.d) >> 64);
}

static inline int32_t spl_key_group_of_hash(int32_t hash, spl_mod md) {
    return (int32_t)spl_mod_apply(md, (uint32_t)spl_murmur_hash(hash));
}

/* Batch versions: out[i] = key group of the i-th key, for 1 <= max_p <= 32768. */
void spl_key_groups_from_hashes(const int32_t *hashes, size_t n, int32_t max_p, int32_t *out);
void spl_key_groups_int32(const int32_t *keys, size_t n, int32_t max_p, int32_t *out);
void spl_key_groups_int64(const int64_t *keys, size_t n, int32_t max_p, int32_t *out);
/* Keys i = data[offsets[i] .. offsets[i+1]) of kind SPL_KEY_STR (UTF-8) or
 * SPL_KEY_BYTES; offsets has n + 1 entries, checked by the caller. */
void spl_key_groups_packed(const uint8_t *data, const int64_t *offsets, size_t n, int kind,
                           int32_t max_p, int32_t *out);
/* Java hash codes alone, for callers that keep them (e.g. for several max parallelisms). */
void spl_java_hashes_packed(const uint8_t *data, const int64_t *offsets, size_t n, int kind,
                            int32_t *out);

#endif
