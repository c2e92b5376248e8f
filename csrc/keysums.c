/* Keyed sums into sorted runs (keysums.h): check key groups and hash-aggregate the
 * batch in one loop, then find each distinct key in the runs: by their hash indexes
 * where given, else (the keys sorted first) one narrowing binary search per key and run. */
#include "keysums.h"

#include <stdlib.h>

#include "debug.h"
#include "keygroups.h"

typedef struct {
    int64_t key;
    uint64_t sum; /* unsigned: int64 wrap-around without undefined behaviour */
} spl_pair;

static void pairs_insertion_sort(spl_pair *a, size_t n) {
    for (size_t i = 1; i < n; i++) {
        spl_pair x = a[i];
        size_t j = i;
        while (j > 0 && a[j - 1].key > x.key) {
            a[j] = a[j - 1];
            j--;
        }
        a[j] = x;
    }
}

static void pairs_sift_down(spl_pair *a, size_t root, size_t n) {
    for (;;) {
        size_t child = 2 * root + 1;
        if (child >= n) return;
        if (child + 1 < n && a[child + 1].key > a[child].key) child++;
        if (a[root].key >= a[child].key) return;
        spl_pair t = a[root];
        a[root] = a[child];
        a[child] = t;
        root = child;
    }
}

static void pairs_heap_sort(spl_pair *a, size_t n) {
    for (size_t i = n / 2; i-- > 0;) pairs_sift_down(a, i, n);
    for (size_t end = n; end-- > 1;) {
        spl_pair t = a[0];
        a[0] = a[end];
        a[end] = t;
        pairs_sift_down(a, 0, end);
    }
}

/* Introsort: quicksort (median of three), heapsort past a depth, insertion sort below
 * 24 entries. Keys are distinct here, so no run of equal keys slows it down. */
static void pairs_sort(spl_pair *a, size_t n, int depth) {
    while (n > 24) {
        if (depth-- == 0) {
            pairs_heap_sort(a, n);
            return;
        }
        size_t mid = n / 2;
        if (a[mid].key < a[0].key) { spl_pair t = a[mid]; a[mid] = a[0]; a[0] = t; }
        if (a[n - 1].key < a[0].key) { spl_pair t = a[n - 1]; a[n - 1] = a[0]; a[0] = t; }
        if (a[n - 1].key < a[mid].key) { spl_pair t = a[n - 1]; a[n - 1] = a[mid]; a[mid] = t; }
        int64_t pivot = a[mid].key;
        size_t i = 0, j = n - 1;
        for (;;) { /* Hoare: a[0] <= pivot <= a[n-1] bound both scans */
            while (a[i].key < pivot) i++;
            while (a[j].key > pivot) j--;
            if (i >= j) break;
            spl_pair t = a[i];
            a[i] = a[j];
            a[j] = t;
            i++;
            j--;
        }
        /* [0, j] <= pivot <= [j + 1, n): recurse into the smaller side, loop on the other. */
        size_t left = j + 1, right = n - left;
        if (left < right) {
            pairs_sort(a, left, depth);
            a += left;
            n = right;
        } else {
            pairs_sort(a + left, right, depth);
            n = left;
        }
    }
    pairs_insertion_sort(a, n);
}

/* The slot where key k's probe sequence starts in a table of 1 << bits slots. */
static inline size_t key_slot(int64_t k, unsigned bits) {
    uint64_t x = (uint64_t)k;
    x ^= x >> 32; /* keys that differ only in their high half spread too */
    return (size_t)((x * 0x9E3779B97F4A7C15ull) >> (64 - bits));
}

unsigned spl_sums_index_bits(size_t n) {
    unsigned bits = 4;
    while (((size_t)1 << bits) < n + n / 2) bits++;
    return bits;
}

void spl_sums_index(const int64_t *keys, size_t n, uint32_t *slots, unsigned bits) {
    size_t mask = ((size_t)1 << bits) - 1;
    __builtin_memset(slots, 0, ((size_t)1 << bits) * sizeof *slots);
    for (size_t i = 0; i < n; i++) {
        size_t h = key_slot(keys[i], bits);
        while (slots[h] != 0) h = (h + 1) & mask;
        slots[h] = (uint32_t)(i + 1);
    }
}

/* Position of k in an indexed run, or run->n if it is not there. A slot past the
 * run (an index built for other keys: the caller's error) is never read through. */
static inline size_t index_find(const spl_sum_run *run, int64_t k) {
    size_t mask = ((size_t)1 << run->index_bits) - 1;
    for (size_t h = key_slot(k, run->index_bits);; h = (h + 1) & mask) {
        uint32_t s = run->index[h];
        if (s == 0) return run->n;
        if (s <= run->n && run->keys[s - 1] == k) return s - 1;
    }
}

/* First index in [lo, n) whose key is >= k (n if none); lo < n. Branch-free halving. */
static inline size_t lower_bound(const int64_t *keys, size_t lo, size_t n, int64_t k) {
    size_t len = n - lo;
    const int64_t *base = keys + lo;
    while (len > 1) {
        size_t half = len / 2;
        base = base[half] < k ? base + half : base;
        len -= half;
    }
    return (size_t)(base - keys) + (*base < k);
}

int spl_sums_add(const void *keys, ptrdiff_t key_stride, const void *values,
                 ptrdiff_t value_stride, size_t n, int32_t max_p,
                 int32_t kg_lo, int32_t kg_hi, spl_sum_run *runs, size_t n_runs,
                 int ascending, int64_t *out_keys, int64_t *out_totals, size_t out_stride,
                 int64_t *out_new, size_t *n_out, size_t *n_new) {
    *n_out = 0;
    *n_new = 0;
    if (n == 0) return SPL_SUMS_OK;
    if (n > SPL_SUMS_MAX_KEYS) return SPL_SUMS_E_TOO_MANY;
    /* Open addressing at a load of at most 1/2; a slot holds 1 + the pair's index
     * (32 bits: half the table to clear per call); pairs keep first-seen order. */
    unsigned bits = 4;
    while (((size_t)1 << bits) < 2 * n) bits++;
    size_t cap = (size_t)1 << bits, mask = cap - 1;
    uint32_t *slots = calloc(cap, sizeof *slots);
    spl_pair *pairs = malloc(n * sizeof *pairs);
    if (slots == NULL || pairs == NULL) {
        free(slots);
        free(pairs);
        return SPL_SUMS_E_NOMEM;
    }
    int check = max_p > 0;
    spl_mod md = spl_mod_make(check ? (uint32_t)max_p : 1u);
    size_t m = 0;
    const uint8_t *kp = keys, *vp = values;
    for (size_t i = 0; i < n; i++, kp += key_stride) {
        int64_t k;
        __builtin_memcpy(&k, kp, sizeof k);
        if (check) {
            int32_t kg = spl_key_group_of_hash(spl_java_hash_int64(k), md);
            if (kg < kg_lo || kg > kg_hi) {
                free(slots);
                free(pairs);
                return SPL_SUMS_E_RANGE;
            }
        }
        uint64_t v = 1u;
        if (vp != NULL) {
            __builtin_memcpy(&v, vp, sizeof v);
            vp += value_stride;
        }
        size_t h = key_slot(k, bits);
        for (;;) {
            uint32_t s = slots[h];
            if (s == 0) {
                slots[h] = (uint32_t)++m;
                pairs[m - 1].key = k;
                pairs[m - 1].sum = v;
                break;
            }
            if (pairs[s - 1].key == k) {
                pairs[s - 1].sum += v;
                break;
            }
            h = (h + 1) & mask;
        }
    }
    free(slots);
    if (ascending) {
        int depth = 0;
        for (size_t x = m; x > 1; x >>= 1) depth += 2;
        pairs_sort(pairs, m, depth);
    }

    /* With the keys ascending, each run's binary search starts where the last ended. */
    size_t lo[2] = {0, 0};
    SPL_ASSERT(n_runs <= 2);
    size_t fresh = 0;
    for (size_t i = 0; i < m; i++) {
        int64_t k = pairs[i].key;
        uint64_t total = pairs[i].sum;
        int found = 0;
        for (size_t r = 0; r < n_runs && !found; r++) {
            spl_sum_run *run = &runs[r];
            size_t p;
            if (run->n == 0) continue;
            if (run->index != NULL) {
                p = index_find(run, k);
            } else {
                if (!ascending) lo[r] = 0;
                if (lo[r] >= run->n) continue;
                p = lower_bound(run->keys, lo[r], run->n, k);
                lo[r] = p;
            }
            if (p < run->n && run->keys[p] == k) {
                total += (uint64_t)run->values[p];
                run->values[p] = (int64_t)total;
                found = 1;
            }
        }
        if (!found) out_new[fresh++] = (int64_t)i;
        out_keys[i * out_stride] = k;
        out_totals[i * out_stride] = (int64_t)total;
    }
    free(pairs);
    *n_out = m;
    *n_new = fresh;
    return SPL_SUMS_OK;
}
