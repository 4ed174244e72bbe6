/*
 * One float vector type for the ISA this library is built for (engine/cpu_kernels.py
 * builds one library per ISA with explicit -m flags and loads the best the CPU runs):
 *
 *   AVX-512 (F/BW/VL/DQ)   16 lanes; with AVX512_BF16, float -> bf16 in one vcvtneps2bf16
 *   AVX2 + FMA + F16C       8 lanes; bf16 <-> float with integer shifts and adds
 *   anything else           SIMD_WIDTH 1: no vector loops; the scalar loops that every
 *                           kernel keeps for its tail do all the work, and the compiler
 *                           vectorizes them as it can (NEON on aarch64)
 *
 * bf16 -> float is exact (a 16-bit shift). float -> bf16 rounds to nearest even, as
 * PyTorch does; vcvtneps2bf16 also does, and differs only in flushing denormals
 * (below 1.2e-38) to zero.
 */
#ifndef SPLITSERVE_SIMD_H
#define SPLITSERVE_SIMD_H

#include "common.h"

#if defined(__AVX2__)
#include <immintrin.h>
/* The sum of 8 floats: the AVX2 build's vf_sum, and the AVX-512 build's for 256-bit halves. */
static inline float sum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define SIMD_WIDTH 16
#define SIMD_ISA_NAME "avx512"
typedef __m512 vfloat;

static inline vfloat vf_zero(void) { return _mm512_setzero_ps(); }
static inline vfloat vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vfloat vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vfloat v) { _mm512_storeu_ps(p, v); }
static inline vfloat vf_add(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
static inline vfloat vf_sub(vfloat a, vfloat b) { return _mm512_sub_ps(a, b); }
static inline vfloat vf_mul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
static inline vfloat vf_div(vfloat a, vfloat b) { return _mm512_div_ps(a, b); }
static inline vfloat vf_min(vfloat a, vfloat b) { return _mm512_min_ps(a, b); }
static inline vfloat vf_max(vfloat a, vfloat b) { return _mm512_max_ps(a, b); }
static inline vfloat vf_fmadd(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vf_sum(vfloat v) { return _mm512_reduce_add_ps(v); }
static inline vfloat vf_floor(vfloat v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
static inline vfloat vf_from_bits(__m512i bits) { return _mm512_castsi512_ps(bits); }
static inline __m512i vf_bits(vfloat v) { return _mm512_castps_si512(v); }
typedef __m512i vint;
static inline vint vi_set1(int32_t x) { return _mm512_set1_epi32(x); }
static inline vint vi_add(vint a, vint b) { return _mm512_add_epi32(a, b); }
static inline vint vi_and(vint a, vint b) { return _mm512_and_si512(a, b); }
static inline vint vi_srli(vint a, int n) { return _mm512_srli_epi32(a, n); }
static inline vint vi_slli(vint a, int n) { return _mm512_slli_epi32(a, n); }
static inline vint vf_to_int(vfloat v) { return _mm512_cvtps_epi32(v); }

static inline vfloat vf_load_bf16(const uint16_t *p) {
    return vf_from_bits(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

#if defined(__AVX512BF16__)
#undef SIMD_ISA_NAME
#define SIMD_ISA_NAME "avx512_bf16"
static inline void vf_store_bf16(uint16_t *p, vfloat v) {
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v));
}
/* v rounded to bf16, kept as float: one convert down, one shift back up. */
static inline vfloat vf_round_bf16(vfloat v) {
    return vf_from_bits(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}
#else
static inline vint vi_round_bf16_bits(vfloat v); /* below, shared with AVX2 */
static inline void vf_store_bf16(uint16_t *p, vfloat v) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(vi_srli(vi_round_bf16_bits(v), 16)));
}
static inline vfloat vf_round_bf16(vfloat v) {
    return vf_from_bits(vi_and(vi_round_bf16_bits(v), vi_set1((int32_t)0xFFFF0000u)));
}
#endif

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SIMD_WIDTH 8
#define SIMD_ISA_NAME "avx2"
typedef __m256 vfloat;
typedef __m256i vint;

static inline vfloat vf_zero(void) { return _mm256_setzero_ps(); }
static inline vfloat vf_set1(float x) { return _mm256_set1_ps(x); }
static inline vfloat vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vfloat v) { _mm256_storeu_ps(p, v); }
static inline vfloat vf_add(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
static inline vfloat vf_sub(vfloat a, vfloat b) { return _mm256_sub_ps(a, b); }
static inline vfloat vf_mul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
static inline vfloat vf_div(vfloat a, vfloat b) { return _mm256_div_ps(a, b); }
static inline vfloat vf_min(vfloat a, vfloat b) { return _mm256_min_ps(a, b); }
static inline vfloat vf_max(vfloat a, vfloat b) { return _mm256_max_ps(a, b); }
static inline vfloat vf_fmadd(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vf_sum(vfloat v) { return sum256(v); }
static inline vfloat vf_floor(vfloat v) { return _mm256_floor_ps(v); }
static inline vfloat vf_from_bits(vint bits) { return _mm256_castsi256_ps(bits); }
static inline vint vf_bits(vfloat v) { return _mm256_castps_si256(v); }
static inline vint vi_set1(int32_t x) { return _mm256_set1_epi32(x); }
static inline vint vi_add(vint a, vint b) { return _mm256_add_epi32(a, b); }
static inline vint vi_and(vint a, vint b) { return _mm256_and_si256(a, b); }
static inline vint vi_srli(vint a, int n) { return _mm256_srli_epi32(a, n); }
static inline vint vi_slli(vint a, int n) { return _mm256_slli_epi32(a, n); }
static inline vint vf_to_int(vfloat v) { return _mm256_cvtps_epi32(v); }

static inline vfloat vf_load_bf16(const uint16_t *p) {
    return vf_from_bits(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vint vi_round_bf16_bits(vfloat v);
static inline void vf_store_bf16(uint16_t *p, vfloat v) {
    /* AVX2 has no 32 -> 16 bit narrowing: pack (which works per 128-bit lane), then gather the lanes. */
    const vint high = vi_srli(vi_round_bf16_bits(v), 16);
    const vint packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0xD8);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}
static inline vfloat vf_round_bf16(vfloat v) {
    return vf_from_bits(vi_and(vi_round_bf16_bits(v), vi_set1((int32_t)0xFFFF0000u)));
}

#else
#define SIMD_WIDTH 1
#define SIMD_ISA_NAME "generic"
#endif

#if SIMD_WIDTH > 1
/* The float's bits plus the round-to-nearest-even increment: the bf16 is the top 16 bits. */
static inline vint vi_round_bf16_bits(vfloat v) {
    const vint bits = vf_bits(v);
    return vi_add(bits, vi_add(vi_set1(0x7FFF), vi_and(vi_srli(bits, 16), vi_set1(1))));
}

/* fast_expf (common.h) on a vector: same range reduction and polynomial. */
static inline vfloat vf_exp(vfloat x) {
    x = vf_min(vf_max(x, vf_set1(-87.0f)), vf_set1(88.0f));
    const vfloat t = vf_mul(x, vf_set1(1.44269504088896341f));
    const vfloat n = vf_floor(vf_add(t, vf_set1(0.5f)));
    const vfloat f = vf_sub(t, n);
    vfloat p = vf_set1(1.5252733804059841e-5f);
    p = vf_fmadd(p, f, vf_set1(1.5403530393381609e-4f));
    p = vf_fmadd(p, f, vf_set1(1.3333558146428443e-3f));
    p = vf_fmadd(p, f, vf_set1(9.6181291076284772e-3f));
    p = vf_fmadd(p, f, vf_set1(5.5504108664821580e-2f));
    p = vf_fmadd(p, f, vf_set1(2.4022650695910071e-1f));
    p = vf_fmadd(p, f, vf_set1(6.9314718055994531e-1f));
    p = vf_fmadd(p, f, vf_set1(1.0f));
    const vfloat scale = vf_from_bits(vi_slli(vi_add(vf_to_int(n), vi_set1(127)), 23));
    return vf_mul(p, scale);
}

/* Element i.. of a bf16 (is_bf16) or float32 array as a float vector, and back. */
static inline __attribute__((always_inline)) vfloat vload(const void *base, int64_t i, const int is_bf16) {
    return is_bf16 ? vf_load_bf16((const uint16_t *)base + i) : vf_load((const float *)base + i);
}

static inline __attribute__((always_inline)) void vstore(void *base, int64_t i, vfloat v, const int is_bf16) {
    if (is_bf16)
        vf_store_bf16((uint16_t *)base + i, v);
    else
        vf_store((float *)base + i, v);
}

/* Round to the storage dtype (identity in float32): where a PyTorch op would round its output. */
static inline __attribute__((always_inline)) vfloat vround_to(vfloat v, const int is_bf16) {
    return is_bf16 ? vf_round_bf16(v) : v;
}
#endif

/* The scalar counterparts, for tails and for the generic build. */
static inline __attribute__((always_inline)) float load(const void *base, int64_t i, const int is_bf16) {
    return is_bf16 ? bf16_to_float(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline __attribute__((always_inline)) float round_to(float value, const int is_bf16) {
    return is_bf16 ? bf16_round(value) : value;
}

static inline __attribute__((always_inline)) void store(void *base, int64_t i, float value, const int is_bf16) {
    if (is_bf16)
        ((uint16_t *)base)[i] = float_to_bf16(value);
    else
        ((float *)base)[i] = value;
}

/* Iterations of a loop over n elements that full vectors cover; the rest go to the scalar tail. */
static inline int64_t vector_end(int64_t n) { return n - n % SIMD_WIDTH; }

#endif
