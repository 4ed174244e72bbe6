/*
 * Linear layers on quantized weights (quant_blocks.h) with the activations quantized on the
 * fly to 8 bits, as llama.cpp does: each 32-element block of an input row becomes 32 int8
 * and a scale (ggml's Q8_0: d = max|x| / 127, rounded to fp16 as llama.cpp stores it, and
 * q = round(x / d), half away from zero), so a weight block's dot product with it is an
 * integer dot product, scaled once:
 *
 *   Q4_0  d_w * d_x * sum(q_w * q_x) - 8 * d_w * s_x
 *   Q4_1  d_w * d_x * sum(q_w * q_x) + m_w * s_x          (q_w the nibbles, 0..15)
 *   Q8_0  d_w * d_x * sum(q_w * q_x)
 *   INT8  d_x * sum(q_w * q_x), the row's sum times its scale once (in_features a multiple of 32)
 *
 * with s_x = d_x * sum(q_x) kept per input block. The K-quants pair with Q8_K inputs instead,
 * 256-element super-blocks as llama.cpp pairs them (quant_q8k.c); quant_linear_q8 hands them
 * over. On AVX2 a block's 32 products and their sum
 * are one vpmaddubsw (unsigned weights times signed inputs; Q8_0's signed weights take
 * llama.cpp's sign trick) and one vpmaddwd: a few instructions per block where the float path
 * (quant_linear.c) spends a conversion and two FMAs per 8 weights. The price is the rounding
 * of the activations to 8 bits (relative error about 1/254 of each block's largest element),
 * which llama.cpp pays too; engine/models/quantized_linear.py says where this path is used.
 *
 * Same contract as quant_linear: x [num_rows, in_features] (rows x_stride apart), float32 or
 * bf16, bias and out of the same dtype; threads split the output features (quant_driver.h).
 */
#include "quant_driver.h"
#include "quant_kblocks.h"

/* One input block, quantized. */
typedef struct {
    float d;        /* scale, an fp16 value */
    float s;        /* d * sum(q) */
    int8_t q[QUANT_BLOCK];
} InputBlock;

static inline float round_half_away(float v) { return v < 0.0f ? -floorf(0.5f - v) : floorf(v + 0.5f); }

static void quantize_input_row(const void *x, int64_t offset, int64_t in_features, const int is_bf16,
                               InputBlock *out) {
    for (int64_t b = 0; b < in_features / QUANT_BLOCK; ++b) {
        float values[QUANT_BLOCK], amax = 0.0f;
        for (int j = 0; j < QUANT_BLOCK; ++j) {
            values[j] = load(x, offset + b * QUANT_BLOCK + j, is_bf16);
            amax = fmaxf(amax, fabsf(values[j]));
        }
        const float d = amax / 127.0f, inverse = d == 0.0f ? 0.0f : 1.0f / d;
        int sum = 0;
        for (int j = 0; j < QUANT_BLOCK; ++j) {
            out[b].q[j] = (int8_t)round_half_away(values[j] * inverse);
            sum += out[b].q[j];
        }
        out[b].d = round_to_half(d);
        out[b].s = out[b].d * (float)sum;
    }
}

/* A block's scale (INT8's blocks have unit scale: the row's comes last) and what each input
   block's s_x is multiplied by: Q4_1's minimum, Q4_0's -8 d, none for the int8 formats. */
static inline __attribute__((always_inline)) float block_d(const uint8_t *block, const int qtype) {
    return qtype == QTYPE_INT8 ? 1.0f : half_to_float(block);
}

static inline __attribute__((always_inline)) float block_offset(const uint8_t *block, const int qtype) {
    if (qtype == QTYPE_Q4_1) return half_to_float(block + 2);
    return qtype == QTYPE_Q4_0 ? -8.0f * half_to_float(block) : 0.0f;
}

#if defined(__AVX2__)
#define Q8_TILE_ROWS 8

/* A weight block as 32 bytes in element order: the nibbles (0..15, unsigned) or Q8_0's and
   INT8's int8. */
static inline __attribute__((always_inline)) __m256i weight_bytes(const uint8_t *block, const int qtype) {
    if (qtype == QTYPE_Q8_0) return _mm256_loadu_si256((const __m256i *)(block + 2));
    if (qtype == QTYPE_INT8) return _mm256_loadu_si256((const __m256i *)block);
    const __m128i nibbles = _mm_loadu_si128((const __m128i *)(block + (qtype == QTYPE_Q4_1 ? 4 : 2)));
    const __m128i low_mask = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(nibbles, low_mask), high = _mm_and_si128(_mm_srli_epi16(nibbles, 4), low_mask);
    return _mm256_set_m128i(high, low);
}

/* sum(w * x) over a block as 8 int32 lanes turned float. w unsigned (nibbles) or, for Q8_0
   and INT8, signed: then |w| times x with w's sign, so that vpmaddubsw's unsigned operand holds. */
static inline __attribute__((always_inline)) __m256 block_dot(__m256i w, const int8_t *xq, const int qtype) {
    __m256i x = _mm256_loadu_si256((const __m256i *)xq);
    if (qtype == QTYPE_Q8_0 || qtype == QTYPE_INT8) {
        x = _mm256_sign_epi8(x, w);
        w = _mm256_abs_epi8(w);
    }
    const __m256i pairs = _mm256_maddubs_epi16(w, x);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

#if SIMD_WIDTH >= 16
/* Two weight blocks side by side, one per 256-bit half: AVX-512 takes a pair per instruction. */
static inline __attribute__((always_inline)) __m512 block_pair_dot(__m512i w, const int8_t *xq0, const int8_t *xq1,
                                                                   const int qtype) {
    __m512i x = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)xq0)),
                                   _mm256_loadu_si256((const __m256i *)xq1), 1);
    if (qtype == QTYPE_Q8_0 || qtype == QTYPE_INT8) { /* no vpsignb in AVX-512: negate x where w is negative */
        x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
        w = _mm512_abs_epi8(w);
    }
    const __m512i pairs = _mm512_maddubs_epi16(w, x);
    return _mm512_cvtepi32_ps(_mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
}
#endif

/* One weight row against `rows` quantized input rows (x_row blocks apart) into sums[rows]. */
static inline __attribute__((always_inline)) void q8_row_tile(const InputBlock *x, int64_t x_row,
                                                              const uint8_t *w_row, int64_t num_blocks,
                                                              const int qtype, const int rows, float *sums) {
    const int64_t block_bytes = qtype_block_bytes(qtype);
    float offsets[Q8_TILE_ROWS];
    for (int m = 0; m < rows; ++m) offsets[m] = 0.0f;
    int64_t b = 0;
#if SIMD_WIDTH >= 16
    __m512 acc_pairs[Q8_TILE_ROWS];
    for (int m = 0; m < rows; ++m) acc_pairs[m] = _mm512_setzero_ps();
    for (; b + 2 <= num_blocks; b += 2) {
        const uint8_t *block0 = w_row + b * block_bytes, *block1 = block0 + block_bytes;
        const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(weight_bytes(block0, qtype)),
                                             weight_bytes(block1, qtype), 1);
        const float d0 = block_d(block0, qtype), d1 = block_d(block1, qtype);
        const float offset0 = block_offset(block0, qtype), offset1 = block_offset(block1, qtype);
        for (int m = 0; m < rows; ++m) {
            const InputBlock *xb = x + m * x_row + b;
            const __m512 scale = _mm512_insertf32x8(_mm512_set1_ps(d0 * xb[0].d), _mm256_set1_ps(d1 * xb[1].d), 1);
            acc_pairs[m] = _mm512_fmadd_ps(block_pair_dot(w, xb[0].q, xb[1].q, qtype), scale, acc_pairs[m]);
            if (qtype == QTYPE_Q4_0 || qtype == QTYPE_Q4_1) offsets[m] += offset0 * xb[0].s + offset1 * xb[1].s;
        }
    }
#endif
    __m256 acc[Q8_TILE_ROWS];
    for (int m = 0; m < rows; ++m) acc[m] = _mm256_setzero_ps();
    for (; b < num_blocks; ++b) {
        const uint8_t *block = w_row + b * block_bytes;
        const __m256i w = weight_bytes(block, qtype);
        const float d = block_d(block, qtype), offset = block_offset(block, qtype);
        for (int m = 0; m < rows; ++m) {
            const InputBlock *xb = x + m * x_row + b;
            acc[m] = _mm256_fmadd_ps(block_dot(w, xb->q, qtype), _mm256_set1_ps(d * xb->d), acc[m]);
            if (qtype == QTYPE_Q4_0 || qtype == QTYPE_Q4_1) offsets[m] += offset * xb->s;
        }
    }
    for (int m = 0; m < rows; ++m) {
#if SIMD_WIDTH >= 16
        sums[m] = _mm512_reduce_add_ps(acc_pairs[m]) + sum256(acc[m]) + offsets[m];
#else
        sums[m] = sum256(acc[m]) + offsets[m];
#endif
    }
}

static inline __attribute__((always_inline)) void q8_row(const InputBlock *x, int64_t x_row, int64_t num_rows,
                                                         const uint8_t *w_row, int64_t num_blocks, const int qtype,
                                                         float *sums) {
    for (int64_t m = 0; m < num_rows; m += Q8_TILE_ROWS) {
        const InputBlock *x_tile = x + m * x_row;
        switch (num_rows - m) {
#define Q8_TILE_CASE(R) \
    case R: q8_row_tile(x_tile, x_row, w_row, num_blocks, qtype, R, sums + m); break;
            Q8_TILE_CASE(1)
            Q8_TILE_CASE(2)
            Q8_TILE_CASE(3)
            Q8_TILE_CASE(4)
            Q8_TILE_CASE(5)
            Q8_TILE_CASE(6)
            Q8_TILE_CASE(7)
#undef Q8_TILE_CASE
            default: q8_row_tile(x_tile, x_row, w_row, num_blocks, qtype, Q8_TILE_ROWS, sums + m); break;
        }
    }
}
#else
/* Generic build: integer dot products in plain C, left to the compiler to vectorize. */
static inline __attribute__((always_inline)) void q8_row(const InputBlock *x, int64_t x_row, int64_t num_rows,
                                                         const uint8_t *w_row, int64_t num_blocks, const int qtype,
                                                         float *sums) {
    const int64_t block_bytes = qtype_block_bytes(qtype);
    for (int64_t m = 0; m < num_rows; ++m) sums[m] = 0.0f;
    for (int64_t b = 0; b < num_blocks; ++b) {
        const uint8_t *block = w_row + b * block_bytes;
        int8_t w[QUANT_BLOCK];
        if (qtype == QTYPE_Q8_0 || qtype == QTYPE_INT8) {
            memcpy(w, block + (qtype == QTYPE_Q8_0 ? 2 : 0), QUANT_BLOCK);
        } else {
            const uint8_t *nibbles = block + (qtype == QTYPE_Q4_1 ? 4 : 2);
            for (int j = 0; j < QUANT_BLOCK / 2; ++j) {
                w[j] = (int8_t)(nibbles[j] & 0x0F);
                w[j + QUANT_BLOCK / 2] = (int8_t)(nibbles[j] >> 4);
            }
        }
        const float d = block_d(block, qtype), offset = block_offset(block, qtype);
        for (int64_t m = 0; m < num_rows; ++m) {
            const InputBlock *xb = x + m * x_row + b;
            int32_t dot = 0;
#pragma omp simd reduction(+ : dot)
            for (int j = 0; j < QUANT_BLOCK; ++j) dot += (int32_t)w[j] * (int32_t)xb->q[j];
            sums[m] += d * xb->d * (float)dot + offset * xb->s;
        }
    }
}
#endif

/* The driver's row kernel (quant_driver.h): x the quantized input rows, num_blocks blocks
   apart; the weight row's blocks from w_row on, after an INT8 row's scale. */
static inline __attribute__((always_inline)) void q8_weight_row(const void *x, int64_t num_rows, const uint8_t *w_row,
                                                                int64_t in_features, const int qtype, float *sums) {
    const int64_t num_blocks = in_features / QUANT_BLOCK;
    q8_row(x, num_blocks, num_rows, row_blocks(w_row, qtype), num_blocks, qtype, sums);
}

static void q8_linear_range(const QuantLinearCall *call, int64_t n_start, int64_t n_end, float *sums) {
    quant_range_each_qtype(q8_weight_row, QUANT_32_BLOCKS, call, n_start, n_end, sums);
}

/* Returns 0; -1 when a buffer cannot be allocated; -2 for an unknown qtype or in_features not
   a whole number of blocks (of 32 elements, for INT8). */
int quant_linear_q8(const void *x, int64_t x_stride, const uint8_t *w, const void *bias, void *out, int64_t num_rows,
                    int64_t in_features, int64_t out_features, int qtype, int is_bf16) {
    if (quant_row_bytes_of(qtype, in_features) < 0 || in_features % QUANT_BLOCK != 0) return -2;
    if (qtype_is_k(qtype))
        return quant_linear_q8k(x, x_stride, w, bias, out, num_rows, in_features, out_features, qtype, is_bf16);
    const int64_t num_blocks = in_features / QUANT_BLOCK;
    InputBlock *xq = malloc((size_t)(num_rows * num_blocks) * sizeof(InputBlock));
    if (xq == NULL) return -1;
    for (int64_t m = 0; m < num_rows; ++m) quantize_input_row(x, m * x_stride, in_features, is_bf16, xq + m * num_blocks);
    const QuantLinearCall call = {xq, num_rows, in_features, w, bias, out, out_features, qtype, is_bf16};
    const int status = quant_linear_run(q8_linear_range, &call);
    free(xq);
    return status;
}
