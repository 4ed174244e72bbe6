/*
 * The quantized weight formats the kernels read, and the dequantization of GGUF's (ggml's)
 * 32-element blocks into this build's float vectors (simd.h). The K-quants' 256-element
 * super-blocks are in quant_kblocks.h.
 *
 *   Q4_0  18 bytes: fp16 d, 16 bytes of nibbles          w = d * (q - 8)
 *   Q4_1  20 bytes: fp16 d, fp16 m, 16 bytes of nibbles  w = d * q + m
 *   Q8_0  34 bytes: fp16 d, 32 int8                      w = d * q
 *
 * In the nibble formats byte j holds element j in its low nibble and element j + 16 in its
 * high one. A weight row of in_features elements is in_features / 32 blocks back to back,
 * rows one after another: the tensor as it lies in the file.
 *
 *   INT8  splitserve's own (--quantization int8): a row is its float32 scale, then
 *         in_features int8 values, w = scale * q (per output channel). The kernels walk it in
 *         "blocks" of 32 values with unit scale, then the row's tail, and scale each dot
 *         product once; in_features need not divide into blocks.
 *
 * The type codes are ggml's (GGMLQuantizationType), INT8's outside their range:
 * engine/models/quant_format.py names them.
 */
#ifndef SPLITSERVE_QUANT_BLOCKS_H
#define SPLITSERVE_QUANT_BLOCKS_H

#include "simd.h"
#if defined(__F16C__)
#include <immintrin.h>
#endif

#define QUANT_BLOCK 32
#define QTYPE_Q4_0 2
#define QTYPE_Q4_1 3
#define QTYPE_Q8_0 8
#define QTYPE_Q4_K 12
#define QTYPE_Q5_K 13
#define QTYPE_Q6_K 14
#define QTYPE_INT8 200
#define INT8_HEADER_BYTES 4

static inline int qtype_known(int qtype) {
    return qtype == QTYPE_Q4_0 || qtype == QTYPE_Q4_1 || qtype == QTYPE_Q8_0 || qtype == QTYPE_Q4_K ||
           qtype == QTYPE_Q5_K || qtype == QTYPE_Q6_K || qtype == QTYPE_INT8;
}

/* Elements of one block as the kernels walk a row (INT8: 32, its tail aside). */
static inline __attribute__((always_inline)) int64_t qtype_block_elements(const int qtype) {
    return qtype == QTYPE_Q4_K || qtype == QTYPE_Q5_K || qtype == QTYPE_Q6_K ? 256 : QUANT_BLOCK;
}

static inline __attribute__((always_inline)) int64_t qtype_block_bytes(const int qtype) {
    switch (qtype) {
        case QTYPE_Q4_0: return 18;
        case QTYPE_Q4_1: return 20;
        case QTYPE_Q8_0: return 34;
        case QTYPE_Q4_K: return 144;
        case QTYPE_Q5_K: return 176;
        case QTYPE_Q6_K: return 210;
        default: return QUANT_BLOCK; /* INT8 */
    }
}

/* Bytes of a row of in_features elements; -1 for an unknown qtype or a row that is not whole
   blocks. */
static inline int64_t quant_row_bytes_of(int qtype, int64_t in_features) {
    if (!qtype_known(qtype) || in_features <= 0) return -1;
    if (qtype == QTYPE_INT8) return INT8_HEADER_BYTES + in_features;
    const int64_t elements = qtype_block_elements(qtype);
    return in_features % elements ? -1 : in_features / elements * qtype_block_bytes(qtype);
}

/* Where a row's blocks start (after an INT8 row's scale). */
static inline __attribute__((always_inline)) const uint8_t *row_blocks(const uint8_t *w_row, const int qtype) {
    return qtype == QTYPE_INT8 ? w_row + INT8_HEADER_BYTES : w_row;
}

/* An INT8 row's scale (1 for every other format, whose scales are in their blocks). */
static inline __attribute__((always_inline)) float row_scale(const uint8_t *w_row, const int qtype) {
    if (qtype != QTYPE_INT8) return 1.0f;
    float scale;
    memcpy(&scale, w_row, sizeof scale);
    return scale;
}

/* IEEE half to float, exact (subnormals included): the generic build's conversion. */
static inline float half_to_float_soft(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu, bits;
    if (exponent == 0x1Fu) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        exponent = 113;
        while ((mantissa & 0x400u) == 0) {
            mantissa <<= 1;
            --exponent;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3FFu) << 13);
    }
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* float to IEEE half, round to nearest even (as numpy's astype(float16)), then back: the value
   a half stores. The generic build's conversion. */
static inline float round_to_half_soft(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    const uint32_t sign = bits & 0x80000000u, magnitude = bits & 0x7FFFFFFFu;
    uint16_t h;
    if (magnitude >= 0x7F800000u) { /* inf, nan */
        h = (uint16_t)(0x7C00u | (magnitude > 0x7F800000u ? 0x200u : 0));
    } else if (magnitude >= 0x477FF000u) { /* rounds past the largest half */
        h = 0x7C00u;
    } else if (magnitude < 0x38800000u) { /* a half subnormal (or zero): scale into 10 bits, round */
        const float scaled = (float)(magnitude == 0 ? 0.0 : (double)fabsf(value) * 16777216.0); /* 2^24 */
        h = (uint16_t)lrintf(scaled);
    } else {
        const uint32_t rounded = magnitude + 0xFFFu + ((magnitude >> 13) & 1u);
        h = (uint16_t)((rounded - 0x38000000u) >> 13);
    }
    return half_to_float_soft((uint16_t)(sign >> 16) | h);
}

static inline __attribute__((always_inline)) float round_to_half(float value) {
#if defined(__F16C__)
    return _cvtsh_ss(_cvtss_sh(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    return round_to_half_soft(value);
#endif
}

static inline __attribute__((always_inline)) float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return half_to_float_soft(h);
#endif
}

#if defined(__F16C__)
/* The two halves at p (a Q4_1 block's d and m) in lanes 0 and 1: one conversion for both (for
   quant_bf16.c, where one at a time took about a fifth of a decode row's time). */
static inline __attribute__((always_inline)) __m128 half_pair_to_floats(const uint8_t *p) {
    int32_t halves;
    memcpy(&halves, p, sizeof halves);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(halves));
}
#endif

/* One block into 32 floats, plain C: the generic build's path and every build's reference. */
static inline __attribute__((always_inline)) void dequantize_block_scalar(const uint8_t *block, const int qtype,
                                                                          float *out) {
    if (qtype == QTYPE_INT8) { /* unit scale: the row's is applied to its dot product */
        for (int j = 0; j < QUANT_BLOCK; ++j) out[j] = (float)((const int8_t *)block)[j];
        return;
    }
    const float d = half_to_float(block);
    if (qtype == QTYPE_Q8_0) {
        const int8_t *q = (const int8_t *)(block + 2);
        for (int j = 0; j < QUANT_BLOCK; ++j) out[j] = d * (float)q[j];
        return;
    }
    const uint8_t *q = block + (qtype == QTYPE_Q4_1 ? 4 : 2);
    const float m = qtype == QTYPE_Q4_1 ? half_to_float(block + 2) : -8.0f * d;
    for (int j = 0; j < QUANT_BLOCK / 2; ++j) {
        out[j] = (float)(q[j] & 0x0F) * d + m;
        out[j + QUANT_BLOCK / 2] = (float)(q[j] >> 4) * d + m;
    }
}

#if SIMD_WIDTH > 1
/* Vectors of one block. */
#define QVECS (QUANT_BLOCK / SIMD_WIDTH)

/* One block into QVECS float vectors, in registers (w = q * d + m, one FMA per vector). */
static inline __attribute__((always_inline)) void dequantize_block(const uint8_t *block, const int qtype,
                                                                   vfloat w[QVECS]) {
    if (qtype == QTYPE_INT8) {
        for (int v = 0; v < QVECS; ++v) {
#if SIMD_WIDTH == 16
            w[v] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 16 * v))));
#else
            w[v] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(block + 8 * v))));
#endif
        }
        return;
    }
    const vfloat d = vf_set1(half_to_float(block));
#if SIMD_WIDTH == 16
    if (qtype == QTYPE_Q8_0) {
        const __m128i *q = (const __m128i *)(block + 2);
        w[0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))));
        w[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))));
        return;
    }
    const __m128i nibbles = _mm_loadu_si128((const __m128i *)(block + (qtype == QTYPE_Q4_1 ? 4 : 2)));
    const __m128i low_mask = _mm_set1_epi8(0x0F);
    const vfloat m = qtype == QTYPE_Q4_1 ? vf_set1(half_to_float(block + 2)) : vf_mul(d, vf_set1(-8.0f));
    w[0] = vf_fmadd(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(nibbles, low_mask))), d, m);
    w[1] = vf_fmadd(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(nibbles, 4), low_mask))), d,
                    m);
#else
    if (qtype == QTYPE_Q8_0) {
        const uint8_t *q = block + 2;
        for (int v = 0; v < QVECS; ++v) {
            const __m128i bytes = _mm_loadl_epi64((const __m128i *)(q + 8 * v));
            w[v] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
        }
        return;
    }
    const __m128i nibbles = _mm_loadu_si128((const __m128i *)(block + (qtype == QTYPE_Q4_1 ? 4 : 2)));
    const __m128i low_mask = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(nibbles, low_mask);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(nibbles, 4), low_mask);
    const vfloat m = qtype == QTYPE_Q4_1 ? vf_set1(half_to_float(block + 2)) : vf_mul(d, vf_set1(-8.0f));
    w[0] = vf_fmadd(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low)), d, m);
    w[1] = vf_fmadd(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8))), d, m);
    w[2] = vf_fmadd(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high)), d, m);
    w[3] = vf_fmadd(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8))), d, m);
#endif
}
#endif

#endif
