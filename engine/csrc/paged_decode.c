/*
 * Paged decode attention for CPU: one query token per sequence, attending to its
 * whole context straight out of the paged KV cache, without gathering blocks
 * into a temporary first (the torch fallback's main cost).
 *
 * Layout (one layer): key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim],
 * block b starting block_stride elements after block b - 1 (the cache is block-major:
 * a block's span holds every layer, so the stride exceeds one layer's block);
 * query, out: [num_seqs, num_heads, head_dim]; block_tables: [num_seqs, >= ceil(len / block_size)]
 * with row stride block_table_stride; seq_lens: [num_seqs].
 *
 * One task per sequence walks its blocks in order, reading each block's K (then V)
 * as one contiguous run for every KV head at once, and prefetches the next block:
 * between two layers the weights stream through the caches, so the KV comes from
 * DRAM and the walk is latency-bound without it. Softmax is computed online
 * (flash-decoding style), one block at a time, in float32. Built with -fopenmp
 * against the same libgomp soname torch loads, so it shares torch's thread pool.
 *
 * With SIMD (simd.h: 16 lanes on AVX-512, 8 on AVX2) and head_dim and block_size
 * multiples of the width, scores and values run on explicit vectors; otherwise, and
 * in the generic build, on scalar loops the compiler vectorizes as it can.
 *
 * A quantized cache (kv_format KV_INT8 or KV_FP8_E4M3, kv_quant.h) has rows of head_dim bytes
 * plus a float32 scale, and its strides count bytes. Values are widened to float in registers
 * as they are read and the scale is applied once per row: to a key row's dot product with the
 * query, and to the softmax weight a value row is accumulated with. When a KV head serves a
 * group of query heads (GQA), its rows of the block are widened once into a tile of floats (one
 * KV head x block_size rows: 4 KB for 16 x 64, in L1) that every head of the group reads, rather
 * than once per head: widening fp8 costs as much as the dot product. Nothing larger than that
 * tile, and never the context, is dequantized into memory.
 */
#include "kv_quant.h"

#define MAX_HEADS 64
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 64
#define CACHE_LINE 64
/* Below this much work (context tokens x heads x head_dim, summed over sequences) a call runs
   on the calling thread alone: a thread team's wake-up would cost more than it saves. */
#define PARALLEL_MIN_WORK (1 << 18)

static inline void load_row(const void *base, int64_t offset, int is_bf16, int64_t n, float *restrict dst) {
    if (is_bf16) {
        const uint16_t *src = (const uint16_t *)base + offset;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
    } else {
        memcpy(dst, (const float *)base + offset, (size_t)n * sizeof(float));
    }
}

/* A cache row (n values at element offset) as floats, its scale applied when quantized. */
static inline __attribute__((always_inline)) void load_kv_row(const void *base, int64_t offset, int is_bf16,
                                                              const int kv_format, int64_t n, float *restrict dst) {
    if (kv_format == KV_PLAIN) {
        load_row(base, offset, is_bf16, n, dst);
        return;
    }
    const uint8_t *row = (const uint8_t *)base + offset;
    const float scale = kv_row_scale(row, n);
    for (int64_t d = 0; d < n; ++d) dst[d] = kv_value(row, d, kv_format) * scale;
}

/* The next block's cache lines, prefetched a line at a time between the current
   block's computations: a burst of ~200 prefetches would stall the core on its
   miss buffers, while trickling them keeps the next block arriving as we compute. */
typedef struct {
    const char *next;
    const char *end;
} PrefetchStream;

static inline void prefetch_step(PrefetchStream *stream) {
    if (stream->next < stream->end) {
        __builtin_prefetch(stream->next, 0, 3);
        stream->next += CACHE_LINE;
    }
}

static inline void prefetch_rest(PrefetchStream *stream) {
    while (stream->next < stream->end) prefetch_step(stream);
}

#if SIMD_WIDTH == 16
/* Permutation indices for reduce_lanes: round r halves the partial sums per token. */
typedef struct {
    __m512i lo[4], hi[4];
} ReduceIndices;

static void make_reduce_indices(ReduceIndices *indices) {
    for (int round = 0, width = 16; width > 1; ++round, width /= 2) {
        int32_t lo[16], hi[16];
        for (int lane = 0; lane < 16; ++lane) {
            const int from_b = lane >= 8 ? 16 : 0, within = lane % 8;
            const int token = within / (width / 2), part = within % (width / 2);
            lo[lane] = from_b + token * width + part;
            hi[lane] = from_b + token * width + width / 2 + part;
        }
        indices->lo[round] = _mm512_loadu_si512(lo);
        indices->hi[round] = _mm512_loadu_si512(hi);
    }
}

/* Lane t of the result is the sum of v[t]'s 16 lanes: four rounds of pairwise
   permute-and-add (45 instructions) instead of 16 separate horizontal sums. */
static inline vfloat reduce_lanes(vfloat v[16], const ReduceIndices *indices) {
    for (int round = 0, count = 16; count > 1; ++round, count /= 2)
        for (int i = 0; i < count / 2; ++i)
            v[i] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * i], indices->lo[round], v[2 * i + 1]),
                                 _mm512_permutex2var_ps(v[2 * i], indices->hi[round], v[2 * i + 1]));
    return v[0];
}
#elif SIMD_WIDTH == 8
typedef int ReduceIndices; /* AVX2's horizontal adds need no table */

static void make_reduce_indices(ReduceIndices *indices) { *indices = 0; }

/* Lane t of the result is the sum of v[t]'s 8 lanes: three rounds of horizontal adds
   (each within 128-bit halves), then the two halves added across. */
static inline vfloat reduce_lanes(vfloat v[8], const ReduceIndices *indices) {
    (void)indices;
    const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
    const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d); /* [t0..t3 low | t0..t3 high], t4..t7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}
#endif

#if SIMD_WIDTH > 1
/* One KV head's n rows of a quantized block (rows token_stride bytes apart from base) as floats,
   scale applied: tile[t][0..head_dim) (head_dim % SIMD_WIDTH == 0). */
static inline __attribute__((always_inline)) void widen_tile(const void *cache, int64_t base, int64_t token_stride,
                                                             int64_t n, const int64_t head_dim, const int kv_format,
                                                             float tile[][MAX_HEAD_DIM]) {
    for (int64_t t = 0; t < n; ++t) {
        const uint8_t *bytes = (const uint8_t *)cache + base + t * token_stride;
        const vfloat scale = vf_set1(kv_row_scale(bytes, head_dim) * kv_vector_factor(kv_format));
        for (int64_t d = 0; d < head_dim; d += SIMD_WIDTH)
            vf_store(&tile[t][d], vf_mul(vload_kv(bytes + d, kv_format), scale));
    }
}

/* Scores of every head against one block of up to block_size tokens, SIMD_WIDTH tokens at a
   time, vectorized along head_dim with one transpose-reduction per group of tokens
   (head_dim % SIMD_WIDTH == 0, block_size % SIMD_WIDTH == 0). */
static inline __attribute__((always_inline)) void block_scores_simd(
    const void *key_cache, int64_t base, int64_t token_stride, int64_t n, int64_t num_kv_heads, int64_t group,
    const int64_t head_dim, const int64_t row_elements, const int is_bf16, const int kv_format,
    float q[][MAX_HEAD_DIM], float scores[][MAX_BLOCK_SIZE], const ReduceIndices *indices,
    PrefetchStream *next_keys) {
    for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
        for (int64_t head = kv_head * group; head < (kv_head + 1) * group; ++head) {
            for (int64_t first = 0; first < n; first += SIMD_WIDTH) {
                vfloat partial[SIMD_WIDTH];
                for (int64_t t = 0; t < SIMD_WIDTH; ++t) {
                    prefetch_step(next_keys);
                    vfloat sum = vf_zero();
                    if (first + t < n) {
                        const int64_t row = base + (first + t) * token_stride + kv_head * row_elements;
                        if (kv_format == KV_PLAIN) {
                            for (int64_t d = 0; d < head_dim; d += SIMD_WIDTH)
                                sum = vf_fmadd(vf_load(&q[head][d]), vload(key_cache, row + d, is_bf16), sum);
                        } else {
                            const uint8_t *bytes = (const uint8_t *)key_cache + row;
                            for (int64_t d = 0; d < head_dim; d += SIMD_WIDTH)
                                sum = vf_fmadd(vf_load(&q[head][d]), vload_kv(bytes + d, kv_format), sum);
                            sum = vf_mul(sum, vf_set1(kv_row_scale(bytes, head_dim) * kv_vector_factor(kv_format)));
                        }
                    }
                    partial[t] = sum;
                }
                vf_store(&scores[head][first], reduce_lanes(partial, indices));
            }
        }
    }
}

/* acc[head] += sum over the block's tokens of p[head][t] * V[t], with each head's
   accumulator held in registers across the block (head_dim % SIMD_WIDTH == 0). */
static inline __attribute__((always_inline)) void block_values_simd(
    const void *value_cache, int64_t base, int64_t token_stride, int64_t n, int64_t num_kv_heads, int64_t group,
    const int64_t head_dim, const int64_t row_elements, const int is_bf16, const int kv_format,
    float scores[][MAX_BLOCK_SIZE], float acc[][MAX_HEAD_DIM], PrefetchStream *next_values) {
    for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
        for (int64_t head = kv_head * group; head < (kv_head + 1) * group; ++head) {
            vfloat sum[MAX_HEAD_DIM / SIMD_WIDTH];
            for (int64_t c = 0; c < head_dim / SIMD_WIDTH; ++c) sum[c] = vf_load(&acc[head][SIMD_WIDTH * c]);
            for (int64_t t = 0; t < n; ++t) {
                prefetch_step(next_values);
                const int64_t row = base + t * token_stride + kv_head * row_elements;
                if (kv_format == KV_PLAIN) {
                    const vfloat p = vf_set1(scores[head][t]);
                    for (int64_t c = 0; c < head_dim / SIMD_WIDTH; ++c)
                        sum[c] = vf_fmadd(p, vload(value_cache, row + SIMD_WIDTH * c, is_bf16), sum[c]);
                } else {
                    /* The row's scale rides on its softmax weight. */
                    const uint8_t *bytes = (const uint8_t *)value_cache + row;
                    const vfloat p =
                        vf_set1(scores[head][t] * kv_row_scale(bytes, head_dim) * kv_vector_factor(kv_format));
                    for (int64_t c = 0; c < head_dim / SIMD_WIDTH; ++c)
                        sum[c] = vf_fmadd(p, vload_kv(bytes + SIMD_WIDTH * c, kv_format), sum[c]);
                }
            }
            for (int64_t c = 0; c < head_dim / SIMD_WIDTH; ++c) vf_store(&acc[head][SIMD_WIDTH * c], sum[c]);
        }
    }
}
#endif

/* One sequence's attention. Inlined into one copy per common head_dim and dtype
   (see the dispatch below): with the length known at compile time every per-row loop is
   straight vector code instead of a loop with peeling and remainder branches. */
static inline __attribute__((always_inline)) void decode_sequence(
    int64_t seq, const void *query, const void *key_cache, const void *value_cache, const int32_t *block_tables,
    const int32_t *seq_lens, void *out, int64_t num_heads, int64_t num_kv_heads, const int64_t head_dim,
    int64_t block_size, int64_t block_table_stride, int64_t block_stride, float scale, const int is_bf16,
    const int kv_format, const void *reduce_indices) {
#if SIMD_WIDTH > 1
    const ReduceIndices *indices = (const ReduceIndices *)reduce_indices;
    /* Scores go SIMD_WIDTH tokens at a time, values one token at a time. */
    const int values_vectorized = head_dim % SIMD_WIDTH == 0;
    const int scores_vectorized = values_vectorized && block_size % SIMD_WIDTH == 0;
#else
    (void)reduce_indices;
#endif
    const int64_t group = num_heads / num_kv_heads;
    /* Cache elements: the model's dtype, or bytes of a quantized row (its values, then its scale). */
    const int64_t row_elements = kv_format == KV_PLAIN ? head_dim : head_dim + KV_SCALE_BYTES;
    const int64_t token_stride = num_kv_heads * row_elements;
    const int64_t element_bytes = kv_format != KV_PLAIN ? 1 : (is_bf16 ? 2 : 4);
    const int64_t block_bytes = block_size * token_stride * element_bytes; /* one layer's K (or V) of a block */
    const char *key_bytes = (const char *)key_cache, *value_bytes = (const char *)value_cache;
    const int64_t seq_len = seq_lens[seq];
    const int32_t *block_table = block_tables + seq * block_table_stride;
    float q[MAX_HEADS][MAX_HEAD_DIM] __attribute__((aligned(64)));
    float acc[MAX_HEADS][MAX_HEAD_DIM] __attribute__((aligned(64)));
    float scores[MAX_HEADS][MAX_BLOCK_SIZE] __attribute__((aligned(64)));
    float row[MAX_HEAD_DIM] __attribute__((aligned(64)));
#if SIMD_WIDTH > 1
    /* A quantized block's rows of one KV head, widened (only touched for quantized caches). */
    float tile[MAX_BLOCK_SIZE][MAX_HEAD_DIM] __attribute__((aligned(64)));
#endif
    float running_max[MAX_HEADS], running_sum[MAX_HEADS];

    for (int64_t head = 0; head < num_heads; ++head) {
        load_row(query, (seq * num_heads + head) * head_dim, is_bf16, head_dim, q[head]);
        for (int64_t d = 0; d < head_dim; ++d) {
            q[head][d] *= scale;
            acc[head][d] = 0.0f;
        }
        running_max[head] = -INFINITY;
        running_sum[head] = 0.0f;
    }

    for (int64_t start = 0; start < seq_len; start += block_size) {
        const int64_t block_index = start / block_size;
        const int64_t base = (int64_t)block_table[block_index] * block_stride;
        const int64_t n = seq_len - start < block_size ? seq_len - start : block_size;
        PrefetchStream next_keys = {NULL, NULL}, next_values = {NULL, NULL};
        if (start + block_size < seq_len) {
            const int64_t next = (int64_t)block_table[block_index + 1] * block_stride * element_bytes;
            next_keys = (PrefetchStream){key_bytes + next, key_bytes + next + block_bytes};
            next_values = (PrefetchStream){value_bytes + next, value_bytes + next + block_bytes};
        }
#if SIMD_WIDTH > 1
        if (scores_vectorized && kv_format != KV_PLAIN && group > 1) {
            /* Each KV head's rows widened once, then scored against its group's heads as float32 rows. */
            for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
                widen_tile(key_cache, base + kv_head * row_elements, token_stride, n, head_dim, kv_format, tile);
                block_scores_simd(tile, 0, MAX_HEAD_DIM, n, 1, group, head_dim, head_dim, 0, KV_PLAIN,
                                  q + kv_head * group, scores + kv_head * group, indices, &next_keys);
            }
        } else if (scores_vectorized) {
            block_scores_simd(key_cache, base, token_stride, n, num_kv_heads, group, head_dim, row_elements, is_bf16,
                              kv_format, q, scores, indices, &next_keys);
        } else
#endif
            for (int64_t t = 0; t < n; ++t) {
                for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
                    load_kv_row(key_cache, base + t * token_stride + kv_head * row_elements, is_bf16, kv_format,
                                head_dim, row);
                    for (int64_t head = kv_head * group; head < (kv_head + 1) * group; ++head) {
                        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                        for (int64_t d = 0; d < head_dim; ++d) dot += q[head][d] * row[d];
                        scores[head][t] = dot;
                    }
                }
            }
        for (int64_t head = 0; head < num_heads; ++head) {
            float block_max = scores[head][0];
            for (int64_t t = 1; t < n; ++t) block_max = scores[head][t] > block_max ? scores[head][t] : block_max;
            const float new_max = block_max > running_max[head] ? block_max : running_max[head];
            const float correction = fast_expf(running_max[head] - new_max); /* 0 on the first block */
            running_sum[head] *= correction;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) acc[head][d] *= correction;
            float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
            for (int64_t t = 0; t < n; ++t) {
                scores[head][t] = fast_expf(scores[head][t] - new_max);
                block_sum += scores[head][t];
            }
            running_sum[head] += block_sum;
            running_max[head] = new_max;
        }
#if SIMD_WIDTH > 1
        if (values_vectorized && kv_format != KV_PLAIN && group > 1) {
            for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
                widen_tile(value_cache, base + kv_head * row_elements, token_stride, n, head_dim, kv_format, tile);
                block_values_simd(tile, 0, MAX_HEAD_DIM, n, 1, group, head_dim, head_dim, 0, KV_PLAIN,
                                  scores + kv_head * group, acc + kv_head * group, &next_values);
            }
        } else if (values_vectorized) {
            block_values_simd(value_cache, base, token_stride, n, num_kv_heads, group, head_dim, row_elements, is_bf16,
                              kv_format, scores, acc, &next_values);
        } else
#endif
            for (int64_t t = 0; t < n; ++t) {
                for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
                    load_kv_row(value_cache, base + t * token_stride + kv_head * row_elements, is_bf16, kv_format,
                                head_dim, row);
                    for (int64_t head = kv_head * group; head < (kv_head + 1) * group; ++head) {
                        const float p = scores[head][t];
#pragma omp simd
                        for (int64_t d = 0; d < head_dim; ++d) acc[head][d] += p * row[d];
                    }
                }
            }
        prefetch_rest(&next_keys);
        prefetch_rest(&next_values);
    }

    for (int64_t head = 0; head < num_heads; ++head) {
        const int64_t offset = (seq * num_heads + head) * head_dim;
        const float inv_sum = running_sum[head] > 0.0f ? 1.0f / running_sum[head] : 0.0f;
        if (is_bf16) {
            uint16_t *dst = (uint16_t *)out + offset;
            for (int64_t d = 0; d < head_dim; ++d) dst[d] = float_to_bf16(acc[head][d] * inv_sum);
        } else {
            float *dst = (float *)out + offset;
            for (int64_t d = 0; d < head_dim; ++d) dst[d] = acc[head][d] * inv_sum;
        }
    }
}

/* Whether paged_decode_attention takes these sizes (its buffers live on the stack). */
int paged_decode_supports(int64_t num_heads, int64_t head_dim, int64_t block_size) {
    return num_heads <= MAX_HEADS && head_dim <= MAX_HEAD_DIM && block_size <= MAX_BLOCK_SIZE;
}

/* Returns 0, or -1 when a size exceeds the stack buffers (the caller falls back). is_bf16: the
   query's and the output's dtype, and a KV_PLAIN cache's; block_stride in cache elements. */
int paged_decode_attention(const void *query, const void *key_cache, const void *value_cache,
                           const int32_t *block_tables, const int32_t *seq_lens, void *out, int64_t num_seqs,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           int64_t block_table_stride, int64_t block_stride, float scale, int is_bf16,
                           int kv_format) {
    if (!paged_decode_supports(num_heads, head_dim, block_size)) return -1;
    const void *reduce_indices = NULL;
#if SIMD_WIDTH > 1
    ReduceIndices indices;
    make_reduce_indices(&indices);
    reduce_indices = &indices;
#endif
#define DECODE(HEAD_DIM, IS_BF16, KV_FORMAT)                                                            \
    decode_sequence(seq, query, key_cache, value_cache, block_tables, seq_lens, out, num_heads, num_kv_heads, \
                    HEAD_DIM, block_size, block_table_stride, block_stride, scale, IS_BF16, KV_FORMAT,      \
                    reduce_indices)
    int64_t total_context = 0;
    for (int64_t seq = 0; seq < num_seqs; ++seq) total_context += seq_lens[seq];
    const int parallel = num_seqs > 1 && total_context * num_heads * head_dim >= PARALLEL_MIN_WORK;
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
    for (int64_t seq = 0; seq < num_seqs; ++seq) {
        /* The branch sits inside the parallel loop: OpenMP outlines the loop body
           into its own function, so a head_dim fixed outside it would not propagate. */
        if (kv_format == KV_INT8) {
            /* Quantized rows: the query's dtype only matters for its load and the output's store. */
            if (head_dim == 64)
                DECODE(64, is_bf16, KV_INT8);
            else if (head_dim == 128)
                DECODE(128, is_bf16, KV_INT8);
            else
                DECODE(head_dim, is_bf16, KV_INT8);
        } else if (kv_format == KV_FP8_E4M3) {
            if (head_dim == 64)
                DECODE(64, is_bf16, KV_FP8_E4M3);
            else if (head_dim == 128)
                DECODE(128, is_bf16, KV_FP8_E4M3);
            else
                DECODE(head_dim, is_bf16, KV_FP8_E4M3);
        } else if (head_dim == 64 && is_bf16)
            DECODE(64, 1, KV_PLAIN);
        else if (head_dim == 128 && is_bf16)
            DECODE(128, 1, KV_PLAIN);
        else if (head_dim == 64)
            DECODE(64, 0, KV_PLAIN);
        else if (head_dim == 128)
            DECODE(128, 0, KV_PLAIN);
        else
            DECODE(head_dim, is_bf16, KV_PLAIN);
    }
#undef DECODE
    return 0;
}
