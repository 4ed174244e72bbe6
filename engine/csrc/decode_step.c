/*
 * One whole forward pass of a Llama-family decoder for a batch of decode tokens (one new
 * token per row), in one call: the same kernels, in the same order, on the same inputs as
 * the PyTorch modules of engine/models/llama.py run them one by one, so the logits are
 * bit-identical to theirs (tests/engine/test_native_decode.py holds it to that).
 *
 * Why one call: a decode step of a small model is some 15 kernel calls per layer, each a
 * few to a few hundred microseconds, and between them Python builds views, checks strides
 * and converts ctypes arguments, holding the GIL throughout. In a serving process the gRPC
 * event loop needs the GIL too, for every token it streams; the engine thread gave it up at
 * every kernel call and waited for it back at every return. Here the caller releases the
 * GIL once (ctypes does) for the whole pass. What those costs were and what one call saves:
 * docs/benchmarks.md, "A decode step in one native call".
 *
 * Per layer, as DecoderLayer.forward: input norm (fused with the residual add), qkv
 * projection, rotary on q and k, K/V stored into the paged cache (quantized there when the cache
 * is: kv_store.c), paged decode attention,
 * output projection, post-attention norm (fused add), gate/up projection, SiLU-and-mul,
 * down projection. Then the final norm and the head, and the logits upcast to float32.
 *
 * Each linear layer is a DecodeLinear naming the kernel its module calls: float panels
 * (PackedLinear, BF16WeightLinear: linear_panels.c), or a quantized weight kept in its blocks
 * (QuantizedLinear: quant_linear.c with float activations, quant_linear_q8 with activations
 * rounded to Q8_0 / Q8_K on the fly, as the module was built to), in one run of rows per format
 * (a MixedQuantizedLinear's parts). A quantized embedding (QuantizedEmbedding) dequantizes the
 * step's rows with quant_dequantize_rows; a head tied to it is a quantized linear over its blocks.
 */
#include <stdlib.h>

#include "common.h"

/* The kernels this file strings together (the other sources of this library). */
void add_rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t num_rows, int64_t hidden,
                  float eps, int is_bf16);
void silu_and_mul(const void *gate_up, void *out, int64_t num_rows, int64_t intermediate, int is_bf16);
void rotary_embedding(const void *q, int64_t q_stride, const void *k, int64_t k_stride, void *q_out, void *k_out,
                      const void *cos_cache, const void *sin_cache, const int64_t *positions, int64_t num_tokens,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int is_bf16);
void store_kv(const void *key, int64_t key_stride, const void *value, int64_t value_stride, void *key_cache,
              void *value_cache, const int64_t *slot_mapping, int64_t num_tokens, int64_t num_kv_heads,
              int64_t head_dim, int64_t block_size, int64_t block_stride, int64_t element_bytes, int kv_format);
int paged_decode_attention(const void *query, const void *key_cache, const void *value_cache,
                           const int32_t *block_tables, const int32_t *seq_lens, void *out, int64_t num_seqs,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           int64_t block_table_stride, int64_t block_stride, float scale, int is_bf16,
                           int kv_format);
int linear_panels(const void *x, int64_t x_stride, const void *panels, const void *bias, void *out, int64_t num_rows,
                  int64_t in_features, int64_t out_features, int is_bf16);
/* quant_linear.c, quant_q8.c (which hands the K-quants to quant_q8k.c): 0, -1 (no memory) or
   -2 (a format or width they refuse). */
int quant_linear(const void *x, int64_t x_stride, const uint8_t *w, const void *bias, void *out, int64_t num_rows,
                 int64_t in_features, int64_t out_features, int qtype, int is_bf16);
int quant_linear_q8(const void *x, int64_t x_stride, const uint8_t *w, const void *bias, void *out, int64_t num_rows,
                    int64_t in_features, int64_t out_features, int qtype, int is_bf16);
int quant_dequantize_rows(const uint8_t *w, const int64_t *row_ids, int64_t first_row, int64_t num_rows,
                          int64_t num_weight_rows, int64_t in_features, int qtype, void *out, int out_is_bf16);

/* Rows of a quantized weight in one format: [out_features] rows of blocks as
   engine/models/quant_format.py lays them out (an INT8 row starts with its scale). */
typedef struct {
    const uint8_t *blocks;
    int64_t out_features;
    int64_t qtype;          /* quant_blocks.h's QTYPE_*: ggml's codes, and INT8's */
    int64_t q8_activations; /* 1: inputs rounded to Q8_0 / Q8_K on the fly (quant_linear_q8) */
} QuantRun;

/* One linear layer's weight as its module holds it: float panels (num_runs 0), or num_runs runs
   of quantized rows side by side. The bias (NULL when absent) is in the model's dtype. */
typedef struct {
    const void *panels;
    const void *bias;
    int64_t num_runs;
    const QuantRun *runs;
} DecodeLinear;

/* One decoder layer's weights and its view of the KV cache: the K and V of block 0, later
   blocks block_stride cache elements apart (bytes, when the cache is quantized). */
typedef struct {
    const void *input_norm, *post_attention_norm;
    DecodeLinear qkv, o, gate_up, down;
    void *key_cache, *value_cache;
} DecodeLayer;

/* Everything but the step's inputs; engine/models/native_decode.py fills it once per model. */
typedef struct {
    int64_t num_layers, hidden, intermediate, num_heads, num_kv_heads, head_dim, vocab_size;
    int64_t block_size, block_stride;
    float rms_norm_eps, scale;
    int64_t is_bf16;
    int64_t kv_format;              /* kv_quant.h: KV_PLAIN (the model's dtype), KV_INT8, KV_FP8_E4M3 */
    const void *embedding;          /* [vocab_size, hidden]: rows of the model's dtype, or of blocks */
    int64_t embedding_qtype;        /* the blocks' QTYPE_*; 0: rows of the model's dtype */
    const void *final_norm;         /* [hidden] */
    DecodeLinear head;              /* [vocab_size, hidden] */
    const void *cos, *sin;          /* [max_positions, head_dim / 2] */
    const DecodeLayer *layers;      /* [num_layers] */
} DecodeModel;

enum { DECODE_OK = 0, DECODE_NO_MEMORY = -1, DECODE_BAD_TOKEN = -2, DECODE_UNSUPPORTED = -3, DECODE_BAD_WEIGHT = -4 };

/* A kernel's 0 / -1 / -2 as a decode status. */
static int kernel_status(int status) {
    return status == 0 ? DECODE_OK : (status == -1 ? DECODE_NO_MEMORY : DECODE_BAD_WEIGHT);
}

static int run_quantized(const QuantRun *run, const void *x, int64_t x_stride, const void *bias, void *out,
                         int64_t rows, int64_t in_features, int bf16) {
    int (*kernel)(const void *, int64_t, const uint8_t *, const void *, void *, int64_t, int64_t, int64_t, int, int) =
        run->q8_activations ? quant_linear_q8 : quant_linear;
    return kernel_status(
        kernel(x, x_stride, run->blocks, bias, out, rows, in_features, run->out_features, (int)run->qtype, bf16));
}

/* out [rows, out_features] (contiguous) = x [rows, in_features] (rows x_stride apart) times the
   layer's weight, plus its bias, computed as its module computes it. Returns a DECODE_ status. */
static int run_linear(const DecodeLinear *linear, const void *x, int64_t x_stride, void *out, int64_t rows,
                      int64_t in_features, int64_t out_features, int bf16) {
    if (linear->num_runs == 0)
        return kernel_status(
            linear_panels(x, x_stride, linear->panels, linear->bias, out, rows, in_features, out_features, bf16));
    if (linear->num_runs == 1)
        return run_quantized(&linear->runs[0], x, x_stride, linear->bias, out, rows, in_features, bf16);
    /* MixedQuantizedLinear: each run's output, then the fused bias added once, in the model's
       dtype (torch.cat, then + bias: a bf16 sum rounded again, as torch rounds it). One row's
       outputs lie side by side in it already; more rows go through a run's own buffer. */
    const int64_t bytes = bf16 ? 2 : 4;
    int64_t widest = 0;
    for (int64_t i = 0; i < linear->num_runs; ++i)
        widest = linear->runs[i].out_features > widest ? linear->runs[i].out_features : widest;
    char *buffer = rows == 1 ? NULL : malloc((size_t)(rows * widest * bytes));
    if (rows > 1 && buffer == NULL) return DECODE_NO_MEMORY;
    int status = DECODE_OK;
    for (int64_t i = 0, offset = 0; i < linear->num_runs; offset += linear->runs[i++].out_features) {
        const QuantRun *run = &linear->runs[i];
        char *target = rows == 1 ? (char *)out + offset * bytes : buffer;
        if ((status = run_quantized(run, x, x_stride, NULL, target, rows, in_features, bf16)) != DECODE_OK) break;
        for (int64_t r = 0; rows > 1 && r < rows; ++r)
            memcpy((char *)out + (r * out_features + offset) * bytes, buffer + r * run->out_features * bytes,
                   (size_t)(run->out_features * bytes));
    }
    free(buffer);
    if (status != DECODE_OK || linear->bias == NULL) return status;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t n = 0; n < out_features; ++n) {
            if (bf16) {
                uint16_t *value = (uint16_t *)out + r * out_features + n;
                *value = float_to_bf16(bf16_to_float(*value) + bf16_to_float(((const uint16_t *)linear->bias)[n]));
            } else {
                ((float *)out)[r * out_features + n] += ((const float *)linear->bias)[n];
            }
        }
    return DECODE_OK;
}

/*
 * input_ids, positions, slot_mapping: [num_rows] int64; block_tables: [num_rows, >= blocks]
 * int32, rows block_table_stride apart; seq_lens: [num_rows] int32 (the new token included);
 * logits: [num_rows, vocab_size] float32; hidden_out: NULL, or [num_rows, hidden] in the model
 * dtype for the final normed hidden states (what Medusa heads draft from); capture_layers:
 * num_captures ascending layer indices, whose residual streams entering them (0: the embeddings)
 * go side by side into captured_out, [num_rows, num_captures * hidden] in the model dtype (what
 * EAGLE-3 drafts fuse; NULL when num_captures is 0). Returns DECODE_OK, or an error code having
 * written nothing but (possibly) some layers' K/V of this step's tokens, which a retry rewrites
 * alike.
 */
int decode_forward(const DecodeModel *m, const int64_t *input_ids, const int64_t *positions,
                   const int64_t *slot_mapping, const int32_t *block_tables, int64_t block_table_stride,
                   const int32_t *seq_lens, int64_t num_rows, float *logits, void *hidden_out,
                   const int64_t *capture_layers, int64_t num_captures, void *captured_out) {
    const int bf16 = (int)m->is_bf16;
    const int64_t bytes = bf16 ? 2 : 4, rows = num_rows, hidden = m->hidden;
    const int64_t q_size = m->num_heads * m->head_dim, kv_size = m->num_kv_heads * m->head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size, inter = m->intermediate;
    for (int64_t r = 0; r < rows; ++r)
        if (input_ids[r] < 0 || input_ids[r] >= m->vocab_size) return DECODE_BAD_TOKEN;

    /* Activations of one layer, each [rows, width] in the model dtype; the head's output too
       in bf16 (it is upcast into logits afterwards). */
    const int64_t widths[] = {hidden, hidden, hidden, qkv_size, q_size, kv_size, q_size, 2 * inter, inter};
    int64_t total = bf16 ? rows * m->vocab_size : 0;
    for (size_t i = 0; i < sizeof widths / sizeof widths[0]; ++i) total += rows * widths[i];
    char *scratch = malloc((size_t)(total * bytes));
    if (scratch == NULL) return DECODE_NO_MEMORY;
    char *cursor = scratch;
#define TAKE(width) (cursor += rows * (width) * bytes, cursor - rows * (width) * bytes)
    char *residual = TAKE(hidden), *x = TAKE(hidden), *normed = TAKE(hidden), *qkv = TAKE(qkv_size);
    char *q = TAKE(q_size), *k = TAKE(kv_size), *attention = TAKE(q_size), *gate_up = TAKE(2 * inter);
    char *activation = TAKE(inter);
    char *head_out = bf16 ? TAKE(m->vocab_size) : (char *)logits;
#undef TAKE

    /* Each kernel that can fail ends the pass at its first failure. */
    int status = DECODE_OK;
    if (m->embedding_qtype != 0) {
        status = kernel_status(quant_dequantize_rows(m->embedding, input_ids, 0, rows, m->vocab_size, hidden,
                                                     (int)m->embedding_qtype, residual, bf16));
    } else {
        for (int64_t r = 0; r < rows; ++r)
            memcpy(residual + r * hidden * bytes, (const char *)m->embedding + input_ids[r] * hidden * bytes,
                   (size_t)(hidden * bytes));
    }
    int64_t next_capture = 0;
    for (int64_t l = 0; l < m->num_layers && status == DECODE_OK; ++l) {
        const DecodeLayer *layer = &m->layers[l];
        /* The first layer normalises the embedding itself, which becomes the residual. */
        if (l == 0)
            add_rms_norm(residual, NULL, layer->input_norm, normed, rows, hidden, m->rms_norm_eps, bf16);
        else
            add_rms_norm(x, residual, layer->input_norm, normed, rows, hidden, m->rms_norm_eps, bf16);
        /* The residual now holds the stream entering layer l (x added in, rounded to the dtype). */
        if (next_capture < num_captures && capture_layers[next_capture] == l) {
            for (int64_t r = 0; r < rows; ++r)
                memcpy((char *)captured_out + (r * num_captures + next_capture) * hidden * bytes,
                       residual + r * hidden * bytes, (size_t)(hidden * bytes));
            ++next_capture;
        }
        if ((status = run_linear(&layer->qkv, normed, hidden, qkv, rows, hidden, qkv_size, bf16)) != DECODE_OK) break;
        rotary_embedding(qkv, qkv_size, qkv + q_size * bytes, qkv_size, q, k, m->cos, m->sin, positions, rows,
                         m->num_heads, m->num_kv_heads, m->head_dim, bf16);
        store_kv(k, kv_size, qkv + (q_size + kv_size) * bytes, qkv_size, layer->key_cache, layer->value_cache,
                 slot_mapping, rows, m->num_kv_heads, m->head_dim, m->block_size, m->block_stride, bytes,
                 (int)m->kv_format);
        if (paged_decode_attention(q, layer->key_cache, layer->value_cache, block_tables, seq_lens, attention, rows,
                                   m->num_heads, m->num_kv_heads, m->head_dim, m->block_size, block_table_stride,
                                   m->block_stride, m->scale, bf16, (int)m->kv_format) != 0) {
            status = DECODE_UNSUPPORTED;
            break;
        }
        if ((status = run_linear(&layer->o, attention, q_size, x, rows, q_size, hidden, bf16)) != DECODE_OK) break;
        add_rms_norm(x, residual, layer->post_attention_norm, normed, rows, hidden, m->rms_norm_eps, bf16);
        status = run_linear(&layer->gate_up, normed, hidden, gate_up, rows, hidden, 2 * inter, bf16);
        if (status != DECODE_OK) break;
        silu_and_mul(gate_up, activation, rows, inter, bf16);
        status = run_linear(&layer->down, activation, inter, x, rows, inter, hidden, bf16);
    }
    if (status == DECODE_OK) {
        add_rms_norm(x, residual, m->final_norm, normed, rows, hidden, m->rms_norm_eps, bf16);
        if (hidden_out != NULL) memcpy(hidden_out, normed, (size_t)(rows * hidden * bytes));
        status = run_linear(&m->head, normed, hidden, head_out, rows, hidden, m->vocab_size, bf16);
    }
    if (status == DECODE_OK && bf16) {
        const uint16_t *source = (const uint16_t *)head_out;
        for (int64_t i = 0; i < rows * m->vocab_size; ++i) logits[i] = bf16_to_float(source[i]);
    }
    free(scratch);
    return status;
}
