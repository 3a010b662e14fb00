/*
 * The online softmax (Milakov and Gimelshein, 2018) of both CPU attention kernels: a row's scores
 * arrive in blocks; each block moves the row's running max m and sum l, its scores become their
 * numerators exp(s - m), and what was accumulated before is scaled by alpha = exp(m_old - m_new).
 * A masked score is -inf and its numerator exactly 0 (exp clamps its input, so it is zeroed, not
 * left at exp(-87)); a row's first block has m = -inf, and alpha 0. Decode attention takes a
 * sequence's whole context as one block; prefill attention takes blocks of keys.
 */
#pragma once
#include <math.h>
#include <stdint.h>

#include "vec_exp.h"

/* The factor for what a row accumulated under max m_old, once its max is m_new (>= m_old). */
static inline float online_softmax_alpha(float m_old, float m_new) {
    if (m_old == -INFINITY) return 0.0f;
    return m_old == m_new ? 1.0f : exp_scalar(m_old - m_new);
}

#ifdef __AVX512F__
/* online_softmax_alpha for 16 rows at once. */
static inline __m512 online_softmax_alpha_avx512(__m512 m_old, __m512 m_new) {
    __mmask16 had = _mm512_cmp_ps_mask(m_old, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    return _mm512_maskz_mov_ps(had, exp_avx512(_mm512_sub_ps(m_old, m_new)));
}

/* 16 scores' numerators given the row max m (masked ones 0). */
static inline __m512 online_softmax_numerators_avx512(__m512 s, __m512 m) {
    __mmask16 seen = _mm512_cmp_ps_mask(s, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    return _mm512_maskz_mov_ps(seen, exp_avx512(_mm512_sub_ps(s, m)));
}
#endif

/* One block of n scores of a row, x[0], x[stride], ...: each becomes its numerator, *m and *l
 * move, and the factor for the row's accumulated output is returned (online_softmax_alpha). */
static inline float online_softmax_step(float *x, int64_t stride, int n, float *m, float *l) {
    float mx = *m;
    int t = 0;
#ifdef __AVX512F__
    if (stride == 1 && n >= 16) {
        __m512 mv = _mm512_set1_ps(mx);
        for (; t + 16 <= n; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(x + t));
        mx = _mm512_reduce_max_ps(mv);
    }
#endif
    for (; t < n; t++) mx = x[t * stride] > mx ? x[t * stride] : mx;
    float sum = 0.0f;
    t = 0;
#ifdef __AVX512F__
    if (stride == 1 && n >= 16) {
        __m512 mm = _mm512_set1_ps(mx), acc = _mm512_setzero_ps();
        for (; t + 16 <= n; t += 16) {
            __m512 e = online_softmax_numerators_avx512(_mm512_loadu_ps(x + t), mm);
            _mm512_storeu_ps(x + t, e);
            acc = _mm512_add_ps(acc, e);
        }
        sum = _mm512_reduce_add_ps(acc);
    }
#endif
    for (; t < n; t++) {
        float *s = x + t * stride;
        *s = *s == -INFINITY ? 0.0f : exp_scalar(*s - mx);
        sum += *s;
    }
    const float alpha = online_softmax_alpha(*m, mx);
    *l = *l * alpha + sum;
    *m = mx;
    return alpha;
}
