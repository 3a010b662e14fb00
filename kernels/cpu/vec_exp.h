/*
 * exp for float32 vectors, for the CPU kernels' softmax and SiLU: Cody-Waite range reduction to
 * r in [-ln2/2, ln2/2], a degree-6 polynomial (relative error about 2e-7), and the power of two
 * applied with scalef. Inputs are clamped to [-87, 88]. With AVX-512 it works on 16 lanes at once;
 * exp_scalar is the same arithmetic, lane by lane, for the tails and for other CPUs.
 */
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_P0 1.3981999507e-3f
#define EXP_P1 8.3334519073e-3f
#define EXP_P2 4.1665795894e-2f
#define EXP_P3 1.6666665459e-1f
#define EXP_P4 5.0000001201e-1f

static inline float exp_scalar(float x) {
    float xc = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = floorf(xc * EXP_LOG2E + 0.5f);
    float r = xc - n * EXP_LN2_HI - n * EXP_LN2_LO;
    float p = EXP_P0;
    p = p * r + EXP_P1;
    p = p * r + EXP_P2;
    p = p * r + EXP_P3;
    p = p * r + EXP_P4;
    p = p * r * r + r + 1.0f;
    return ldexpf(p, (int)n);
}

#ifdef __AVX512F__
#include <immintrin.h>

static inline __m512 exp_avx512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#endif
