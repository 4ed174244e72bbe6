/*
 * Store one step's new K and V rows into their paged-cache slots: the write half of
 * attention, one call per layer instead of index arithmetic and two index_put_ calls
 * (~13 us per layer for one decode token, more than the attention itself).
 *
 * key, value: [num_tokens, row_elements] with rows key_stride / value_stride elements apart
 * (row_elements = num_kv_heads * head_dim, contiguous: a slice of the fused qkv output);
 * key_cache, value_cache: [num_blocks, block_size, row_elements], block b starting
 * block_stride elements after block b - 1 (engine/kv_cache_layout.py); slot_mapping:
 * [num_tokens], slot s = token s % block_size of block s / block_size. element_bytes: 2 or 4.
 */
#include <stdint.h>
#include <string.h>

void store_kv(const void *key, int64_t key_stride, const void *value, int64_t value_stride, void *key_cache,
              void *value_cache, const int64_t *slot_mapping, int64_t num_tokens, int64_t row_elements,
              int64_t block_size, int64_t block_stride, int64_t element_bytes) {
    const size_t row_bytes = (size_t)(row_elements * element_bytes);
    for (int64_t token = 0; token < num_tokens; ++token) {
        const int64_t slot = slot_mapping[token];
        const int64_t offset = ((slot / block_size) * block_stride + (slot % block_size) * row_elements) * element_bytes;
        memcpy((char *)key_cache + offset, (const char *)key + token * key_stride * element_bytes, row_bytes);
        memcpy((char *)value_cache + offset, (const char *)value + token * value_stride * element_bytes, row_bytes);
    }
}
