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

#include "bf16.h"
#include "vec_exp.h"

/* In place: each value rounded to bfloat16 (kept as float32). */
static inline void round_row_bf16(float *v, int64_t n) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(v + i, bf16x16_round(_mm512_loadu_ps(v + i)));
#endif
    for (; i < n; i++) v[i] = round_bf16(v[i]);
}

#define MAX_ROW 16384 /* floats of per-row scratch on a thread's stack: wider rows go in chunks */

/* silu(g) * u over one row of width floats (u == NULL: silu(g) alone). */
static inline void silu_mul_row_f32(const float *g, const float *u, float *o, int64_t width) {
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= width; i += 16) {
        __m512 gv = _mm512_loadu_ps(g + i);
        __m512 e = exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, e));
        _mm512_storeu_ps(o + i, u ? _mm512_mul_ps(s, _mm512_loadu_ps(u + i)) : s);
    }
#endif
    for (; i < width; i++) o[i] = g[i] / (1.0f + exp_scalar(-g[i])) * (u ? u[i] : 1.0f);
}

/* One float32 row of rms_norm: with delta, xr += delta first (in place), then o = w * xr / rms(xr). */
static inline void rms_norm_row_f32(float *xr, const float *dr, const float *w, float *o, int64_t dim, float eps) {
    float sum = 0.0f;
    if (dr) {
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) xr[i] += dr[i];
    }
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < dim; i++) sum += xr[i] * xr[i];
    float inv = 1.0f / sqrtf(sum / (float)dim + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; i++) o[i] = w[i] * (xr[i] * inv);
}

/* One bfloat16 row of rms_norm, through float32 scratch on the thread's stack a chunk of the row at a
 * time (rows of any width; a row that fits one chunk is read once): with delta, xr = bf16(xr +
 * delta) first (in place), then o = bf16(bf16(xr / rms(xr)) * w), the eager ops' roundings. */
static inline void rms_norm_row_bf16(uint16_t *xr, const uint16_t *dr, const uint16_t *w, uint16_t *o, int64_t dim,
                                     float eps) {
    float xf[MAX_ROW], tmp[MAX_ROW];
    float sum = 0.0f;
    for (int64_t c = 0; c < dim; c += MAX_ROW) {
        const int64_t n = dim - c < MAX_ROW ? dim - c : MAX_ROW;
        bf16_row_to_float(xr + c, xf, n);
        if (dr) {
            bf16_row_to_float(dr + c, tmp, n);
#pragma omp simd
            for (int64_t i = 0; i < n; i++) xf[i] += tmp[i];
            round_row_bf16(xf, n);
            float_row_to_bf16(xf, xr + c, n);
        }
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++) sum += xf[i] * xf[i];
    }
    float inv = 1.0f / sqrtf(sum / (float)dim + eps);
    for (int64_t c = 0; c < dim; c += MAX_ROW) {
        const int64_t n = dim - c < MAX_ROW ? dim - c : MAX_ROW;
        /* x holds the updated row in bfloat16, so reading a chunk again is exact. */
        if (dim > MAX_ROW) bf16_row_to_float(xr + c, xf, n);
        /* As the reference: the normalised row is rounded to bfloat16 before the weight. */
#pragma omp simd
        for (int64_t i = 0; i < n; i++) xf[i] *= inv;
        round_row_bf16(xf, n);
        bf16_row_to_float(w + c, tmp, n);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) xf[i] *= tmp[i];
        float_row_to_bf16(xf, o + c, n);
    }
}

void rms_norm(void *x, const void *delta, const void *weight, void *out, int64_t rows, int64_t dim,
              float eps, int is_bf16, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * dim > 32768)
    for (int64_t r = 0; r < rows; r++) {
        int64_t base = r * dim;
        if (!is_bf16)
            rms_norm_row_f32((float *)x + base, delta ? (const float *)delta + base : NULL, (const float *)weight,
                             (float *)out + base, dim, eps);
        else
            rms_norm_row_bf16((uint16_t *)x + base, delta ? (const uint16_t *)delta + base : NULL,
                              (const uint16_t *)weight, (uint16_t *)out + base, dim, eps);
    }
}

/* One bfloat16 row of silu_mul: g holds the gate's width values, then the up's. */
static inline void silu_mul_row_bf16(const uint16_t *g, uint16_t *o, int64_t width) {
    float gf[MAX_ROW], uf[MAX_ROW];
    for (int64_t c = 0; c < width; c += MAX_ROW) {
        const int64_t n = width - c < MAX_ROW ? width - c : MAX_ROW;
        bf16_row_to_float(g + c, gf, n);
        bf16_row_to_float(g + width + c, uf, n);
        silu_mul_row_f32(gf, NULL, gf, n);
        round_row_bf16(gf, n); /* silu rounded to bfloat16 before the product, as eager */
#pragma omp simd
        for (int64_t i = 0; i < n; i++) gf[i] *= uf[i];
        float_row_to_bf16(gf, o + c, n);
    }
}

void silu_mul(const void *gate_up, void *out, int64_t rows, int64_t width, int is_bf16, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * width > 32768)
    for (int64_t r = 0; r < rows; r++) {
        if (!is_bf16) {
            const float *g = (const float *)gate_up + r * 2 * width;
            const float *u = g + width;
            silu_mul_row_f32(g, u, (float *)out + r * width, width);
        } else {
            silu_mul_row_bf16((const uint16_t *)gate_up + r * 2 * width, (uint16_t *)out + r * width, width);
        }
    }
}

/* Rotary embedding of one row in place: x[i] * cos[i] + x[(i + half) % dim] * sin_signed[i],
 * sin_signed being sin with its first half negated (engine.models.llama.apply_rope_signed). Two
 * roundings as the eager ops make them, never one fused multiply-add, so the result is the
 * reference's bit for bit. */
__attribute__((optimize("fp-contract=off"))) static void rope_row_f32(float *x, const float *cos,
                                                                        const float *sin_signed, int dim) {
    float tmp[512];
    int half = dim / 2;
    for (int i = 0; i < dim; i++) tmp[i] = x[i];
    for (int i = 0; i < dim; i++) {
        float a = tmp[i] * cos[i];
        float b = tmp[i < half ? i + half : i - half] * sin_signed[i];
        x[i] = a + b;
    }
}

/* The same in bfloat16: each product and the sum rounded to bfloat16, as the eager ops round them.
 * cos and sin_signed arrive as float32 rows. */
__attribute__((optimize("fp-contract=off"))) static void rope_row_bf16(uint16_t *x, const float *cos,
                                                                         const float *sin_signed, int dim) {
    float xf[512], a[512], b[512];
    int half = dim / 2;
    bf16_row_to_float(x, xf, dim);
    for (int i = 0; i < dim; i++) {
        a[i] = xf[i] * cos[i];
        b[i] = xf[i < half ? i + half : i - half] * sin_signed[i];
    }
    round_row_bf16(a, dim);
    round_row_bf16(b, dim);
    for (int i = 0; i < dim; i++) a[i] += b[i];
    float_row_to_bf16(a, x, dim);
}

/*
 * The attention input of a step, in one pass over the fused q|k|v projection (tokens, (heads +
 * 2 * kv_heads) * head_dim): q and k rotated in place, then each token's k and v rows copied into
 * the paged caches (num_blocks, block_size, kv_heads, head_dim) at its slot. cos and sin_signed
 * are (tokens, head_dim); the caches hold num_slots token rows. Returns 1 when head_dim is beyond
 * the row buffer, 2 when a slot lies outside [0, num_slots); either way nothing is written.
 */
int rope_and_store_kv(void *qkv, const void *cos, const void *sin_signed, const int64_t *slots, void *k_cache,
                      void *v_cache, int64_t num_slots, int64_t tokens, int num_heads, int num_kv_heads,
                      int head_dim, int is_bf16, int num_threads) {
    if (head_dim > 512 || head_dim % 2) return 1;
    /* The slots come from the caller's block tables: one out of range would write past the pool. */
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return 2;
    const int64_t width = (int64_t)(num_heads + 2 * num_kv_heads) * head_dim;
    const int64_t kv_row = (int64_t)num_kv_heads * head_dim;
    const int64_t elem = is_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (tokens > 16)
    for (int64_t t = 0; t < tokens; t++) {
        char *row = (char *)qkv + t * width * elem;
        const char *c = (const char *)cos + t * head_dim * elem;
        const char *s = (const char *)sin_signed + t * head_dim * elem;
        float cf[512], sf[512];
        if (is_bf16) {
            bf16_row_to_float((const uint16_t *)c, cf, head_dim);
            bf16_row_to_float((const uint16_t *)s, sf, head_dim);
        }
        for (int h = 0; h < num_heads + num_kv_heads; h++) {
            char *x = row + (int64_t)h * head_dim * elem;
            if (is_bf16)
                rope_row_bf16((uint16_t *)x, cf, sf, head_dim);
            else
                rope_row_f32((float *)x, (const float *)c, (const float *)s, head_dim);
        }
        int64_t slot = slots[t];
        const char *k = row + (int64_t)num_heads * head_dim * elem;
        memcpy((char *)k_cache + slot * kv_row * elem, k, (size_t)(kv_row * elem));
        memcpy((char *)v_cache + slot * kv_row * elem, k + kv_row * elem, (size_t)(kv_row * elem));
    }
    return 0;
}
