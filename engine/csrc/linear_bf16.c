/*
 * bf16 linear layer for a few rows, on CPUs where oneDNN has no bf16 matmul (AVX2
 * without AVX-NE-CONVERT, the generic build): out = x @ w^T (+ bias), with x, w,
 * bias and out in bf16, float32 accumulation and one rounding at the end, as
 * oneDNN's bf16 kernels round.
 *
 * Decoding a few sequences is a matter of reading the weights once per step: each
 * weight row is converted to float32 in registers (a 16-bit shift) and multiplied
 * into every input row while it is there, so a step reads half the bytes a float32
 * model does. torch's own fallback for bf16 GEMM on such CPUs converts element by
 * element and is ~4x slower than float32 for more than one row (engine/models/cpu_linear.py
 * takes the float32 GEMM on an upcast weight for many rows instead).
 *
 * x: [num_rows, in_features], rows x_stride elements apart; w: [out_features,
 * in_features] contiguous; bias: [out_features] or NULL; out: [num_rows, out_features]
 * contiguous. Output features are split across threads when the weight is large.
 */
#include <stdlib.h>

#include "simd.h"

/* Weight elements below which one thread reads the weight faster than a team can wake up. */
#define PARALLEL_MIN_WEIGHTS (1 << 18)
/* A tile: one weight row against up to MAX_TILE_ROWS input rows, with two accumulators per input
   row (even and odd vectors along in_features) so that even one row has two independent FMA
   chains. The weight is read strictly in order, row after row: the hardware prefetcher keeps
   one long stream going, which it would not for several rows read side by side. */
#define MAX_TILE_ROWS 4

#if SIMD_WIDTH > 1
static inline __attribute__((always_inline)) void tile(const float *x, const uint16_t *w, const uint16_t *bias,
                                                       uint16_t *out, int64_t out_stride, int64_t in_features,
                                                       const int rows) {
    vfloat even[MAX_TILE_ROWS], odd[MAX_TILE_ROWS];
    for (int i = 0; i < rows; ++i) even[i] = odd[i] = vf_zero();
    int64_t k = 0;
    for (; k + 2 * SIMD_WIDTH <= in_features; k += 2 * SIMD_WIDTH) {
        const vfloat w0 = vf_load_bf16(w + k), w1 = vf_load_bf16(w + k + SIMD_WIDTH);
        for (int i = 0; i < rows; ++i) {
            even[i] = vf_fmadd(vf_load(x + i * in_features + k), w0, even[i]);
            odd[i] = vf_fmadd(vf_load(x + i * in_features + k + SIMD_WIDTH), w1, odd[i]);
        }
    }
    for (int i = 0; i < rows; ++i) {
        float sum = vf_sum(vf_add(even[i], odd[i]));
        for (int64_t t = k; t < in_features; ++t) sum += x[i * in_features + t] * bf16_to_float(w[t]);
        if (bias != NULL) sum += bf16_to_float(*bias);
        out[i * out_stride] = float_to_bf16(sum);
    }
}

/* Output feature n (weight row n) for every input row. */
static inline void weight_row(const float *x, const uint16_t *w, const uint16_t *bias, uint16_t *out,
                              int64_t num_rows, int64_t in_features, int64_t out_features, int64_t n) {
    const uint16_t *row_bias = bias == NULL ? NULL : bias + n;
    const uint16_t *weight = w + n * in_features;
    for (int64_t m = 0; m < num_rows; m += MAX_TILE_ROWS) {
        const float *x_tile = x + m * in_features;
        uint16_t *out_tile = out + m * out_features + n;
        /* Constant tile heights, so each variant's loops unroll into straight register code. */
        switch (num_rows - m) {
            case 1: tile(x_tile, weight, row_bias, out_tile, out_features, in_features, 1); break;
            case 2: tile(x_tile, weight, row_bias, out_tile, out_features, in_features, 2); break;
            case 3: tile(x_tile, weight, row_bias, out_tile, out_features, in_features, 3); break;
            default: tile(x_tile, weight, row_bias, out_tile, out_features, in_features, 4); break;
        }
    }
}
#else
/* Generic build: one dot product per output, left to the compiler to vectorize. */
static inline void weight_row(const float *x, const uint16_t *w, const uint16_t *bias, uint16_t *out,
                              int64_t num_rows, int64_t in_features, int64_t out_features, int64_t n) {
    const uint16_t *weight = w + n * in_features;
    for (int64_t m = 0; m < num_rows; ++m) {
        const float *input = x + m * in_features;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t k = 0; k < in_features; ++k) sum += input[k] * bf16_to_float(weight[k]);
        if (bias != NULL) sum += bf16_to_float(bias[n]);
        out[m * out_features + n] = float_to_bf16(sum);
    }
}
#endif

/* Returns 0, or -1 when the float32 copy of x cannot be allocated. */
int linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias, uint16_t *out,
                int64_t num_rows, int64_t in_features, int64_t out_features) {
    /* x is read once per column block: converted once here, not at every read. */
    float *x32 = malloc((size_t)(num_rows * in_features) * sizeof(float));
    if (x32 == NULL) return -1;
    for (int64_t m = 0; m < num_rows; ++m) {
#pragma omp simd
        for (int64_t k = 0; k < in_features; ++k) x32[m * in_features + k] = bf16_to_float(x[m * x_stride + k]);
    }
#pragma omp parallel for schedule(static) if (out_features * in_features >= PARALLEL_MIN_WEIGHTS)
    for (int64_t n = 0; n < out_features; ++n) weight_row(x32, w, bias, out, num_rows, in_features, out_features, n);
    free(x32);
    return 0;
}
