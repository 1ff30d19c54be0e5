/* A GGUF matrix times activations, llama.cpp's way: each 32-value block of an activation row is
 * quantized to int8 with one fp32 step (ggml's Q8_1: dx = max|x| / 127, xq = round(x / dx), and
 * sx = dx * sum(xq)), and each output is an integer dot per block, scaled once:
 *
 *     y[t][n] = sum_b dw[n][b] * dx[t][b] * sum_i q[n][32b + i] * xq[t][32b + i]  +  mw[n][b] * sx[t][b]
 *
 * for weights w = q * dw + mw with unsigned q (Q4_1: q in 0..15, mw the block's minimum; Q8_0 as
 * q = w + 128 in 0..255, so mw = -128 dw and only dw is stored).
 *
 * Layout (kernels/cpu/ggml_a8.py packs it): rows in tiles of 16 (the last padded with zero rows),
 * a tile's blocks one after another, each as 8 slices of 4 consecutive k for the 16 rows: slice v
 * holds, per row l, bytes q[l][32b + 4v .. 32b + 4v + 3] (8-bit: 8 x 64 bytes; 4-bit: 4 x 64 bytes,
 * slice v in the low nibbles and slice v + 4 in the high ones). So one AVX512-VNNI vpdpbusd against
 * 4 activation bytes broadcast adds 64 products into 16 lanes, one lane per output row: no horizontal
 * sums, and a block's dots scale by its 16 rows' dw (fp16 [tile][block][16], as the GGUF stores
 * them) in one FMA. A tile is read and unpacked once per 8 activation rows; tiles go to OpenMP threads. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels_cpu.h"
#include "vec8.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define GGML_A8_VNNI 1
#endif

/* PREFETCH: blocks ahead, 4 KiB of 4-bit weights; cold, 1 thread, 3072x576 at 32 rows: 365 us none, 325 at 4
 * blocks, 297 at 8, 286 at 16, 290 at 32 (batch 1: 120, 93, 78, 76, 73) */
enum { QK = 32, TILE = 16, TOKENS = 8, PREFETCH = 16 };

#ifdef GGML_A8_VNNI
/* 16 activations from fp32 or bf16 (widened: exact) */
static inline __m512 load16(const void *x, int64_t i, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)x + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const bf16_t *)x + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* One activation row (fp32, or bf16 when bf16 != 0) -> int8 blocks, each block's step d and step * sum s (32
 * values: two vectors). */
static void quantize_row_q8_1(const void *x, int bf16, int64_t k, int8_t *q, float *d, float *s) {
    for (int64_t b = 0; b < k / QK; b++) {
        const __m512 lo = load16(x, b * QK, bf16), hi = load16(x, b * QK + 16, bf16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const float db = amax / 127.0f, inv = db != 0.0f ? 1.0f / db : 0.0f;
        /* the default rounding mode: to nearest, ties to even, as torch.round */
        const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
        const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
        _mm_storeu_si128((__m128i *)(q + b * QK), _mm512_cvtsepi32_epi8(qlo));
        _mm_storeu_si128((__m128i *)(q + b * QK + 16), _mm512_cvtsepi32_epi8(qhi));
        d[b] = db;
        s[b] = db * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    }
}
#else
/* One activation row (fp32, or bf16 when bf16 != 0) -> int8 blocks, each block's step d and step * sum s. */
static void quantize_row_q8_1(const void *x, int bf16, int64_t k, int8_t *q, float *d, float *s) {
    for (int64_t b = 0; b < k / QK; b++) {
        float xb[QK];
        for (int i = 0; i < QK; i++)
            xb[i] = bf16 ? bf16_to_f32(((const bf16_t *)x)[b * QK + i]) : ((const float *)x)[b * QK + i];
        int8_t *qb = q + b * QK;
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(xb[i]));
        const float db = amax / 127.0f, inv = db != 0.0f ? 1.0f / db : 0.0f;
        int sum = 0;
        for (int i = 0; i < QK; i++) {
            const int v = (int)nearbyintf(xb[i] * inv); /* ties to even, as torch.round */
            qb[i] = (int8_t)v;
            sum += v;
        }
        d[b] = db;
        s[b] = db * (float)sum;
    }
}
#endif

/* The activations of one call, quantized: xq [m][k], dx and sx [m][k / 32]. */
typedef struct {
    const int8_t *xq;
    const float *dx, *sx;
    int64_t k;
} Acts;

#ifdef GGML_A8_VNNI
/* A tile's 16 outputs for tokens t0 .. t0 + T - 1; BITS and T are compile-time constants after inlining. The
 * block's weights are loaded (and for 4 bits unpacked) once and reused by all T tokens, so at T = 8 a token's
 * block costs 8 vpdpbusd + 4 vector ops (widen, two scales, the m-term) + 1.5 of the unpack's 12. A token's
 * integer dot runs in CH chains (exact: int32 sums, any order): one when 6+ tokens give the core independent
 * work, more for few tokens. Its fp32 ops are the same, in the same order, at every T: outputs do not depend
 * on the row count or on where a row falls in a register block. */
static inline __attribute__((always_inline)) void tile_vnni(const uint8_t *w, const uint16_t *dw, const uint16_t *mw,
                                                            const int BITS, Acts a, int64_t t0, const int T,
                                                            float out[TOKENS][TILE]) {
    const int64_t nb = a.k / QK, block_bytes = BITS == 4 ? 256 : 512;
    const int CH = T >= 6 ? 1 : T >= 3 ? 2 : 4;
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    __m512 acc[TOKENS];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = w + b * block_bytes;
        /* the weights stream from DRAM (a model is larger than the L3): fetch PREFETCH blocks ahead, into the
         * next tile past the last block (a prefetch never faults) */
        const char *ahead = (const char *)(wb + PREFETCH * block_bytes);
        for (int l = 0; l < block_bytes; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
        _mm_prefetch((const char *)(dw + (b + PREFETCH) * TILE), _MM_HINT_T0);
        if (BITS == 4) _mm_prefetch((const char *)(mw + (b + PREFETCH) * TILE), _MM_HINT_T0);
        __m512i s[8]; /* slice v: k 4v .. 4v + 3 of the block, 16 rows */
        if (BITS == 4) {
            for (int u = 0; u < 4; u++) {
                const __m512i v = _mm512_loadu_si512(wb + 64 * u);
                s[u] = _mm512_and_si512(v, nibble);
                s[u + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
            }
        } else {
            for (int v = 0; v < 8; v++) s[v] = _mm512_loadu_si512(wb + 64 * v);
        }
        const __m512 d16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dw + b * TILE)));
        const __m512 m16 = BITS == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mw + b * TILE))) : d16;
        for (int t = 0; t < T; t++) {
            const int64_t row = (t0 + t) * nb + b;
            int32_t x4[8]; /* the block's activations, 4 bytes a slice */
            memcpy(x4, a.xq + row * QK, sizeof x4);
            __m512i p[4];
            for (int c = 0; c < CH; c++) p[c] = _mm512_setzero_si512();
            for (int v = 0; v < CH; v++) p[v] = _mm512_dpbusd_epi32(p[v], s[v], _mm512_set1_epi32(x4[v]));
            for (int v = CH; v < 8; v++) p[v % CH] = _mm512_dpbusd_epi32(p[v % CH], s[v], _mm512_set1_epi32(x4[v]));
            for (int c = 1; c < CH; c++) p[0] = _mm512_add_epi32(p[0], p[c]);
            const __m512 dot = _mm512_cvtepi32_ps(p[0]);
            const __m512 dx = _mm512_set1_ps(a.dx[row]), sx = _mm512_set1_ps(a.sx[row]);
            if (BITS == 4) {
                acc[t] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d16, dx), acc[t]);
                acc[t] = _mm512_fmadd_ps(m16, sx, acc[t]);
            } else { /* dw * (dx * dot - 128 sx) */
                const __m512 m128 = _mm512_mul_ps(sx, _mm512_set1_ps(-128.0f));
                acc[t] = _mm512_fmadd_ps(_mm512_fmadd_ps(dot, dx, m128), d16, acc[t]);
            }
        }
    }
    for (int t = 0; t < T; t++) _mm512_storeu_ps(out[t], acc[t]);
}

#define GGML_A8_TILE_CASE(T)                                                                                     \
    case T:                                                                                                      \
        if (bits == 4) tile_vnni(w, dw, mw, 4, a, t0, T, out);                                                   \
        else tile_vnni(w, dw, mw, 8, a, t0, T, out);                                                             \
        break;

static void compute_tile(const uint8_t *w, const uint16_t *dw, const uint16_t *mw, int bits, Acts a, int64_t t0,
                         int T, float out[TOKENS][TILE]) {
    switch (T) { /* a constant token count and width, so the loops unroll and the branches fold */
    GGML_A8_TILE_CASE(8)
    GGML_A8_TILE_CASE(7)
    GGML_A8_TILE_CASE(6)
    GGML_A8_TILE_CASE(5)
    GGML_A8_TILE_CASE(4)
    GGML_A8_TILE_CASE(3)
    GGML_A8_TILE_CASE(2)
    default: GGML_A8_TILE_CASE(1)
    }
}
#else
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t u;
    float f;
    if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        f = ldexpf((float)man, -24);
        memcpy(&u, &f, 4);
        u |= sign;
    } else {
        u = sign | (exp == 31 ? 0x7F800000u | man << 13 : (exp + 112) << 23 | man << 13);
    }
    memcpy(&f, &u, 4);
    return f;
}

/* The same sums, one weight at a time (CPUs without AVX512-VNNI). */
static void compute_tile(const uint8_t *w, const uint16_t *dw, const uint16_t *mw, int bits, Acts a, int64_t t0,
                         int T, float out[TOKENS][TILE]) {
    const int64_t nb = a.k / QK, block_bytes = bits == 4 ? 256 : 512;
    for (int t = 0; t < T; t++)
        for (int l = 0; l < TILE; l++) {
            float sum = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const int64_t row = (t0 + t) * nb + b;
                int32_t dot = 0;
                for (int i = 0; i < QK; i++) {
                    const int v = i / 4, j = i % 4;
                    const uint8_t *wb = w + b * block_bytes;
                    const int q = bits == 8 ? wb[64 * v + 4 * l + j] : (wb[64 * (v % 4) + 4 * l + j] >> (v < 4 ? 0 : 4)) & 0x0F;
                    dot += q * a.xq[row * QK + i];
                }
                const float d = f16_to_f32(dw[b * TILE + l]), m = bits == 4 ? f16_to_f32(mw[b * TILE + l]) : -128.0f * d;
                sum += d * a.dx[row] * (float)dot + m * a.sx[row];
            }
            out[t][l] = sum;
        }
}
#endif

/* The arguments: ggml_mul_mat_a8_args (kernels_cpu.h). Returns 0, or KERNELS_CPU_NO_MEMORY when the scratch
 * for the quantized activations cannot be allocated. */
int ggml_mul_mat_a8(const ggml_mul_mat_a8_args *args) {
    void *out = args->out;
    const void *x = args->x;
    const uint8_t *w = args->w;
    const uint16_t *dw = args->dw, *mw = args->mw;
    const int64_t m = args->m, n = args->n, k = args->k, x_stride = args->x_stride, bits = args->bits;
    const int64_t bf16 = args->bf16;
    const int64_t nb = k / QK, tiles = (n + TILE - 1) / TILE, tile_bytes = nb * (bits == 4 ? 256 : 512);
    float *dx = malloc(sizeof(float) * (size_t)(m * nb)), *sx = malloc(sizeof(float) * (size_t)(m * nb));
    int8_t *xq = malloc((size_t)(m * k));
    if (!dx || !sx || !xq) {
        free(dx), free(sx), free(xq);
        return KERNELS_CPU_NO_MEMORY;
    }
    const size_t row_bytes = (size_t)x_stride * (bf16 ? sizeof(bf16_t) : sizeof(float));
#pragma omp parallel for schedule(static) if (m >= GGML_A8_QUANTIZE_PARALLEL_MIN)
    for (int64_t t = 0; t < m; t++)
        quantize_row_q8_1((const char *)x + t * row_bytes, (int)bf16, k, xq + t * k, dx + t * nb, sx + t * nb);
    const Acts a = {xq, dx, sx, k};
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < tiles; i++) {
        const int64_t r0 = i * TILE, rows_here = n - r0 < TILE ? n - r0 : TILE;
        for (int64_t t0 = 0; t0 < m; t0 += TOKENS) {
            const int T = (int)(m - t0 < TOKENS ? m - t0 : TOKENS);
            float y[TOKENS][TILE];
            compute_tile(w + i * tile_bytes, dw + i * nb * TILE, mw + i * nb * TILE, (int)bits, a, t0, T, y);
            for (int t = 0; t < T; t++) {
                const int64_t o = (t0 + t) * n + r0;
                if (rows_here == TILE && bf16) { /* a full tile: two 8-wide roundings, as f32_to_bf16 */
                    v8 lo, hi;
                    memcpy(&lo, y[t], sizeof lo), memcpy(&hi, y[t] + 8, sizeof hi);
                    bf16_store8((bf16_t *)out + o, lo), bf16_store8((bf16_t *)out + o + 8, hi);
                } else if (bf16) {
                    for (int64_t l = 0; l < rows_here; l++) ((bf16_t *)out)[o + l] = f32_to_bf16(y[t][l]);
                } else {
                    memcpy((float *)out + o, y[t], sizeof(float) * (size_t)rows_here);
                }
            }
        }
    }
    free(dx), free(sx), free(xq);
    return 0;
}
