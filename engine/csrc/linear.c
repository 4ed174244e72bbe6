/*
 * Linear layer for a few rows (decode steps): out = x @ w^T (+ bias), with x, w, bias
 * and out all bf16 or all float32, float32 accumulation, one rounding at the end in
 * bf16 (as oneDNN's bf16 kernels round).
 *
 * Decoding a few sequences is a matter of reading the weights once per step, and a
 * GEMM library's general kernels leave much of the memory bandwidth unused on so few
 * rows (oneDNN's packed bf16 and float32 kernels read a SmolLM2 weight at half the
 * bandwidth a plain pass over memory reaches). Here each weight row streams by once,
 * converted to float32 in registers when it is bf16 (a 16-bit shift), and is multiplied
 * into every input row while it is there. It is also the bf16 path on CPUs where oneDNN
 * has no bf16 matmul at all: torch's own fallback for bf16 GEMM there converts element by
 * element and is ~4x slower than float32 for more than one row (engine/models/cpu_linear.py
 * says which rows come here).
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
static inline __attribute__((always_inline)) void tile(const float *x, const void *w, const void *bias, void *out,
                                                       int64_t out_stride, int64_t in_features, const int rows,
                                                       const int is_bf16) {
    vfloat even[MAX_TILE_ROWS], odd[MAX_TILE_ROWS];
    for (int i = 0; i < rows; ++i) even[i] = odd[i] = vf_zero();
    int64_t k = 0;
    for (; k + 2 * SIMD_WIDTH <= in_features; k += 2 * SIMD_WIDTH) {
        const vfloat w0 = vload(w, k, is_bf16), w1 = vload(w, k + SIMD_WIDTH, is_bf16);
        for (int i = 0; i < rows; ++i) {
            even[i] = vf_fmadd(vf_load(x + i * in_features + k), w0, even[i]);
            odd[i] = vf_fmadd(vf_load(x + i * in_features + k + SIMD_WIDTH), w1, odd[i]);
        }
    }
    for (int i = 0; i < rows; ++i) {
        float sum = vf_sum(vf_add(even[i], odd[i]));
        for (int64_t t = k; t < in_features; ++t) sum += x[i * in_features + t] * load(w, t, is_bf16);
        if (bias != NULL) sum += load(bias, 0, is_bf16);
        store(out, i * out_stride, sum, is_bf16);
    }
}

/* Output feature n (weight row n) for every input row. */
static inline __attribute__((always_inline)) void weight_row(const float *x, const void *w, const void *bias,
                                                             void *out, int64_t num_rows, int64_t in_features,
                                                             int64_t out_features, int64_t n, const int is_bf16) {
    const int64_t element_bytes = is_bf16 ? 2 : 4;
    const void *row_bias = bias == NULL ? NULL : (const char *)bias + n * element_bytes;
    const void *weight = (const char *)w + n * in_features * element_bytes;
    for (int64_t m = 0; m < num_rows; m += MAX_TILE_ROWS) {
        const float *x_tile = x + m * in_features;
        void *out_tile = (char *)out + (m * out_features + n) * element_bytes;
        /* Constant tile heights, so each variant's loops unroll into straight register code. */
        switch (num_rows - m) {
            case 1: tile(x_tile, weight, row_bias, out_tile, out_features, in_features, 1, is_bf16); break;
            case 2: tile(x_tile, weight, row_bias, out_tile, out_features, in_features, 2, is_bf16); break;
            case 3: tile(x_tile, weight, row_bias, out_tile, out_features, in_features, 3, is_bf16); break;
            default: tile(x_tile, weight, row_bias, out_tile, out_features, in_features, 4, is_bf16); break;
        }
    }
}
#else
/* Generic build: one dot product per output, left to the compiler to vectorize. */
static inline __attribute__((always_inline)) void weight_row(const float *x, const void *w, const void *bias,
                                                             void *out, int64_t num_rows, int64_t in_features,
                                                             int64_t out_features, int64_t n, const int is_bf16) {
    const int64_t offset = n * in_features;
    for (int64_t m = 0; m < num_rows; ++m) {
        const float *input = x + m * in_features;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t k = 0; k < in_features; ++k) sum += input[k] * load(w, offset + k, is_bf16);
        if (bias != NULL) sum += load(bias, n, is_bf16);
        store(out, m * out_features + n, sum, is_bf16);
    }
}
#endif

/* Returns 0, or -1 when the float32 copy of x cannot be allocated. */
int linear_rows(const void *x, int64_t x_stride, const void *w, const void *bias, void *out, int64_t num_rows,
                int64_t in_features, int64_t out_features, int is_bf16) {
    /* x is read once per weight row: converted (or gathered) once here, not at every read. */
    float *x32 = malloc((size_t)(num_rows * in_features) * sizeof(float));
    if (x32 == NULL) return -1;
    for (int64_t m = 0; m < num_rows; ++m) {
#pragma omp simd
        for (int64_t k = 0; k < in_features; ++k) x32[m * in_features + k] = load(x, m * x_stride + k, is_bf16);
    }
    /* The dtype branch inside the loop: OpenMP outlines the body, and only there does a
       constant is_bf16 reach the inlined row code. */
#pragma omp parallel for schedule(static) if (out_features * in_features >= PARALLEL_MIN_WEIGHTS)
    for (int64_t n = 0; n < out_features; ++n) {
        if (is_bf16)
            weight_row(x32, w, bias, out, num_rows, in_features, out_features, n, 1);
        else
            weight_row(x32, w, bias, out, num_rows, in_features, out_features, n, 0);
    }
    free(x32);
    return 0;
}
