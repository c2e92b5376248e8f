/* The GeneratorSource's batch in one pass (generate.h). */
#include "generate.h"

void spl_gen_fill(uint8_t *out, const spl_gen_layout *layout, const int64_t *parts,
                  const int64_t *starts, const int64_t *counts, size_t m, uint64_t seed_mix,
                  uint64_t keys, const uint8_t *pattern) {
    const spl_gen_layout L = *layout;
    uint8_t *rec = out;
    for (size_t b = 0; b < m; b++) {
        int64_t p = parts[b];
        int32_t p32 = (int32_t)p;
        uint64_t base = (uint64_t)p * 0x9E3779B97F4A7C15ull + seed_mix;
        int64_t s = starts[b];
        unsigned letter = (unsigned)(((uint64_t)s) % 26u);
        for (int64_t j = 0; j < counts[b]; j++, s++, rec += L.itemsize) {
            __builtin_memcpy(rec + L.partition, &p32, sizeof p32);
            __builtin_memcpy(rec + L.seq, &s, sizeof s);
            if (keys) {
                int64_t k = (int64_t)(spl_splitmix64((uint64_t)s + base) % keys);
                __builtin_memcpy(rec + L.key, &k, sizeof k);
            }
            __builtin_memcpy(rec + L.payload, pattern + letter, L.payload_len);
            letter = letter == 25 ? 0 : letter + 1;
        }
    }
}
