/* The bf16 prefill tile on AVX512-BF16 (included by paged_attention.c): paged_attention.h's tile (8 query
 * rows of one head in the 8 lanes, online softmax over the paged blocks, causal mask in the chunks that cross
 * the tile's first position) with both products on `vdpbf16ps`, which multiplies 16 bf16 pairs and adds each
 * pair's two products to an fp32 lane, instead of fp32 FMAs on widened rows.
 *
 * S^T = K Q^T: the tile's queries are stored once as bf16 pairs, qp[d / 2][r] = (q[r][d], q[r][d + 1]), so a
 * key's pair (k[d], k[d + 1]) broadcast to the 8 lanes scores 8 rows over two dimensions in one instruction
 * (K is read straight from the cache, never widened). A product of two bf16 values is exact in fp32, so the
 * scores are the fp32 tile's up to summation order; the scale multiplies the sum (the query stays bf16).
 *
 * O += P V: the probabilities of two tokens are rounded to bf16 and paired per row, (p[t][r], p[t + 1][r]),
 * and the two tokens' V rows are interleaved (vpunpck{l,h}wd: pairs for dims 0-3, 8-11 and 4-7, 12-15 of each
 * 16), so one instruction adds two tokens' weighted rows to 8 dimensions of a row's accumulator; the
 * accumulators keep that order and are put back in dimension order once, at the end. Rounding P to bf16
 * moves each weight by at most 2^-9 of itself, as GPU tensor-core attention does (and vLLM's CPU attention):
 * the output moves by at most 2^-9 max|V|, under the bf16 store's own rounding; the softmax sum l stays fp32.
 * Per 8 tokens x 8 rows at head_dim 64: 256 + 256 instructions where the fp32 tile has 512 + 512 FMAs.
 *
 * vdpbf16ps treats bf16 subnormal inputs (below 1.2e-38) as zero. head_dim is a multiple of 16 (nv = head_dim
 * / 8 even), specialised at compile time for 32, 64 and 128. */
#include <immintrin.h>
#include <string.h>

static inline __attribute__((always_inline)) int attend_tile_bf16_dp(
    bf16_t *out, int64_t out_stride, const bf16_t *q, int64_t q_stride, int64_t rows, int64_t pos0,
    const bf16_t *key_cache, const bf16_t *value_cache, const int32_t *table, int64_t table_width, int64_t kv_head,
    int64_t num_kv_heads, const int64_t nv, int64_t block_size, int64_t num_blocks, float scale) {
    const int64_t head_dim = 8 * nv, half = head_dim / 2, token_stride = num_kv_heads * head_dim;
    const int64_t last = pos0 + rows - 1;
    uint32_t qp[half][8]; /* qp[d2][r]: row r's pair (q[2 d2], q[2 d2 + 1]); rows past `rows` zero */
    float o[8][head_dim]; /* row r's accumulator, each 16 dims in unpack order (0-3, 8-11 | 4-7, 12-15) */
    for (int64_t r = 0; r < 8; r++) {
        uint32_t row[half];
        if (r < rows) memcpy(row, q + r * q_stride, sizeof(row));
        else memset(row, 0, sizeof(row));
        for (int64_t d2 = 0; d2 < half; d2++) qp[d2][r] = row[d2];
        for (int64_t d = 0; d < head_dim; d++) o[r][d] = 0.0f;
    }
    v8i pos;
    for (int64_t r = 0; r < 8; r++) pos[r] = (int32_t)(pos0 + r); /* rows past `rows`: attend, never stored */
    v8 m = (v8){0} - INFINITY, l = (v8){0};
    if (last / block_size >= table_width) return KERNELS_CPU_SHORT_TABLE;
    for (int64_t start = 0; start <= last; start += block_size) {
        const int64_t block = table[start / block_size];
        if (block < 0 || block >= num_blocks) return KERNELS_CPU_BAD_BLOCK;
        const int64_t n = last + 1 - start < block_size ? last + 1 - start : block_size;
        const bf16_t *kb = key_cache + block * block_size * token_stride + kv_head * head_dim;
        const bf16_t *vb = value_cache + block * block_size * token_stride + kv_head * head_dim;
        for (int64_t c0 = 0; c0 < n; c0 += 8) {
            const int64_t cn = n - c0 < 8 ? n - c0 : 8;
            const bf16_t *krow[8], *vrow[8]; /* a short chunk repeats its last row, masked (p = 0) below */
            for (int64_t t = 0; t < 8; t++) {
                krow[t] = kb + (c0 + (t < cn ? t : cn - 1)) * token_stride;
                vrow[t] = vb + (c0 + (t < cn ? t : cn - 1)) * token_stride;
            }
            /* two accumulators per token (even and odd pairs): 16 independent chains hide the latency */
            __m256 s0[8], s1[8];
            for (int64_t t = 0; t < 8; t++) s0[t] = s1[t] = _mm256_setzero_ps();
            for (int64_t d2 = 0; d2 < half; d2 += 2) {
                const __m256bh qa = (__m256bh)_mm256_loadu_si256((const __m256i *)qp[d2]);
                const __m256bh qb = (__m256bh)_mm256_loadu_si256((const __m256i *)qp[d2 + 1]);
                for (int64_t t = 0; t < 8; t++) {
                    uint32_t ka, kb2;
                    memcpy(&ka, krow[t] + 2 * d2, 4);
                    memcpy(&kb2, krow[t] + 2 * d2 + 2, 4);
                    s0[t] = _mm256_dpbf16_ps(s0[t], qa, (__m256bh)_mm256_set1_epi32((int)ka));
                    s1[t] = _mm256_dpbf16_ps(s1[t], qb, (__m256bh)_mm256_set1_epi32((int)kb2));
                }
            }
            v8 s[8];
            const int64_t first = start + c0;
            v8 mx = (v8){0} - INFINITY;
            for (int64_t t = 0; t < 8; t++) {
                s[t] = (v8)_mm256_add_ps(s0[t], s1[t]) * scale;
                if (t >= cn) s[t] = (v8){0} - INFINITY; /* past the chunk */
                else if (first + t > pos0) /* after some row's position */
                    s[t] = vselect(((v8i){0} + (int32_t)(first + t)) > pos, (v8){0} - INFINITY, s[t]);
                mx = vmax(mx, s[t]);
            }
            const v8 m_new = vmax(m, mx); /* finite: token 0 is in every row's first chunk */
            const v8 alpha = exp8(m - m_new);
            v8 sum = (v8){0};
            uint32_t pp[4][8] __attribute__((aligned(32))); /* pp[t / 2][r]: row r's bf16 pair (p[t], p[t + 1]) */
            for (int64_t t = 0; t < 8; t += 2) {
                const v8 e0 = exp8(s[t] - m_new), e1 = exp8(s[t + 1] - m_new);
                sum += e0 + e1;
                *(v8ui *)pp[t / 2] = bf16_bits8(e0) | (bf16_bits8(e1) << 16);
            }
            l = l * alpha + sum;
            m = m_new;
            float a[8];
            *(v8u *)a = alpha;
            const int64_t pairs = (cn + 1) / 2;
            for (int64_t j = 0; j < nv; j += 2) { /* 16 dims: two accumulator vectors per row */
                __m256 lo[8], hi[8];
                for (int64_t r = 0; r < 8; r++) {
                    lo[r] = _mm256_mul_ps(_mm256_loadu_ps(&o[r][8 * j]), _mm256_set1_ps(a[r]));
                    hi[r] = _mm256_mul_ps(_mm256_loadu_ps(&o[r][8 * j + 8]), _mm256_set1_ps(a[r]));
                }
                for (int64_t tp = 0; tp < pairs; tp++) {
                    const __m256i v0 = _mm256_loadu_si256((const __m256i *)(vrow[2 * tp] + 8 * j));
                    const __m256i v1 = _mm256_loadu_si256((const __m256i *)(vrow[2 * tp + 1] + 8 * j));
                    const __m256bh vl = (__m256bh)_mm256_unpacklo_epi16(v0, v1);
                    const __m256bh vh = (__m256bh)_mm256_unpackhi_epi16(v0, v1);
                    for (int64_t r = 0; r < 8; r++) {
                        const __m256bh pr = (__m256bh)_mm256_set1_epi32((int)pp[tp][r]);
                        lo[r] = _mm256_dpbf16_ps(lo[r], pr, vl);
                        hi[r] = _mm256_dpbf16_ps(hi[r], pr, vh);
                    }
                }
                for (int64_t r = 0; r < 8; r++) {
                    _mm256_storeu_ps(&o[r][8 * j], lo[r]);
                    _mm256_storeu_ps(&o[r][8 * j + 8], hi[r]);
                }
            }
        }
    }
    float inv[8];
    *(v8u *)inv = 1.0f / l;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < nv; j += 2) {
            const __m256 lo = _mm256_loadu_ps(&o[r][8 * j]), hi = _mm256_loadu_ps(&o[r][8 * j + 8]);
            const v8 x = inv[r] + (v8){0};
            bf16_store8(out + r * out_stride + 8 * j, (v8)_mm256_permute2f128_ps(lo, hi, 0x20) * x);
            bf16_store8(out + r * out_stride + 8 * j + 8, (v8)_mm256_permute2f128_ps(lo, hi, 0x31) * x);
        }
    return 0;
}
