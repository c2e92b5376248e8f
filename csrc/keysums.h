/* Keyed sums: a batch of int64 keys (and int64 values) added into sums kept in
 * sorted runs, the heap sum state's layout. One pass in C where numpy needs a
 * sort, several searches and a call per run. No Python here. */
#ifndef SPL_KEYSUMS_H
#define SPL_KEYSUMS_H

#include <stddef.h>
#include <stdint.h>

enum { SPL_SUMS_OK = 0, SPL_SUMS_E_RANGE = -1, SPL_SUMS_E_NOMEM = -2, SPL_SUMS_E_TOO_MANY = -3 };

/* Most keys one call takes (the batch's hash table indexes them in 32 bits). */
#define SPL_SUMS_MAX_KEYS ((size_t)1 << 31)

/* One run of sums: keys sorted ascending and distinct; values[i] is keys[i]'s sum.
 * index, when not NULL, is the run's hash index (spl_sums_index): 1 << index_bits
 * slots, each 0 or 1 + the position of a key; a key is found by one probe sequence
 * instead of a binary search. */
typedef struct {
    const int64_t *keys;
    int64_t *values;
    size_t n;
    const uint32_t *index;
    unsigned index_bits;
} spl_sum_run;

/* Most keys a run's hash index takes (slots hold 1 + a position in 32 bits). */
#define SPL_SUMS_INDEX_MAX_KEYS ((size_t)UINT32_MAX - 1)

/* The bits of the hash index for n keys: 1 << bits slots, at least 1.5 n (a load of
 * at most 2/3) and at least 16. */
unsigned spl_sums_index_bits(size_t n);

/* Builds the hash index of keys[0 .. n) (distinct; n <= SPL_SUMS_INDEX_MAX_KEYS) into
 * slots[0 .. 1 << bits), bits from spl_sums_index_bits(n). */
void spl_sums_index(const int64_t *keys, size_t n, uint32_t *slots, unsigned bits);

/* Adds value i (1 for every i when values is NULL) to the sum of key i, i < n, with
 * int64 wrap-around. Key i is the int64 at keys + i * key_stride (bytes; any
 * alignment, so a field of packed records is read in place), value i likewise.
 *
 * When max_p > 0 every key's Flink key group must lie in [kg_lo, kg_hi]; otherwise
 * SPL_SUMS_E_RANGE is returned and nothing is written (the runs are untouched).
 *
 * The distinct keys go to out_keys[i * out_stride], i < *n_out: in ascending order when
 * ascending is non-zero, else in the order of their first record in the batch. A key
 * found in one of the runs (their keys are disjoint) has its batch sum added there in
 * place and its new sum written to out_totals[i * out_stride]; a key in no run gets its
 * batch sum there and its index i listed, ascending, in out_new[0 .. *n_new). With
 * out_stride 2 and out_totals = out_keys + 1 the output is (key, sum) rows: the memory
 * of a record batch of two int64 fields, written in the same pass. Every out array has
 * room for n entries (n rows). More than SPL_SUMS_MAX_KEYS keys:
 * SPL_SUMS_E_TOO_MANY, nothing written. */
int spl_sums_add(const void *keys, ptrdiff_t key_stride, const void *values,
                 ptrdiff_t value_stride, size_t n, int32_t max_p,
                 int32_t kg_lo, int32_t kg_hi, spl_sum_run *runs, size_t n_runs,
                 int ascending, int64_t *out_keys, int64_t *out_totals, size_t out_stride,
                 int64_t *out_new, size_t *n_out, size_t *n_new);

#endif
