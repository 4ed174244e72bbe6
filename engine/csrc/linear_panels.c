/*
 * Linear layer for decode steps (one to a few dozen rows), on weights laid out in panels:
 * out = x @ w^T (+ bias), x, bias and out bf16 or float32 alike, the panels of the same dtype,
 * float32 accumulation and one rounding at the end in bf16 (as oneDNN's bf16 kernels round).
 *
 * A decode step reads every weight once, so its linears should run at the memory's read
 * bandwidth whatever the number of rows. Dot products along in_features (one weight row at a
 * time against every input row) do at one or two rows, but each multiply then needs an input
 * vector load and each output a horizontal sum, and from three or four rows those, not the
 * memory, set the pace. Here the weight is stored in panels of PANEL_WIDTH output features,
 * in_features-major: panel p holds w[p*W + j][k] at [p][k][j]. One step of k loads the panel's
 * W weights as whole vectors and multiplies each into every input row's x[m][k], broadcast:
 * W/SIMD_WIDTH loads shared by all the rows, no input vector loads, no horizontal sums, and the
 * accumulators (rows x W/SIMD_WIDTH vectors) stay in registers across the whole of in_features.
 * Each panel is one contiguous stretch of memory and a thread's panels follow one another,
 * so the weight streams in order, as the hardware prefetcher likes it. bf16 weights are
 * converted in registers (a 16-bit shift), once per load for all rows; where the CPU has
 * AVX512_BF16 they are not converted at all: the panels interleave pairs of in_features
 * ([p][k/2][j][2]) and vdpbf16ps multiplies each pair of bf16 weights by a broadcast pair of
 * bf16 inputs, adding both exact products to a float32 lane (oneDNN's bf16 kernels use the
 * same instruction), half the instructions per weight and none to convert.
 *
 * x: [num_rows, in_features], rows x_stride elements apart; panels: [ceil(out_features / W),
 * in_features, W] contiguous, zero past out_features (pack_panels lays them out; the layout is
 * this file's business alone); bias: [out_features] or NULL; out: [num_rows, out_features]
 * contiguous. Panels are split across threads when the weight is large.
 */
#include <stdlib.h>

#include "simd.h"

/* Weight elements below which one thread reads the weight faster than a team can wake up. */
#define PANEL_PARALLEL_MIN_WEIGHTS (1 << 18)

#if SIMD_WIDTH > 1
#define PANEL_VECTORS 2
#define PANEL_WIDTH (PANEL_VECTORS * SIMD_WIDTH)
#else
#define PANEL_WIDTH 16
#endif

#if defined(__AVX512BF16__)
#define PAIRED_BF16 1
#else
#define PAIRED_BF16 0
#endif

/* bf16 panels in pairs of in_features (this build, bf16 weights). */
static inline int paired(const int is_bf16) { return PAIRED_BF16 && is_bf16; }

/* Elements along in_features that a panel holds: in pairs, an odd count gets a zero pad. */
static inline int64_t panel_depth(int64_t in_features, const int is_bf16) {
    return paired(is_bf16) ? in_features + (in_features & 1) : in_features;
}

static inline int64_t panel_count(int64_t out_features) { return (out_features + PANEL_WIDTH - 1) / PANEL_WIDTH; }

/* Where w[p*W + j][k] lies in the panels. */
static inline int64_t panel_index(int64_t p, int64_t k, int64_t j, int64_t depth, const int is_bf16) {
    if (paired(is_bf16)) return (p * depth + (k & ~(int64_t)1)) * PANEL_WIDTH + 2 * j + (k & 1);
    return (p * depth + k) * PANEL_WIDTH + j;
}

/* How far ahead of its reads a tile asks for the panel, in bytes (0: not at all; the build
   may set it, engine/cpu_kernels.py: SPLITSERVE_PANEL_PREFETCH_BYTES). A decode step streams
   every weight once, and with the hardware prefetcher alone the memory sits idle while the core
   multiplies a cache line into the tile's rows: the two add up instead of overlapping, more so
   the more rows. Asked for early, the lines arrive during the multiplications. What it gains and
   the distances tried: docs/benchmarks.md, "Panels read ahead, and both dtypes beside vLLM". */
#ifndef PANEL_PREFETCH_BYTES
#define PANEL_PREFETCH_BYTES 2048
#endif

int64_t panel_prefetch_bytes(void) { return PANEL_PREFETCH_BYTES; }

/* The cache lines PANEL_PREFETCH_BYTES past one step of `bytes` that starts at `at`. */
static inline __attribute__((always_inline)) void prefetch_ahead(const void *at, const int64_t bytes) {
#if PANEL_PREFETCH_BYTES > 0
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)at + PANEL_PREFETCH_BYTES + b, 0, 3);
#else
    (void)at, (void)bytes;
#endif
}

#if SIMD_WIDTH > 1
/* Rows of one tile: its accumulators, the panel's vectors and one broadcast fit the ISA's
   registers (32 vector registers with AVX-512, 16 with AVX2). More rows take more tiles, each
   reading the panel again, from cache. */
#if SIMD_WIDTH >= 16
#define PANEL_TILE_ROWS 8
#else
#define PANEL_TILE_ROWS 6
#endif

/* One tile of rows against one panel. x: float32 rows of in_features, or (paired) rows of
   depth / 2 bf16 pairs, x_row elements apart. */
static inline __attribute__((always_inline)) void panel_tile(const void *x, int64_t x_row, int64_t depth,
                                                             const void *panel, const void *bias, void *out,
                                                             int64_t out_features, int64_t n, const int rows,
                                                             const int is_bf16) {
    vfloat acc[PANEL_TILE_ROWS][PANEL_VECTORS];
    for (int m = 0; m < rows; ++m)
        for (int v = 0; v < PANEL_VECTORS; ++v) acc[m][v] = vf_zero();
#if PAIRED_BF16
    if (paired(is_bf16)) {
        const uint32_t *pairs = x;
        for (int64_t k = 0; k < depth / 2; ++k) {
            __m512bh w[PANEL_VECTORS];
            prefetch_ahead((const uint16_t *)panel + k * PANEL_VECTORS * 2 * SIMD_WIDTH, PANEL_VECTORS * 64);
            for (int v = 0; v < PANEL_VECTORS; ++v)
                w[v] = (__m512bh)_mm512_loadu_si512((const uint16_t *)panel + (k * PANEL_VECTORS + v) * 2 * SIMD_WIDTH);
            for (int m = 0; m < rows; ++m) {
                const __m512bh xk = (__m512bh)_mm512_set1_epi32((int)pairs[m * x_row + k]);
                for (int v = 0; v < PANEL_VECTORS; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xk, w[v]);
            }
        }
    } else
#endif
    {
        const float *x32 = x;
        const int64_t step_bytes = PANEL_WIDTH * (is_bf16 ? 2 : 4);
        for (int64_t k = 0; k < depth; ++k) {
            vfloat w[PANEL_VECTORS];
            prefetch_ahead((const char *)panel + k * step_bytes, step_bytes);
            for (int v = 0; v < PANEL_VECTORS; ++v) w[v] = vload(panel, k * PANEL_WIDTH + v * SIMD_WIDTH, is_bf16);
            for (int m = 0; m < rows; ++m) {
                const vfloat xk = vf_set1(x32[m * x_row + k]);
                for (int v = 0; v < PANEL_VECTORS; ++v) acc[m][v] = vf_fmadd(xk, w[v], acc[m][v]);
            }
        }
    }
    /* The panel's last columns may lie past out_features (zero padding): store what exists. */
    const int64_t width = out_features - n < PANEL_WIDTH ? out_features - n : PANEL_WIDTH;
    for (int m = 0; m < rows; ++m) {
        float sums[PANEL_WIDTH];
        for (int v = 0; v < PANEL_VECTORS; ++v) vf_store(sums + v * SIMD_WIDTH, acc[m][v]);
        for (int64_t j = 0; j < width; ++j) {
            const float value = bias == NULL ? sums[j] : sums[j] + load(bias, n + j, is_bf16);
            store(out, m * out_features + n + j, value, is_bf16);
        }
    }
}

/* Panel p (output features p*W..) for every input row, a tile of rows at a time. */
static inline __attribute__((always_inline)) void panel_rows(const void *x, int64_t x_row, int64_t num_rows,
                                                             int64_t depth, const void *panels, const void *bias,
                                                             void *out, int64_t out_features, int64_t p,
                                                             const int is_bf16) {
    /* x's elements are 4 bytes either way: a float32, or a pair of bf16. */
    const int64_t n = p * PANEL_WIDTH, out_bytes = is_bf16 ? 2 : 4;
    const void *panel = (const char *)panels + p * depth * PANEL_WIDTH * out_bytes;
    for (int64_t m = 0; m < num_rows; m += PANEL_TILE_ROWS) {
        const void *x_tile = (const char *)x + m * x_row * 4;
        void *out_tile = (char *)out + m * out_features * out_bytes;
        /* Constant tile heights, so each variant's loops unroll into straight register code. */
        switch (num_rows - m) {
#define PANEL_TILE_CASE(R)                                                                    \
    case R: panel_tile(x_tile, x_row, depth, panel, bias, out_tile, out_features, n, R, is_bf16); break;
            PANEL_TILE_CASE(1)
            PANEL_TILE_CASE(2)
            PANEL_TILE_CASE(3)
            PANEL_TILE_CASE(4)
            PANEL_TILE_CASE(5)
#if PANEL_TILE_ROWS >= 8
            PANEL_TILE_CASE(6)
            PANEL_TILE_CASE(7)
#endif
#undef PANEL_TILE_CASE
            default:
                panel_tile(x_tile, x_row, depth, panel, bias, out_tile, out_features, n, PANEL_TILE_ROWS, is_bf16);
                break;
        }
    }
}
#else
/* Generic build: each panel's W dot products side by side, left to the compiler to vectorize. */
static inline __attribute__((always_inline)) void panel_rows(const void *x, int64_t x_row, int64_t num_rows,
                                                             int64_t depth, const void *panels, const void *bias,
                                                             void *out, int64_t out_features, int64_t p,
                                                             const int is_bf16) {
    const int64_t n = p * PANEL_WIDTH;
    const int64_t width = out_features - n < PANEL_WIDTH ? out_features - n : PANEL_WIDTH;
    const int64_t offset = p * depth * PANEL_WIDTH;
    for (int64_t m = 0; m < num_rows; ++m) {
        float sums[PANEL_WIDTH] = {0};
        for (int64_t k = 0; k < depth; ++k) {
            const float xk = ((const float *)x)[m * x_row + k];
#pragma omp simd
            for (int j = 0; j < PANEL_WIDTH; ++j) sums[j] += xk * load(panels, offset + k * PANEL_WIDTH + j, is_bf16);
        }
        for (int64_t j = 0; j < width; ++j) {
            const float value = bias == NULL ? sums[j] : sums[j] + load(bias, n + j, is_bf16);
            store(out, m * out_features + n + j, value, is_bf16);
        }
    }
}
#endif

int panel_width(void) { return PANEL_WIDTH; }

/* Elements of the panels of an [out_features, in_features] weight, padding included. */
int64_t panel_elements(int64_t out_features, int64_t in_features, int is_bf16) {
    return panel_count(out_features) * panel_depth(in_features, is_bf16) * PANEL_WIDTH;
}

/* w: [out_features, in_features] contiguous -> panels (panel_elements() elements of w's dtype). */
void pack_panels(const void *w, void *panels, int64_t out_features, int64_t in_features, int is_bf16) {
    const int64_t depth = panel_depth(in_features, is_bf16), element_bytes = is_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panel_count(out_features); ++p)
        for (int64_t k = 0; k < depth; ++k)
            for (int64_t j = 0; j < PANEL_WIDTH; ++j) {
                const int64_t n = p * PANEL_WIDTH + j;
                char *dst = (char *)panels + panel_index(p, k, j, depth, is_bf16) * element_bytes;
                if (n < out_features && k < in_features)
                    memcpy(dst, (const char *)w + (n * in_features + k) * element_bytes, element_bytes);
                else
                    memset(dst, 0, element_bytes);
            }
}

/* Panels [p_start, p_end) as one float32 block of w^T: wt32 [in_features, (p_end - p_start) * W], for a
   GEMM over many rows (columns past out_features are zero). */
void unpack_panels(const void *panels, float *wt32, int64_t in_features, int64_t p_start, int64_t p_end, int is_bf16) {
    const int64_t columns = (p_end - p_start) * PANEL_WIDTH, depth = panel_depth(in_features, is_bf16);
#pragma omp parallel for schedule(static) if ((p_end - p_start) * in_features * PANEL_WIDTH >= PANEL_PARALLEL_MIN_WEIGHTS)
    for (int64_t p = p_start; p < p_end; ++p)
        for (int64_t k = 0; k < in_features; ++k) {
            float *dst = wt32 + k * columns + (p - p_start) * PANEL_WIDTH;
#pragma omp simd
            for (int64_t j = 0; j < PANEL_WIDTH; ++j) dst[j] = load(panels, panel_index(p, k, j, depth, is_bf16), is_bf16);
        }
}

/* Returns 0, or -1 when the copy of x cannot be allocated. */
int linear_panels(const void *x, int64_t x_stride, const void *panels, const void *bias, void *out, int64_t num_rows,
                  int64_t in_features, int64_t out_features, int is_bf16) {
    /* Each x element is broadcast once per panel: gathered once here into contiguous rows, as
       float32, or (paired) as the bf16 pairs the panels hold, zero-padded to the panel depth. */
    const int64_t depth = panel_depth(in_features, is_bf16);
    const int64_t x_row = paired(is_bf16) ? depth / 2 : depth;
    void *x_copy = malloc((size_t)(num_rows * x_row) * 4);
    if (x_copy == NULL) return -1;
    for (int64_t m = 0; m < num_rows; ++m) {
        if (paired(is_bf16)) {
            const uint16_t *row = (const uint16_t *)x + m * x_stride;
            uint32_t *pairs = (uint32_t *)x_copy + m * x_row;
            for (int64_t k = 0; k < x_row; ++k) {
                const uint32_t high = 2 * k + 1 < in_features ? row[2 * k + 1] : 0;
                pairs[k] = (uint32_t)row[2 * k] | high << 16;
            }
        } else {
            float *row = (float *)x_copy + m * x_row;
#pragma omp simd
            for (int64_t k = 0; k < in_features; ++k) row[k] = load(x, m * x_stride + k, is_bf16);
        }
    }
    /* The dtype branch inside the loop: OpenMP outlines the body, and only there does a
       constant is_bf16 reach the inlined panel code. Threads take whole panels, so a layer
       with fewer panels than threads (SmolLM2's 576 outputs are 18) leaves some idle: fine
       on the 2-thread machines this was measured on, not measured on many cores. */
#pragma omp parallel for schedule(static) if (out_features * in_features >= PANEL_PARALLEL_MIN_WEIGHTS)
    for (int64_t p = 0; p < panel_count(out_features); ++p) {
        if (is_bf16)
            panel_rows(x_copy, x_row, num_rows, depth, panels, bias, out, out_features, p, 1);
        else
            panel_rows(x_copy, x_row, num_rows, depth, panels, bias, out, out_features, p, 0);
    }
    free(x_copy);
    return 0;
}
