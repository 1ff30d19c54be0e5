/* Write each token's K and V rows into the paged caches at its slot, fp32 or bf16 (a copy of
 * elem_size-byte values); slot -1 is skipped.
 *
 * One call per layer replaces the mask, the boolean selects and the two index_put calls of the
 * PyTorch version. Rows are read through strides (K and V are usually views into one fused QKV
 * matmul output); head_dim is contiguous. Returns 0, or KERNELS_CPU_BAD_SLOT when a slot lies past
 * the cache (nothing is written for it; the caller raises).
 */
#include <stdint.h>
#include <string.h>

#include "kernels_cpu.h"

int reshape_and_cache(const reshape_and_cache_args *a) {
    const char *key = a->key, *value = a->value;
    char *key_cache = a->key_cache, *value_cache = a->value_cache;
    const int64_t *slot_mapping = a->slot_mapping, num_tokens = a->num_tokens, num_kv_heads = a->num_kv_heads;
    const int64_t head_dim = a->head_dim, num_slots = a->num_slots, elem_size = a->elem_size;
    const int64_t k_token_stride = a->k_token_stride, k_head_stride = a->k_head_stride;
    const int64_t v_token_stride = a->v_token_stride, v_head_stride = a->v_head_stride;
    const size_t row = elem_size * head_dim;
    int status = 0;
#pragma omp parallel for schedule(static) if (num_tokens >= CACHE_WRITE_PARALLEL_MIN)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        if (slot >= num_slots) {
#pragma omp atomic write
            status = KERNELS_CPU_BAD_SLOT;
            continue;
        }
        char *k_dst = key_cache + slot * num_kv_heads * row;
        char *v_dst = value_cache + slot * num_kv_heads * row;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            memcpy(k_dst + h * row, key + (t * k_token_stride + h * k_head_stride) * elem_size, row);
            memcpy(v_dst + h * row, value + (t * v_token_stride + h * v_head_stride) * elem_size, row);
        }
    }
    return status;
}
