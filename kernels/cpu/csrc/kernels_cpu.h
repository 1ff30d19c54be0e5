/* The library's whole interface: every exported function, the status they return, the argument structs the
 * larger ones take (kernels/cpu/interface.py mirrors them field for field, and a test compares the two), and
 * the sizes from which a kernel hands its loop to the OpenMP threads. Pointers to tensor data are void: each
 * struct serves the fp32 and the bf16 function alike, which read them as their element type. */
#ifndef KERNELS_CPU_H
#define KERNELS_CPU_H

#include <stdint.h>

typedef enum {
    KERNELS_CPU_OK = 0,
    KERNELS_CPU_BAD_BLOCK = 1,     /* a block table entry a sequence uses lies outside the cache */
    KERNELS_CPU_BAD_SLOT = 2,      /* a slot lies past the cache's end */
    KERNELS_CPU_SHORT_TABLE = 3,   /* a sequence needs more blocks than its block table row has */
    KERNELS_CPU_BAD_POSITION = 4,  /* a position lies outside the RoPE tables */
    KERNELS_CPU_BAD_QUERY_LEN = 5, /* a sequence's query rows fall or outnumber its tokens */
    KERNELS_CPU_NO_MEMORY = 6,     /* scratch memory could not be allocated */
} kernels_cpu_status;

/* Threading thresholds: below these sizes a call runs on the calling thread (waking the others costs a few
 * microseconds, more when another process holds a core; docs/benchmarks.md has the measurements). */
#define SILU_PARALLEL_MIN 16384       /* rows x d elements (exp and a division each) */
#define RMS_NORM_PARALLEL_MIN 16384   /* rows x width elements */
#define ROPE_PARALLEL_MIN 65536       /* tokens x heads x head_dim elements */
#define CACHE_WRITE_PARALLEL_MIN 256  /* tokens */
#define DECODE_PARALLEL_MIN 8192      /* (context token, query head) pairs: ~1 MFLOP at head_dim 64 */
#define PREFILL_PARALLEL_MIN 8192     /* (query row, context token, head) triples */
#define SKINNY_PARALLEL_MIN (1 << 16) /* elements of w: a second thread pays for its wake-up (~4 us of streaming) */
#define GGML_A8_QUANTIZE_PARALLEL_MIN 8 /* activation rows to quantize */

/* Paged attention over caches [num_blocks, block_size, num_kv_heads, head_dim] (contiguous): decode (one query
 * row per sequence) and prefill (sequence s owns query rows query_start_loc[s] .. query_start_loc[s + 1] - 1,
 * the last positions of its seq_lens[s] tokens). out [rows, num_heads, head_dim] contiguous; query rows at
 * q_token_stride / q_head_stride (head_dim contiguous); block_tables [num_seqs, table_width] int32 with row
 * stride table_stride. Decode reads head_splits (how many runs a sequence's KV heads are cut into, 1 ..
 * num_kv_heads) and no query_start_loc; prefill the reverse. */
typedef struct {
    void *out;
    const void *query, *key_cache, *value_cache;
    const int32_t *block_tables, *seq_lens, *query_start_loc;
    int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks;
    int64_t q_token_stride, q_head_stride, table_stride, table_width, head_splits;
    float scale;
} paged_attention_args;

/* Each token's K and V rows (token and head strides in elements; head_dim contiguous) copied into the caches
 * at its slot (slot -1: skipped); elem_size bytes a value. */
typedef struct {
    const void *key, *value;
    void *key_cache, *value_cache;
    const int64_t *slot_mapping;
    int64_t num_tokens, num_kv_heads, head_dim, num_slots;
    int64_t k_token_stride, k_head_stride, v_token_stride, v_head_stride, elem_size;
} reshape_and_cache_args;

/* Rotate-half RoPE in place on x [tokens, heads, head_dim] (tokens token_stride apart, heads head_dim apart)
 * at positions, from cos / sin tables [max_positions, head_dim / 2]. */
typedef struct {
    void *x;
    const int64_t *positions;
    const void *cos, *sin;
    int64_t tokens, heads, head_dim, token_stride, max_positions;
} rotary_embedding_args;

/* A decode step's attention block: qkv [tokens, (num_heads + 2 num_kv_heads) * head_dim], rows qkv_stride
 * apart; the fields as in the three structs above (the caches' blocks of block_size, num_blocks of them). */
typedef struct {
    void *out, *qkv;
    const int64_t *positions;
    const void *cos, *sin;
    void *key_cache, *value_cache;
    const int64_t *slot_mapping;
    const int32_t *block_tables, *seq_lens;
    int64_t tokens, num_heads, num_kv_heads, head_dim, block_size, num_blocks, qkv_stride;
    int64_t table_stride, table_width, head_splits, max_positions;
    float scale;
} decode_attention_block_args;

/* y [m, n] = x [m, k] (rows x_stride apart) @ w [n, k].T (+ bias [n]) (+ residual [m, n], rows residual_stride
 * apart); bias and residual may be NULL. */
typedef struct {
    void *y;
    const void *x, *w, *bias, *residual;
    int64_t m, n, k, x_stride, residual_stride;
} skinny_gemm_args;

/* out [m, n] (fp32, or bf16 when bf16 != 0) = x [m, k] (rows x_stride apart, x's dtype the same) times a
 * packed GGUF matrix (w, its fp16 block scales dw and minimums mw; mw unused for bits 8). */
typedef struct {
    void *out;
    const void *x;
    const uint8_t *w;
    const uint16_t *dw, *mw;
    int64_t m, n, k, x_stride, bits, bf16;
} ggml_mul_mat_a8_args;

/* Weight-only fp8: y [m, n] (x's dtype) = x [m, k] (fp32, or bf16 when bf16 != 0; rows x_stride apart) @
 * (w [n, k] float8_e4m3fn codes * scale [n] fp32).T (+ bias [n]) (+ residual [m, n], rows residual_stride apart,
 * x's dtype); bias and residual may be NULL. */
typedef struct {
    void *y;
    const void *x, *bias, *residual;
    const uint8_t *w;
    const float *scale;
    int64_t m, n, k, x_stride, residual_stride, bf16;
} fp8_gemm_args;

int paged_attention_decode_f32(const paged_attention_args *a);
int paged_attention_decode_bf16(const paged_attention_args *a);
int paged_attention_f32(const paged_attention_args *a);
int paged_attention_bf16(const paged_attention_args *a);
int reshape_and_cache(const reshape_and_cache_args *a);
int rotary_embedding_f32(const rotary_embedding_args *a);
int rotary_embedding_bf16(const rotary_embedding_args *a);
int decode_attention_block_f32(const decode_attention_block_args *a);
int decode_attention_block_bf16(const decode_attention_block_args *a);
void skinny_gemm_f32(const skinny_gemm_args *a);
void skinny_gemm_bf16(const skinny_gemm_args *a);
int ggml_mul_mat_a8(const ggml_mul_mat_a8_args *a);
int fp8_gemm_w8a16(const fp8_gemm_args *a);
/* the same product, bf16 x only, w packed by fp8_gemm.py's fp8_pack ([ceil(n/32)][ceil(k/2)][64] codes) */
int fp8_gemm_w8a16_packed(const fp8_gemm_args *a);
/* skinny_gemm's product for bf16 x, w packed by packed_gemm.py's bf16_pack ([ceil(n/32)][ceil(k/2)][32][2]) */
void bf16_gemm_packed(const skinny_gemm_args *a);
/* 1 where this build computes the two packed GEMMs for x of this dtype on AVX512-BF16 dot products */
int packed_gemm_native(int64_t bf16);
/* the elementwise ops: few enough arguments to pass them as they are (x rows x_stride apart, out contiguous) */
void rms_norm_f32(float *out, const float *x, const float *weight, int64_t rows, int64_t width, int64_t x_stride,
                  float eps);
void rms_norm_bf16(uint16_t *out, const uint16_t *x, const uint16_t *weight, int64_t rows, int64_t width,
                   int64_t x_stride, float eps);
void silu_and_mul_f32(float *out, const float *x, int64_t rows, int64_t d, int64_t x_stride);
void silu_and_mul_bf16(uint16_t *out, const uint16_t *x, int64_t rows, int64_t d, int64_t x_stride);
void fp8_dequantize(void *out, const uint8_t *q, const float *scale, int64_t n, int64_t k, int64_t bf16);

#endif
