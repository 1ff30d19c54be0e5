/* The bf16 decode kernel's work item on AVX512-BF16 (included by paged_attention_decode.c): the same
 * arithmetic as the 8-wide template (paged_attention_decode.h) with fp32 inside, in 16-wide registers.
 *
 * On 8-float vectors the bf16 kernel was bound by its instructions, not by memory (make bench-cpu-attention:
 * 16-22 GB/s of K/V where the fp32 kernel streams 28-32 on the same machine): each K element was widened to
 * fp32 and multiplied on its own, with a horizontal sum of 8 lanes per (token, query head). Here a K row
 * stays bf16: `vdpbf16ps` multiplies 32 of its elements by the query's in one instruction (a product of two
 * bf16 values is exact in fp32; pairs are summed in fp32), so a head_dim-64 score is two instructions and one
 * 16-lane sum. The scale multiplies the sum instead of the query (the query stays bf16: at head_dim 64 the
 * scale is 1/8 and nothing changes but the summation order). V rows are widened to fp32 16 at a time, once
 * for up to four query heads of their group, and the probabilities stay fp32 (rounding them to bf16 to use
 * `vdpbf16ps` here too would move the result off the reference's).
 *
 * vdpbf16ps treats bf16 subnormal inputs (below 1.2e-38) as zero; scores and outputs are otherwise the fp32
 * kernel's up to summation order. head_dim is 64 or 128 (nz = head_dim / 32 registers of bf16 pairs),
 * specialised at compile time so every loop over it unrolls; at 32 this path measured no faster, and other
 * sizes take the 8-wide template.
 *
 * Measured (make bench-cpu-attention's batches, caches evicted between calls, an Intel Xeon with AMX, 2
 * threads, against the 8-wide kernel alternating): small-llama's heads 1.01x, SmolLM2's 1.06-1.08x, head_dim
 * 128 1.11-1.15x. Cold reads of randomly placed blocks run at 12-15 GB/s there whichever kernel computes, so
 * the arithmetic it saves shows where the K/V are partly cached, and where the arithmetic is the bound. */
#include <immintrin.h>

/* acc[0..cnt) += p[0..cnt][t] * V[t] over the block's n rows; cnt query heads (a constant after inlining),
 * each accumulator head_dim / 16 registers, V widened once for all cnt heads. */
static inline __attribute__((always_inline)) void zmm_accumulate_pv(
    __m512 (*acc)[8], const float *p, int64_t p_stride, const bf16_t *v, int64_t token_stride, int64_t n,
    const int cnt, const int64_t nd) {
    __m512 a[4][8];
    for (int c = 0; c < cnt; c++)
        for (int64_t j = 0; j < nd; j++) a[c][j] = acc[c][j];
    for (int64_t t = 0; t < n; t++) {
        __m512 pt[4];
        for (int c = 0; c < cnt; c++) pt[c] = _mm512_set1_ps(p[c * p_stride + t]);
        for (int64_t j = 0; j < nd; j++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(v + t * token_stride + 16 * j));
            const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
            for (int c = 0; c < cnt; c++) a[c][j] = _mm512_fmadd_ps(pt[c], x, a[c][j]);
        }
    }
    for (int c = 0; c < cnt; c++)
        for (int64_t j = 0; j < nd; j++) acc[c][j] = a[c][j];
}

/* Query heads h0 * group .. h1 * group of one sequence; as attend_heads in paged_attention_decode.h. */
static inline __attribute__((always_inline)) int attend_heads_bf16_zmm(
    bf16_t *out, const bf16_t *q, int64_t q_head_stride, const bf16_t *key_cache, const bf16_t *value_cache,
    const int32_t *table, int64_t table_width, int64_t seq_len, int64_t h0, int64_t h1, int64_t group,
    int64_t num_kv_heads, const int64_t nz, int64_t block_size, int64_t num_blocks, float scale) {
    const int64_t head_dim = 32 * nz, nd = 2 * nz, nh = h1 - h0, nq = nh * group,
                  token_stride = num_kv_heads * head_dim;
    const int64_t padded = (block_size + 7) / 8 * 8;
    __m512bh qz[nq][nz];
    __m512 acc[nq][8]; /* head_dim / 16 used: 8 at 128 */
    v8 pv[nq][padded / 8]; /* a block's scores, then its probabilities */
    float(*p)[padded] = (float(*)[padded])pv, m[nq], l[nq];
    for (int64_t i = 0; i < nq; i++) {
        for (int64_t c = 0; c < nz; c++) qz[i][c] = (__m512bh)_mm512_loadu_si512(q + i * q_head_stride + 32 * c);
        for (int64_t j = 0; j < nd; j++) acc[i][j] = _mm512_setzero_ps();
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    if (seq_len > table_width * block_size) return KERNELS_CPU_SHORT_TABLE;
    for (int64_t start = 0; start < seq_len; start += block_size) {
        const int64_t block = table[start / block_size];
        if (block < 0 || block >= num_blocks) return KERNELS_CPU_BAD_BLOCK;
        const int64_t n = seq_len - start < block_size ? seq_len - start : block_size;
        const int64_t base = block * block_size * token_stride + h0 * head_dim;
        const int64_t next = start + block_size < seq_len ? table[start / block_size + 1] : -1;
        const int64_t next_base = next >= 0 && next < num_blocks ? next * block_size * token_stride + h0 * head_dim : -1;
        for (int64_t t = 0; t < n; t++) {
            if (next_base >= 0)
                prefetch_rows((const char *)(key_cache + next_base + t * token_stride),
                              (const char *)(value_cache + next_base + t * token_stride), nh * head_dim * 2);
            for (int64_t h = 0; h < nh; h++) {
                __m512bh k[nz];
                for (int64_t c = 0; c < nz; c++)
                    k[c] = (__m512bh)_mm512_loadu_si512(key_cache + base + t * token_stride + h * head_dim + 32 * c);
                for (int64_t g = 0; g < group; g++) {
                    const int64_t i = h * group + g;
                    __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), qz[i][0], k[0]);
                    for (int64_t c = 1; c < nz; c++) s = _mm512_dpbf16_ps(s, qz[i][c], k[c]);
                    p[i][t] = _mm512_reduce_add_ps(s) * scale;
                }
            }
        }
        for (int64_t i = 0; i < nq; i++) {
            const __m512 alpha = _mm512_set1_ps(online_softmax_block(pv[i], n, padded, &m[i], &l[i]));
            for (int64_t j = 0; j < nd; j++) acc[i][j] = _mm512_mul_ps(acc[i][j], alpha);
        }
        /* up to 4 query heads per pass over V at head_dim <= 64 (their accumulators and a V row fit the 32
         * registers), 2 at 128 */
        const int per_pass = nd <= 4 ? 4 : 2;
        for (int64_t h = 0; h < nh; h++) {
            const bf16_t *v = value_cache + base + h * head_dim;
            for (int64_t g = 0; g < group; g += per_pass) {
                const int64_t i = h * group + g, cnt = group - g < per_pass ? group - g : per_pass;
                switch (cnt) {
                    case 1: zmm_accumulate_pv(acc + i, p[i], padded, v, token_stride, n, 1, nd); break;
                    case 2: zmm_accumulate_pv(acc + i, p[i], padded, v, token_stride, n, 2, nd); break;
                    case 3: zmm_accumulate_pv(acc + i, p[i], padded, v, token_stride, n, 3, nd); break;
                    default: zmm_accumulate_pv(acc + i, p[i], padded, v, token_stride, n, 4, nd); break;
                }
            }
        }
    }
    for (int64_t i = 0; i < nq; i++) {
        const __m512 inv = _mm512_set1_ps(l[i] > 0.0f ? 1.0f / l[i] : 0.0f);
        for (int64_t j = 0; j < nd; j++) {
            const __m512 o = _mm512_mul_ps(acc[i][j], inv);
            bf16_store8(out + i * head_dim + 16 * j, (v8)_mm512_castps512_ps256(o));
            bf16_store8(out + i * head_dim + 16 * j + 8, (v8)_mm512_extractf32x8_ps(o, 1));
        }
    }
    return 0;
}
