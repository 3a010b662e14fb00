/*
 * Paged decode attention for the CPU: one query token per sequence attends over its context, read
 * in place from the paged KV cache (no gather into a padded batch), after vLLM's CPU paged
 * attention and PagedAttention (Kwon et al., SOSP 2023).
 *
 * Layout (see engine/attention/__init__.py): k_cache, v_cache (num_blocks, block_size,
 * num_kv_heads, head_dim); block_tables (num_seqs, bt_stride) int32; seq_lens (num_seqs) int32.
 * q is (num_rows, num_heads, head_dim) with rows q_stride elements apart (a view into the fused
 * q|k|v projection), out the same shape, contiguous; sequence i reads and writes row rows[i]
 * (rows == NULL: row i). Every tensor has one element type: float32 or bfloat16; scores,
 * softmax and accumulation are float32. Sequence i attends to its keys from starts[i] on (starts ==
 * NULL: from 0), a sliding window's first key, and with softcap > 0 its scores are soft-capped,
 * softcap * tanh(score / softcap) (Gemma 2 and 3).
 *
 * One work item is a sequence: its blocks are read front to back with every KV head of a token at
 * once, and the GQA group's query heads share each K and V row as it is loaded. Items are spread
 * over the threads of the OpenMP runtime the process already runs (torch's), so it uses the
 * threads torch was given.
 *
 * With AVX-512 and head sizes 64 and 128 (attend_seq_avx512) the scores of 16 tokens are summed
 * together in one transpose-add tree instead of one horizontal reduction per score, each KV head's
 * values are accumulated in registers, and rows are prefetched into L2 well ahead. On SmolLM2's
 * decode steps (2-core EPYC) that read the cache at 22 GB/s where the portable loop read 16.5.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "online_softmax.h"
#include "paged_bounds.h"
#include "vec_exp.h"


/* One sequence, every head: each block's K (then V) rows are read front to back, all KV heads of a
 * token at once (num_kv_heads * head_dim contiguous elements), so the hardware prefetcher streams
 * whole blocks. Scores live in scores[head * seq_len + t]; acc holds num_heads * head_dim floats;
 * rowbuf holds one token's num_kv_heads * head_dim floats (for bfloat16 caches). */
/* The reciprocal of the softmax denominator of a row of n scores, which become its numerators
 * (the whole context taken as one block of the online softmax). */
static inline float softmax_numerators_inv(float *x, int n) {
    float m = -INFINITY, l = 0.0f;
    online_softmax_step(x, 1, n, &m, &l);
    return 1.0f / l;
}

/* Gemma's soft cap on a head's scores, before the softmax. */
static inline void soft_cap(float *x, int n, float cap) {
    const float inv = 1.0f / cap;
    for (int t = 0; t < n; t++) x[t] = cap * tanhf(x[t] * inv);
}

static inline __attribute__((always_inline)) void attend_seq(
    const void *q, int64_t q_stride, const void *k_cache, const void *v_cache, int is_bf16, const int32_t *table,
    int seq_len, int start, float softcap, int64_t row, int num_heads, int num_kv_heads, int head_dim, int block_size,
    float scale, void *out, float *scores, float *acc, float *qf, float *rowbuf) {
    const int group = num_heads / num_kv_heads;
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    const int num_blocks = (seq_len + block_size - 1) / block_size;
    const int64_t q_off = row * num_heads * head_dim, q_in = row * q_stride;
    const int64_t elem = is_bf16 ? 2 : 4;
    const int64_t row_bytes = token_stride * elem;
    if (is_bf16)
        bf16_row_to_float((const uint16_t *)q + q_in, qf, (int64_t)num_heads * head_dim);
    else
        memcpy(qf, (const float *)q + q_in, (size_t)num_heads * head_dim * sizeof(float));
    for (int i = 0; i < num_heads * head_dim; i++) {
        qf[i] *= scale;
        acc[i] = 0.0f;
    }
    for (int b = start / block_size; b < num_blocks; b++) {
        int t0 = b * block_size;
        int n = seq_len - t0 < block_size ? seq_len - t0 : block_size;
        int j0 = start > t0 ? start - t0 : 0;  /* keys before the window's first are skipped */
        int64_t first = (int64_t)table[b] * block_size * token_stride;
        /* The next block lies anywhere in the pool: its rows are asked for one per row of this
         * block, so the loads are in flight while this one is computed. */
        const char *next = b + 1 < num_blocks
            ? (const char *)k_cache + (int64_t)table[b + 1] * block_size * token_stride * elem
            : NULL;
        for (int j = j0; j < n; j++) {
            if (next)
                for (int64_t off = 0; off < row_bytes; off += 64)
                    __builtin_prefetch(next + (int64_t)j * row_bytes + off, 0, 3);
            const float *kr;
            if (is_bf16) {
                bf16_row_to_float((const uint16_t *)k_cache + first + (int64_t)j * token_stride, rowbuf, token_stride);
                kr = rowbuf;
            } else {
                kr = (const float *)k_cache + first + (int64_t)j * token_stride;
            }
            for (int h = 0; h < num_heads; h++) {
                const float *kh = kr + (int64_t)(h / group) * head_dim;
                const float *qh = qf + (int64_t)h * head_dim;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int d = 0; d < head_dim; d++) s += qh[d] * kh[d];
                scores[(int64_t)h * seq_len + t0 + j] = s;
            }
        }
    }
    for (int h = 0; h < num_heads; h++) {
        float *sh = scores + (int64_t)h * seq_len;
        if (softcap > 0.0f) soft_cap(sh + start, seq_len - start, softcap);
        float inv = softmax_numerators_inv(sh + start, seq_len - start);
#pragma omp simd
        for (int t = start; t < seq_len; t++) sh[t] *= inv;
    }
    for (int b = start / block_size; b < num_blocks; b++) {
        int t0 = b * block_size;
        int n = seq_len - t0 < block_size ? seq_len - t0 : block_size;
        int j0 = start > t0 ? start - t0 : 0;  /* keys before the window's first are skipped */
        int64_t first = (int64_t)table[b] * block_size * token_stride;
        /* The next block lies anywhere in the pool: its rows are asked for one per row of this
         * block, so the loads are in flight while this one is computed. */
        const char *next = b + 1 < num_blocks
            ? (const char *)v_cache + (int64_t)table[b + 1] * block_size * token_stride * elem
            : NULL;
        for (int j = j0; j < n; j++) {
            if (next)
                for (int64_t off = 0; off < row_bytes; off += 64)
                    __builtin_prefetch(next + (int64_t)j * row_bytes + off, 0, 3);
            const float *vr;
            if (is_bf16) {
                bf16_row_to_float((const uint16_t *)v_cache + first + (int64_t)j * token_stride, rowbuf, token_stride);
                vr = rowbuf;
            } else {
                vr = (const float *)v_cache + first + (int64_t)j * token_stride;
            }
            for (int h = 0; h < num_heads; h++) {
                const float *vh = vr + (int64_t)(h / group) * head_dim;
                float *ah = acc + (int64_t)h * head_dim;
                float p = scores[(int64_t)h * seq_len + t0 + j];
#pragma omp simd
                for (int d = 0; d < head_dim; d++) ah[d] += p * vh[d];
            }
        }
    }
    if (is_bf16) {
        float_row_to_bf16(acc, (uint16_t *)out + q_off, (int64_t)num_heads * head_dim);
    } else {
        memcpy((float *)out + q_off, acc, (size_t)num_heads * head_dim * sizeof(float));
    }
}

#ifdef __AVX512F__
/* 16 vectors in, one out: lane i holds the sum of v[i]'s lanes (a transpose folded into the adds,
 * 45 shuffles and adds for 16 sums where 16 separate reductions take about 128). */
static inline __m512 sum16x16(const __m512 *v) {
    __m512 s[8], t[4], u[2];
    for (int i = 0; i < 8; i++)
        s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        t[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* The cache slot of a sequence's token t: its block's place in the pool, then its row there. */
static inline int64_t token_slot(const int32_t *table, int t, int block_size) {
    return (int64_t)table[t / block_size] * block_size + t % block_size;
}

static inline __m512 load16(const void *base, int64_t i, int is_bf16) {
    if (is_bf16) return bf16x16_load((const uint16_t *)base + i, (__mmask16)0xffff);
    return _mm512_loadu_ps((const float *)base + i);
}

/* How far ahead the rows are asked for, into L2 (an L1 prefetch holds one of L1's few miss
 * buffers until the line arrives): on a 2-core EPYC VM 48 tokens ahead read 1.4-1.5x faster than
 * 16 ahead into L1, once the context no longer fits in the caches. */
#define PREFETCH_TOKENS 48

/* Heads of one GQA group whose V accumulators stay in registers at once (NC vectors each). */
#define GROUP_CHUNK(NC) ((NC) <= 4 ? 4 : 2)

/* attend_seq for head_dim = 16 * NC on AVX-512. The dot products' lanes are summed in a tree, and
 * each head's values are divided by the softmax denominator once, at the end.
 * - Scores: tiles of 16 tokens. Each token's K row (every KV head) is loaded once; each query head
 *   leaves one vector of partial products per token, and a tile's 16 vectors fold into 16 scores.
 * - Values: one KV head at a time, its group's accumulators in registers through the whole context.
 * Scratch: scores (num_heads * seq_len), partial (num_heads * 16 vectors), qf (num_heads * head_dim). */
static inline __attribute__((always_inline)) void attend_seq_avx512(
    const int NC, const void *q, int64_t q_stride, const void *k_cache, const void *v_cache, int is_bf16,
    const int32_t *table, int seq_len, int start, float softcap, int64_t row, int num_heads, int num_kv_heads,
    int block_size, float scale, void *out, float *scores, __m512 *partial, float *qf) {
    const int head_dim = 16 * NC;
    const int group = num_heads / num_kv_heads;
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    const int64_t q_in = row * q_stride, q_off = row * (int64_t)num_heads * head_dim;
    const int64_t elem = is_bf16 ? 2 : 4;
    const int64_t row_bytes = token_stride * elem;
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int i = 0; i < num_heads * NC; i++) _mm512_storeu_ps(qf + 16 * i, _mm512_mul_ps(load16(q, q_in + 16 * i, is_bf16), vscale));

    for (int t0 = start; t0 < seq_len; t0 += 16) {
        const int n = seq_len - t0 < 16 ? seq_len - t0 : 16;
        for (int j = 0; j < n; j++) {
            const int t = t0 + j;
            const int64_t first = token_slot(table, t, block_size) * token_stride;
            /* The row PREFETCH_TOKENS on, wherever its block lies, is asked for now. */
            if (t + PREFETCH_TOKENS < seq_len) {
                const char *ahead = (const char *)k_cache + token_slot(table, t + PREFETCH_TOKENS, block_size) * row_bytes;
                for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(ahead + off, 0, 2);
            }
            for (int kh = 0; kh < num_kv_heads; kh++) {
                __m512 k[8];
                for (int c = 0; c < NC; c++) k[c] = load16(k_cache, first + (int64_t)kh * head_dim + 16 * c, is_bf16);
                for (int g = 0; g < group; g++) {
                    const int h = kh * group + g;
                    const float *qh = qf + (int64_t)h * head_dim;
                    __m512 p = _mm512_mul_ps(_mm512_loadu_ps(qh), k[0]);
                    for (int c = 1; c < NC; c++) p = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), k[c], p);
                    partial[h * 16 + j] = p;
                }
            }
        }
        for (int h = 0; h < num_heads; h++) {
            for (int j = n; j < 16; j++) partial[h * 16 + j] = _mm512_setzero_ps();
            _mm512_mask_storeu_ps(scores + (int64_t)h * seq_len + t0, tail_mask(n), sum16x16(partial + h * 16));
        }
    }

    float inv[512]; /* the caller keeps num_heads <= 512 */
    for (int h = 0; h < num_heads; h++) {
        if (softcap > 0.0f) soft_cap(scores + (int64_t)h * seq_len + start, seq_len - start, softcap);
        inv[h] = softmax_numerators_inv(scores + (int64_t)h * seq_len + start, seq_len - start);
    }

    const int GC = GROUP_CHUNK(NC);
    for (int kh = 0; kh < num_kv_heads; kh++) {
        for (int g0 = 0; g0 < group; g0 += GC) {
            const int gc = group - g0 < GC ? group - g0 : GC;
            const int h0 = kh * group + g0;
            __m512 acc[4][8];
            for (int g = 0; g < GC; g++)
                for (int c = 0; c < NC; c++) acc[g][c] = _mm512_setzero_ps();
            for (int t = start; t < seq_len; t++) {
                const int64_t first = token_slot(table, t, block_size) * token_stride;
                if (t + PREFETCH_TOKENS < seq_len) {
                    const char *ahead =
                        (const char *)v_cache +
                        (token_slot(table, t + PREFETCH_TOKENS, block_size) * token_stride + (int64_t)kh * head_dim) * elem;
                    for (int64_t off = 0; off < head_dim * elem; off += 64) __builtin_prefetch(ahead + off, 0, 2);
                }
                __m512 v[8];
                for (int c = 0; c < NC; c++) v[c] = load16(v_cache, first + (int64_t)kh * head_dim + 16 * c, is_bf16);
                for (int g = 0; g < GC; g++) {
                    if (g >= gc) break;
                    const __m512 p = _mm512_set1_ps(scores[(int64_t)(h0 + g) * seq_len + t]);
                    for (int c = 0; c < NC; c++) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
                }
            }
            for (int g = 0; g < gc; g++) {
                const __m512 s = _mm512_set1_ps(inv[h0 + g]);
                for (int c = 0; c < NC; c++) {
                    const int64_t o = q_off + (int64_t)(h0 + g) * head_dim + 16 * c;
                    const __m512 r = _mm512_mul_ps(acc[g][c], s);
                    if (is_bf16)
                        bf16x16_store((uint16_t *)out + o, r, (__mmask16)0xffff);
                    else
                        _mm512_storeu_ps((float *)out + o, r);
                }
            }
        }
    }
}
#endif

/* Per thread scratch of attend_one, in floats: the AVX-512 path's partial products (num_heads tiles
 * of 16 vectors, first, so they are 64-byte aligned), then scores, accumulators, the scaled query
 * and a row buffer. */
static inline size_t attend_scratch_floats(int num_heads, int num_kv_heads, int head_dim, int max_len) {
    const size_t per_head = (size_t)num_heads * head_dim;
    return (size_t)num_heads * 16 * 16 + (size_t)num_heads * max_len + 2 * per_head + (size_t)num_kv_heads * head_dim;
}

/* One sequence's attention, every head, into its row of out: the AVX-512 path for head sizes 64 and
 * 128, else the portable loop (copies with a constant head_dim where it is a common one, which the
 * compiler unrolls into whole vector registers). buffer: attend_scratch_floats, 64-byte aligned. */
static void attend_one(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache, int is_bf16,
                       const int32_t *table, int seq_len, int start, float softcap, int64_t row, int num_heads,
                       int num_kv_heads, int head_dim, int block_size, float scale, void *out, float *buffer,
                       int max_len) {
    const size_t per_head = (size_t)num_heads * head_dim;
    float *scores = buffer + (size_t)num_heads * 16 * 16;
    float *acc = scores + (size_t)num_heads * max_len, *qf = acc + per_head, *rowbuf = qf + per_head;
#ifdef __AVX512F__
    if (num_heads <= 512 && (head_dim == 64 || head_dim == 128)) {
        if (head_dim == 64)
            attend_seq_avx512(4, q, q_stride, k_cache, v_cache, is_bf16, table, seq_len, start, softcap, row, num_heads,
                              num_kv_heads, block_size, scale, out, scores, (__m512 *)buffer, qf);
        else
            attend_seq_avx512(8, q, q_stride, k_cache, v_cache, is_bf16, table, seq_len, start, softcap, row, num_heads,
                              num_kv_heads, block_size, scale, out, scores, (__m512 *)buffer, qf);
        return;
    }
#endif
    switch (head_dim) {
    case 64:
        attend_seq(q, q_stride, k_cache, v_cache, is_bf16, table, seq_len, start, softcap, row, num_heads, num_kv_heads, 64,
                   block_size, scale, out, scores, acc, qf, rowbuf);
        break;
    case 128:
        attend_seq(q, q_stride, k_cache, v_cache, is_bf16, table, seq_len, start, softcap, row, num_heads, num_kv_heads, 128,
                   block_size, scale, out, scores, acc, qf, rowbuf);
        break;
    default:
        attend_seq(q, q_stride, k_cache, v_cache, is_bf16, table, seq_len, start, softcap, row, num_heads, num_kv_heads,
                   head_dim, block_size, scale, out, scores, acc, qf, rowbuf);
    }
}

/* Returns 0 on success, 1 when a size is beyond this kernel's limits, 2 when out of memory, and
 * PAGED_BAD_* (paged_bounds.h) when an input would send it out of bounds; nothing is read or
 * written then. The caches hold num_blocks blocks, q and out num_rows rows, and each block table
 * row bt_width entries. */
int paged_decode_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache, int is_bf16,
                           int64_t num_blocks, const int32_t *block_tables, int64_t bt_stride, int64_t bt_width,
                           const int32_t *seq_lens, const int64_t *rows, int64_t num_rows, int num_seqs,
                           const int32_t *starts, float softcap, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, void *out,
                           int num_threads) {
    if (num_kv_heads < 1 || num_heads % num_kv_heads != 0 || block_size < 1) return 1;
    for (int i = 0; i < num_seqs; i++) {
        const int64_t row = rows ? rows[i] : i;
        if (row < 0 || row >= num_rows) return PAGED_BAD_ROW;
        if (starts && (starts[i] < 0 || starts[i] >= seq_lens[i])) return PAGED_BAD_LENGTH;
        const int bad =
            paged_check_context(block_tables + (int64_t)i * bt_stride, bt_width, seq_lens[i], block_size, num_blocks);
        if (bad) return bad;
    }
    int max_len = 1;
    for (int i = 0; i < num_seqs; i++)
        if (seq_lens[i] > max_len) max_len = seq_lens[i];
    const size_t scratch_bytes = (attend_scratch_floats(num_heads, num_kv_heads, head_dim, max_len) * sizeof(float) + 63) / 64 * 64;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *buffer = (float *)aligned_alloc(64, scratch_bytes);
        /* Every thread reaches the worksharing loop, even one whose buffer failed. */
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < num_seqs; i++) {
            if (buffer == NULL) {
                failed = 2;
                continue;
            }
            attend_one(q, q_stride, k_cache, v_cache, is_bf16, block_tables + (int64_t)i * bt_stride, seq_lens[i],
                       starts ? starts[i] : 0, softcap, rows ? rows[i] : i, num_heads, num_kv_heads, head_dim, block_size,
                       scale, out, buffer, max_len);
        }
        free(buffer);
    }
    return failed;
}
