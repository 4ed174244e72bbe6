/*
 * Linear layers on quantized weights (quant_blocks.h: GGUF's 32-element blocks and INT8 rows;
 * quant_kblocks.h: the K-quants' 256-element super-blocks): out = x @ w^T (+ bias), x, bias
 * and out float32 or bf16 alike, w [out_features] rows of blocks (the tensor as the file holds
 * it), float32 accumulation and one rounding at the end in bf16.
 *
 * quant_linear takes float activations: each weight block is dequantized in registers (one
 * FMA per vector, w = q * d + m; a K-quant super-block decodes its scales once, then each
 * 32-element sub-block likewise) and multiplied into a tile of input rows, so a block read
 * from memory serves every row of the tile; more rows take more tiles, each dequantizing the
 * (cached) row again. An INT8 row's blocks have unit scale and its own scale multiplies the
 * dot product once. Threads split the output features as quant_driver.h does for every
 * quantized kernel. bf16 inputs against Q4_0 / Q4_1 blocks go to AVX512_BF16's dot products
 * where the build has them (quant_bf16.c). For many rows (prefill) the caller dequantizes a slice of rows at a time
 * with quant_dequantize_rows and runs a float GEMM (engine/models/quantized_linear.py says
 * which is faster where).
 *
 * quant_dequantize_rows also serves the embedding lookup: the rows a batch's token ids name.
 */
#include "quant_driver.h"
#include "quant_kblocks.h"

#if defined(__AVX512BF16__)
/* quant_bf16.c: Q4_0 and Q4_1 blocks against bf16 inputs with AVX512_BF16's dot products. */
int quant_linear_bf16_dot(const void *x, int64_t x_stride, const uint8_t *w, const void *bias, void *out,
                          int64_t num_rows, int64_t in_features, int64_t out_features, int qtype);
#endif

int64_t quant_row_bytes(int qtype, int64_t in_features) { return quant_row_bytes_of(qtype, in_features); }

/* An INT8 row's elements past its whole blocks, added to sums[m] of each input row (the driver
   applies its scale). Nothing for the block formats. */
static inline __attribute__((always_inline)) void finish_rows(const float *x, int64_t x_row, const uint8_t *w_row,
                                                              int64_t in_features, const int qtype, const int64_t rows,
                                                              float *sums) {
    if (qtype != QTYPE_INT8) return;
    const int8_t *q = (const int8_t *)row_blocks(w_row, qtype);
    for (int64_t m = 0; m < rows; ++m) {
        float tail = 0.0f;
        for (int64_t k = in_features - in_features % QUANT_BLOCK; k < in_features; ++k)
            tail += x[m * x_row + k] * (float)q[k];
        sums[m] += tail;
    }
}

#if SIMD_WIDTH > 1
/* Input rows per tile. Taller AVX2 tiles (6, 8) measured no faster: past a few rows the FMAs
   and input loads per row, not the dequantization shared by the tile, set the pace. */
#if SIMD_WIDTH >= 16
#define QTILE_ROWS 8
#else
#define QTILE_ROWS 4
#endif
/* Vector registers a tile's accumulators and the block's vectors may take (of 16 with AVX2,
   32 with AVX-512), leaving some for loads and the dequantization's constants. */
#define QTILE_REGISTERS (SIMD_WIDTH >= 16 ? 28 : 12)

/* acc[m] += w * x[m] over one 32-element block (x_row floats between input rows). */
#define QTILE_FMA(xb)                                                                                         \
    for (int m = 0; m < rows; ++m)                                                                            \
        for (int v = 0; v < QVECS; ++v)                                                                       \
            acc[m][v % accs] = vf_fmadd(vf_load((xb) + m * x_row + v * SIMD_WIDTH), w[v], acc[m][v % accs]);

/* Dot products of one weight row with `rows` input rows (x_row floats apart) into sums[rows].
   Each row keeps up to QVECS independent accumulators (FMA latency), as registers allow. */
static inline __attribute__((always_inline)) void qrow_tile(const float *x, int64_t x_row, const uint8_t *w_row,
                                                            int64_t in_features, const int qtype, const int rows,
                                                            float *sums) {
    const int accs = rows * QVECS + QVECS <= QTILE_REGISTERS ? QVECS : (rows * 2 + QVECS <= QTILE_REGISTERS ? 2 : 1);
    const int64_t block_bytes = qtype_block_bytes(qtype), block_elements = qtype_block_elements(qtype);
    const int64_t num_blocks = in_features / block_elements;
    const uint8_t *blocks = row_blocks(w_row, qtype);
    vfloat acc[QTILE_ROWS][QVECS];
    for (int m = 0; m < rows; ++m)
        for (int a = 0; a < accs; ++a) acc[m][a] = vf_zero();
    for (int64_t b = 0; b < num_blocks; ++b) {
        const uint8_t *block = blocks + b * block_bytes;
        const float *xb = x + b * block_elements;
        if (qtype_is_k(qtype)) {
            KScales scales;
            k_scales(block, qtype, &scales);
            /* Unrolled: each sub-block's offsets and shifts become constants. */
#pragma GCC unroll 8
            for (int s = 0; s < QK_SUBS; ++s) {
                vfloat w[QVECS];
                k_dequantize_sub(block, qtype, s, &scales, w);
                QTILE_FMA(xb + s * QUANT_BLOCK)
            }
        } else {
            vfloat w[QVECS];
            dequantize_block(block, qtype, w);
            QTILE_FMA(xb)
        }
    }
    for (int m = 0; m < rows; ++m) {
        vfloat total = acc[m][0];
        for (int a = 1; a < accs; ++a) total = vf_add(total, acc[m][a]);
        sums[m] = vf_sum(total);
    }
    finish_rows(x, x_row, w_row, in_features, qtype, rows, sums);
}
#undef QTILE_FMA

static inline __attribute__((always_inline)) void qrow(const float *x, int64_t x_row, int64_t num_rows,
                                                       const uint8_t *w_row, int64_t in_features, const int qtype,
                                                       float *sums) {
    for (int64_t m = 0; m < num_rows; m += QTILE_ROWS) {
        const float *x_tile = x + m * x_row;
        /* Constant tile heights, so each variant's loops unroll into straight register code. */
        switch (num_rows - m) {
#define QTILE_CASE(R) \
    case R: qrow_tile(x_tile, x_row, w_row, in_features, qtype, R, sums + m); break;
            QTILE_CASE(1)
            QTILE_CASE(2)
            QTILE_CASE(3)
#if QTILE_ROWS >= 8
            QTILE_CASE(4)
            QTILE_CASE(5)
            QTILE_CASE(6)
            QTILE_CASE(7)
#endif
#undef QTILE_CASE
            default: qrow_tile(x_tile, x_row, w_row, in_features, qtype, QTILE_ROWS, sums + m); break;
        }
    }
}
#else
/* Generic build: a block (a K-quant's super-block) dequantized into a buffer, then its dot
   product with every row. */
static inline __attribute__((always_inline)) void qrow(const float *x, int64_t x_row, int64_t num_rows,
                                                       const uint8_t *w_row, int64_t in_features, const int qtype,
                                                       float *sums) {
    const int64_t block_bytes = qtype_block_bytes(qtype), block_elements = qtype_block_elements(qtype);
    const int64_t num_blocks = in_features / block_elements;
    const uint8_t *blocks = row_blocks(w_row, qtype);
    for (int64_t m = 0; m < num_rows; ++m) sums[m] = 0.0f;
    for (int64_t b = 0; b < num_blocks; ++b) {
        float w[QK_K];
        if (qtype_is_k(qtype))
            k_dequantize_scalar(blocks + b * block_bytes, qtype, w);
        else
            dequantize_block_scalar(blocks + b * block_bytes, qtype, w);
        for (int64_t m = 0; m < num_rows; ++m) {
            const float *xb = x + m * x_row + b * block_elements;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < block_elements; ++j) sum += xb[j] * w[j];
            sums[m] += sum;
        }
    }
    finish_rows(x, x_row, w_row, in_features, qtype, num_rows, sums);
}
#endif

/* The driver's row kernel (quant_driver.h): x the float32 input rows, in_features apart. */
static inline __attribute__((always_inline)) void qlinear_row(const void *x, int64_t num_rows, const uint8_t *w_row,
                                                              int64_t in_features, const int qtype, float *sums) {
    qrow(x, in_features, num_rows, w_row, in_features, qtype, sums);
}

static void qlinear_range(const QuantLinearCall *call, int64_t n_start, int64_t n_end, float *sums) {
    quant_range_each_qtype(qlinear_row, QUANT_32_BLOCKS | QUANT_K_BLOCKS, call, n_start, n_end, sums);
}

/* Returns 0; -1 when a buffer cannot be allocated; -2 for an unknown qtype or in_features not
   a whole number of blocks. */
int quant_linear(const void *x, int64_t x_stride, const uint8_t *w, const void *bias, void *out, int64_t num_rows,
                 int64_t in_features, int64_t out_features, int qtype, int is_bf16) {
    if (quant_row_bytes_of(qtype, in_features) < 0) return -2;
#if defined(__AVX512BF16__)
    if (is_bf16 && (qtype == QTYPE_Q4_0 || qtype == QTYPE_Q4_1))
        return quant_linear_bf16_dot(x, x_stride, w, bias, out, num_rows, in_features, out_features, qtype);
#endif
    /* Rows gathered once into contiguous float32 (bf16 upcast exactly). */
    float *x32 = malloc((size_t)(num_rows * in_features) * sizeof(float));
    if (x32 == NULL) return -1;
    for (int64_t m = 0; m < num_rows; ++m) {
        float *row = x32 + m * in_features;
#pragma omp simd
        for (int64_t k = 0; k < in_features; ++k) row[k] = load(x, m * x_stride + k, is_bf16);
    }
    const QuantLinearCall call = {x32, num_rows, in_features, w, bias, out, out_features, qtype, is_bf16};
    const int status = quant_linear_run(qlinear_range, &call);
    free(x32);
    return status;
}

/* One row's elements into out (float32, or bf16 when out_is_bf16). */
static inline __attribute__((always_inline)) void dequantize_row(const uint8_t *w_row, int64_t in_features,
                                                                 const int qtype, void *out, int64_t at,
                                                                 const int out_is_bf16) {
    const int64_t block_bytes = qtype_block_bytes(qtype), block_elements = qtype_block_elements(qtype);
    const int64_t num_blocks = in_features / block_elements;
    const uint8_t *blocks = row_blocks(w_row, qtype);
    const float scale = row_scale(w_row, qtype);
    for (int64_t b = 0; b < num_blocks; ++b) {
        const uint8_t *block = blocks + b * block_bytes;
        const int64_t start = at + b * block_elements;
#if SIMD_WIDTH > 1
        /* Each vector straight to out, converted to bf16 in registers: through a float buffer on
           the stack, the buffer's stores took 70% of the dequantization's time in the processes
           where prefills ran slow (docs/benchmarks.md, "Where the file's first token goes"). */
        if (qtype_is_k(qtype)) {
            KScales scales;
            k_scales(block, qtype, &scales);
            /* Unrolled: each sub-block's offsets and shifts become constants. */
#pragma GCC unroll 8
            for (int s = 0; s < QK_SUBS; ++s) {
                vfloat v[QVECS];
                k_dequantize_sub(block, qtype, s, &scales, v);
                for (int j = 0; j < QVECS; ++j) vstore(out, start + s * QUANT_BLOCK + j * SIMD_WIDTH, v[j], out_is_bf16);
            }
        } else {
            vfloat v[QVECS];
            dequantize_block(block, qtype, v);
            for (int j = 0; j < QVECS; ++j) vstore(out, start + j * SIMD_WIDTH, vf_mul(v[j], vf_set1(scale)), out_is_bf16);
        }
#else
        float values[QK_K];
        if (qtype_is_k(qtype)) {
            k_dequantize_scalar(block, qtype, values);
        } else {
            dequantize_block_scalar(block, qtype, values);
            for (int j = 0; j < QUANT_BLOCK; ++j) values[j] *= scale;
        }
        for (int64_t j = 0; j < block_elements; ++j) store(out, start + j, values[j], out_is_bf16);
#endif
    }
    for (int64_t k = num_blocks * block_elements; k < in_features; ++k) /* an INT8 row's tail */
        store(out, at + k, scale * (float)((const int8_t *)blocks)[k], out_is_bf16);
}

/* Rows of w into out [num_rows, in_features] (float32, or bf16 when out_is_bf16): rows
   first_row.. when row_ids is NULL, else row_ids[i] (an embedding lookup). Returns 0; -2 for an
   unknown qtype or in_features not a whole number of blocks; -3 for a row id outside
   [0, num_weight_rows). */
int quant_dequantize_rows(const uint8_t *w, const int64_t *row_ids, int64_t first_row, int64_t num_rows,
                          int64_t num_weight_rows, int64_t in_features, int qtype, void *out, int out_is_bf16) {
    const int64_t row_bytes = quant_row_bytes_of(qtype, in_features);
    if (row_bytes < 0) return -2;
    for (int64_t i = 0; i < num_rows; ++i) {
        const int64_t row = row_ids == NULL ? first_row + i : row_ids[i];
        if (row < 0 || row >= num_weight_rows) return -3;
    }
#pragma omp parallel for schedule(static) if (num_rows * in_features >= QUANT_PARALLEL_MIN_WEIGHTS)
    for (int64_t i = 0; i < num_rows; ++i) {
        const uint8_t *w_row = w + (row_ids == NULL ? first_row + i : row_ids[i]) * row_bytes;
        dequantize_row(w_row, in_features, qtype, out, i * in_features, out_is_bf16);
    }
    return 0;
}
