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
 * softmax and accumulation are float32.
 *
 * One work item is a sequence: its blocks are read front to back with every KV head of a token at
 * once, and the GQA group's query heads share each K and V row as it is loaded. Items are spread
 * over the threads of the OpenMP runtime the process already runs (torch's), so it uses the
 * threads torch was given.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "vec_exp.h"


/* In place over n scores: x = exp(x - max(x)); returns their sum. */
static inline float softmax_numerators(float *x, int n) {
    float m = -INFINITY;
    int t = 0;
#ifdef __AVX512F__
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (; t + 16 <= n; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(x + t));
    m = _mm512_reduce_max_ps(mv);
#endif
    for (; t < n; t++) m = x[t] > m ? x[t] : m;
    float total = 0.0f;
    t = 0;
#ifdef __AVX512F__
    __m512 mm = _mm512_set1_ps(m), acc = _mm512_setzero_ps();
    for (; t + 16 <= n; t += 16) {
        __m512 e = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(x + t), mm));
        _mm512_storeu_ps(x + t, e);
        acc = _mm512_add_ps(acc, e);
    }
    total = _mm512_reduce_add_ps(acc);
#endif
    for (; t < n; t++) {
        float e = exp_scalar(x[t] - m);
        x[t] = e;
        total += e;
    }
    return total;
}

/* One sequence, every head: each block's K (then V) rows are read front to back, all KV heads of a
 * token at once (num_kv_heads * head_dim contiguous elements), so the hardware prefetcher streams
 * whole blocks. Scores live in scores[head * seq_len + t]; acc holds num_heads * head_dim floats;
 * rowbuf holds one token's num_kv_heads * head_dim floats (for bfloat16 caches). */
static inline __attribute__((always_inline)) void attend_seq(
    const void *q, int64_t q_stride, const void *k_cache, const void *v_cache, int is_bf16, const int32_t *table,
    int seq_len, int64_t row, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, void *out,
    float *scores, float *acc, float *qf, float *rowbuf) {
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
    for (int b = 0; b < num_blocks; b++) {
        int t0 = b * block_size;
        int n = seq_len - t0 < block_size ? seq_len - t0 : block_size;
        int64_t first = (int64_t)table[b] * block_size * token_stride;
        /* The next block lies anywhere in the pool: its rows are asked for one per row of this
         * block, so the loads are in flight while this one is computed. */
        const char *next = b + 1 < num_blocks
            ? (const char *)k_cache + (int64_t)table[b + 1] * block_size * token_stride * elem
            : NULL;
        for (int j = 0; j < n; j++) {
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
        float inv = 1.0f / softmax_numerators(sh, seq_len);
#pragma omp simd
        for (int t = 0; t < seq_len; t++) sh[t] *= inv;
    }
    for (int b = 0; b < num_blocks; b++) {
        int t0 = b * block_size;
        int n = seq_len - t0 < block_size ? seq_len - t0 : block_size;
        int64_t first = (int64_t)table[b] * block_size * token_stride;
        /* The next block lies anywhere in the pool: its rows are asked for one per row of this
         * block, so the loads are in flight while this one is computed. */
        const char *next = b + 1 < num_blocks
            ? (const char *)v_cache + (int64_t)table[b + 1] * block_size * token_stride * elem
            : NULL;
        for (int j = 0; j < n; j++) {
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

/* Returns 0 on success, 1 when a size is beyond this kernel's limits, 2 when out of memory. */
int paged_decode_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache, int is_bf16,
                           const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                           const int64_t *rows, int num_seqs, int num_heads, int num_kv_heads,
                           int head_dim, int block_size, float scale, void *out, int num_threads) {
    if (num_kv_heads < 1 || num_heads % num_kv_heads != 0) return 1;
    int max_len = 1;
    for (int i = 0; i < num_seqs; i++)
        if (seq_lens[i] > max_len) max_len = seq_lens[i];
    const size_t per_head = (size_t)num_heads * head_dim;
    const size_t scratch = (size_t)num_heads * max_len + 2 * per_head + (size_t)num_kv_heads * head_dim;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = (float *)malloc(scratch * sizeof(float));
        /* Every thread reaches the worksharing loop, even one whose buffer failed. */
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < num_seqs; i++) {
            if (scores == NULL) {
                failed = 2;
                continue;
            }
            float *acc = scores + (size_t)num_heads * max_len, *qf = acc + per_head, *rowbuf = qf + per_head;
            int64_t row = rows ? rows[i] : i;
            const int32_t *table = block_tables + (int64_t)i * bt_stride;
            /* The common head sizes get copies with a constant head_dim, which the compiler unrolls
             * into whole vector registers. */
            switch (head_dim) {
            case 64:
                attend_seq(q, q_stride, k_cache, v_cache, is_bf16, table, seq_lens[i], row, num_heads, num_kv_heads, 64,
                           block_size, scale, out, scores, acc, qf, rowbuf);
                break;
            case 128:
                attend_seq(q, q_stride, k_cache, v_cache, is_bf16, table, seq_lens[i], row, num_heads, num_kv_heads, 128,
                           block_size, scale, out, scores, acc, qf, rowbuf);
                break;
            default:
                attend_seq(q, q_stride, k_cache, v_cache, is_bf16, table, seq_lens[i], row, num_heads, num_kv_heads,
                           head_dim, block_size, scale, out, scores, acc, qf, rowbuf);
            }
        }
        free(scores);
    }
    return failed;
}
