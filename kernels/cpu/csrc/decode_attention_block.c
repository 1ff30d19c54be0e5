/* A decode step's attention block after the QKV GEMM, in one call per layer: RoPE on the q and k heads of
 * the fused qkv rows (in place), their K and V rows written into the paged caches, then paged decode
 * attention of the rotated queries. It runs the library's own three kernels in sequence (rotary_embedding,
 * reshape_and_cache, paged_attention_decode: the same arithmetic, so the same bits); what it saves is the
 * host side: one foreign call per layer instead of three, with the step's positions, slots and tables
 * converted once per step by the caller instead of once per kernel per layer (on a batch-1 decode step of
 * a 30-layer model the glue cost more than the kernels).
 *
 * qkv [tokens, (num_heads + 2 num_kv_heads) * head_dim] with row stride qkv_stride (q heads, then k, then v,
 * head_dim contiguous); one query row per sequence (tokens == sequences, a decode-only step). Returns 0 or
 * the first failing kernel's status (a bad position before anything is written; a bad slot or block). */
#include <stdint.h>

#include "vec8.h"

int rotary_embedding_f32(float *x, const int64_t *positions, const float *cos, const float *sin, int64_t tokens,
                         int64_t heads, int64_t head_dim, int64_t token_stride, int64_t max_positions);
int rotary_embedding_bf16(bf16_t *x, const int64_t *positions, const bf16_t *cos, const bf16_t *sin, int64_t tokens,
                          int64_t heads, int64_t head_dim, int64_t token_stride, int64_t max_positions);
int reshape_and_cache(const char *key, const char *value, char *key_cache, char *value_cache,
                      const int64_t *slot_mapping, int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim,
                      int64_t num_slots, int64_t k_token_stride, int64_t k_head_stride, int64_t v_token_stride,
                      int64_t v_head_stride, int64_t elem_size);
int paged_attention_decode_f32(float *out, const float *query, const float *key_cache, const float *value_cache,
                               const int32_t *block_tables, const int32_t *seq_lens, int64_t num_seqs,
                               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                               int64_t num_blocks, int64_t q_seq_stride, int64_t q_head_stride,
                               int64_t table_stride, int64_t table_width, int64_t head_splits, float scale);
int paged_attention_decode_bf16(bf16_t *out, const bf16_t *query, const bf16_t *key_cache,
                                const bf16_t *value_cache, const int32_t *block_tables, const int32_t *seq_lens,
                                int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                int64_t block_size, int64_t num_blocks, int64_t q_seq_stride, int64_t q_head_stride,
                                int64_t table_stride, int64_t table_width, int64_t head_splits, float scale);

#define DEFINE_BLOCK(T, SUFFIX)                                                                                  \
    int decode_attention_block_##SUFFIX(                                                                         \
        T *out, T *qkv, const int64_t *positions, const T *cos, const T *sin, T *key_cache, T *value_cache,     \
        const int64_t *slot_mapping, const int32_t *block_tables, const int32_t *seq_lens, int64_t tokens,      \
        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,      \
        int64_t qkv_stride, int64_t table_stride, int64_t table_width, int64_t head_splits,                     \
        int64_t max_positions, float scale) {                                                                    \
        int rc = rotary_embedding_##SUFFIX(qkv, positions, cos, sin, tokens, num_heads + num_kv_heads, head_dim, \
                                           qkv_stride, max_positions);                                          \
        if (rc) return rc;                                                                                       \
        const T *key = qkv + num_heads * head_dim, *value = key + num_kv_heads * head_dim;                       \
        rc = reshape_and_cache((const char *)key, (const char *)value, (char *)key_cache, (char *)value_cache,  \
                               slot_mapping, tokens, num_kv_heads, head_dim, num_blocks * block_size,           \
                               qkv_stride, head_dim, qkv_stride, head_dim, sizeof(T));                          \
        if (rc) return rc;                                                                                       \
        return paged_attention_decode_##SUFFIX(out, qkv, key_cache, value_cache, block_tables, seq_lens, tokens, \
                                               num_heads, num_kv_heads, head_dim, block_size, num_blocks,       \
                                               qkv_stride, head_dim, table_stride, table_width, head_splits,    \
                                               scale);                                                           \
    }

DEFINE_BLOCK(float, f32)
DEFINE_BLOCK(bf16_t, bf16)
