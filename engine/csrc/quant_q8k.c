/*
 * Linear layers on K-quant weights (quant_kblocks.h) with the activations quantized on the fly
 * to Q8_K, as llama.cpp pairs the K-quants: each 256-element super-block of an input row
 * becomes 256 int8, a float32 scale d_x and the sums of each 16 of them (bsums), by
 * llama.cpp's quantize_row_q8_K_ref (iscale = -127 / the element of largest magnitude, q =
 * round(iscale * x) to nearest even, d_x = 1 / iscale). A weight super-block's dot product
 * with it is then integer sums scaled twice:
 *
 *   Q4_K, Q5_K  d_w d_x sum_s sc_s dot(q_w, q_x)_s  -  dmin_w d_x sum_s m_s (bsums_2s + bsums_2s+1)
 *   Q6_K        d_w d_x sum_g sc_g dot(q_w, q_x)_g  -  32 d_w d_x sum_g sc_g bsums_g        (q_w 0..63)
 *
 * (s the 32-element sub-blocks, g the 16-element groups). The integer sums stay below 2^28 a
 * super-block, so int32 holds them. On AVX2 a sub-block's 32 products are one vpmaddubsw
 * (unsigned weights times signed inputs: q_w <= 63 keeps its pair sums inside int16) and its
 * scales one vpmaddwd; AVX-512 takes two sub-blocks per instruction. The price is the inputs'
 * rounding to 8 bits (relative error about 1/254 of each super-block's largest element, a
 * little more than Q8_0's per 32), which llama.cpp pays too.
 *
 * quant_linear_q8 (quant_q8.c) hands the K-quants here: same contract.
 */
#include "quant_driver.h"
#include "quant_kblocks.h"

/* One input super-block, quantized (llama.cpp's block_q8_K, its fields reordered). */
typedef struct {
    float d;
    int16_t bsums[QK_GROUPS];
    int8_t q[QK_K];
} InputKBlock;

static void quantize_input_row_k(const void *x, int64_t offset, int64_t in_features, const int is_bf16,
                                 InputKBlock *out) {
    for (int64_t b = 0; b < in_features / QK_K; ++b) {
        float values[QK_K], amax = 0.0f, extreme = 0.0f;
        for (int j = 0; j < QK_K; ++j) {
            values[j] = load(x, offset + b * QK_K + j, is_bf16);
            if (fabsf(values[j]) > amax) {
                amax = fabsf(values[j]);
                extreme = values[j];
            }
        }
        InputKBlock *block = out + b;
        if (amax == 0.0f) {
            memset(block, 0, sizeof *block);
            continue;
        }
        const float iscale = -127.0f / extreme;
        for (int j = 0; j < QK_K; ++j) {
            const long v = lrintf(iscale * values[j]);
            block->q[j] = (int8_t)(v > 127 ? 127 : v);
        }
        for (int g = 0; g < QK_GROUPS; ++g) {
            int sum = 0;
            for (int l = 0; l < 16; ++l) sum += block->q[16 * g + l];
            block->bsums[g] = (int16_t)sum;
        }
        block->d = 1.0f / iscale;
    }
}

/* What multiplies the bsums, per 16-element group: Q4_K / Q5_K's mins (each sub-block's for its
   two groups), Q6_K's scales; and the float factor of their sum, over d_x. */
static inline __attribute__((always_inline)) void k_bsum_weights(const KIntScales *scales, const int qtype,
                                                                 int16_t weights[QK_GROUPS], float *factor) {
    for (int g = 0; g < QK_GROUPS; ++g) weights[g] = qtype == QTYPE_Q6_K ? scales->scale[g] : scales->min[g / 2];
    *factor = qtype == QTYPE_Q6_K ? -32.0f * scales->d : -scales->dmin;
}

#if defined(__AVX2__)
#define Q8K_TILE_ROWS 4

/* Sub-block s's scales as 16 int16 for vpmaddwd: its first group's in the low 128-bit lane
   (products of elements 0..15), its second's in the high one. */
static inline __attribute__((always_inline)) __m256i sub_scales(const KIntScales *scales, const int s) {
    return _mm256_set_m128i(_mm_set1_epi16(scales->scale[2 * s + 1]), _mm_set1_epi16(scales->scale[2 * s]));
}

/* One weight row against `rows` quantized input rows (x_row super-blocks apart) into sums[rows]. */
static inline __attribute__((always_inline)) void q8k_row_tile(const InputKBlock *x, int64_t x_row,
                                                               const uint8_t *w_row, int64_t num_blocks,
                                                               const int qtype, const int rows, float *sums) {
    const int64_t block_bytes = qtype_block_bytes(qtype);
    __m256 acc[Q8K_TILE_ROWS];
    for (int m = 0; m < rows; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < num_blocks; ++b) {
        const uint8_t *block = w_row + b * block_bytes;
        KIntScales scales;
        k_int_scales(block, qtype, &scales);
        int16_t bsum_weights[QK_GROUPS];
        float bsum_factor;
        k_bsum_weights(&scales, qtype, bsum_weights, &bsum_factor);
#if SIMD_WIDTH >= 16
        __m512i dots[Q8K_TILE_ROWS];
        for (int m = 0; m < rows; ++m) dots[m] = _mm512_setzero_si512();
        /* Unrolled: each sub-block's offsets and shifts become constants. */
#pragma GCC unroll 8
        for (int s = 0; s < QK_SUBS; s += 2) {
            const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(k_sub_bytes(block, qtype, s)),
                                                 k_sub_bytes(block, qtype, s + 1), 1);
            const __m512i scale = _mm512_inserti64x4(_mm512_castsi256_si512(sub_scales(&scales, s)),
                                                     sub_scales(&scales, s + 1), 1);
            for (int m = 0; m < rows; ++m) {
                const __m512i xq = _mm512_loadu_si512((const void *)(x[m * x_row + b].q + QUANT_BLOCK * s));
                dots[m] = _mm512_add_epi32(dots[m], _mm512_madd_epi16(_mm512_maddubs_epi16(w, xq), scale));
            }
        }
#else
        __m256i dots[Q8K_TILE_ROWS];
        for (int m = 0; m < rows; ++m) dots[m] = _mm256_setzero_si256();
        /* Unrolled: each sub-block's offsets and shifts become constants. */
#pragma GCC unroll 8
        for (int s = 0; s < QK_SUBS; ++s) {
            const __m256i w = k_sub_bytes(block, qtype, s), scale = sub_scales(&scales, s);
            for (int m = 0; m < rows; ++m) {
                const __m256i xq = _mm256_loadu_si256((const __m256i *)(x[m * x_row + b].q + QUANT_BLOCK * s));
                dots[m] = _mm256_add_epi32(dots[m], _mm256_madd_epi16(_mm256_maddubs_epi16(w, xq), scale));
            }
        }
#endif
        const __m256i weights = _mm256_loadu_si256((const __m256i *)bsum_weights);
        for (int m = 0; m < rows; ++m) {
            const InputKBlock *xb = x + m * x_row + b;
#if SIMD_WIDTH >= 16
            const __m256i dot = _mm256_add_epi32(_mm512_castsi512_si256(dots[m]), _mm512_extracti64x4_epi64(dots[m], 1));
#else
            const __m256i dot = dots[m];
#endif
            const __m256i bsums = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)xb->bsums), weights);
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scales.d * xb->d), acc[m]);
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(bsums), _mm256_set1_ps(bsum_factor * xb->d), acc[m]);
        }
    }
    for (int m = 0; m < rows; ++m) sums[m] = sum256(acc[m]);
}

static inline __attribute__((always_inline)) void q8k_row(const InputKBlock *x, int64_t x_row, int64_t num_rows,
                                                          const uint8_t *w_row, int64_t num_blocks, const int qtype,
                                                          float *sums) {
    for (int64_t m = 0; m < num_rows; m += Q8K_TILE_ROWS) {
        const InputKBlock *x_tile = x + m * x_row;
        switch (num_rows - m) {
#define Q8K_TILE_CASE(R) \
    case R: q8k_row_tile(x_tile, x_row, w_row, num_blocks, qtype, R, sums + m); break;
            Q8K_TILE_CASE(1)
            Q8K_TILE_CASE(2)
            Q8K_TILE_CASE(3)
#undef Q8K_TILE_CASE
            default: q8k_row_tile(x_tile, x_row, w_row, num_blocks, qtype, Q8K_TILE_ROWS, sums + m); break;
        }
    }
}
#else
/* Generic build: the super-block's q values unpacked once, integer dot products in plain C. */
static inline __attribute__((always_inline)) void q8k_row(const InputKBlock *x, int64_t x_row, int64_t num_rows,
                                                          const uint8_t *w_row, int64_t num_blocks, const int qtype,
                                                          float *sums) {
    const int64_t block_bytes = qtype_block_bytes(qtype);
    for (int64_t m = 0; m < num_rows; ++m) sums[m] = 0.0f;
    for (int64_t b = 0; b < num_blocks; ++b) {
        const uint8_t *block = w_row + b * block_bytes;
        KIntScales scales;
        k_int_scales(block, qtype, &scales);
        int16_t bsum_weights[QK_GROUPS];
        float bsum_factor;
        k_bsum_weights(&scales, qtype, bsum_weights, &bsum_factor);
        uint8_t q[QK_K];
        for (int s = 0; s < QK_SUBS; ++s) k_sub_bytes_scalar(block, qtype, s, q + QUANT_BLOCK * s);
        for (int64_t m = 0; m < num_rows; ++m) {
            const InputKBlock *xb = x + m * x_row + b;
            int32_t dot = 0, bsums = 0;
            for (int g = 0; g < QK_GROUPS; ++g) {
                int32_t group = 0;
#pragma omp simd reduction(+ : group)
                for (int l = 0; l < 16; ++l) group += (int32_t)q[16 * g + l] * (int32_t)xb->q[16 * g + l];
                dot += scales.scale[g] * group;
                bsums += bsum_weights[g] * xb->bsums[g];
            }
            sums[m] += scales.d * xb->d * (float)dot + bsum_factor * xb->d * (float)bsums;
        }
    }
}
#endif

/* The driver's row kernel (quant_driver.h): x the quantized input rows, num_blocks super-blocks
   apart; the weight row's super-blocks from w_row. */
static inline __attribute__((always_inline)) void q8k_weight_row(const void *x, int64_t num_rows, const uint8_t *w_row,
                                                                 int64_t in_features, const int qtype, float *sums) {
    const int64_t num_blocks = in_features / QK_K;
    q8k_row(x, num_blocks, num_rows, w_row, num_blocks, qtype, sums);
}

static void q8k_linear_range(const QuantLinearCall *call, int64_t n_start, int64_t n_end, float *sums) {
    quant_range_each_qtype(q8k_weight_row, QUANT_K_BLOCKS, call, n_start, n_end, sums);
}

/* Returns 0; -1 when a buffer cannot be allocated; -2 for a qtype other than a K-quant or
   in_features not a whole number of super-blocks. */
int quant_linear_q8k(const void *x, int64_t x_stride, const uint8_t *w, const void *bias, void *out, int64_t num_rows,
                     int64_t in_features, int64_t out_features, int qtype, int is_bf16) {
    if (!qtype_is_k(qtype) || quant_row_bytes_of(qtype, in_features) < 0) return -2;
    const int64_t num_blocks = in_features / QK_K;
    InputKBlock *xq = malloc((size_t)(num_rows * num_blocks) * sizeof(InputKBlock));
    if (xq == NULL) return -1;
    for (int64_t m = 0; m < num_rows; ++m)
        quantize_input_row_k(x, m * x_stride, in_features, is_bf16, xq + m * num_blocks);
    const QuantLinearCall call = {xq, num_rows, in_features, w, bias, out, out_features, qtype, is_bf16};
    const int status = quant_linear_run(q8k_linear_range, &call);
    free(xq);
    return status;
}
