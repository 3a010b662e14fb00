/*
 * Bounds of what the paged attention kernels read, checked before any of it is: the block tables,
 * context lengths and row indices come from the caller, and one entry out of range would read
 * another sequence's cache (or memory past the pool) and write past the output.
 */
#pragma once
#include <stdint.h>

/* What the kernels return for inputs out of bounds (0 is success, 1 and 2 are their own). */
#define PAGED_BAD_BLOCK 3   /* a block table entry the context reads lies outside [0, num_blocks) */
#define PAGED_BAD_LENGTH 4  /* a context length negative, or longer than its block table row covers */
#define PAGED_BAD_ROW 5     /* a query row, or a block table row, outside its tensor */

/* A context of seq_len tokens read through one block table row of width entries. */
static inline int paged_check_context(const int32_t *table, int64_t width, int64_t seq_len, int block_size,
                                      int64_t num_blocks) {
    if (seq_len < 0 || seq_len > width * block_size) return PAGED_BAD_LENGTH;
    const int64_t used = (seq_len + block_size - 1) / block_size;
    int32_t lo = 0, hi = 0;
    for (int64_t b = 0; b < used; b++) {
        lo = table[b] < lo ? table[b] : lo;
        hi = table[b] > hi ? table[b] : hi;
    }
    return lo < 0 || (used > 0 && hi >= num_blocks) ? PAGED_BAD_BLOCK : 0;
}
