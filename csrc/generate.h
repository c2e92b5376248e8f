/* Generated records: the GeneratorSource's batch filled in one pass. Keys and payloads
 * are pure functions of (partition, seq, seed), the same ones the source documents and
 * computes in numpy for the cases this does not cover. No Python here. */
#ifndef SPL_GENERATE_H
#define SPL_GENERATE_H

#include <stddef.h>
#include <stdint.h>

/* Where the fields of one record lie (byte offsets into a record of itemsize bytes). */
typedef struct {
    size_t itemsize;
    size_t partition; /* int32 */
    size_t seq;       /* int64 */
    size_t key;       /* int64 */
    size_t payload;   /* payload_len bytes */
    size_t payload_len;
} spl_gen_layout;

/* splitmix64's finalizer of z + the golden ratio (wrapping). */
static inline uint64_t spl_splitmix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Writes the records of m blocks into out, block after block: block b holds counts[b]
 * records of partition parts[b] with seq starts[b], starts[b] + 1, ... Each record gets
 * its partition (as int32), its seq, the payload pattern[seq % 26 ..][0 .. payload_len)
 * (pattern: the letters 'A'..'Z' repeated, 26 + payload_len bytes) and, when keys > 0,
 * the key splitmix64(seq + partition * 0x9E3779B97F4A7C15 + seed_mix) % keys (uint64
 * arithmetic). Fields are written unaligned; other bytes of a record are not touched. */
void spl_gen_fill(uint8_t *out, const spl_gen_layout *layout, const int64_t *parts,
                  const int64_t *starts, const int64_t *counts, size_t m, uint64_t seed_mix,
                  uint64_t keys, const uint8_t *pattern);

#endif
