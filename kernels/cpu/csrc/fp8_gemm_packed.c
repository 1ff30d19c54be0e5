/* Weight-only fp8 (W8A16) for bf16 activations on AVX512-BF16: y = x @ (q * scale).T (+ bias) (+ residual), the
 * products on vdpbf16ps (two bf16 products a lane, summed in fp32) with the weight kept in e4m3 bytes.
 *
 * The weight is repacked once at load (kernels/cpu/fp8_gemm.py `fp8_pack`, the same bytes permuted) into blocks
 * of 32 output rows: packed [ceil(n / 32)][ceil(k / 2)][32 rows][2 k], zero codes in the n and k padding. The 64
 * bytes of one k pair of a block are two runs of 32 bytes, each 16 rows x 2 k: decoded to 32 bf16 lanes they are
 * the pairs vdpbf16ps multiplies with a broadcast pair of x (x[2p], x[2p + 1]) into 16 fp32 sums.
 *
 * The decode, exact, in 16-bit lanes: magnitude m = b & 0x7f; a normal code's bf16 bits are (m << 4) + (120 << 7)
 * (e4m3's exponent bias 7 to bf16's 127, its 3 mantissa bits on top of bf16's 7); the 8 codes m < 8 (zero and
 * the subnormals m * 2^-9, which the add would misread) come from SUBNORMAL (vpermw under a mask); the sign is
 * b's bit 7 at bit 15. NaN codes (0x7f, 0xff) decode as +-480: the layers' weights come from saturating
 * quantization and hold none. Every e4m3 value is a bf16 value, so the products are exact in fp32 (8 x 8
 * significant bits) and the only roundings are the fp32 sums (vdpbf16ps adds each lane's two products to its
 * sum; its bf16 inputs are never subnormal here: weights are >= 2^-9, x is the caller's), then acc * scale + bias
 * in fp32 (one fused multiply-add), rounded once to bf16, the residual added as skinny_gemm.c does.
 *
 * Two ways through a block, by the rows m: up to REGISTER_ROWS the codes are decoded in registers beside the dot
 * products (each decoded pair serves every row; the weight is read once, as memory-bound decode wants); above,
 * the block's whole k is decoded once into a per-thread bf16 buffer (2 bytes a weight, in L2) and every group of
 * ROWS rows runs over it, so the decode is paid once per block, not once per row group. OpenMP over blocks.
 * Builds without AVX512-BF16 compute the same sums in fp32 one value at a time (correct, slow: the engine packs
 * weights only where `fp8_packed_native` says this build has the fast path). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels_cpu.h"
#include "vec8.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define FP8P_NATIVE 1
#endif

enum { BLOCK = 32, ROWS = 8 }; /* output rows of a block; rows of x per microkernel call */
#ifndef REGISTER_ROWS
#define REGISTER_ROWS 8 /* up to this many rows, the decode in registers (benchmarks/cpu_gemm_rows.py) */
#endif

#define INLINE static inline __attribute__((always_inline))

int fp8_packed_native(int64_t bf16) {
#ifdef FP8P_NATIVE
    return bf16 != 0;
#else
    (void)bf16;
    return 0;
#endif
}

#ifdef FP8P_NATIVE
/* bf16 bits of m * 2^-9, m = 0..7 (e4m3's zero and subnormals); the rest unused */
static const uint16_t SUBNORMAL[32] = {0, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};

/* 32 codes -> their 32 exact bf16 values */
INLINE __m512i decode32(const uint8_t *p, __m512i table) {
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    const __m512i m = _mm512_and_si512(b, _mm512_set1_epi16(0x7f));
    const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(m, 4), _mm512_set1_epi16(120 << 7));
    const __mmask32 sub = _mm512_cmplt_epu16_mask(m, _mm512_set1_epi16(8));
    const __m512i mag = _mm512_mask_permutexvar_epi16(normal, sub, m, table);
    /* mag | (b << 8 & 0x8000): the sign */
    return _mm512_ternarylogic_epi32(mag, _mm512_slli_epi16(b, 8), _mm512_set1_epi16((short)0x8000), 0xF8);
}

/* x's pair p (x[2p], x[2p + 1]) as a 32-bit broadcast; tail: the last pair of an odd k, x[k - 1] and a zero
 * (its weight is zero too, but x past the row must not be read: it may be another tensor's NaN) */
INLINE __m512bh x_pair(const bf16_t *x, int64_t p, int tail) {
    uint32_t v = x[2 * p];
    if (!tail) memcpy(&v, x + 2 * p, 4);
    return (__m512bh)_mm512_set1_epi32((int)v);
}

/* acc[r] += x[r] . the block's weights at k pair p, r < rows */
INLINE void pair_step(const void *w, int decoded, __m512i table, int64_t p, const bf16_t *x, int64_t x_stride,
                      int rows, int tail, __m512 acc[ROWS][2]) {
    __m512i w0, w1;
    if (decoded) {
        w0 = _mm512_load_si512((const uint16_t *)w + p * 64);
        w1 = _mm512_load_si512((const uint16_t *)w + p * 64 + 32);
    } else {
        w0 = decode32((const uint8_t *)w + p * 64, table);
        w1 = decode32((const uint8_t *)w + p * 64 + 32, table);
    }
    for (int r = 0; r < rows; r++) {
        const __m512bh xb = x_pair(x + r * x_stride, p, tail);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)w0, xb);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)w1, xb);
    }
}

/* acc[r][0..1] = rows of x (x_stride apart) . one block's weights over k; w: the packed codes of the block
 * (decoded != 0: its decoded bf16 buffer instead). rows a constant after inlining. */
INLINE void tile(const void *w, int decoded, const bf16_t *x, int64_t x_stride, int rows, int64_t k,
                 __m512 acc[ROWS][2]) {
    const int64_t full = k / 2;
    const __m512i table = _mm512_loadu_si512(SUBNORMAL);
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < full; p++) pair_step(w, decoded, table, p, x, x_stride, rows, 0, acc);
    if (k & 1) pair_step(w, decoded, table, full, x, x_stride, rows, 1, acc);
}

/* the block's outputs n0 .. n0 + 31 (those < n) of `rows` rows: acc * scale + bias, rounded to bf16, + residual */
INLINE void epilogue(const fp8_gemm_args *a, int64_t row0, int rows, int64_t n0, __m512 acc[ROWS][2]) {
    const int64_t n = a->n;
    const bf16_t *bias = a->bias, *residual = a->residual;
    bf16_t *y = a->y;
    for (int h = 0; h < 2; h++) {
        const int64_t c = n0 + 16 * h;
        if (c >= n) break;
        const __mmask16 mask = n - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - c)) - 1);
        const __m512 s = _mm512_maskz_loadu_ps(mask, a->scale + c);
        const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + c)), 16))
                              : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const int64_t row = row0 + r;
            __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(acc[r][h], s, b));
            if (residual) { /* bf16(out) + residual, rounded again */
                const __m512 res = _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, residual + row * a->residual_stride + c)),
                    16));
                const __m512 o = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(out), 16));
                out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(o, res));
            }
            _mm256_mask_storeu_epi16(y + row * n + c, mask, out);
        }
    }
}

#define TILE_CASE(R)                                               \
    case R:                                                        \
        tile(w, decoded, x + r0 * xs, xs, R, k, acc);              \
        break

/* rows r0 .. m - 1 of one block, ROWS at a time, against w (codes or decoded) */
INLINE void block_rows(const fp8_gemm_args *a, const void *w, int decoded, int64_t n0) {
    const int64_t m = a->m, k = a->k, xs = a->x_stride;
    const bf16_t *x = a->x;
    for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
        __m512 acc[ROWS][2];
        const int rows = m - r0 < ROWS ? (int)(m - r0) : ROWS;
        switch (rows) {
            TILE_CASE(1); TILE_CASE(2); TILE_CASE(3); TILE_CASE(4); TILE_CASE(5); TILE_CASE(6); TILE_CASE(7);
        default: tile(w, decoded, x + r0 * xs, xs, ROWS, k, acc); break;
        }
        epilogue(a, r0, rows, n0, acc);
    }
}
#endif

#ifndef FP8P_NATIVE
/* e4m3 code -> its value (finite codes; the portable path) */
static float decode_value(uint8_t c) {
    const uint32_t e = (c >> 3) & 15, mant = c & 7;
    const float v = e ? (float)(8 + mant) / 8.0f * (float)(1 << e) / 128.0f : (float)mant / 512.0f;
    return c & 0x80 ? -v : v;
}
#endif

int fp8_gemm_w8a16_packed(const fp8_gemm_args *a) {
    const int64_t m = a->m, n = a->n, k = a->k, pairs = (k + 1) / 2, blocks = (n + BLOCK - 1) / BLOCK;
    const uint8_t *w = a->w;
    if (!a->bf16) return KERNELS_CPU_OK; /* bf16 x only (fp8_gemm.py refuses others) */
#ifdef FP8P_NATIVE
    if (m <= REGISTER_ROWS) {
#pragma omp parallel for schedule(static) if (n * k >= SKINNY_PARALLEL_MIN)
        for (int64_t j = 0; j < blocks; j++) block_rows(a, w + j * pairs * 64, 0, j * BLOCK);
        return KERNELS_CPU_OK;
    }
    int status = KERNELS_CPU_OK;
#pragma omp parallel if (n * k >= SKINNY_PARALLEL_MIN)
    {
        uint16_t *buf = aligned_alloc(64, (size_t)pairs * 64 * sizeof(uint16_t));
        if (!buf) {
#pragma omp atomic write
            status = KERNELS_CPU_NO_MEMORY;
        }
#pragma omp for schedule(static)
        for (int64_t j = 0; j < blocks; j++) {
            if (!buf) continue;
            const uint8_t *wj = w + j * pairs * 64;
            const __m512i table = _mm512_loadu_si512(SUBNORMAL);
            for (int64_t i = 0; i < pairs * 2; i++)
                _mm512_store_si512(buf + i * 32, decode32(wj + i * 32, table));
            block_rows(a, buf, 1, j * BLOCK);
        }
        free(buf);
    }
    return status;
#else
    const bf16_t *x = a->x, *bias = a->bias, *residual = a->residual;
    bf16_t *y = a->y;
#pragma omp parallel for schedule(static) if (n * k >= SKINNY_PARALLEL_MIN)
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *wj = w + (j / BLOCK) * pairs * 64 + (j % BLOCK) * 2;
        for (int64_t r = 0; r < m; r++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < k; i++)
                acc += bf16_to_f32(x[r * a->x_stride + i]) * decode_value(wj[(i / 2) * 64 + (i % 2)]);
            const float out = acc * a->scale[j] + (bias ? bf16_to_f32(bias[j]) : 0.0f);
            y[r * n + j] = residual ? f32_to_bf16(bf16_round(out) + bf16_to_f32(residual[r * a->residual_stride + j]))
                                    : f32_to_bf16(out);
        }
    }
    (void)pairs;
    (void)blocks;
    return KERNELS_CPU_OK;
#endif
}
