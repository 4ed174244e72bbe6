/*
 * The driver the linear layers on quantized weights share: quant_linear.c (float inputs),
 * quant_q8.c and quant_q8k.c (inputs quantized to 8 bits). A kernel prepares its input rows
 * once, then calls, in this order:
 *
 *   quant_linear_run         splits the output features over the OpenMP team, a contiguous
 *                            range a thread so that each reads its weight rows in order, and
 *                            gives each thread num_rows floats of scratch;
 *   the kernel's range       one per kernel, a QuantRangeKernel written as one call of
 *                            quant_range_each_qtype, which picks the call's qtype and dtype
 *                            and passes them on as constants;
 *   quant_range              walks the thread's weight rows: the format's row kernel (inlined,
 *                            so it specialises on the constants) gives a row's dot products,
 *                            then the row's scale and the bias are applied and out is stored.
 */
#ifndef SPLITSERVE_QUANT_DRIVER_H
#define SPLITSERVE_QUANT_DRIVER_H

#include <omp.h>
#include <stdlib.h>

#include "quant_blocks.h"

/* Weight elements below which one thread reads the weight faster than a team wakes up
   (linear_panels.c's threshold, the same trade). */
#define QUANT_PARALLEL_MIN_WEIGHTS (1 << 18)

/* The qtypes a row kernel reads, for quant_range_each_qtype. */
#define QUANT_32_BLOCKS 1 /* Q4_0, Q4_1, Q8_0 and INT8 */
#define QUANT_K_BLOCKS 2  /* Q4_K, Q5_K and Q6_K */

/* One linear layer call: out [num_rows, out_features] = x @ w^T (+ bias). */
typedef struct {
    const void *x; /* num_rows input rows as the kernel prepared them: float32, or quantized blocks */
    int64_t num_rows;
    int64_t in_features;
    const uint8_t *w; /* out_features rows of quant_row_bytes_of(qtype, in_features) bytes */
    const void *bias; /* out_features values, or NULL */
    void *out;
    int64_t out_features;
    int qtype;
    int is_bf16; /* bias and out: bf16, else float32 */
} QuantLinearCall;

/* Output features [n_start, n_end) of every row; sums: the thread's num_rows floats of scratch. */
typedef void (*QuantRangeKernel)(const QuantLinearCall *call, int64_t n_start, int64_t n_end, float *sums);

/* A format's dot products of one weight row (w_row: its bytes, an INT8 row's scale first) with
   each of num_rows prepared input rows, into sums[num_rows], before the row's scale. */
typedef void (*QuantRowKernel)(const void *x, int64_t num_rows, const uint8_t *w_row, int64_t in_features,
                               int qtype, float *sums);

/* This OpenMP thread's share of `total` output features: a contiguous range. */
static inline void thread_range(int64_t total, int64_t *start, int64_t *end) {
    const int64_t num_threads = omp_get_num_threads(), thread = omp_get_thread_num();
    const int64_t per_thread = (total + num_threads - 1) / num_threads;
    *start = thread * per_thread < total ? thread * per_thread : total;
    *end = *start + per_thread < total ? *start + per_thread : total;
}

/* Output features [n_start, n_end): the row's scale (an INT8 row's; 1, folded away, for the
   block formats) and the bias meet its dot products in one multiply-add. */
static inline __attribute__((always_inline)) void quant_range(QuantRowKernel row, const QuantLinearCall *call,
                                                              int64_t n_start, int64_t n_end, const int qtype,
                                                              const int is_bf16, float *sums) {
    const void *x = call->x, *bias = call->bias;
    const uint8_t *w = call->w;
    void *out = call->out;
    const int64_t num_rows = call->num_rows, in_features = call->in_features, out_features = call->out_features;
    const int64_t row_bytes = quant_row_bytes_of(qtype, in_features);
    for (int64_t n = n_start; n < n_end; ++n) {
        const uint8_t *w_row = w + n * row_bytes;
        row(x, num_rows, w_row, in_features, qtype, sums);
        const float b = bias == NULL ? 0.0f : load(bias, n, is_bf16), scale = row_scale(w_row, qtype);
        for (int64_t m = 0; m < num_rows; ++m) store(out, m * out_features + n, sums[m] * scale + b, is_bf16);
    }
}

/* quant_range with the call's qtype (one of `families`, a constant) and dtype as constants, so
   the inlined row kernel specialises on them. */
static inline __attribute__((always_inline)) void quant_range_each_qtype(QuantRowKernel row, const int families,
                                                                         const QuantLinearCall *call, int64_t n_start,
                                                                         int64_t n_end, float *sums) {
#define QUANT_RANGE_CASE(FAMILY, QTYPE)                             \
    if ((families & (FAMILY)) && call->qtype == (QTYPE)) {          \
        if (call->is_bf16)                                          \
            quant_range(row, call, n_start, n_end, QTYPE, 1, sums); \
        else                                                        \
            quant_range(row, call, n_start, n_end, QTYPE, 0, sums); \
        return;                                                     \
    }
    QUANT_RANGE_CASE(QUANT_32_BLOCKS, QTYPE_Q4_0)
    QUANT_RANGE_CASE(QUANT_32_BLOCKS, QTYPE_Q4_1)
    QUANT_RANGE_CASE(QUANT_32_BLOCKS, QTYPE_Q8_0)
    QUANT_RANGE_CASE(QUANT_32_BLOCKS, QTYPE_INT8)
    QUANT_RANGE_CASE(QUANT_K_BLOCKS, QTYPE_Q4_K)
    QUANT_RANGE_CASE(QUANT_K_BLOCKS, QTYPE_Q5_K)
    QUANT_RANGE_CASE(QUANT_K_BLOCKS, QTYPE_Q6_K)
#undef QUANT_RANGE_CASE
}

/* range over the call's output features (one thread below QUANT_PARALLEL_MIN_WEIGHTS weight
   elements). Returns 0; -1 when a thread's scratch cannot be allocated. */
static int quant_linear_run(QuantRangeKernel range, const QuantLinearCall *call) {
    int status = 0;
#pragma omp parallel if (call->out_features * call->in_features >= QUANT_PARALLEL_MIN_WEIGHTS)
    {
        int64_t n_start, n_end;
        thread_range(call->out_features, &n_start, &n_end);
        float *sums = malloc((size_t)call->num_rows * sizeof(float));
        if (sums == NULL) {
#pragma omp atomic write
            status = -1;
        } else {
            if (n_start < n_end) range(call, n_start, n_end, sums);
            free(sums);
        }
    }
    return status;
}

#endif
