/*
 * Fused elementwise ops for the CPU forward: each reads and writes its rows once where torch's eager
 * ops make several passes (and, in a decode step of a few dozen rows, pay a dispatch per pass).
 *
 * - rms_norm: optionally x += delta (the residual update) first, then out = weight * x / rms(x),
 *   the norm in float32 as Llama's reference computes it (Zhang and Sennrich, NeurIPS 2019).
 * - silu_mul: out = silu(gate) * up over a fused (rows, 2 * width) gate|up projection
 *   (SwiGLU, Shazeer 2020).
 *
 * Rows are spread over the threads of the OpenMP runtime the process already runs (torch's).
 * Tensors are contiguous float32 or bfloat16 (one type for all of a call); math is float32.
 */
#include <math.h>
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
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float load(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float v, int is_bf16) {
    if (is_bf16)
        ((uint16_t *)p)[i] = float_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* exp(x) to about 2e-7 relative error, vectorizable: Cody-Waite reduction and a degree-6
 * polynomial; saturates to 0 below -87 and to exp(88) above 88. */
static inline float fast_exp(float x) {
    const float log2e = 1.44269504088896341f;
    const float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    float xc = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = __builtin_floorf(xc * log2e + 0.5f);
    float r = xc - n * ln2_hi - n * ln2_lo;
    float p = 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.0f ? 0.0f : p * scale;
}

void rms_norm(void *x, const void *delta, const void *weight, void *out, int64_t rows, int64_t dim,
              float eps, int is_bf16, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * dim > 32768)
    for (int64_t r = 0; r < rows; r++) {
        int64_t base = r * dim;
        float sum = 0.0f;
        if (!is_bf16) {
            float *xr = (float *)x + base;
            if (delta) {
                const float *dr = (const float *)delta + base;
#pragma omp simd
                for (int64_t i = 0; i < dim; i++) xr[i] += dr[i];
            }
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < dim; i++) sum += xr[i] * xr[i];
            float inv = 1.0f / sqrtf(sum / (float)dim + eps);
            const float *w = (const float *)weight;
            float *o = (float *)out + base;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) o[i] = w[i] * (xr[i] * inv);
        } else {
            if (delta) {
                for (int64_t i = 0; i < dim; i++)
                    store(x, base + i, load(x, base + i, 1) + load(delta, base + i, 1), 1);
            }
            for (int64_t i = 0; i < dim; i++) {
                float v = load(x, base + i, 1);
                sum += v * v;
            }
            float inv = 1.0f / sqrtf(sum / (float)dim + eps);
            /* As the reference: the normalised row is rounded to bfloat16 before the weight. */
            for (int64_t i = 0; i < dim; i++) {
                float normed = bf16_to_float(float_to_bf16(load(x, base + i, 1) * inv));
                store(out, base + i, load(weight, i, 1) * normed, 1);
            }
        }
    }
}

void silu_mul(const void *gate_up, void *out, int64_t rows, int64_t width, int is_bf16, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * width > 32768)
    for (int64_t r = 0; r < rows; r++) {
        if (!is_bf16) {
            const float *g = (const float *)gate_up + r * 2 * width;
            const float *u = g + width;
            float *o = (float *)out + r * width;
#pragma omp simd
            for (int64_t i = 0; i < width; i++) o[i] = g[i] / (1.0f + fast_exp(-g[i])) * u[i];
        } else {
            const uint16_t *g = (const uint16_t *)gate_up + r * 2 * width;
            const uint16_t *u = g + width;
            uint16_t *o = (uint16_t *)out + r * width;
            for (int64_t i = 0; i < width; i++) {
                float gv = bf16_to_float(g[i]);
                /* silu rounded to bfloat16 before the product, as the eager ops round it. */
                float s = bf16_to_float(float_to_bf16(gv / (1.0f + fast_exp(-gv))));
                o[i] = float_to_bf16(s * bf16_to_float(u[i]));
            }
        }
    }
}
