/*
 * bfloat16 <-> float32 for the CPU kernels: scalar forms, and with AVX-512 whole rows 16 lanes at a
 * time. float32 -> bfloat16 rounds to nearest even (NaN stays NaN), as torch's conversion does.
 */
#pragma once
#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t x) {
    uint32_t u = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* v rounded to bfloat16 and back: the value a bfloat16 tensor would hold. */
static inline float round_bf16(float v) { return bf16_to_float(float_to_bf16(v)); }

#ifdef __AVX512F__
#include <immintrin.h>

static inline __m512 bf16x16_load(const uint16_t *p, __mmask16 m) {
    __m256i raw = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

/* Round to nearest even in the integer domain; NaNs get a quiet bit so they stay NaN. */
static inline __m512i bf16x16_bits(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_or_epi32(rounded, nan, u, _mm512_set1_epi32(0x400000));
    return _mm512_srli_epi32(rounded, 16);
}

static inline void bf16x16_store(uint16_t *p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bf16x16_bits(v)));
}

static inline __m512 bf16x16_round(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16x16_bits(v), 16));
}

static inline __mmask16 tail_mask(int64_t remaining) {
    return remaining >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << remaining) - 1u);
}
#endif

static inline void bf16_row_to_float(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        _mm512_mask_storeu_ps(dst + i, m, bf16x16_load(src + i, m));
    }
#endif
    for (; i < n; i++) dst[i] = bf16_to_float(src[i]);
}

static inline void float_row_to_bf16(const float *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        bf16x16_store(dst + i, _mm512_maskz_loadu_ps(m, src + i), m);
    }
#endif
    for (; i < n; i++) dst[i] = float_to_bf16(src[i]);
}
