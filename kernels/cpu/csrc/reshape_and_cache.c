/* Write each token's K and V rows into the paged caches at its slot, fp32; slot -1 is skipped.
 *
 * One call per layer replaces the mask, the boolean selects and the two index_put calls of the
 * PyTorch version. Rows are read through strides (K and V are usually views into one fused QKV
 * matmul output); head_dim is contiguous. Returns 0, or KERNELS_CPU_BAD_SLOT when a slot lies past
 * the cache (nothing is written for it; the caller raises).
 */
#include <stdint.h>
#include <string.h>

#define KERNELS_CPU_BAD_SLOT 2

int reshape_and_cache_f32(const float *key, const float *value, float *key_cache, float *value_cache,
                          const int64_t *slot_mapping, int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim,
                          int64_t num_slots, int64_t k_token_stride, int64_t k_head_stride, int64_t v_token_stride,
                          int64_t v_head_stride) {
    const size_t row = sizeof(float) * head_dim;
    int status = 0;
#pragma omp parallel for schedule(static) if (num_tokens >= 256)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        if (slot >= num_slots) {
#pragma omp atomic write
            status = KERNELS_CPU_BAD_SLOT;
            continue;
        }
        float *k_dst = key_cache + slot * num_kv_heads * head_dim;
        float *v_dst = value_cache + slot * num_kv_heads * head_dim;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            memcpy(k_dst + h * head_dim, key + t * k_token_stride + h * k_head_stride, row);
            memcpy(v_dst + h * head_dim, value + t * v_token_stride + h * v_head_stride, row);
        }
    }
    return status;
}
