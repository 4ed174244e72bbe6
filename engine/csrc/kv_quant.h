/*
 * Rows of a quantized KV cache (engine/kv_cache_dtype.py): head_dim 8-bit values, int8 or fp8
 * e4m3, then their float32 scale; a value is stored * scale.
 *
 * Writing (kv_store.c) computes the same float32 operations as engine.kv_cache_dtype.quantize,
 * in the same order, so the C and the torch writers store the same bytes. Reading
 * (paged_decode.c) widens a vector of values to float in registers: int8 by sign extension;
 * fp8 by moving its bits into a half's (sign, 4-bit exponent, 3-bit mantissa in place) and
 * F16C's half -> float, which turns fp8's subnormals into normal floats exactly (no denormal
 * float ever reaches the arithmetic); the half is the fp8 value times 2^-8, a factor the caller
 * folds into the row's scale (kv_vector_factor).
 */
#ifndef SPLITSERVE_KV_QUANT_H
#define SPLITSERVE_KV_QUANT_H

#include "simd.h"

/* The format of a cache's rows, as engine/cpu_kernels.py passes it. */
enum { KV_PLAIN = 0, KV_INT8 = 1, KV_FP8_E4M3 = 2 };
#define KV_SCALE_BYTES 4

/* The float32 scale stored after a row's head_dim values. */
static inline float kv_row_scale(const uint8_t *row, int64_t head_dim) {
    float scale;
    memcpy(&scale, row + head_dim, sizeof scale);
    return scale;
}

static inline float fp8_e4m3_to_float(uint8_t bits) {
    const uint32_t exponent = (bits >> 3) & 15u, mantissa = bits & 7u;
    float magnitude = (float)mantissa * 0.001953125f; /* subnormal: mantissa * 2^-9 */
    if (exponent != 0) {
        const uint32_t f = ((exponent + 120u) << 23) | (mantissa << 20); /* bias 7 -> 127 */
        memcpy(&magnitude, &f, sizeof magnitude);
    }
    return (bits & 0x80u) ? -magnitude : magnitude;
}

/* Round to nearest, ties to even, as torch's float -> float8_e4m3fn (c10's
   fp8e4m3fn_from_fp32_value); |value| <= 448, which the quantizer's clamp guarantees. */
static inline uint8_t float_to_fp8_e4m3(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    const uint32_t sign = bits & 0x80000000u;
    bits ^= sign;
    uint8_t result;
    if (bits >= (1087u << 20)) {
        result = 0x7F; /* 480 and up: NaN */
    } else if (bits < (121u << 23)) {
        /* Below 2^-6, the smallest normal: adding 2^14 rounds the float to a multiple of 2^-9,
           fp8's subnormal step, and leaves that multiple in the low mantissa bits. */
        const uint32_t denorm_bits = 141u << 23;
        float magnitude, denorm, sum;
        memcpy(&magnitude, &bits, sizeof magnitude);
        memcpy(&denorm, &denorm_bits, sizeof denorm);
        sum = magnitude + denorm;
        memcpy(&bits, &sum, sizeof bits);
        result = (uint8_t)(bits - denorm_bits);
    } else {
        const uint32_t odd = (bits >> 20) & 1u;
        bits += ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + odd; /* rebias, round to 3 mantissa bits */
        result = (uint8_t)(bits >> 20);
    }
    return result | (uint8_t)(sign >> 24);
}

/* One row of head_dim values (bf16 or float32 at src) into dst: head_dim bytes, then the scale. */
static inline void kv_quantize_row(const void *src, int is_bf16, int64_t head_dim, int kv_format, uint8_t *dst) {
    const float qmax = kv_format == KV_INT8 ? 127.0f : 448.0f;
    float absmax = 0.0f;
    for (int64_t d = 0; d < head_dim; ++d) {
        const float magnitude = fabsf(load(src, d, is_bf16));
        absmax = magnitude > absmax ? magnitude : absmax;
    }
    const float scale = absmax / qmax;
    const float inverse = 1.0f / (scale > 0.0f ? scale : 1.0f); /* an all-zero row stores zeros */
    for (int64_t d = 0; d < head_dim; ++d) {
        const float x = fminf(fmaxf(load(src, d, is_bf16) * inverse, -qmax), qmax);
        dst[d] = kv_format == KV_INT8 ? (uint8_t)(int8_t)rintf(x) : float_to_fp8_e4m3(x);
    }
    memcpy(dst + head_dim, &scale, sizeof scale);
}

/* A row's value d as float, without its scale. */
static inline float kv_value(const uint8_t *row, int64_t d, int kv_format) {
    return kv_format == KV_INT8 ? (float)(int8_t)row[d] : fp8_e4m3_to_float(row[d]);
}

/* fp8 -> half, three integer steps per vector of 16-bit lanes: sign-extend each byte to 16 bits
   (bits 7..15 all the sign), shift left by 7 (exponent and mantissa land in bits 7..13, the sign
   in bits 14 and 15), clear bit 14 (the half's top exponent bit, always 0 for fp8's range). */
#define KV_FP8_HALF_MASK 0xBFFF

#if SIMD_WIDTH == 16
/* 16 values from p, as floats times kv_vector_factor's reciprocal. */
static inline __attribute__((always_inline)) vfloat vload_kv(const uint8_t *p, const int kv_format) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    if (kv_format == KV_INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
    const __m256i half = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7),
                                          _mm256_set1_epi16((short)KV_FP8_HALF_MASK));
    return _mm512_cvtph_ps(half);
}
#elif SIMD_WIDTH == 8
/* 8 values from p, as floats times kv_vector_factor's reciprocal. */
static inline __attribute__((always_inline)) vfloat vload_kv(const uint8_t *p, const int kv_format) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)p);
    if (kv_format == KV_INT8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    const __m128i half =
        _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(bytes), 7), _mm_set1_epi16((short)KV_FP8_HALF_MASK));
    return _mm256_cvtph_ps(half);
}
#endif

/* What vload_kv's floats are to be multiplied by, besides the row's scale. */
static inline float kv_vector_factor(int kv_format) { return kv_format == KV_FP8_E4M3 ? 256.0f : 1.0f; }

#endif
