/*
 * Fused elementwise kernels for CPU, each one pass over its rows instead of the
 * four to seven PyTorch ops (and temporaries) it replaces. In bfloat16 the norm
 * and the rotation round at the same points as transformers' modules do.
 *
 * All tensors are row-major; rows are split across OpenMP threads only when there
 * are enough elements to pay for it (parallel_worth_it): one decode token's row is
 * a few microseconds of arithmetic, while waking a thread team costs as much, and
 * far more when a core is busy with another process (the barrier waits for it).
 *
 * Each loop runs full SIMD vectors (simd.h) and then a scalar tail; in the generic
 * build the scalar loop does it all.
 */
#include "simd.h"

/* Below this many elements a call runs on the calling thread alone. */
#define PARALLEL_MIN_ELEMENTS (1 << 16)

static inline int parallel_worth_it(int64_t num_rows, int64_t width) {
    return num_rows > 1 && num_rows * width >= PARALLEL_MIN_ELEMENTS;
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
    int64_t i = 0;
    const void *normed_input = residual != NULL ? residual : x;
#if SIMD_WIDTH > 1
    vfloat sum = vf_zero();
    if (residual != NULL) {
        for (; i < vector_end(hidden); i += SIMD_WIDTH) {
            const vfloat value = vround_to(vf_add(vload(x, offset + i, is_bf16), vload(residual, offset + i, is_bf16)), is_bf16);
            vstore(residual, offset + i, value, is_bf16);
            sum = vf_fmadd(value, value, sum);
        }
    } else {
        for (; i < vector_end(hidden); i += SIMD_WIDTH) {
            const vfloat value = vload(x, offset + i, is_bf16);
            sum = vf_fmadd(value, value, sum);
        }
    }
    sum_squares = vf_sum(sum);
#endif
    if (residual != NULL) {
#pragma omp simd reduction(+ : sum_squares)
        for (int64_t j = i; j < hidden; ++j) {
            const float value = round_to(load(x, offset + j, is_bf16) + load(residual, offset + j, is_bf16), is_bf16);
            store(residual, offset + j, value, is_bf16);
            sum_squares += value * value;
        }
    } else {
#pragma omp simd reduction(+ : sum_squares)
        for (int64_t j = i; j < hidden; ++j) {
            const float value = load(x, offset + j, is_bf16);
            sum_squares += value * value;
        }
    }
    const float inv_rms = 1.0f / sqrtf(sum_squares / (float)hidden + eps);
    i = 0;
#if SIMD_WIDTH > 1
    const vfloat scale = vf_set1(inv_rms);
    for (; i < vector_end(hidden); i += SIMD_WIDTH) {
        const vfloat normed = vround_to(vf_mul(vload(normed_input, offset + i, is_bf16), scale), is_bf16);
        vstore(out, offset + i, vf_mul(vload(weight, i, is_bf16), normed), is_bf16);
    }
#endif
#pragma omp simd
    for (int64_t j = i; j < hidden; ++j) {
        const float normed = round_to(load(normed_input, offset + j, is_bf16) * inv_rms, is_bf16);
        store(out, offset + j, load(weight, j, is_bf16) * normed, is_bf16);
    }
}

/* The dtype branch sits inside each parallel loop: OpenMP outlines the loop body into its own
   function, so only there does a constant is_bf16 reach the inlined row code. */
void add_rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t num_rows, int64_t hidden,
                  float eps, int is_bf16) {
#pragma omp parallel for schedule(static) if (parallel_worth_it(num_rows, hidden))
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
   bfloat16 ulp. */
static inline __attribute__((always_inline)) void silu_and_mul_row(const void *gate_up, void *out, int64_t row,
                                                                   int64_t intermediate, const int is_bf16) {
    const int64_t gate = row * 2 * intermediate, up = gate + intermediate, dst = row * intermediate;
    int64_t i = 0;
#if SIMD_WIDTH > 1
    const vfloat one = vf_set1(1.0f), zero = vf_zero();
    for (; i < vector_end(intermediate); i += SIMD_WIDTH) {
        const vfloat g = vload(gate_up, gate + i, is_bf16), u = vload(gate_up, up + i, is_bf16);
        vstore(out, dst + i, vf_mul(vf_div(g, vf_add(one, vf_exp(vf_sub(zero, g)))), u), is_bf16);
    }
#endif
#pragma omp simd
    for (int64_t j = i; j < intermediate; ++j)
        store(out, dst + j, silu_times(load(gate_up, gate + j, is_bf16), load(gate_up, up + j, is_bf16)), is_bf16);
}

/* gate_up: [num_rows, 2 * intermediate] (gate then up); out: [num_rows, intermediate]. */
void silu_and_mul(const void *gate_up, void *out, int64_t num_rows, int64_t intermediate, int is_bf16) {
#pragma omp parallel for schedule(static) if (parallel_worth_it(num_rows, 3 * intermediate))
    for (int64_t row = 0; row < num_rows; ++row) {
        if (is_bf16)
            silu_and_mul_row(gate_up, out, row, intermediate, 1);
        else
            silu_and_mul_row(gate_up, out, row, intermediate, 0);
    }
}

/* One token's heads: transformers computes x * cos + rotate_half(x) * sin, each product
   rounded, then the sum. */
static inline __attribute__((always_inline)) void rotary_heads(const void *src, void *dst, const void *cos_cache,
                                                               const void *sin_cache, int64_t table, int64_t src_offset,
                                                               int64_t dst_offset, int64_t num_heads, int64_t head_dim,
                                                               const int is_bf16) {
    const int64_t half = head_dim / 2;
    for (int64_t head = 0; head < num_heads; ++head, src_offset += head_dim, dst_offset += head_dim) {
        int64_t i = 0;
#if SIMD_WIDTH > 1
        for (; i < vector_end(half); i += SIMD_WIDTH) {
            const vfloat c = vload(cos_cache, table + i, is_bf16), s = vload(sin_cache, table + i, is_bf16);
            const vfloat x1 = vload(src, src_offset + i, is_bf16), x2 = vload(src, src_offset + half + i, is_bf16);
            const vfloat first = vf_sub(vround_to(vf_mul(x1, c), is_bf16), vround_to(vf_mul(x2, s), is_bf16));
            const vfloat second = vf_add(vround_to(vf_mul(x2, c), is_bf16), vround_to(vf_mul(x1, s), is_bf16));
            vstore(dst, dst_offset + i, first, is_bf16);
            vstore(dst, dst_offset + half + i, second, is_bf16);
        }
#endif
#pragma omp simd
        for (int64_t j = i; j < half; ++j) {
            const float c = load(cos_cache, table + j, is_bf16), s = load(sin_cache, table + j, is_bf16);
            const float x1 = load(src, src_offset + j, is_bf16), x2 = load(src, src_offset + half + j, is_bf16);
            store(dst, dst_offset + j, round_to(x1 * c, is_bf16) - round_to(x2 * s, is_bf16), is_bf16);
            store(dst, dst_offset + half + j, round_to(x2 * c, is_bf16) + round_to(x1 * s, is_bf16), is_bf16);
        }
    }
}

/*
 * Neox-style rotary embedding of q and k in one call (one decode layer's worth):
 * q_out = rotate(q), k_out = rotate(k). q: [num_tokens, num_heads, head_dim] and
 * k: [num_tokens, num_kv_heads, head_dim], rows q_stride / k_stride elements apart
 * (heads and head_dim contiguous: views into the fused qkv projection); q_out, k_out
 * contiguous. cos, sin: [max_positions, head_dim / 2] in the same dtype; positions:
 * [num_tokens].
 */
void rotary_embedding(const void *q, int64_t q_stride, const void *k, int64_t k_stride, void *q_out, void *k_out,
                      const void *cos_cache, const void *sin_cache, const int64_t *positions, int64_t num_tokens,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int is_bf16) {
#pragma omp parallel for schedule(static) if (parallel_worth_it(num_tokens, (num_heads + num_kv_heads) * head_dim))
    for (int64_t token = 0; token < num_tokens; ++token) {
        const int64_t table = positions[token] * (head_dim / 2);
        const int64_t q_dst = token * num_heads * head_dim, k_dst = token * num_kv_heads * head_dim;
        if (is_bf16) {
            rotary_heads(q, q_out, cos_cache, sin_cache, table, token * q_stride, q_dst, num_heads, head_dim, 1);
            rotary_heads(k, k_out, cos_cache, sin_cache, table, token * k_stride, k_dst, num_kv_heads, head_dim, 1);
        } else {
            rotary_heads(q, q_out, cos_cache, sin_cache, table, token * q_stride, q_dst, num_heads, head_dim, 0);
            rotary_heads(k, k_out, cos_cache, sin_cache, table, token * k_stride, k_dst, num_kv_heads, head_dim, 0);
        }
    }
}

/* Which simd.h path this library was built with: the loader checks it got the one it asked for. */
const char *simd_isa(void) { return SIMD_ISA_NAME; }
