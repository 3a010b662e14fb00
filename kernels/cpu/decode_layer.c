/*
 * One decoder layer of a decode step in one call, on CPU. In float32: up to 256 sequences with
 * AVX-512, up to 16 with AVX2 and FMA, up to 8 with neither (decode_layer_max_rows). In bfloat16:
 * up to 256 with AVX512-BF16's dot products, none without (decode_layer_max_rows_bf16; the
 * products are gemm_tile_bf16's, the rest the fused kernels' bfloat16 rows). A narrow
 * step's prompt rows come as decodes too, each over its sequence's keys up to its own: every row's
 * K/V is stored before any row attends.
 *
 * At a few sequences a decode step is the weights streamed from memory once; what else it
 * costs is dispatch: per layer four oneDNN calls, four fused C kernels, their Python wrappers and
 * checks, and a dozen module calls, about 3.5 ms a step on SmolLM2's 30 layers (2-core EPYC), a
 * quarter of the step. Here a layer is one call and one OpenMP parallel region:
 *
 *   x += delta; h = rms_norm(x) * ln1                 (the previous layer's MLP output added)
 *   qkv = h W_qkv^T (+ b_qkv); rotate q and k; store k and v in the paged caches
 *   a = attention(q, caches)                           (attend_one, the decode kernel's)
 *   x += a W_o^T; h = rms_norm(x) * ln2
 *   delta = silu(h W_gate^T) * (h W_up^T) W_down^T     (returned: the next layer adds it)
 *
 * The row functions are the fused kernels' own (fused_elementwise.c, paged_decode_attention.c,
 * included here), so norms, rotary embedding and attention compute exactly what they compute;
 * the products are this file's, in two shapes:
 * - up to 8 rows, each thread streams whole rows of a weight (out, in) once for every sequence of
 *   the step (gemv_rows), which matches or beats oneDNN's packed products there; with AVX2 (no
 *   AVX-512) in 8-float vectors with up to 12 accumulators, and past 8 rows the same blocks of
 *   weight rows multiplied by the x rows a few at a time (gemv_share_groups). On a 2-core Zen 3,
 *   SmolLM2's decode steps took 20.6, 23.2, 32.2 and 31.2 ms at 1, 3, 6 and 8 sequences, against
 *   25.0, 32.8, 56.9 and 71.8 with dot products left to the compiler (and 39-64 ms layer by layer);
 * - wider, register tiles of 6 x rows by 4 weight rows (gemm_tile), each block of weight rows
 *   multiplied by every x row while it sits in L1. On SmolLM2's four shapes (2-core Xeon, 30
 *   layers) they took 23.1, 31.8 and 52.0 ms at 16, 32 and 64 rows, against oneDNN's 23.5, 33.4
 *   and 53.7; and the layer costs one call instead of a dozen, so the engine sends every decode
 *   step here.
 * The engine's layer in torch (engine.models.llama) is the reference.
 */
#include <omp.h>
#if defined(__AVX2__) && !defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "fused_elementwise.c"
#include "paged_decode_attention.c"

#ifdef __AVX512F__
#define DECODE_LAYER_MAX_ROWS 256
#elif defined(__AVX2__) && defined(__FMA__)
/* Past 16 rows the grouped products (loads, not multiplies, bound them) fall behind oneDNN's: the
 * engine's layer path takes those steps (SmolLM2, Zen 3: 68 against 82 ms at 16 rows, 107 against
 * 101 at 24). */
#define DECODE_LAYER_MAX_ROWS 16
#else
#define DECODE_LAYER_MAX_ROWS 8 /* gemv_rows alone: wider steps keep the engine's layer path */
#endif
#define DECODE_BAD_SLOT 6 /* a slot outside the KV cache's num_blocks * block_size rows */

/* Weight rows asked for ahead of the ones being multiplied: the next block's, so that a block of
 * a few rows (at several x rows, the registers hold few accumulators) still keeps enough rows in
 * flight. Without it four rows at a time read at half the rate of oneDNN's packed product; with
 * it 1-8 x rows match or beat it on SmolLM2's shapes (2-core EPYC). */
#define PREFETCH_ROWS 8

/* y[m][o] = b[o] + sum_i x[m][i] * w[o][i] for o in [o0, o1), m < rows; w is (out, in) row-major.
 * BLOCK weight rows are streamed at once, each multiplied by every x row, into BLOCK * rows <= 16
 * accumulators that one transposing sum reduces together (rows and BLOCK are constants where it is
 * inlined, so the accumulators stay in registers). */
static inline __attribute__((always_inline)) void gemv_rows(const float *x, const int rows, const int BLOCK,
                                                            const float *w, const float *b, float *y, int64_t out,
                                                            int64_t in, int64_t o0, int64_t o1) {
    int64_t o = o0;
#ifdef __AVX512F__
    for (; o + BLOCK <= o1; o += BLOCK) {
        __m512 acc[16];
        for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
        const float *w0 = w + o * in;
        for (int64_t i = 0; i < in; i += 16) {
            const __mmask16 k = in - i >= 16 ? (__mmask16)0xffff : tail_mask((int)(in - i));
            __m512 wv[16];
            for (int r = 0; r < BLOCK; r++) wv[r] = _mm512_maskz_loadu_ps(k, w0 + r * in + i);
            for (int r = 0; r < PREFETCH_ROWS; r++) __builtin_prefetch(w0 + (BLOCK + r) * in + i, 0, 3);
            for (int m = 0; m < rows; m++) {
                const __m512 xv = _mm512_maskz_loadu_ps(k, x + m * in + i);
                for (int r = 0; r < BLOCK; r++) acc[m * BLOCK + r] = _mm512_fmadd_ps(wv[r], xv, acc[m * BLOCK + r]);
            }
        }
        float sums[16];
        _mm512_storeu_ps(sums, sum16x16(acc));
        for (int m = 0; m < rows; m++)
            for (int r = 0; r < BLOCK; r++) y[m * out + o + r] = sums[m * BLOCK + r] + (b ? b[o + r] : 0.0f);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    /* Eight floats a vector, sixteen registers: BLOCK * rows <= 12 accumulators, so that the FMAs
     * in flight cover their latency while the weight rows stream once. */
    const int64_t whole = in & ~(int64_t)7;
    for (; o + BLOCK <= o1; o += BLOCK) {
        __m256 acc[12];
        for (int j = 0; j < 12; j++) acc[j] = _mm256_setzero_ps();
        const float *w0 = w + o * in;
        for (int64_t i = 0; i < whole; i += 8) {
            for (int r = 0; r < PREFETCH_ROWS && r < 2 * BLOCK; r++) __builtin_prefetch(w0 + (BLOCK + r) * in + i, 0, 3);
            for (int r = 0; r < BLOCK; r++) {
                const __m256 wv = _mm256_loadu_ps(w0 + r * in + i);
                for (int m = 0; m < rows; m++)
                    acc[m * BLOCK + r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * in + i), acc[m * BLOCK + r]);
            }
        }
        for (int m = 0; m < rows; m++)
            for (int r = 0; r < BLOCK; r++) {
                const __m256 a = acc[m * BLOCK + r];
                __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
                h = _mm_add_ps(h, _mm_movehl_ps(h, h));
                h = _mm_add_ss(h, _mm_movehdup_ps(h));
                float t = _mm_cvtss_f32(h);
                for (int64_t i = whole; i < in; i++) t += w0[r * in + i] * x[m * in + i];
                y[m * out + o + r] = t + (b ? b[o + r] : 0.0f);
            }
    }
#endif
    for (; o < o1; o++) {
        const float *wr = w + o * in;
        for (int m = 0; m < rows; m++) {
            const float *xm = x + m * in;
            float t = 0.0f;
#pragma omp simd reduction(+ : t)
            for (int64_t i = 0; i < in; i++) t += wr[i] * xm[i];
            y[m * out + o] = t + (b ? b[o] : 0.0f);
        }
    }
}

/* This thread's share of a product, blocks of BLOCK output rows spread over the team (no barrier:
 * the caller places them). */
static inline __attribute__((always_inline)) void gemv_share_block(const float *x, const int rows, const int BLOCK,
                                                                   const float *w, const float *b, float *y,
                                                                   int64_t out, int64_t in) {
    const int64_t blocks = (out + BLOCK - 1) / BLOCK;
#pragma omp for schedule(static) nowait
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t o0 = blk * BLOCK, o1 = o0 + BLOCK < out ? o0 + BLOCK : out;
        gemv_rows(x, rows, BLOCK, w, b, y, out, in, o0, o1);
    }
}

#ifdef __AVX512F__
/* Wide steps: a tile of MR x rows by BLOCK weight rows, MR * BLOCK <= 24 accumulators (reduced 16
 * at a time). Each weight vector loaded feeds MR products and each x vector BLOCK, so the tile is
 * bound by its multiplies rather than its loads. */
static inline __attribute__((always_inline)) void gemm_tile(const float *x, const int MR, const int BLOCK,
                                                            const float *w0, const float *b, float *y, int64_t out,
                                                            int64_t in, int64_t o) {
    __m512 acc[24]; /* never addressed as a whole, so that the unrolled tile keeps it in registers */
#pragma GCC unroll 24
    for (int j = 0; j < MR * BLOCK; j++) acc[j] = _mm512_setzero_ps();
    /* Whole vectors, then the masked tail (none on the usual widths, multiples of 16). */
#define TILE_STEP(LOAD)                                                                                      \
    do {                                                                                                     \
        __m512 wv[8];                                                                                        \
        _Pragma("GCC unroll 8") for (int r = 0; r < BLOCK; r++) wv[r] = LOAD(w0 + r * in + i);              \
        _Pragma("GCC unroll 8") for (int m = 0; m < MR; m++) {                                              \
            const __m512 xv = LOAD(x + m * in + i);                                                          \
            _Pragma("GCC unroll 8") for (int r = 0; r < BLOCK; r++) acc[m * BLOCK + r] =                     \
                _mm512_fmadd_ps(wv[r], xv, acc[m * BLOCK + r]);                                              \
        }                                                                                                    \
    } while (0)
    int64_t i = 0;
    for (; i + 16 <= in; i += 16) TILE_STEP(_mm512_loadu_ps);
    if (i < in) {
        const __mmask16 k = tail_mask((int)(in - i));
#define MASKED_LOAD(p) _mm512_maskz_loadu_ps(k, (p))
        TILE_STEP(MASKED_LOAD);
#undef MASKED_LOAD
    }
#undef TILE_STEP
    __m512 red[32];
#pragma GCC unroll 32
    for (int j = 0; j < 32; j++) red[j] = j < MR * BLOCK ? acc[j] : _mm512_setzero_ps();
    float sums[32];
    for (int g = 0; g < MR * BLOCK; g += 16) _mm512_storeu_ps(sums + g, sum16x16(red + g));
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < BLOCK; r++) y[m * out + o + r] = sums[m * BLOCK + r] + (b ? b[o + r] : 0.0f);
}

/* 24 accumulators, 4 weight and 1 x vector: 29 of the 32 registers. */
#define WIDE_BLOCK 4
#define WIDE_MR 6

/* This thread's share of a wide product: blocks of WIDE_BLOCK weight rows spread over the team, each
 * block multiplied by every x row in tiles of WIDE_MR rows while it sits in L1. */
static void gemm_share_wide(const float *x, int rows, const float *w, const float *b, float *y, int64_t out,
                            int64_t in) {
    const int64_t blocks = out / WIDE_BLOCK;
#pragma omp for schedule(static) nowait
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t o = blk * WIDE_BLOCK;
        const float *w0 = w + o * in;
        if (blk + 1 < blocks)
            for (int r = 0; r < WIDE_BLOCK; r++)
                for (int64_t i = 0; i < in; i += 16) __builtin_prefetch(w0 + (WIDE_BLOCK + r) * in + i, 0, 3);
        int m = 0;
        for (; m + WIDE_MR <= rows; m += WIDE_MR) gemm_tile(x + m * in, WIDE_MR, WIDE_BLOCK, w0, b, y + m * out, out, in, o);
        switch (rows - m) {
        case 1: gemm_tile(x + m * in, 1, WIDE_BLOCK, w0, b, y + m * out, out, in, o); break;
        case 2: gemm_tile(x + m * in, 2, WIDE_BLOCK, w0, b, y + m * out, out, in, o); break;
        case 3: gemm_tile(x + m * in, 3, WIDE_BLOCK, w0, b, y + m * out, out, in, o); break;
        case 4: gemm_tile(x + m * in, 4, WIDE_BLOCK, w0, b, y + m * out, out, in, o); break;
        case 5: gemm_tile(x + m * in, 5, WIDE_BLOCK, w0, b, y + m * out, out, in, o); break;
        default: break; /* none left: rows - m < WIDE_MR */
        }
    }
#pragma omp single nowait
    {
        for (int64_t o = blocks * WIDE_BLOCK; o < out; o++)
            for (int m = 0; m < rows; m++) gemm_tile(x + m * in, 1, 1, w + o * in, b, y + m * out, out, in, o);
    }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* This thread's share of a product of more than 8 x rows with AVX2: blocks of GROUP_BLOCK weight rows
 * spread over the team, each multiplied by the x rows 4 at a time (then the rest) while it sits in
 * L1, so that the weights stream from memory once. */
#define GROUP_BLOCK 2
static void gemv_share_groups(const float *x, int rows, const float *w, const float *b, float *y, int64_t out,
                              int64_t in) {
    const int64_t blocks = (out + GROUP_BLOCK - 1) / GROUP_BLOCK;
#pragma omp for schedule(static) nowait
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t o0 = blk * GROUP_BLOCK, o1 = o0 + GROUP_BLOCK < out ? o0 + GROUP_BLOCK : out;
        int m = 0;
        for (; m + 8 <= rows; m += 8) {
            gemv_rows(x + m * in, 4, GROUP_BLOCK, w, b, y + m * out, out, in, o0, o1);
            gemv_rows(x + (m + 4) * in, 4, GROUP_BLOCK, w, b, y + (m + 4) * out, out, in, o0, o1);
        }
        const float *xm = x + m * in;
        float *ym = y + m * out;
        switch (rows - m) {
        case 1: gemv_rows(xm, 1, GROUP_BLOCK, w, b, ym, out, in, o0, o1); break;
        case 2: gemv_rows(xm, 2, GROUP_BLOCK, w, b, ym, out, in, o0, o1); break;
        case 3: gemv_rows(xm, 3, GROUP_BLOCK, w, b, ym, out, in, o0, o1); break;
        case 4: gemv_rows(xm, 4, GROUP_BLOCK, w, b, ym, out, in, o0, o1); break;
        case 5: gemv_rows(xm, 5, GROUP_BLOCK, w, b, ym, out, in, o0, o1); break;
        case 6: gemv_rows(xm, 6, GROUP_BLOCK, w, b, ym, out, in, o0, o1); break;
        case 7: gemv_rows(xm, 4, GROUP_BLOCK, w, b, ym, out, in, o0, o1);
                gemv_rows(xm + 4 * in, 3, GROUP_BLOCK, w, b, ym + 4 * out, out, in, o0, o1); break;
        default: break; /* none left */
        }
    }
}
#endif

#ifdef __AVX512BF16__
/* bfloat16: x and w bfloat16, 32 values a vector, multiplied in pairs and summed into float32 lanes
 * (AVX512-BF16's dot product), y rounded to bfloat16 once from the float32 sum and bias, as
 * oneDNN's bfloat16 products round theirs. A tile of MR x rows by BLOCK weight rows, MR * BLOCK <= 24
 * accumulators, the weight rows loaded once for every x row. */
#define BF16_TILE_STEP(LOAD)                                                                                 \
    do {                                                                                                     \
        __m512i wv[12];                                                                                      \
        _Pragma("GCC unroll 12") for (int r = 0; r < BLOCK; r++) wv[r] = LOAD(w0 + r * in + i);             \
        _Pragma("GCC unroll 8") for (int m = 0; m < MR; m++) {                                              \
            const __m512bh xv = (__m512bh)LOAD(x + m * in + i);                                              \
            _Pragma("GCC unroll 12") for (int r = 0; r < BLOCK; r++) acc[m * BLOCK + r] =                    \
                _mm512_dpbf16_ps(acc[m * BLOCK + r], xv, (__m512bh)wv[r]);                                   \
        }                                                                                                    \
    } while (0)

static inline __attribute__((always_inline)) void gemm_tile_bf16(const uint16_t *x, const int MR, const int BLOCK,
                                                                 const uint16_t *w0, const uint16_t *b, uint16_t *y,
                                                                 int64_t out, int64_t in, int64_t o) {
    __m512 acc[24];
#pragma GCC unroll 24
    for (int j = 0; j < MR * BLOCK; j++) acc[j] = _mm512_setzero_ps();
    int64_t i = 0;
#define PLAIN_LOAD(p) _mm512_loadu_si512((const void *)(p))
    for (; i + 32 <= in; i += 32) BF16_TILE_STEP(PLAIN_LOAD);
#undef PLAIN_LOAD
    if (i < in) { /* the tail, zeros past it (pairs of zeros add nothing) */
        const __mmask32 k = (__mmask32)((1ull << (in - i)) - 1ull);
#define MASKED_LOAD(p) _mm512_maskz_loadu_epi16(k, (const void *)(p))
        BF16_TILE_STEP(MASKED_LOAD);
#undef MASKED_LOAD
    }
    __m512 red[32];
#pragma GCC unroll 32
    for (int j = 0; j < 32; j++) red[j] = j < MR * BLOCK ? acc[j] : _mm512_setzero_ps();
    float sums[32];
    for (int g = 0; g < MR * BLOCK; g += 16) _mm512_storeu_ps(sums + g, sum16x16(red + g));
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < BLOCK; r++)
            y[m * out + o + r] = float_to_bf16(sums[m * BLOCK + r] + (b ? bf16_to_float(b[o + r]) : 0.0f));
}
#undef BF16_TILE_STEP

/* This thread's share of a bfloat16 product: blocks of BLOCK weight rows spread over the team, each
 * multiplied by every x row, MR at a time (then the rest), while it sits in L1; the rows past the
 * last whole block one by one. The next block's rows are asked for ahead (a step of few rows
 * streams the weights from memory). */
static inline __attribute__((always_inline)) void gemm_share_bf16_block(const uint16_t *x, int rows, const int MR,
                                                                        const int BLOCK, const uint16_t *w,
                                                                        const uint16_t *b, uint16_t *y, int64_t out,
                                                                        int64_t in) {
    const int64_t blocks = out / BLOCK;
#pragma omp for schedule(static) nowait
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t o = blk * BLOCK;
        const uint16_t *w0 = w + o * in;
        if (blk + 1 < blocks)
            for (int r = 0; r < BLOCK; r++)
                for (int64_t i = 0; i < in; i += 32) __builtin_prefetch(w0 + (BLOCK + r) * in + i, 0, 3);
        int m = 0;
        for (; m + MR <= rows; m += MR) gemm_tile_bf16(x + m * in, MR, BLOCK, w0, b, y + m * out, out, in, o);
        if (BLOCK == WIDE_BLOCK) /* the narrow tiles take exactly their rows: none left */
            switch (rows - m) {
            case 1: gemm_tile_bf16(x + m * in, 1, WIDE_BLOCK, w0, b, y + m * out, out, in, o); break;
            case 2: gemm_tile_bf16(x + m * in, 2, WIDE_BLOCK, w0, b, y + m * out, out, in, o); break;
            case 3: gemm_tile_bf16(x + m * in, 3, WIDE_BLOCK, w0, b, y + m * out, out, in, o); break;
            case 4: gemm_tile_bf16(x + m * in, 4, WIDE_BLOCK, w0, b, y + m * out, out, in, o); break;
            case 5: gemm_tile_bf16(x + m * in, 5, WIDE_BLOCK, w0, b, y + m * out, out, in, o); break;
            default: break; /* none left: rows - m < WIDE_MR */
            }
    }
#pragma omp single nowait
    {
        for (int64_t o = blocks * BLOCK; o < out; o++)
            for (int m = 0; m < rows; m++) gemm_tile_bf16(x + m * in, 1, 1, w + o * in, b, y + m * out, out, in, o);
    }
}

/* The tile by x rows: as many weight rows as the accumulators allow where the rows are few. */
static void gemm_share_bf16(const uint16_t *x, int rows, const uint16_t *w, const uint16_t *b, uint16_t *y,
                            int64_t out, int64_t in) {
    switch (rows) {
    case 1: gemm_share_bf16_block(x, 1, 1, 12, w, b, y, out, in); break;
    case 2: gemm_share_bf16_block(x, 2, 2, 8, w, b, y, out, in); break;
    case 3: gemm_share_bf16_block(x, 3, 3, 6, w, b, y, out, in); break;
    case 4: gemm_share_bf16_block(x, 4, 4, 4, w, b, y, out, in); break;
    default: gemm_share_bf16_block(x, rows, WIDE_MR, WIDE_BLOCK, w, b, y, out, in);
    }
}
#define DECODE_LAYER_MAX_ROWS_BF16 DECODE_LAYER_MAX_ROWS
#else
#define DECODE_LAYER_MAX_ROWS_BF16 0 /* no bfloat16 dot products: bfloat16 steps keep the layer path */
#endif

/* The block width by x rows: the most weight rows whose accumulators fit 16 vectors (12 with AVX2's
 * sixteen registers). */
static inline void gemv_share(const float *x, int rows, const float *w, const float *b, float *y, int64_t out,
                              int64_t in) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    switch (rows) {
    case 1: gemv_share_block(x, 1, 8, w, b, y, out, in); break;
    case 2: gemv_share_block(x, 2, 6, w, b, y, out, in); break;
    case 3: gemv_share_block(x, 3, 4, w, b, y, out, in); break;
    case 4: gemv_share_block(x, 4, 3, w, b, y, out, in); break;
    case 5: gemv_share_block(x, 5, 2, w, b, y, out, in); break;
    case 6: gemv_share_block(x, 6, 2, w, b, y, out, in); break;
    case 7: gemv_share_block(x, 7, 1, w, b, y, out, in); break;
    case 8: gemv_share_block(x, 8, 1, w, b, y, out, in); break;
    default: gemv_share_groups(x, rows, w, b, y, out, in);
    }
#else
    switch (rows) {
    case 1: gemv_share_block(x, 1, 16, w, b, y, out, in); break;
    case 2: gemv_share_block(x, 2, 8, w, b, y, out, in); break;
    case 3: gemv_share_block(x, 3, 5, w, b, y, out, in); break;
    case 4: gemv_share_block(x, 4, 4, w, b, y, out, in); break;
    case 5: gemv_share_block(x, 5, 3, w, b, y, out, in); break;
    case 6: gemv_share_block(x, 6, 2, w, b, y, out, in); break;
    case 7: gemv_share_block(x, 7, 2, w, b, y, out, in); break;
#ifdef __AVX512F__
    case 8: gemv_share_block(x, 8, 2, w, b, y, out, in); break;
    default: gemm_share_wide(x, rows, w, b, y, out, in);
#else
    default: gemv_share_block(x, 8, 2, w, b, y, out, in);
#endif
    }
#endif
}

/* The layer's parts on a row (or a product) of either dtype: float32, or bfloat16 where is_bf16
 * (called only where the build takes bfloat16 steps). Pointers are to the first value of the
 * tensor; offsets count values. */

static inline void norm_row(void *x, const void *delta, const void *w, void *h, int64_t m, int64_t hidden,
                            float eps, int is_bf16) {
#ifdef __AVX512BF16__
    if (is_bf16) {
        rms_norm_row_bf16((uint16_t *)x + m * hidden, delta ? (const uint16_t *)delta + m * hidden : NULL,
                          (const uint16_t *)w, (uint16_t *)h + m * hidden, hidden, eps);
        return;
    }
#endif
    rms_norm_row_f32((float *)x + m * hidden, delta ? (const float *)delta + m * hidden : NULL, (const float *)w,
                     (float *)h + m * hidden, hidden, eps);
}

/* This thread's share of y = x w^T (+ b), rows x rows (no barrier: the caller places them). */
static inline void product(const void *x, int rows, const void *w, const void *b, void *y, int64_t out, int64_t in,
                           int is_bf16) {
#ifdef __AVX512BF16__
    if (is_bf16) {
        gemm_share_bf16((const uint16_t *)x, rows, (const uint16_t *)w, (const uint16_t *)b, (uint16_t *)y, out, in);
        return;
    }
#endif
    gemv_share((const float *)x, rows, (const float *)w, (const float *)b, (float *)y, out, in);
}

/* Row m of q|k|v: q and k rotated in place, k and v stored at the row's slot. */
static inline void rope_store_row(void *qkv, const void *cos, const void *sin_signed, int64_t m, int64_t slot,
                                  void *k_cache, void *v_cache, int num_heads, int num_kv_heads, int head_dim,
                                  int is_bf16) {
    const int64_t q_size = (int64_t)num_heads * head_dim, kv_size = (int64_t)num_kv_heads * head_dim;
    const int64_t width = q_size + 2 * kv_size;
    const size_t elem = is_bf16 ? 2 : 4;
    char *row = (char *)qkv + m * width * elem;
#ifdef __AVX512BF16__
    if (is_bf16) {
        float cf[512], sf[512];
        bf16_row_to_float((const uint16_t *)cos + m * head_dim, cf, head_dim);
        bf16_row_to_float((const uint16_t *)sin_signed + m * head_dim, sf, head_dim);
        for (int hd = 0; hd < num_heads + num_kv_heads; hd++)
            rope_row_bf16((uint16_t *)row + (int64_t)hd * head_dim, cf, sf, head_dim);
    } else
#endif
        for (int hd = 0; hd < num_heads + num_kv_heads; hd++)
            rope_row_f32((float *)row + (int64_t)hd * head_dim, (const float *)cos + m * head_dim,
                         (const float *)sin_signed + m * head_dim, head_dim);
    memcpy((char *)k_cache + slot * kv_size * elem, row + q_size * elem, (size_t)kv_size * elem);
    memcpy((char *)v_cache + slot * kv_size * elem, row + (q_size + kv_size) * elem, (size_t)kv_size * elem);
}

/* Row m of silu(gate) * up, gate|up (rows, 2 inter) into act (rows, inter). */
static inline void silu_row(const void *gate_up, void *act, int64_t m, int64_t inter, int is_bf16) {
#ifdef __AVX512BF16__
    if (is_bf16) {
        silu_mul_row_bf16((const uint16_t *)gate_up + m * 2 * inter, (uint16_t *)act + m * inter, inter);
        return;
    }
#endif
    const float *g = (const float *)gate_up + m * 2 * inter;
    silu_mul_row_f32(g, g + inter, (float *)act + m * inter, inter);
}

/* The widest step this build takes, in float32 and in bfloat16. */
int decode_layer_max_rows(void) { return DECODE_LAYER_MAX_ROWS; }
int decode_layer_max_rows_bf16(void) { return DECODE_LAYER_MAX_ROWS_BF16; }

/*
 * Returns 0 on success, 1 when a size is beyond this kernel's limits (rows above the build's widest
 * step in the dtype, head_dim above 512 or odd, heads not in whole GQA groups), 2 when out of
 * memory, DECODE_BAD_SLOT or PAGED_BAD_* (paged_bounds.h) when a slot, block table or length lies
 * out of bounds;
 * nothing is written then.
 *
 * Every tensor is float32, or bfloat16 where is_bf16 (the slots, tables and lengths aside).
 * x, delta, out_delta: (rows, hidden); cos, sin_signed: (rows, head_dim); slots: (rows,) int64;
 * block_tables (rows, bt_stride) int32 with bt_width entries used; seq_lens (rows,) int32 including
 * the new token. w_qkv ((heads + 2 kv_heads) head_dim, hidden), b_qkv nullable; w_o (hidden, heads
 * head_dim); w_gate_up (2 inter, hidden): gate rows, then up rows; w_down (hidden, inter).
 * delta may be NULL (the first layer); out_delta must not alias x or delta.
 *
 * In bfloat16 each step's values are rounded where the engine's layer path rounds them (its fused
 * kernels' bfloat16 rows are the ones called here; every product's output once, from its float32
 * sum), so the two differ only in the order of a product's sums.
 */
int decode_layer(void *x, const void *delta, void *out_delta, int64_t rows, int64_t hidden, int64_t inter,
                 const void *ln1, const void *ln2, float eps, const void *w_qkv, const void *b_qkv, const void *w_o,
                 const void *w_gate_up, const void *w_down, const void *cos, const void *sin_signed,
                 const int64_t *slots, void *k_cache, void *v_cache, int64_t num_blocks, int block_size,
                 const int32_t *block_tables, int64_t bt_stride, int64_t bt_width, const int32_t *seq_lens,
                 int num_heads, int num_kv_heads, int head_dim, float scale, int is_bf16, int num_threads) {
    if (rows < 1 || rows > (is_bf16 ? DECODE_LAYER_MAX_ROWS_BF16 : DECODE_LAYER_MAX_ROWS) || head_dim > 512 ||
        head_dim % 2 || num_kv_heads < 1 || num_heads % num_kv_heads != 0 || block_size < 1)
        return 1;
    const int64_t num_slots = num_blocks * block_size;
    int max_len = 1;
    for (int64_t m = 0; m < rows; m++) {
        if (slots[m] < 0 || slots[m] >= num_slots) return DECODE_BAD_SLOT;
        const int bad = paged_check_context(block_tables + m * bt_stride, bt_width, seq_lens[m], block_size, num_blocks);
        if (bad) return bad;
        if (seq_lens[m] < 1) return PAGED_BAD_LENGTH;
        if (seq_lens[m] > max_len) max_len = seq_lens[m];
    }
    const int64_t q_size = (int64_t)num_heads * head_dim, kv_size = (int64_t)num_kv_heads * head_dim;
    const int64_t qkv_width = q_size + 2 * kv_size;
    const size_t elem = is_bf16 ? 2 : 4;
    /* Activations of the step (h, qkv, attention output, gate|up, silu product), then each
     * thread's attention scratch, every part 64-byte aligned. */
    const size_t act_values = (size_t)rows * (hidden + qkv_width + q_size + 3 * inter);
    const size_t act_bytes = (act_values * elem + 63) / 64 * 64;
    const size_t attend_bytes =
        (attend_scratch_floats(num_heads, num_kv_heads, head_dim, max_len) * sizeof(float) + 63) / 64 * 64;
    const int threads = num_threads < 1 ? 1 : num_threads;
    char *scratch = (char *)aligned_alloc(64, act_bytes + (size_t)threads * attend_bytes);
    if (scratch == NULL) return 2;
    char *h = scratch, *qkv = h + rows * hidden * elem, *att = qkv + rows * qkv_width * elem;
    char *gate_up = att + rows * q_size * elem, *act = gate_up + rows * 2 * inter * elem;

#pragma omp parallel num_threads(threads)
    {
        const int tid = omp_get_thread_num();
        float *attend_buffer = (float *)(scratch + act_bytes + (size_t)tid * attend_bytes);
#pragma omp for schedule(static)
        for (int64_t m = 0; m < rows; m++) norm_row(x, delta, ln1, h, m, hidden, eps, is_bf16);
        product(h, (int)rows, w_qkv, b_qkv, qkv, qkv_width, hidden, is_bf16);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t m = 0; m < rows; m++)
            rope_store_row(qkv, cos, sin_signed, m, slots[m], k_cache, v_cache, num_heads, num_kv_heads, head_dim,
                           is_bf16);
#pragma omp for schedule(dynamic, 1)
        for (int64_t m = 0; m < rows; m++)
            attend_one(qkv, qkv_width, k_cache, v_cache, is_bf16, block_tables + m * bt_stride, seq_lens[m], 0, 0.0f,
                       m, num_heads, num_kv_heads, head_dim, block_size, scale, att, attend_buffer, max_len);
        /* The attention output's product goes to out_delta, free until the MLP's. */
        product(att, (int)rows, w_o, NULL, out_delta, hidden, q_size, is_bf16);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t m = 0; m < rows; m++) norm_row(x, out_delta, ln2, h, m, hidden, eps, is_bf16);
        product(h, (int)rows, w_gate_up, NULL, gate_up, 2 * inter, hidden, is_bf16);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t m = 0; m < rows; m++) silu_row(gate_up, act, m, inter, is_bf16);
        product(act, (int)rows, w_down, NULL, out_delta, hidden, inter, is_bf16);
    }
    free(scratch);
    return 0;
}
