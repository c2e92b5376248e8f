/* Batch key-group assignment; the per-key functions live in keygroups.h. */
#include "keygroups.h"

void spl_key_groups_from_hashes(const int32_t *hashes, size_t n, int32_t max_p, int32_t *out) {
    spl_mod md = spl_mod_make((uint32_t)max_p);
    for (size_t i = 0; i < n; i++) out[i] = spl_key_group_of_hash(hashes[i], md);
}

void spl_key_groups_int32(const int32_t *keys, size_t n, int32_t max_p, int32_t *out) {
    spl_key_groups_from_hashes(keys, n, max_p, out); /* Integer.hashCode(v) == v */
}

void spl_key_groups_int64(const int64_t *keys, size_t n, int32_t max_p, int32_t *out) {
    spl_mod md = spl_mod_make((uint32_t)max_p);
    for (size_t i = 0; i < n; i++) out[i] = spl_key_group_of_hash(spl_java_hash_int64(keys[i]), md);
}

void spl_java_hashes_packed(const uint8_t *data, const int64_t *offsets, size_t n, int kind,
                            int32_t *out) {
    if (kind == SPL_KEY_STR) {
        for (size_t i = 0; i < n; i++)
            out[i] = spl_java_hash_utf8(data + offsets[i], (size_t)(offsets[i + 1] - offsets[i]));
    } else {
        for (size_t i = 0; i < n; i++)
            out[i] = spl_java_hash_bytes(data + offsets[i], (size_t)(offsets[i + 1] - offsets[i]));
    }
}

void spl_key_groups_packed(const uint8_t *data, const int64_t *offsets, size_t n, int kind,
                           int32_t max_p, int32_t *out) {
    spl_java_hashes_packed(data, offsets, n, kind, out);
    spl_key_groups_from_hashes(out, n, max_p, out);
}
