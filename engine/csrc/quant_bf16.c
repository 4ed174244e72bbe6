/*
 * Q4_0 and Q4_1 weights against bf16 activations with AVX512_BF16's dot products (vdpbf16ps),
 * where the CPU has them: quant_linear hands such calls here. A block's nibbles become bf16
 * integers (0..15, or q - 8 for Q4_0: exact in bf16) through one table lookup (vpermw), and one
 * vdpbf16ps takes the block's 32 products with the input (each exact in float32) and sums them
 * in float32. The block's scale and minimum then apply once, in float32:
 *
 *   sum(w * x) over a block = d * sum(q * x) + m * sum(x)          (Q4_1; Q4_0 has no m)
 *
 * with sum(x) per input block computed once a call. So the weights are not rounded at all (the
 * float path's dequantization, w = q * d + m, rounds each w to float32; this rounds d * sum
 * instead): the result equals the float path's within float32 summation error, with less vector
 * work per block (no int-to-float conversion, no dequantizing FMA), and the bf16 input is read as
 * it is. One input row against SmolLM2's Q4_1 layer shapes ran 1.1-1.25x the float path's
 * speed on a Zen 4 (docs/benchmarks.md, "bf16 dot products for 4-bit blocks").
 *
 * Same contract as quant_linear (x [num_rows, in_features], rows x_stride apart; bias and out
 * bf16); threads split the output features (quant_driver.h). Other builds compile nothing here.
 */
#include "quant_driver.h"

#if defined(__AVX512BF16__)

/* Input rows a pass over a weight row takes: each block's bf16 integers serve them all. */
#define BF16_TILE_ROWS 8

/* The prepared input: num_rows rows of in_features bf16 (contiguous), and each row's block sums. */
typedef struct {
    const uint16_t *x;
    const float *block_sums; /* [num_rows, in_features / 32] */
} Bf16Input;

/* bf16 of the integers 0..15 (Q4_1's nibbles) and -8..7 (Q4_0's q - 8), vpermw's table (its low
   16 words). */
static const uint16_t Q4_1_INTEGERS[32] = {0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
                                           0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
static const uint16_t Q4_0_INTEGERS[32] = {0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
                                           0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0};

static inline __attribute__((always_inline)) __m512i nibble_table(const int qtype) {
    return _mm512_loadu_si512(qtype == QTYPE_Q4_0 ? Q4_0_INTEGERS : Q4_1_INTEGERS);
}

/* A block's 32 nibbles, in element order, as bf16 integers: byte j holds element j low and j + 16
   high (quant_blocks.h). */
static inline __attribute__((always_inline)) __m512i block_integers(const uint8_t *nibbles, __m512i table) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)nibbles);
    const __m128i low_mask = _mm_set1_epi8(0x0F);
    const __m256i bytes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low_mask),
                                           _mm_and_si128(packed, low_mask));
    return _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(bytes), table);
}

/* One weight row against `rows` input rows into sums[rows]. */
static inline __attribute__((always_inline)) void bf16_row_tile(const Bf16Input *input, int64_t first_row,
                                                                const uint8_t *w_row, int64_t in_features,
                                                                const int qtype, const int rows, __m512i table,
                                                                float *sums) {
    const int64_t num_blocks = in_features / QUANT_BLOCK, block_bytes = qtype_block_bytes(qtype);
    __m512 acc[BF16_TILE_ROWS];
    float offsets[BF16_TILE_ROWS];
    for (int m = 0; m < rows; ++m) {
        acc[m] = _mm512_setzero_ps();
        offsets[m] = 0.0f;
    }
    for (int64_t b = 0; b < num_blocks; ++b) {
        const uint8_t *block = w_row + b * block_bytes;
        const __m512bh q = (__m512bh)block_integers(block + (qtype == QTYPE_Q4_1 ? 4 : 2), table);
        const __m128 scales = half_pair_to_floats(block); /* d, and Q4_1's m */
        const __m512 d = _mm512_broadcastss_ps(scales);
        const float minimum = _mm_cvtss_f32(_mm_movehdup_ps(scales));
        for (int m = 0; m < rows; ++m) {
            const int64_t row = first_row + m;
            const __m512bh xb = (__m512bh)_mm512_loadu_si512(input->x + row * in_features + b * QUANT_BLOCK);
            acc[m] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), q, xb), d, acc[m]);
            if (qtype == QTYPE_Q4_1) offsets[m] += minimum * input->block_sums[row * num_blocks + b];
        }
    }
    for (int m = 0; m < rows; ++m) sums[m] = _mm512_reduce_add_ps(acc[m]) + offsets[m];
}

/* The driver's row kernel: the prepared input (a Bf16Input) against one weight row. */
static inline __attribute__((always_inline)) void bf16_row(const void *x, int64_t num_rows, const uint8_t *w_row,
                                                           int64_t in_features, const int qtype, float *sums) {
    const Bf16Input *input = x;
    const __m512i table = nibble_table(qtype);
    for (int64_t m = 0; m < num_rows; m += BF16_TILE_ROWS) {
        switch (num_rows - m) {
#define BF16_TILE_CASE(R) \
    case R: bf16_row_tile(input, m, w_row, in_features, qtype, R, table, sums + m); break;
            BF16_TILE_CASE(1)
            BF16_TILE_CASE(2)
            BF16_TILE_CASE(3)
            BF16_TILE_CASE(4)
            BF16_TILE_CASE(5)
            BF16_TILE_CASE(6)
            BF16_TILE_CASE(7)
#undef BF16_TILE_CASE
            default: bf16_row_tile(input, m, w_row, in_features, qtype, BF16_TILE_ROWS, table, sums + m); break;
        }
    }
}

static void bf16_linear_range(const QuantLinearCall *call, int64_t n_start, int64_t n_end, float *sums) {
    if (call->qtype == QTYPE_Q4_0)
        quant_range(bf16_row, call, n_start, n_end, QTYPE_Q4_0, 1, sums);
    else
        quant_range(bf16_row, call, n_start, n_end, QTYPE_Q4_1, 1, sums);
}

/* Returns 0; -1 when a buffer cannot be allocated; -2 for a qtype other than Q4_0 and Q4_1 or
   in_features not a whole number of blocks. */
int quant_linear_bf16_dot(const void *x, int64_t x_stride, const uint8_t *w, const void *bias, void *out,
                          int64_t num_rows, int64_t in_features, int64_t out_features, int qtype) {
    if ((qtype != QTYPE_Q4_0 && qtype != QTYPE_Q4_1) || quant_row_bytes_of(qtype, in_features) < 0) return -2;
    const int64_t num_blocks = in_features / QUANT_BLOCK;
    uint16_t *rows = malloc((size_t)(num_rows * in_features) * sizeof(uint16_t));
    float *block_sums = malloc((size_t)(num_rows * num_blocks) * sizeof(float));
    if (rows == NULL || block_sums == NULL) {
        free(rows);
        free(block_sums);
        return -1;
    }
    for (int64_t m = 0; m < num_rows; ++m) {
        const uint16_t *source = (const uint16_t *)x + m * x_stride;
        memcpy(rows + m * in_features, source, (size_t)in_features * sizeof(uint16_t));
        for (int64_t b = 0; b < num_blocks; ++b)
            block_sums[m * num_blocks + b] = _mm512_reduce_add_ps(
                _mm512_add_ps(vf_load_bf16(source + b * QUANT_BLOCK), vf_load_bf16(source + b * QUANT_BLOCK + 16)));
    }
    const Bf16Input input = {rows, block_sums};
    const QuantLinearCall call = {&input, num_rows, in_features, w, bias, out, out_features, qtype, 1};
    const int status = quant_linear_run(bf16_linear_range, &call);
    free(rows);
    free(block_sums);
    return status;
}

#endif
