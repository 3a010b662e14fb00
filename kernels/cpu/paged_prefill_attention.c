/*
 * Paged causal attention for prompt chunks on the CPU: each chunk's queries attend over the
 * sequence's context (the tokens cached before the chunk, then the chunk's own, which the caller
 * stored first), read in place from the paged KV cache with a blocked online softmax in the manner
 * of FlashAttention (Dao et al., 2022).
 *
 * Layout (see engine/attention/__init__.py): k_cache, v_cache (num_blocks, block_size,
 * num_kv_heads, head_dim); block_tables (num_seqs, bt_stride) int32. q is (num_rows, num_heads,
 * head_dim) with rows q_stride elements apart (a view into the fused q|k|v projection); out is the
 * same shape, contiguous. Chunk c is sequence chunk_seq[c]: its q_len[c] query rows start at row
 * q_start[c], and its context is seq_len[c] tokens, the last q_len[c] of them the chunk's own; query
 * j (absolute position seq_len - q_len + j) sees keys 0 .. seq_len - q_len + j. Every tensor has
 * one element type, float32 or bfloat16; scores, softmax and accumulation are float32.
 *
 * A work item is a tile of a chunk's query tokens for one KV head; its rows are every (token, query
 * head) of the GQA group, up to 48 of them, so each key and value row loaded serves the whole group.
 * The tile is held transposed (head_dim x rows), and so are its scores (keys x rows) and its output
 * (head_dim x rows): every vector runs across query rows, so a key row is used straight from the
 * cache as broadcasts, the softmax's maxima and sums are plain vector operations with no horizontal
 * reductions, and the causal mask is one compare of the rows' positions per key. Items are spread
 * over the threads of the OpenMP runtime the process already runs (torch's).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "online_softmax.h"
#include "paged_bounds.h"
#include "vec_exp.h"

#define VL 16       /* floats per vector */
#define MAX_RV 3    /* row vectors per tile: up to 48 query rows */
#define KB 64       /* keys per softmax block */
#define KG 8        /* keys per scores micro-tile; also head_dim elements per output micro-tile */
#define MAX_HEAD_DIM 256

/* Query tokens per tile: as many as fill 48 rows (tokens times the GQA group). */
static inline int tile_tokens(int group) { return MAX_RV * VL / group; }

/* Rows of n keys (or values) from position k0: pointers into the cache where it holds float32,
 * else rows widened into buf (n x head_dim). The block size is a power of two, 1 << block_shift. */
static inline void key_rows(const void *cache, int is_bf16, const int32_t *table, int k0, int n, int block_shift,
                            int64_t token_stride, int64_t head_off, int head_dim, const float **rows, float *buf) {
    const int mask = (1 << block_shift) - 1;
    for (int j = 0; j < n; j++) {
        int t = k0 + j;
        int64_t off = (((int64_t)table[t >> block_shift] << block_shift) + (t & mask)) * token_stride + head_off;
        if (is_bf16) {
            bf16_row_to_float((const uint16_t *)cache + off, buf + (int64_t)j * head_dim, head_dim);
            rows[j] = buf + (int64_t)j * head_dim;
        } else {
            rows[j] = (const float *)cache + off;
        }
    }
}

#ifdef __AVX512F__

/* st (n x RV vectors, rows ldr floats apart) = keys' rows times qt (head_dim x RV vectors). */
static inline __attribute__((always_inline)) void scores_block(const float *qt, int ldr, const float *const *keys,
                                                               int n, int head_dim, float *st, const int RV) {
    for (int j0 = 0; j0 < n; j0 += KG) {
        const float *k[KG];
        for (int i = 0; i < KG; i++) k[i] = keys[j0 + i < n ? j0 + i : n - 1];
        __m512 acc[KG][MAX_RV];
#pragma GCC unroll 8
        for (int i = 0; i < KG; i++)
#pragma GCC unroll 3
            for (int v = 0; v < RV; v++) acc[i][v] = _mm512_setzero_ps();
        for (int d = 0; d < head_dim; d++) {
            __m512 q[MAX_RV];
#pragma GCC unroll 3
            for (int v = 0; v < RV; v++) q[v] = _mm512_loadu_ps(qt + (int64_t)d * ldr + v * VL);
#pragma GCC unroll 8
            for (int i = 0; i < KG; i++) {
                __m512 b = _mm512_set1_ps(k[i][d]);
#pragma GCC unroll 3
                for (int v = 0; v < RV; v++) acc[i][v] = _mm512_fmadd_ps(b, q[v], acc[i][v]);
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < KG; i++)
            if (j0 + i < n)
#pragma GCC unroll 3
                for (int v = 0; v < RV; v++) _mm512_storeu_ps(st + (int64_t)(j0 + i) * ldr + v * VL, acc[i][v]);
    }
}

/* ot (head_dim x RV vectors) += values' rows (n of them)^T times pt (n x RV vectors). */
static inline __attribute__((always_inline)) void accumulate_block(float *ot, int ldr, const float *const *values,
                                                                   int n, int head_dim, const float *pt,
                                                                   const int RV) {
    for (int d0 = 0; d0 < head_dim; d0 += KG) {
        __m512 acc[KG][MAX_RV];
#pragma GCC unroll 8
        for (int i = 0; i < KG; i++)
#pragma GCC unroll 3
            for (int v = 0; v < RV; v++) acc[i][v] = _mm512_loadu_ps(ot + (int64_t)(d0 + i) * ldr + v * VL);
        for (int j = 0; j < n; j++) {
            const float *vr = values[j] + d0;
            __m512 p[MAX_RV];
#pragma GCC unroll 3
            for (int v = 0; v < RV; v++) p[v] = _mm512_loadu_ps(pt + (int64_t)j * ldr + v * VL);
#pragma GCC unroll 8
            for (int i = 0; i < KG; i++) {
                __m512 b = _mm512_set1_ps(vr[i]);
#pragma GCC unroll 3
                for (int v = 0; v < RV; v++) acc[i][v] = _mm512_fmadd_ps(b, p[v], acc[i][v]);
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < KG; i++)
#pragma GCC unroll 3
            for (int v = 0; v < RV; v++) _mm512_storeu_ps(ot + (int64_t)(d0 + i) * ldr + v * VL, acc[i][v]);
    }
}

/* One block of n keys from k0, after its scores: the causal mask where `masked` (row r sees key j
 * when pos[r] >= j), then the online softmax (online_softmax.h) of 16 rows at a time: the running
 * max m and sum l move, st holds the numerators, and ot is rescaled where the max moved. */
static inline __attribute__((always_inline)) void softmax_block(float *st, int ldr, int n, int k0, int masked,
                                                                const int32_t *pos, float *m, float *l, float *ot,
                                                                int head_dim, const int RV) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512i posv[MAX_RV];
    __m512 mx[MAX_RV], mo[MAX_RV];
#pragma GCC unroll 3
    for (int v = 0; v < RV; v++) {
        posv[v] = _mm512_loadu_si512(pos + v * VL);
        mo[v] = mx[v] = _mm512_loadu_ps(m + v * VL);
    }
    for (int j = 0; j < n; j++) {
        float *row = st + (int64_t)j * ldr;
#pragma GCC unroll 3
        for (int v = 0; v < RV; v++) {
            __m512 s = _mm512_loadu_ps(row + v * VL);
            if (masked) {
                __mmask16 seen = _mm512_cmp_epi32_mask(posv[v], _mm512_set1_epi32(k0 + j), _MM_CMPINT_NLT);
                s = _mm512_mask_mov_ps(ninf, seen, s);
                _mm512_storeu_ps(row + v * VL, s);
            }
            mx[v] = _mm512_max_ps(mx[v], s);
        }
    }
    __m512 sum[MAX_RV];
    int moved = 0;
#pragma GCC unroll 3
    for (int v = 0; v < RV; v++) {
        sum[v] = _mm512_setzero_ps();
        moved |= _mm512_cmp_ps_mask(mx[v], mo[v], _CMP_NEQ_OQ) != 0;
    }
    for (int j = 0; j < n; j++) {
        float *row = st + (int64_t)j * ldr;
#pragma GCC unroll 3
        for (int v = 0; v < RV; v++) {
            __m512 e = online_softmax_numerators_avx512(_mm512_loadu_ps(row + v * VL), mx[v]);
            _mm512_storeu_ps(row + v * VL, e);
            sum[v] = _mm512_add_ps(sum[v], e);
        }
    }
    if (moved) {
        __m512 alpha[MAX_RV];
#pragma GCC unroll 3
        for (int v = 0; v < RV; v++) {
            alpha[v] = online_softmax_alpha_avx512(mo[v], mx[v]);
        }
        for (int d = 0; d < head_dim; d++)
#pragma GCC unroll 3
            for (int v = 0; v < RV; v++) {
                float *o = ot + (int64_t)d * ldr + v * VL;
                _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), alpha[v]));
            }
#pragma GCC unroll 3
        for (int v = 0; v < RV; v++)
            _mm512_storeu_ps(l + v * VL, _mm512_fmadd_ps(_mm512_loadu_ps(l + v * VL), alpha[v], sum[v]));
    } else {
#pragma GCC unroll 3
        for (int v = 0; v < RV; v++) _mm512_storeu_ps(l + v * VL, _mm512_add_ps(_mm512_loadu_ps(l + v * VL), sum[v]));
    }
#pragma GCC unroll 3
    for (int v = 0; v < RV; v++) _mm512_storeu_ps(m + v * VL, mx[v]);
}

#else /* the same arithmetic, one row at a time, for CPUs without AVX-512 */

/* Here the tile is row-major (qt and ot: a row's head_dim floats together), and the last argument
 * is its rows, padding left out (its results are never read back): dot products and row updates
 * along head_dim, which the compiler vectorizes (AVX2), with no reduction carried through memory. */
static inline void scores_block(const float *qt, int ldr, const float *const *keys, int n, int head_dim, float *st,
                                const int rows) {
    for (int j = 0; j < n; j++) {
        const float *kj = keys[j];
        for (int r = 0; r < rows; r++) {
            const float *q = qt + (int64_t)r * head_dim;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int d = 0; d < head_dim; d++) acc += kj[d] * q[d];
            st[(int64_t)j * ldr + r] = acc;
        }
    }
}

static inline void accumulate_block(float *ot, int ldr, const float *const *values, int n, int head_dim,
                                    const float *pt, const int rows) {
    for (int r = 0; r < rows; r++) {
        float *o = ot + (int64_t)r * head_dim;
        for (int j = 0; j < n; j++) {
            const float p = pt[(int64_t)j * ldr + r];
            const float *vj = values[j];
#pragma omp simd
            for (int d = 0; d < head_dim; d++) o[d] += p * vj[d];
        }
    }
}

static inline void softmax_block(float *st, int ldr, int n, int k0, int masked, const int32_t *pos, float *m,
                                 float *l, float *ot, int head_dim, const int rows) {
    for (int r = 0; r < rows; r++) {
        if (masked)
            for (int j = 0; j < n; j++)
                if (pos[r] < k0 + j) st[(int64_t)j * ldr + r] = -INFINITY;
        const float alpha = online_softmax_step(st + r, ldr, n, &m[r], &l[r]);
        if (alpha != 1.0f)
            for (int d = 0; d < head_dim; d++) ot[(int64_t)r * head_dim + d] *= alpha;
    }
}

#endif

/* Scratch floats per thread: the transposed tile, output and scores, the softmax state, and up to
 * KB widened key and value rows for a bfloat16 cache. */
static inline size_t scratch_floats(int head_dim) {
    const size_t ldr = MAX_RV * VL;
    return 2 * (size_t)head_dim * ldr + (size_t)KB * ldr + 3 * ldr + 2 * (size_t)KB * head_dim;
}

/* One tile of a chunk's query tokens [t0, t1) for one KV head. */
static inline __attribute__((always_inline)) void attend_tile(
    const void *q, int64_t q_stride, const void *k_cache, const void *v_cache, int is_bf16, const int32_t *table,
    int64_t q_start, int q_len, int seq_len, int t0, int t1, int kv_head, int num_heads, int num_kv_heads, int group,
    int head_dim, int block_size, float scale, void *out, float *scratch, const int RV) {
    const int ldr = MAX_RV * VL, rows = (t1 - t0) * group;
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim, head_off = (int64_t)kv_head * head_dim;
    float *qt = scratch, *ot = qt + (size_t)head_dim * ldr, *st = ot + (size_t)head_dim * ldr;
    float *m = st + (size_t)KB * ldr, *l = m + ldr;
    int32_t *pos = (int32_t *)(l + ldr); /* each row's own position: its last key */
    float *kbuf = l + 2 * ldr, *vbuf = kbuf + (size_t)KB * head_dim;
    const int offset = seq_len - q_len; /* context tokens before the chunk */
#ifdef __AVX512F__
#define TILE_AT(d, r) ((int64_t)(d) * ldr + (r)) /* head_dim x rows: a vector of rows per element */
#else
#define TILE_AT(d, r) ((int64_t)(r) * head_dim + (d)) /* rows x head_dim */
#endif
    const int block_shift = __builtin_ctz((unsigned)block_size);
    float qrow[MAX_HEAD_DIM];
    for (int r = 0; r < RV * VL; r++) {
        if (r < rows) {
            int t = t0 + r / group;
            int64_t in = (q_start + t) * q_stride + (int64_t)(kv_head * group + r % group) * head_dim;
            if (is_bf16)
                bf16_row_to_float((const uint16_t *)q + in, qrow, head_dim);
            else
                memcpy(qrow, (const float *)q + in, (size_t)head_dim * sizeof(float));
            for (int d = 0; d < head_dim; d++) qt[TILE_AT(d, r)] = qrow[d] * scale;
            pos[r] = offset + t;
        } else { /* padding rows: zero queries that see every key, never read back */
            for (int d = 0; d < head_dim; d++) qt[TILE_AT(d, r)] = 0.0f;
            pos[r] = INT32_MAX;
        }
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
#ifdef __AVX512F__
    for (int d = 0; d < head_dim; d++) memset(ot + (int64_t)d * ldr, 0, (size_t)RV * VL * sizeof(float));
#else
    memset(ot, 0, (size_t)rows * head_dim * sizeof(float));
#endif
    /* Keys 0 .. offset + t1 - 1 are seen by some row; those up to offset + t0 by every row. */
    const int end = offset + t1, unmasked = offset + t0 + 1;
    const float *keys[KB], *values[KB];
#ifdef __AVX512F__
    const int width = RV; /* whole vectors of rows */
#else
    const int width = rows;
#endif
    for (int k0 = 0; k0 < end; k0 += KB) {
        int n = end - k0 < KB ? end - k0 : KB;
        key_rows(k_cache, is_bf16, table, k0, n, block_shift, token_stride, head_off, head_dim, keys, kbuf);
        scores_block(qt, ldr, keys, n, head_dim, st, width);
        softmax_block(st, ldr, n, k0, k0 + n > unmasked, pos, m, l, ot, head_dim, width);
        key_rows(v_cache, is_bf16, table, k0, n, block_shift, token_stride, head_off, head_dim, values, vbuf);
        accumulate_block(ot, ldr, values, n, head_dim, st, width);
    }
    for (int r = 0; r < rows; r++) {
        float inv = 1.0f / l[r];
        for (int d = 0; d < head_dim; d++) qrow[d] = ot[TILE_AT(d, r)] * inv;
        int64_t dst = ((q_start + t0 + r / group) * num_heads + (int64_t)(kv_head * group + r % group)) * head_dim;
        if (is_bf16)
            float_row_to_bf16(qrow, (uint16_t *)out + dst, head_dim);
        else
            memcpy((float *)out + dst, qrow, (size_t)head_dim * sizeof(float));
    }
}

#undef TILE_AT

static void attend_tile_rv(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache, int is_bf16,
                           const int32_t *table, int64_t q_start, int q_len, int seq_len, int t0, int t1, int kv_head,
                           int num_heads, int num_kv_heads, int group, int head_dim, int block_size, float scale,
                           void *out, float *scratch) {
    int rv = ((t1 - t0) * group + VL - 1) / VL;
#define TILE(RV_)                                                                                                   \
    attend_tile(q, q_stride, k_cache, v_cache, is_bf16, table, q_start, q_len, seq_len, t0, t1, kv_head, num_heads, \
                num_kv_heads, group, head_dim, block_size, scale, out, scratch, RV_)
    if (rv == 1)
        TILE(1);
    else if (rv == 2)
        TILE(2);
    else
        TILE(3);
#undef TILE
}

/* Returns 0 on success, 1 when a size is beyond this kernel's limits, 2 when out of memory, and
 * PAGED_BAD_* (paged_bounds.h) when an input would send it out of bounds; nothing is read or
 * written then. The caches hold num_blocks blocks, q and out num_rows rows, and the block tables
 * bt_rows rows of bt_width entries. */
int paged_prefill_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache, int is_bf16,
                            int64_t num_blocks, const int32_t *block_tables, int64_t bt_stride, int64_t bt_rows,
                            int64_t bt_width, const int32_t *chunk_seq, const int64_t *q_start, const int32_t *q_len,
                            const int32_t *seq_len, int64_t num_rows, int num_chunks, int num_heads,
                            int num_kv_heads, int head_dim, int block_size, float scale, void *out, int num_threads) {
    if (num_kv_heads < 1 || num_heads % num_kv_heads != 0 || head_dim < 1 || head_dim > MAX_HEAD_DIM ||
        head_dim % KG != 0 || block_size < 1 || (block_size & (block_size - 1)) != 0)
        return 1;
    const int group = num_heads / num_kv_heads;
    if (group > MAX_RV * VL) return 1;
    const int tokens = tile_tokens(group);
    for (int c = 0; c < num_chunks; c++)
        if (q_len[c] < 1 || q_len[c] > seq_len[c]) return 1;
    for (int c = 0; c < num_chunks; c++) {
        if (chunk_seq[c] < 0 || chunk_seq[c] >= bt_rows) return PAGED_BAD_ROW;
        if (q_start[c] < 0 || q_start[c] > num_rows - q_len[c]) return PAGED_BAD_ROW;
        const int bad =
            paged_check_context(block_tables + (int64_t)chunk_seq[c] * bt_stride, bt_width, seq_len[c], block_size,
                                num_blocks);
        if (bad) return bad;
    }
    /* Where each chunk's tiles start in the list of work items. */
    int64_t *first_item = (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_chunks + 1));
    if (first_item == NULL) return 2;
    first_item[0] = 0;
    for (int c = 0; c < num_chunks; c++)
        first_item[c + 1] = first_item[c] + (int64_t)num_kv_heads * ((q_len[c] + tokens - 1) / tokens);
    const int64_t num_items = first_item[num_chunks];
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scratch = (float *)aligned_alloc(64, (scratch_floats(head_dim) * sizeof(float) + 63) / 64 * 64);
        int c = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; item++) {
            if (scratch == NULL) {
                failed = 2;
                continue;
            }
            while (first_item[c + 1] <= item) c++;
            while (first_item[c] > item) c--;
            int64_t local = item - first_item[c];
            int tiles = (q_len[c] + tokens - 1) / tokens;
            /* A chunk's last tiles, which see the most keys, first: they set the critical path. */
            int tile = tiles - 1 - (int)(local / num_kv_heads), h = (int)(local % num_kv_heads);
            int t0 = tile * tokens, t1 = t0 + tokens < q_len[c] ? t0 + tokens : q_len[c];
            attend_tile_rv(q, q_stride, k_cache, v_cache, is_bf16, block_tables + (int64_t)chunk_seq[c] * bt_stride,
                           q_start[c], q_len[c], seq_len[c], t0, t1, h, num_heads, num_kv_heads, group, head_dim,
                           block_size, scale, out, scratch);
        }
        free(scratch);
    }
    free(first_item);
    return failed;
}
