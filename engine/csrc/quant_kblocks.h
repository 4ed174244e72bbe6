/*
 * GGUF's K-quants (llama.cpp's k_quants), 256-element super-blocks of 8 sub-blocks of 32:
 *
 *   Q4_K  144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
 *         w = d * sc[s] * q - dmin * m[s]                     (q 0..15, s = element / 32)
 *   Q5_K  176 bytes: fp16 d, fp16 dmin, 12 bytes of scales and mins, 32 bytes of high bits,
 *         128 bytes of nibbles; w as Q4_K with q 0..31
 *   Q6_K  210 bytes: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8 scales,
 *         fp16 d; w = d * sc[g] * (q - 32)                     (q 0..63, g = element / 16)
 *
 * Where sub-block s's 32 elements lie (element l of it, l < 32):
 *   Q4_K  nibble (s odd: high, even: low) of qs[32 (s / 2) + l]
 *   Q5_K  the same, plus bit s of qh[l] as bit 4
 *   Q6_K  with h = s / 4, r = s % 4: nibble (r >= 2: high) of ql[64 h + 32 (r % 2) + l],
 *         plus bits 2r, 2r + 1 of qh[32 h + l] as bits 4, 5
 * Scales: sub-block s < 4 takes scales[s] & 63 and mins scales[s + 4] & 63; s >= 4 takes the
 * low (scale) and high (min) nibble of scales[s + 4] with the top two bits of scales[s - 4]
 * and scales[s] above them (llama.cpp's get_scale_min_k4).
 *
 * Every format here comes down to w = q * D + M with q unsigned, D and M per 32-element
 * sub-block (Q4_K, Q5_K) or per 16-element group (Q6_K): KScales holds them, decoded once per
 * super-block, and the integer kernels (quant_q8k.c) take the integer scales and mins instead.
 */
#ifndef SPLITSERVE_QUANT_KBLOCKS_H
#define SPLITSERVE_QUANT_KBLOCKS_H

#include "quant_blocks.h"

#define QK_K 256
#define QK_SUBS 8 /* 32-element sub-blocks per super-block */
#define QK_GROUPS 16

/* quant_q8k.c: K-quant weights against Q8_K inputs (quant_linear_q8 hands them over). */
int quant_linear_q8k(const void *x, int64_t x_stride, const uint8_t *w, const void *bias, void *out, int64_t num_rows,
                     int64_t in_features, int64_t out_features, int qtype, int is_bf16);

static inline __attribute__((always_inline)) int qtype_is_k(const int qtype) {
    return qtype == QTYPE_Q4_K || qtype == QTYPE_Q5_K || qtype == QTYPE_Q6_K;
}

/* Q4_K / Q5_K: sub-block s's 6-bit scale and min. */
static inline __attribute__((always_inline)) void k_scale_min(const uint8_t *scales, int s, int *scale, int *min) {
    if (s < 4) {
        *scale = scales[s] & 63;
        *min = scales[s + 4] & 63;
    } else {
        *scale = (scales[s + 4] & 0x0F) | ((scales[s - 4] >> 6) << 4);
        *min = (scales[s + 4] >> 4) | ((scales[s] >> 6) << 4);
    }
}

/* A super-block's integer scales: per 16-element group (Q4_K / Q5_K repeat each sub-block's
   for its two groups; Q6_K's are signed), and Q4_K / Q5_K's per sub-block mins. */
typedef struct {
    int16_t scale[QK_GROUPS];
    int16_t min[QK_SUBS];
    float d, dmin; /* Q6_K: d only */
} KIntScales;

static inline __attribute__((always_inline)) void k_int_scales(const uint8_t *block, const int qtype, KIntScales *out) {
    if (qtype == QTYPE_Q6_K) {
        const int8_t *scales = (const int8_t *)(block + 192);
        for (int g = 0; g < QK_GROUPS; ++g) out->scale[g] = scales[g];
        out->d = half_to_float(block + 208);
        out->dmin = 0.0f;
        return;
    }
    out->d = half_to_float(block);
    out->dmin = half_to_float(block + 2);
    for (int s = 0; s < QK_SUBS; ++s) {
        int scale, min;
        k_scale_min(block + 4, s, &scale, &min);
        out->scale[2 * s] = out->scale[2 * s + 1] = (int16_t)scale;
        out->min[s] = (int16_t)min;
    }
}

/* Q4_K / Q5_K's 12 bytes of scales and mins as 8 scale bytes then 8 min bytes, in four 32-bit
   steps (llama.cpp's utmp unpacking; k_scale_min one at a time gives the same). */
static inline __attribute__((always_inline)) void k_unpack_scales(const uint8_t *packed, uint32_t out[4]) {
    uint32_t in[3];
    memcpy(in, packed, sizeof in);
    out[0] = in[0] & 0x3F3F3F3Fu;
    out[1] = (in[2] & 0x0F0F0F0Fu) | (((in[0] >> 6) & 0x03030303u) << 4);
    out[2] = in[1] & 0x3F3F3F3Fu;
    out[3] = ((in[2] >> 4) & 0x0F0F0F0Fu) | (((in[1] >> 6) & 0x03030303u) << 4);
}

/* Float scales and offsets, w = q * D[i] + M[i] with i the sub-block (Q4_K, Q5_K: 8 of them) or
   the 16-element group (Q6_K: 16), in gguf's dequantizers' arithmetic (D = d * sc, M =
   -(dmin * m); Q6_K's M = -32 D). */
typedef struct {
    float D[QK_GROUPS], M[QK_GROUPS];
} KScales;

/* Which of KScales' entries element `element` of a super-block takes. */
static inline __attribute__((always_inline)) int k_scale_index(const int qtype, const int element) {
    return qtype == QTYPE_Q6_K ? element / 16 : element / 32;
}

static inline __attribute__((always_inline)) void k_scales(const uint8_t *block, const int qtype, KScales *out) {
#if defined(__AVX2__)
    if (qtype == QTYPE_Q6_K) {
        const __m128i scales = _mm_loadu_si128((const __m128i *)(block + 192));
        const __m256 d = _mm256_set1_ps(half_to_float(block + 208)), minus32 = _mm256_set1_ps(-32.0f);
        const __m256 low = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(scales)));
        const __m256 high = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(scales, 8))));
        _mm256_storeu_ps(out->D, low);
        _mm256_storeu_ps(out->D + 8, high);
        _mm256_storeu_ps(out->M, _mm256_mul_ps(minus32, low));
        _mm256_storeu_ps(out->M + 8, _mm256_mul_ps(minus32, high));
        return;
    }
    uint32_t unpacked[4];
    k_unpack_scales(block + 4, unpacked);
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)unpacked)));
    const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(unpacked + 2))));
    _mm256_storeu_ps(out->D, _mm256_mul_ps(_mm256_set1_ps(half_to_float(block)), sc));
    /* -(dmin * m): the product, its sign flipped (exact). */
    const __m256 offsets = _mm256_mul_ps(_mm256_set1_ps(half_to_float(block + 2)), mins);
    _mm256_storeu_ps(out->M, _mm256_xor_ps(offsets, _mm256_set1_ps(-0.0f)));
#else
    KIntScales ints;
    k_int_scales(block, qtype, &ints);
    for (int i = 0; i < (qtype == QTYPE_Q6_K ? QK_GROUPS : QK_SUBS); ++i) {
        out->D[i] = ints.d * (float)ints.scale[qtype == QTYPE_Q6_K ? i : 2 * i];
        out->M[i] = qtype == QTYPE_Q6_K ? -32.0f * out->D[i] : -(ints.dmin * (float)ints.min[i]);
    }
#endif
}

/* Sub-block s's 32 unsigned q values, plain C: the generic build's path and the reference. */
static inline __attribute__((always_inline)) void k_sub_bytes_scalar(const uint8_t *block, const int qtype, int s,
                                                                     uint8_t q[32]) {
    if (qtype == QTYPE_Q6_K) {
        const int h = s / 4, r = s % 4;
        const uint8_t *ql = block + 64 * h + 32 * (r % 2), *qh = block + 128 + 32 * h;
        for (int l = 0; l < 32; ++l)
            q[l] = (uint8_t)(((r >= 2 ? ql[l] >> 4 : ql[l]) & 0x0F) | (((qh[l] >> (2 * r)) & 3) << 4));
        return;
    }
    const uint8_t *qs = block + (qtype == QTYPE_Q5_K ? 48 : 16) + 32 * (s / 2);
    for (int l = 0; l < 32; ++l) {
        q[l] = (uint8_t)((s % 2 ? qs[l] >> 4 : qs[l]) & 0x0F);
        if (qtype == QTYPE_Q5_K) q[l] |= (uint8_t)(((block[16 + l] >> s) & 1) << 4);
    }
}

/* A whole super-block into 256 floats, plain C. */
static inline void k_dequantize_scalar(const uint8_t *block, const int qtype, float *out) {
    KScales scales;
    k_scales(block, qtype, &scales);
    for (int s = 0; s < QK_SUBS; ++s) {
        uint8_t q[32];
        k_sub_bytes_scalar(block, qtype, s, q);
        for (int l = 0; l < 32; ++l) {
            const int i = k_scale_index(qtype, 32 * s + l);
            out[32 * s + l] = (float)q[l] * scales.D[i] + scales.M[i];
        }
    }
}

#if defined(__AVX2__)
/* Sub-block s's 32 unsigned q values in element order, in one register. */
static inline __attribute__((always_inline)) __m256i k_sub_bytes(const uint8_t *block, const int qtype, const int s) {
    const __m256i low_mask = _mm256_set1_epi8(0x0F);
    if (qtype == QTYPE_Q6_K) {
        const int h = s / 4, r = s % 4;
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(block + 64 * h + 32 * (r % 2)));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(block + 128 + 32 * h));
        const __m256i low = _mm256_and_si256(r >= 2 ? _mm256_srli_epi16(ql, 4) : ql, low_mask);
        /* Bits 2r, 2r + 1 of each byte down to 0, 1 (a 16-bit shift: the mask drops what crosses bytes). */
        const __m256i high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * r)), _mm256_set1_epi8(3));
        return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
    }
    const __m256i qs = _mm256_loadu_si256((const __m256i *)(block + (qtype == QTYPE_Q5_K ? 48 : 16) + 32 * (s / 2)));
    __m256i q = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(qs, 4) : qs, low_mask);
    if (qtype == QTYPE_Q5_K) {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(block + 16));
        const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(s)), _mm256_set1_epi8(1));
        q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
    }
    return q;
}
#endif

#if SIMD_WIDTH > 1
/* Sub-block s into QVECS float vectors, in registers: w = q * D + M, one FMA a vector. */
static inline __attribute__((always_inline)) void k_dequantize_sub(const uint8_t *block, const int qtype, const int s,
                                                                   const KScales *scales, vfloat w[QVECS]) {
    const __m256i q = k_sub_bytes(block, qtype, s);
#if SIMD_WIDTH == 16
    /* One vector per 16-element group. */
    const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
    for (int v = 0; v < QVECS; ++v) {
        const int i = k_scale_index(qtype, 32 * s + 16 * v);
        w[v] = vf_fmadd(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(halves[v])), vf_set1(scales->D[i]),
                        vf_set1(scales->M[i]));
    }
#else
    const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
    for (int v = 0; v < QVECS; ++v) {
        const int i = k_scale_index(qtype, 32 * s + 8 * v);
        const __m128i bytes = v % 2 ? _mm_srli_si128(halves[v / 2], 8) : halves[v / 2];
        w[v] = vf_fmadd(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), vf_set1(scales->D[i]), vf_set1(scales->M[i]));
    }
#endif
}
#endif

#endif
