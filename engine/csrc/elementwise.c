/*
 * Fused elementwise kernels for CPU, each one pass over its rows instead of the
 * four to seven PyTorch ops (and temporaries) it replaces. In bfloat16 the norm
 * and the rotation round at the same points as transformers' modules do.
 *
 * All tensors are contiguous, row-major; rows are split across OpenMP threads.
 */
#include "common.h"

/* Element i of a bf16 (is_bf16) or float32 array, as float. */
static inline float load(const void *base, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_float(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* Round to the storage dtype (identity in float32): where a PyTorch op would round its output. */
static inline float round_to(float value, int is_bf16) { return is_bf16 ? bf16_round(value) : value; }

static inline void store(void *base, int64_t i, float value, int is_bf16) {
    if (is_bf16)
        ((uint16_t *)base)[i] = float_to_bf16(value);
    else
        ((float *)base)[i] = value;
}

/*
 * One row of add_rms_norm: residual (optional, in place) += x; out = weight * rms_norm(residual or x).
 * transformers: hidden = residual + x (rounded); normed = (hidden.float() * rsqrt(mean(hidden^2) + eps))
 * rounded to the dtype; out = weight * normed (rounded).
 */
static inline __attribute__((always_inline)) void add_rms_norm_row(const void *x, void *residual,
                                                                   const void *weight, void *out, int64_t offset,
                                                                   int64_t hidden, float eps, const int is_bf16) {
    float sum_squares = 0.0f;
    if (residual != NULL) {
#pragma omp simd reduction(+ : sum_squares)
        for (int64_t i = 0; i < hidden; ++i) {
            const float value = round_to(load(x, offset + i, is_bf16) + load(residual, offset + i, is_bf16), is_bf16);
            store(residual, offset + i, value, is_bf16);
            sum_squares += value * value;
        }
    } else {
#pragma omp simd reduction(+ : sum_squares)
        for (int64_t i = 0; i < hidden; ++i) {
            const float value = load(x, offset + i, is_bf16);
            sum_squares += value * value;
        }
    }
    const void *normed_input = residual != NULL ? residual : x;
    const float inv_rms = 1.0f / sqrtf(sum_squares / (float)hidden + eps);
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) {
        const float normed = round_to(load(normed_input, offset + i, is_bf16) * inv_rms, is_bf16);
        store(out, offset + i, load(weight, i, is_bf16) * normed, is_bf16);
    }
}

/* The dtype branch sits inside each parallel loop: OpenMP outlines the loop body into its own
   function, so only there does a constant is_bf16 reach the inlined row code. */
void add_rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t num_rows, int64_t hidden,
                  float eps, int is_bf16) {
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < num_rows; ++row) {
        if (is_bf16)
            add_rms_norm_row(x, residual, weight, out, row * hidden, hidden, eps, 1);
        else
            add_rms_norm_row(x, residual, weight, out, row * hidden, hidden, eps, 0);
    }
}

static inline __attribute__((always_inline)) float silu_times(float gate, float up) {
    return gate / (1.0f + fast_expf(-gate)) * up;
}

/* out[i] = silu(gate[i]) * up[i], computed in float32 and rounded once, as vLLM's
   fused kernel does: transformers also rounds the silu, and so can differ by one
   bfloat16 ulp (rounding twice vectorizes 4x worse here). Typed, restrict pointers:
   with void pointers the compiler cannot rule out aliasing. */
static inline __attribute__((always_inline)) void silu_and_mul_row(const void *gate_up, void *out, int64_t row,
                                                                   int64_t intermediate, const int is_bf16) {
    const int64_t in_offset = row * 2 * intermediate, out_offset = row * intermediate;
    if (is_bf16) {
        const uint16_t *restrict gate = (const uint16_t *)gate_up + in_offset, *restrict up = gate + intermediate;
        uint16_t *restrict dst = (uint16_t *)out + out_offset;
#pragma omp simd
        for (int64_t i = 0; i < intermediate; ++i)
            dst[i] = float_to_bf16(silu_times(bf16_to_float(gate[i]), bf16_to_float(up[i])));
    } else {
        const float *restrict gate = (const float *)gate_up + in_offset, *restrict up = gate + intermediate;
        float *restrict dst = (float *)out + out_offset;
#pragma omp simd
        for (int64_t i = 0; i < intermediate; ++i) dst[i] = silu_times(gate[i], up[i]);
    }
}

/* gate_up: [num_rows, 2 * intermediate] (gate then up); out: [num_rows, intermediate]. */
void silu_and_mul(const void *gate_up, void *out, int64_t num_rows, int64_t intermediate, int is_bf16) {
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < num_rows; ++row) {
        if (is_bf16)
            silu_and_mul_row(gate_up, out, row, intermediate, 1);
        else
            silu_and_mul_row(gate_up, out, row, intermediate, 0);
    }
}

/* transformers: x * cos + rotate_half(x) * sin, each product rounded, then the sum. */
static inline __attribute__((always_inline)) void rotary_token(const void *src, void *dst, const void *cos_cache,
                                                               const void *sin_cache, int64_t table, int64_t src_offset,
                                                               int64_t dst_offset, int64_t num_heads, int64_t head_dim,
                                                               const int is_bf16) {
    const int64_t half = head_dim / 2;
    for (int64_t head = 0; head < num_heads; ++head, src_offset += head_dim, dst_offset += head_dim) {
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
            const float c = load(cos_cache, table + i, is_bf16), s = load(sin_cache, table + i, is_bf16);
            const float x1 = load(src, src_offset + i, is_bf16), x2 = load(src, src_offset + half + i, is_bf16);
            store(dst, dst_offset + i, round_to(x1 * c, is_bf16) + round_to(-x2 * s, is_bf16), is_bf16);
            store(dst, dst_offset + half + i, round_to(x2 * c, is_bf16) + round_to(x1 * s, is_bf16), is_bf16);
        }
    }
}

/*
 * Neox-style rotary embedding: dst = rotate(src). src, dst: [num_tokens, num_heads, head_dim], rows
 * src_stride / dst_stride elements apart (heads and head_dim contiguous); cos, sin:
 * [max_positions, head_dim / 2] in the same dtype; positions: [num_tokens]. dst may be src.
 */
void rotary_embedding(const void *src, int64_t src_stride, void *dst, int64_t dst_stride, const void *cos_cache,
                      const void *sin_cache, const int64_t *positions, int64_t num_tokens, int64_t num_heads,
                      int64_t head_dim, int is_bf16) {
#pragma omp parallel for schedule(static)
    for (int64_t token = 0; token < num_tokens; ++token) {
        const int64_t table = positions[token] * (head_dim / 2);
        if (is_bf16)
            rotary_token(src, dst, cos_cache, sin_cache, table, token * src_stride, token * dst_stride, num_heads,
                         head_dim, 1);
        else
            rotary_token(src, dst, cos_cache, sin_cache, table, token * src_stride, token * dst_stride, num_heads,
                         head_dim, 0);
    }
}
