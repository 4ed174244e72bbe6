/*
 * Store one step's new K and V rows into their paged-cache slots: the write half of
 * attention, one call per layer instead of index arithmetic and two index_put_ calls, which
 * cost more than the attention itself for one decode token.
 *
 * key, value: [num_tokens, num_kv_heads * head_dim] with rows key_stride / value_stride
 * elements apart (each row contiguous: a slice of the fused qkv output), element_bytes each
 * (2: bf16, or any 16-bit float when the cache stores it as is; 4: float32); slot_mapping:
 * [num_tokens], slot s = token s % block_size of block s / block_size.
 *
 * key_cache, value_cache: [num_blocks, block_size, num_kv_heads, row], block b starting
 * block_stride cache elements after block b - 1 (engine/kv_cache_layout.py). kv_format
 * KV_PLAIN: rows of head_dim elements of the input's dtype, copied as they are; KV_INT8 or
 * KV_FP8_E4M3: rows of head_dim + 4 bytes, each token-head row quantized here
 * (kv_quant.h: the bytes engine.kv_cache_dtype.quantize writes).
 */
#include "kv_quant.h"

void store_kv(const void *key, int64_t key_stride, const void *value, int64_t value_stride, void *key_cache,
              void *value_cache, const int64_t *slot_mapping, int64_t num_tokens, int64_t num_kv_heads,
              int64_t head_dim, int64_t block_size, int64_t block_stride, int64_t element_bytes, int kv_format) {
    const int64_t row_elements = num_kv_heads * head_dim;
    if (kv_format == KV_PLAIN) {
        const size_t row_bytes = (size_t)(row_elements * element_bytes);
        for (int64_t token = 0; token < num_tokens; ++token) {
            const int64_t slot = slot_mapping[token];
            const int64_t offset =
                ((slot / block_size) * block_stride + (slot % block_size) * row_elements) * element_bytes;
            memcpy((char *)key_cache + offset, (const char *)key + token * key_stride * element_bytes, row_bytes);
            memcpy((char *)value_cache + offset, (const char *)value + token * value_stride * element_bytes,
                   row_bytes);
        }
        return;
    }
    const int is_bf16 = element_bytes == 2;
    const int64_t row_bytes = head_dim + KV_SCALE_BYTES;
    for (int64_t token = 0; token < num_tokens; ++token) {
        const int64_t slot = slot_mapping[token];
        const int64_t offset = (slot / block_size) * block_stride + (slot % block_size) * num_kv_heads * row_bytes;
        const char *key_row = (const char *)key + token * key_stride * element_bytes;
        const char *value_row = (const char *)value + token * value_stride * element_bytes;
        for (int64_t head = 0; head < num_kv_heads; ++head) {
            const int64_t at = offset + head * row_bytes, from = head * head_dim * element_bytes;
            kv_quantize_row(key_row + from, is_bf16, head_dim, kv_format, (uint8_t *)key_cache + at);
            kv_quantize_row(value_row + from, is_bf16, head_dim, kv_format, (uint8_t *)value_cache + at);
        }
    }
}
