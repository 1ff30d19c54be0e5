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
#include <stddef.h>

#include "kernels_cpu.h"

/* ELEM: the element's size in bytes */
#define DEFINE_BLOCK(SUFFIX, ELEM)                                                                                \
    int decode_attention_block_##SUFFIX(const decode_attention_block_args *a) {                                 \
        const int64_t elem = ELEM;                                                                              \
        const rotary_embedding_args rope = {a->qkv, a->positions, a->cos, a->sin, a->tokens,                   \
                                            a->num_heads + a->num_kv_heads, a->head_dim, a->qkv_stride,       \
                                            a->max_positions};                                                \
        int rc = rotary_embedding_##SUFFIX(&rope);                                                              \
        if (rc) return rc;                                                                                      \
        const char *key = (const char *)a->qkv + a->num_heads * a->head_dim * elem;                             \
        const reshape_and_cache_args write = {key, key + a->num_kv_heads * a->head_dim * elem, a->key_cache,     \
                                              a->value_cache, a->slot_mapping, a->tokens, a->num_kv_heads,      \
                                              a->head_dim, a->num_blocks * a->block_size, a->qkv_stride,       \
                                              a->head_dim, a->qkv_stride, a->head_dim, elem};                   \
        rc = reshape_and_cache(&write);                                                                         \
        if (rc) return rc;                                                                                      \
        const paged_attention_args attend = {a->out, a->qkv, a->key_cache, a->value_cache, a->block_tables,    \
                                             a->seq_lens, NULL, a->tokens, a->num_heads, a->num_kv_heads,      \
                                             a->head_dim, a->block_size, a->num_blocks, a->qkv_stride,         \
                                             a->head_dim, a->table_stride, a->table_width, a->head_splits,     \
                                             a->scale};                                                        \
        return paged_attention_decode_##SUFFIX(&attend);                                                        \
    }

DEFINE_BLOCK(f32, 4)
DEFINE_BLOCK(bf16, 2)
